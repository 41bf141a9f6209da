"""How the lock connection speaks to the server: statements sent straight through libpq.

The direct path speaks to libpq through psycopg's own protocol step and type adapters,
as a cursor does, minus the cursor's bookkeeping (half of the client's time per attempt,
more on a busy machine). Statements come from :mod:`.sql` with ``%(name)s`` placeholders;
each is converted to ``$n`` and encoded once. An exception raised while a statement is in
flight (a signal handler's) is settled here: the statement is cancelled and drained.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat

try:  # psycopg's own (C-accelerated) protocol step, which its cursors use as well
    from psycopg.generators import execute as _fetch_results
except ImportError:  # pragma: no cover - a psycopg without it: the cursor path below
    _fetch_results = None

if TYPE_CHECKING:
    from psycopg import abc

__all__ = ["DRAIN_TIMEOUT", "STATEMENT_DEADLINE", "NoAnswer", "Protocol", "converted"]

#: How long a lock statement may go without an answer before its session is given up:
#: the server's own statement_timeout (30 s) plus a little, for what that timeout cannot
#: see (a stopped server process, a stalled network, a commit waiting for a standby).
STATEMENT_DEADLINE = 32.0

#: How long an interrupted statement may take to be cancelled and drained before the
#: session is given up instead.
DRAIN_TIMEOUT = 5.0


class NoAnswer(Exception):
    """A statement got no answer before its deadline: ``within`` seconds, the caller's
    bound (the time left of a blocking acquire's timeout) when ``caller`` is true."""

    def __init__(self, within: float = STATEMENT_DEADLINE, caller: bool = False) -> None:
        super().__init__(within, caller)
        self.within = within
        self.caller = caller

    def __str__(self) -> str:
        why = " (the time left of the caller's timeout)" if self.caller else ""
        return f"no answer within {self.within:.3g} s{why}"


def _bounded(gen: Any, deadline: float, within: float = DRAIN_TIMEOUT, caller: bool = False) -> Any:
    """``gen`` (a psycopg protocol generator), raising :class:`NoAnswer` once ``deadline``
    (``time.monotonic()``) has passed: psycopg resumes it at every poll interval."""
    try:
        wanted = next(gen)
        while True:
            ready = yield wanted
            if time.monotonic() > deadline:
                raise NoAnswer(within, caller)
            wanted = gen.send(ready)
    except StopIteration as stop:
        return stop.value


class Protocol:
    """The statement half of :class:`~django_pglock.connection.LockConnection`."""

    #: Whether this psycopg has the protocol step the direct path needs.
    direct_available = _fetch_results is not None

    _conn: psycopg.Connection[Any] | None
    _cursor: psycopg.RawCursor[Any] | None
    _tx: abc.Transformer | None
    _prepare: bool
    _direct: bool
    _prepared: dict[tuple[bytes, tuple[int, ...]], bytes]
    _preparing: tuple[bytes, tuple[int, ...], bytes] | None
    _encoding: str

    def _abandon_session(self) -> int | None:  # pragma: no cover - defined by LockConnection
        raise NotImplementedError

    def _found_pooler(self, evidence: str) -> None:  # pragma: no cover - by LockConnection
        raise NotImplementedError

    def _run_or_retry(
        self, statement: bytes, values: list[Any], deadline: float | None
    ) -> list[tuple[Any, ...]]:
        """:meth:`_run`, once more unprepared if a pooler made its prepared statement
        vanish or collide (nothing ran then)."""
        try:
            return self._run(statement, values, deadline)
        except (
            psycopg.errors.DuplicatePreparedStatement,
            psycopg.errors.InvalidSqlStatementName,
            psycopg.errors.ProtocolViolation,  # a same-named statement of another query
        ):
            # Prepared statements vanish or collide when a transaction-mode pooler
            # moves the session between server connections. Nothing ran: run it
            # again unprepared, and leave the advisory path for good.
            self._prepare = False
            self._found_pooler("its prepared statements came and went")
            return self._run(statement, values, deadline)

    def _abort_in_flight(self) -> tuple[list[tuple[Any, ...]], int | None]:
        """After an exception that left a statement in flight: cancel it and read what
        it returned, so the next statement finds the session idle. A session that cannot
        be drained in time is closed instead (returns its generation as ended)."""
        conn = self._conn
        if conn is None or self._tx is None:
            return [], None
        if conn.closed:  # psycopg gave it up itself (its own cancellation got no answer)
            return [], self._abandon_session()
        pgconn = conn.pgconn
        preparing, self._preparing = self._preparing, None
        if pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
            return [], None
        rows: list[tuple[Any, ...]] = []
        try:
            with contextlib.suppress(psycopg.Error):
                conn.cancel_safe(timeout=DRAIN_TIMEOUT)
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
                if _fetch_results is None:
                    raise NoAnswer  # pragma: no cover - a psycopg without the direct path
                results = conn.wait(_bounded(_fetch_results(pgconn), deadline), interval=0.1)
                if preparing is not None and results:
                    # The statement was being prepared: remember it only if that worked.
                    if results[0].status == pq.ExecStatus.COMMAND_OK:
                        self._prepared[preparing[:2]] = preparing[2]
                    preparing = None
                for result in results:
                    if result.status == pq.ExecStatus.TUPLES_OK:
                        self._tx.set_pgresult(result)
                        rows = self._tx.load_rows(0, result.ntuples, tuple)
            return rows, None
        except BaseException:
            return [], self._abandon_session()

    def _run(
        self, statement: bytes, values: list[Any], deadline: float | None = None
    ) -> list[tuple[Any, ...]]:
        """Send one statement on the open session and return its rows (caller holds the lock).

        It gets :data:`STATEMENT_DEADLINE` seconds to answer, or until ``deadline``
        (``time.monotonic()``, a blocking acquire's bound) if that comes first; then
        :class:`NoAnswer` is raised and the statement may still run on the server.

        The direct path speaks to libpq through psycopg's own protocol step and type
        adapters, as a cursor does, minus the cursor's bookkeeping: that bookkeeping was
        half of the client's time per attempt, more on a busy machine. Waiting goes
        through ``Connection.wait``, so an interrupt cancels the statement as it would
        in a cursor. Without the direct path (an unexpected psycopg), the cursor runs it.
        """
        conn = self._conn
        tx = self._tx
        assert conn is not None and tx is not None
        self._preparing = None
        if not self._direct or _fetch_results is None:
            cursor = self._cursor
            assert cursor is not None
            cursor.execute(statement, values, prepare=self._prepare)
            result = cursor.pgresult
            if result is None or result.status != pq.ExecStatus.TUPLES_OK:
                return []
            return cursor.fetchall()
        now = time.monotonic()
        limit, caller = now + STATEMENT_DEADLINE, False
        if deadline is not None and deadline < limit:
            limit, caller = deadline, True

        def bounded(gen: Any) -> Any:
            return _bounded(gen, limit, round(limit - now, 1), caller)

        with conn.lock:
            buffers = tx.dump_sequence(values, _formats(len(values)))
            types = tx.types or ()
            formats = tx.formats
            pgconn = conn.pgconn
            if self._prepare:
                name = self._prepared.get((statement, types))
                if name is None:
                    name = _statement_name(statement, types)
                    # Remembered while in flight: an interruption now is settled by
                    # _abort_in_flight from the prepare's own result.
                    self._preparing = (statement, types, name)
                    pgconn.send_prepare(name, statement, param_types=types)
                    self._check(conn.wait(bounded(_fetch_results(pgconn))))
                    self._preparing = None
                    self._prepared[(statement, types)] = name
                pgconn.send_query_prepared(name, buffers, param_formats=formats)
            else:
                pgconn.send_query_params(
                    statement, buffers, param_types=types, param_formats=formats
                )
            result = self._check(conn.wait(bounded(_fetch_results(pgconn))))
            if result.status != pq.ExecStatus.TUPLES_OK:
                return []
            tx.set_pgresult(result)
            return tx.load_rows(0, result.ntuples, tuple)

    def _check(self, results: list[pq.abc.PGresult]) -> pq.abc.PGresult:
        """The last result of one statement; an error result raised as psycopg would."""
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=self._encoding)
        return results[-1]


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")

_FORMATS: dict[int, list[PyFormat]] = {}


def _formats(count: int) -> list[PyFormat]:
    """Let psycopg pick each parameter's format, as ``%s`` does."""
    formats = _FORMATS.get(count)
    if formats is None:
        formats = _FORMATS[count] = [PyFormat.AUTO] * count
    return formats


def _statement_name(statement: bytes, types: tuple[int, ...]) -> bytes:
    """A prepared statement's name derived from its text and parameter types.

    Behind a transaction-mode pooler a session may meet statements another client
    prepared on the same server connection: a name that only ever means one statement
    keeps that from running the wrong one.
    """
    digest = hashlib.blake2b(statement + repr(types).encode(), digest_size=10).hexdigest()
    return f"django_pglock_{digest}".encode()


_converted: dict[str, tuple[bytes, tuple[str, ...]]] = {}  # the statements of sql.py


def converted(query: str) -> tuple[bytes, tuple[str, ...]]:
    """``query`` as sent (``$n`` placeholders, encoded) and its parameter names in order."""
    found = _converted.get(query)
    if found is None:
        found = _converted[query] = _positional(query)
    return found


def _positional(query: str) -> tuple[bytes, tuple[str, ...]]:
    """``query`` with its ``%(name)s`` placeholders as ``$1``, ``$2``…, encoded, and the
    names in placeholder order.

    Each (constant) statement is converted and encoded once, then sent as it is on every
    attempt, without psycopg's own placeholder conversion and encoding per call.
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _PLACEHOLDER.sub(number, query).encode(), tuple(names)
