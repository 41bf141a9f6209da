"""Finding a transaction- or statement-mode pooler before the lock session takes a key.

A session advisory lock belongs to a server process. Behind a pooler in transaction (or
statement) mode, such as PgBouncer with ``pool_mode = transaction``, each statement of the
lock connection runs on whichever server connection is free, and a key it takes stays
with that server connection, not with the client: when the pooler retires the server
connection (``server_lifetime``, an hour by default) the key is free while the holder runs
on. Statements answered by different server processes reveal the pooler, but one client
alone usually keeps getting the same server connection (PgBouncer hands out the one
released last), so that evidence may never come.

So, right after the lock session is set up, and before it takes any key, it is probed
between statements (autocommit: a transaction pooler has just taken its server connection
back): a second, short-lived connection with the same parameters asks for its server
process, and so does the session itself, three times over (in a busy pool other clients
may take the server connection in between; a quiet one answers at the first round):

* the probe answered by the session's own server process: a real server never gives one
  server process to two live sessions, while a transaction pooler hands the server
  connection the session just released to the next client (PgBouncer's default,
  ``server_round_robin = 0``);
* the session's own next statement answered by another server process: its statements
  move between server connections (``server_round_robin = 1`` hands out the one released
  longest ago).

A session-mode pooler keeps the session's server connection linked to it, so the probe
gets another one and nothing is concluded. A probe that cannot connect, fails or has to
wait for a server connection (a full session pool) concludes nothing either, and is
logged at debug level only. The cost is one short connection and up to six small
statements, once per process and database alias (a session reopened later is not probed
again), and only while the ``ADVISORY`` setting is not ``False``.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import pq

__all__ = ["find_pooler"]

logger = logging.getLogger("django_pglock")

#: The probe's connect timeout (seconds; libpq's minimum is 2).
CONNECT_TIMEOUT = 2
#: How long the probe's statements may wait for a server connection, in all.
ANSWER_TIMEOUT = 1.0
#: Rounds of (session's statement, probe's statement); a busy pool may hide one round.
ROUNDS = 3
APPLICATION_NAME = "django_pglock probe"

_QUERY = "SELECT pg_backend_pid()"

MOVED = "its statements ran on different server processes"
SHARED = "another connection was given its server process"


def find_pooler(
    session: psycopg.Connection[Any], params: Mapping[str, Any], backend_pid: int, alias: str
) -> str | None:
    """Evidence that ``session`` goes through a transaction-mode pooler, or ``None``.

    ``session`` is the lock session, idle in autocommit, whose setup statement ran on
    ``backend_pid``; ``params`` are the libpq parameters it was opened with. Never raises
    for a database error: a failing probe only means no evidence.
    """
    probe = _open_probe(params, alias)
    try:
        deadline = time.monotonic() + ANSWER_TIMEOUT
        for _ in range(ROUNDS):
            try:
                row = session.execute(_QUERY, prepare=False).fetchone()
            except psycopg.Error as exc:
                # The statements that follow meet the same error and report it.
                logger.debug("django_pglock: pooler probe on alias %r: %s", alias, _line(exc))
                return None
            if row is None or int(row[0]) != backend_pid:
                return MOVED
            if probe is None:
                continue
            other = _backend_pid(probe, deadline, alias)
            if other is None:
                _close(probe)
                probe = None
            elif other == backend_pid:
                return SHARED
        return None
    finally:
        _close(probe)


def _open_probe(params: Mapping[str, Any], alias: str) -> psycopg.Connection[Any] | None:
    options = {**params, "application_name": APPLICATION_NAME}
    options["connect_timeout"] = CONNECT_TIMEOUT
    try:
        return psycopg.connect(autocommit=True, prepare_threshold=None, **options)
    except psycopg.Error as exc:  # e.g. max_connections reached: no evidence, no harm
        # libpq's message names host and port at most, never the password.
        logger.debug(
            "django_pglock: pooler probe on alias %r could not connect: %s", alias, _line(exc)
        )
        return None


def _backend_pid(probe: psycopg.Connection[Any], deadline: float, alias: str) -> int | None:
    """The probe's server process, or ``None`` if it is not told by ``deadline``.

    Sent through libpq directly so that waiting is bounded: behind a full session pool
    the statement waits for a server connection that may not come for minutes.
    """
    pgconn = probe.pgconn
    try:
        pgconn.send_query(_QUERY.encode())
        while pgconn.flush():
            if not _wait(pgconn, deadline, write=True):  # pragma: no cover - fits in one write
                return _late(alias)
        results: list[pq.abc.PGresult] = []
        while True:
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    return _answer(results, alias)
                results.append(result)
            if not _wait(pgconn, deadline, write=False):
                return _late(alias)
    except psycopg.Error as exc:
        logger.debug("django_pglock: pooler probe on alias %r: %s", alias, _line(exc))
        return None


def _wait(pgconn: pq.abc.PGconn, deadline: float, *, write: bool) -> bool:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    sock = pgconn.socket
    ready = select.select([] if write else [sock], [sock] if write else [], [], remaining)
    return bool(ready[0] or ready[1])


def _answer(results: list[pq.abc.PGresult], alias: str) -> int | None:
    for result in results:
        if result.status == pq.ExecStatus.TUPLES_OK and result.ntuples == 1:
            value = result.get_value(0, 0)
            if value is not None:
                return int(value)
    message = next((r.error_message for r in results if r.error_message), b"no answer")
    logger.debug(
        "django_pglock: pooler probe on alias %r: %s",
        alias,
        message.decode(errors="replace").strip(),
    )
    return None


def _late(alias: str) -> int | None:
    logger.debug(
        "django_pglock: pooler probe on alias %r got no server process within %.1f s "
        "(a full session pool?)",
        alias,
        ANSWER_TIMEOUT,
    )
    return None


def _close(probe: psycopg.Connection[Any] | None) -> None:
    if probe is not None:
        with contextlib.suppress(Exception):
            probe.close()


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
