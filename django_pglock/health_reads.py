"""The reads of job health (see :mod:`.health`): the grants on the advisory path and which
of them are gone (``sql.ABANDONED``), then the jobs with their runs, claims and holders
(``sql.JOB_HEALTH``, read in binary)."""

from __future__ import annotations

import datetime
from typing import Any

import psycopg
from django.db import connections
from django.utils import timezone

from . import sql
from .jobspec import JobSpec

__all__ = ["gone_holders", "read_holders", "read_rows"]

# The statement's columns that are times (timestamptz).
_TIMES = (1, 3, 4, 7, 8, 9, 14)


def read_holders(alias: str) -> list[tuple[str, int]]:
    """Bound the transaction's statements (``sql.HEALTH_BOUNDS``) and read the grants on
    the advisory path, in one round trip: the candidates for :func:`gone_holders`."""
    with connections[alias].cursor() as cursor:
        cursor.execute(f"{sql.HEALTH_BOUNDS}; {sql.ADVISORY_ROWS}")
        while cursor.description is None and cursor.nextset():
            pass  # past the SET LOCALs' results
        return [(name, token) for name, token in cursor.fetchall()]


def read_rows(
    alias: str, declared: dict[str, JobSpec], gone: set[tuple[str, int]]
) -> list[tuple[Any, ...]]:
    """The rows of ``sql.JOB_HEALTH``, its times as aware datetimes in UTC.

    Read in binary: psycopg builds the datetimes in C, where Django's cursors (which bind
    parameters on the client, and read text) would parse each one in Python. The cursor is
    wrapped as Django wraps its own, so execute wrappers and query logging see the statement.
    """
    connection = connections[alias]
    raw = connection.connection
    if isinstance(raw, psycopg.Connection):
        binary: psycopg.Cursor[Any] = psycopg.Cursor(raw)
        binary.format = psycopg.pq.Format.BINARY
        # (django-stubs types the argument as Django's wrapper; Django passes the driver's cursor.)
        wrap = connection.make_debug_cursor if connection.queries_logged else connection.make_cursor
        wrapped = wrap(binary)  # type: ignore[arg-type]
    else:  # pragma: no cover - Django picks psycopg 3 whenever it is installed, as here
        wrapped = connection.cursor()
    with wrapped as cursor:
        params: dict[str, Any] = {
            "declared": list(declared),
            "gone_names": [name for name, _ in gone],
            "gone_tokens": [token for _, token in gone],
        }
        cursor.execute(sql.JOB_HEALTH, params)
        rows: list[tuple[Any, ...]] = cursor.fetchall()
    if rows and rows[0][1].tzinfo is not datetime.timezone.utc:
        # The session's time zone is not UTC (USE_TZ = False): the same instants, in UTC.
        rows = [_in_utc(row) for row in rows]
    return rows


def _in_utc(row: tuple[Any, ...]) -> tuple[Any, ...]:
    values = list(row)
    for i in _TIMES:
        value = values[i]
        if value is not None:
            if value.tzinfo is None:  # a text read without USE_TZ: the session's zone
                value = timezone.make_aware(value, timezone.get_default_timezone())
            values[i] = value.astimezone(datetime.timezone.utc)
    return tuple(values)


def gone_holders(alias: str, held: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """The (name, token) of ``held`` (holders on the advisory path) whose session is gone;
    their runs are closed as lost."""
    if not held:
        return set()
    names = [name for name, _ in held]
    params: dict[str, Any] = {
        "names": names,
        "tokens": [token for _, token in held],
        "keys": [sql.advisory_key(name) for name in names],
    }
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.ABANDONED, params)
        return {(name, token) for name, token in cursor.fetchall()}
