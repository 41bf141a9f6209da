"""Opening the lock session: libpq parameters from Django's, defaults that bound every
wait on the network, the session's setup, and an error that says what each host said."""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections
from psycopg.adapt import Transformer

from . import sql
from .conf import get_setting
from .exceptions import DatabaseUnavailable
from .failures import describe_hosts, first_line

if TYPE_CHECKING:
    from .connection import LockConnection

__all__ = [
    "CONNECT_TIMEOUT",
    "LEAST_CONNECT_TIMEOUT",
    "LOCK_TIMEOUT",
    "STATEMENT_TIMEOUT",
    "open_session",
]

STATEMENT_TIMEOUT = "30s"
LOCK_TIMEOUT = "5s"
#: Seconds libpq may spend on each host when opening the lock session. A server that
#: accepts TCP but never answers (a stopped old primary) would otherwise hang a new
#: process until it resumes. ``OPTIONS["connect_timeout"]`` in ``DATABASES`` wins.
CONNECT_TIMEOUT = 10
#: The least ``connect_timeout`` a blocking acquire's bound leaves (libpq counts whole
#: seconds and takes anything below 2 as 2).
LEAST_CONNECT_TIMEOUT = 2
# A dead or partitioned server is noticed within about 25 s even with a statement in
# flight (libpq ignores these on Unix sockets); the holder's own monotonic deadline
# covers the rest. Options set in DATABASES[alias]["OPTIONS"] win.
_SESSION_DEFAULTS = {
    "connect_timeout": CONNECT_TIMEOUT,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 10000,
}
# Keys of Django's connection params that are not libpq parameters.
_NOT_LIBPQ = ("cursor_factory", "context", "prepare_threshold", "row_factory", "autocommit")


def _connect_once(**params: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(autocommit=True, **params)


def open_session(
    lock_conn: LockConnection, deadline: float | None = None
) -> psycopg.Connection[Any]:
    """Open and set up a new session for ``lock_conn``; its attributes follow the session.

    ``deadline`` (``time.monotonic()``, a blocking acquire's bound): each host gets a
    ``connect_timeout`` no longer than the time left (at least
    :data:`LEAST_CONNECT_TIMEOUT`), whatever ``DATABASES`` says.
    """
    wrapper = connections[lock_conn.alias]
    params = dict(wrapper.get_connection_params())
    options = wrapper.settings_dict.get("OPTIONS", {})
    for key in _NOT_LIBPQ:
        params.pop(key, None)
    params.setdefault("application_name", "django_pglock")
    for key, value in _SESSION_DEFAULTS.items():
        params.setdefault(key, value)
    if deadline is not None:
        params["connect_timeout"] = _bounded_timeout(params["connect_timeout"], deadline)
    # Prepared statements save planning on every acquire; they are unsafe behind a
    # transaction-mode pooler, which is also when the advisory path is switched off.
    if "prepare_threshold" in options:
        lock_conn._prepare = options["prepare_threshold"] is not None
    else:
        lock_conn._prepare = bool(get_setting("ADVISORY"))
    try:
        # prepare_threshold=None would switch preparing off even for prepare=True.
        threshold = 0 if lock_conn._prepare else None
        conn = psycopg.connect(autocommit=True, prepare_threshold=threshold, **params)
    except psycopg.Error as exc:
        raise DatabaseUnavailable(_cannot_connect(lock_conn.alias, params, exc)) from None
    try:
        row = conn.execute(
            sql.SESSION_SETUP,
            {"statement_timeout": STATEMENT_TIMEOUT, "lock_timeout": LOCK_TIMEOUT},
            prepare=False,
        ).fetchone()
    except psycopg.Error as exc:
        with contextlib.suppress(psycopg.Error):
            conn.close()
        raise DatabaseUnavailable(
            f"Could not set up the lock connection for database alias {lock_conn.alias!r}: "
            f"{first_line(exc)}."
        ) from None
    assert row is not None
    lock_conn.durable_commit = str(row[0])
    lock_conn.backend_pid = backend_pid = int(row[5])
    lock_conn._backend_start = row[6]
    lock_conn.generation += 1
    for pid, started in lock_conn._abandoned:
        with contextlib.suppress(psycopg.Error):
            conn.execute(sql.END_ABANDONED, {"pid": pid, "started": started}, prepare=False)
    if lock_conn._abandoned:
        lock_conn._abandoned = []
        lock_conn.orphans_possible = True  # what it ran before it ended may have granted
    _as_django(conn, wrapper.timezone_name, options.get("assume_role"), lock_conn.alias)
    lock_conn._cursor = psycopg.RawCursor(conn)
    lock_conn._tx = Transformer(conn)
    lock_conn._prepared = {}
    lock_conn._encoding = conn.info.encoding
    # A transaction-mode pooler, looked for once, before any key is taken here.
    if lock_conn.generation == 1 and not lock_conn.pooled and get_setting("ADVISORY") is not False:
        from .pooler import find_pooler

        evidence = find_pooler(conn, params, backend_pid, lock_conn.alias)
        if evidence is not None:
            lock_conn._prepare = False  # its prepared statements would come and go as well
            lock_conn._found_pooler(evidence)
    return conn


def _as_django(
    conn: psycopg.Connection[Any], time_zone: str | None, role: str | None, alias: str
) -> None:
    """Apply what Django's backend applies to each new connection of ``alias`` (see
    ``DatabaseWrapper.init_connection_state``): its time zone, when the server's differs,
    and ``OPTIONS["assume_role"]`` (Django 5.0+), whose rights the lock statements need
    when the login role lacks them. Both persist for the session; a session opened again
    gets them again. Nothing is sent when neither is needed."""
    if time_zone and conn.info.parameter_status("TimeZone") == time_zone:
        time_zone = None
    if not time_zone and not role:
        return
    try:
        conn.execute(sql.SESSION_AS_DJANGO, {"time_zone": time_zone, "role": role}, prepare=False)
    except psycopg.Error as exc:
        with contextlib.suppress(psycopg.Error):
            conn.close()
        what = f"OPTIONS['assume_role'] = {role!r}" if role else f"TimeZone {time_zone!r}"
        raise DatabaseUnavailable(
            f"Could not set up the lock connection for database alias {alias!r} as Django "
            f"does ({what}): {first_line(exc)}. Check DATABASES[{alias!r}]."
        ) from None


def _bounded_timeout(configured: Any, deadline: float) -> Any:
    """``connect_timeout`` for a session opened by ``deadline``: the configured one if it
    is shorter, else the whole seconds left, at least :data:`LEAST_CONNECT_TIMEOUT`."""
    left = max(LEAST_CONNECT_TIMEOUT, math.ceil(deadline - time.monotonic()))
    try:
        seconds = int(float(configured))
    except (TypeError, ValueError):
        return configured  # libpq's own error names it
    return seconds if 0 < seconds <= left else left


def _cannot_connect(alias: str, params: dict[str, Any], exc: psycopg.Error) -> str:
    """Why the session could not be opened: libpq's message names host, port and
    user, never the password; the parameters themselves are not repeated. With a
    multi-host DSN, psycopg reports only the last host: each one is asked again."""
    hosts = describe_hosts(params, _connect_once)
    said = f"each host said: {hosts}" if hosts else first_line(exc)
    read_only = "read-only" in said or "hot standby" in said or "recovery" in said
    hint = (
        "A server is up but read-only (a standby not yet promoted); a blocking acquire "
        "retries until its timeout."
        if read_only
        else f"Check DATABASES[{alias!r}] and that the server is up."
    )
    where = f"database alias {alias!r}"
    return f"Could not open the lock connection for {where}: {said}. {hint}"
