"""The one dedicated autocommit connection per process and database alias.

Built from ``DATABASES[alias]`` through Django's own ``get_connection_params()``, so every
libpq option, SSL setting, service file and ``.pgpass`` works as it does for Django,
while Django's connection (and its pool and transactions) is never touched. A forked
child never uses its parent's connection: the registry is keyed by process id.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import abc

from .conf import get_setting, validate_alias
from .exceptions import ConnectionBusy, DatabaseUnavailable, LockError, SessionEnded
from .failures import first_line, is_unavailable
from .opening import open_session
from .protocol import NoAnswer, Protocol, converted
from .sessionevents import notified as _notified
from .sessionevents import on_session_end as on_session_end
from .sessionevents import tell_session_ended as _tell_session_ended

__all__ = ["ConnectionBusy", "LockConnection", "SessionEnded", "get_connection", "validate_alias"]

logger = logging.getLogger("django_pglock")


class LockConnection(Protocol):
    """An autocommit psycopg connection shared by every lock of this process on one alias.

    Calls are serialised by a lock. A broken connection is closed and reopened on the next
    call; ``generation`` counts the sessions opened, so callers can tell whether the
    session that took an advisory lock is still the current one.
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.pid = os.getpid()  # the process this connection belongs to
        self.lock = threading.RLock()
        self.generation = 0
        self.backend_pid: int | None = None
        self.pooled = False  # a transaction-mode pooler was detected
        # A statement was interrupted: a row of this process that no lease owns may exist
        # (the heartbeat thread sweeps them; see sql.SWEEP_ORPHANS).
        self.orphans_possible = False
        self._backend_start: Any = None  # when this session's server process started
        self._abandoned: list[tuple[int | None, Any]] = []  # sessions that stopped answering
        self._pooler_announced = False  # callers were told, so leases left the advisory path
        self.durable_commit = "on"  # the session's synchronous_commit (never off)
        self._conn: psycopg.Connection[Any] | None = None
        self._cursor: psycopg.RawCursor[Any] | None = None  # the fallback path's cursor
        self._prepare = True
        # The direct path: one transformer per session, and the statements prepared on
        # it (by text and parameter types, as psycopg keys its own).
        self._direct = Protocol.direct_available
        self._tx: abc.Transformer | None = None
        self._prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._preparing: tuple[bytes, tuple[int, ...], bytes] | None = None
        self._encoding = "utf-8"

    def __repr__(self) -> str:  # never shows connection parameters
        state = "open" if self._conn is not None else "closed"
        return f"<LockConnection alias={self.alias!r} {state} backend_pid={self.backend_pid}>"

    def _connect(self, deadline: float | None = None) -> psycopg.Connection[Any]:
        conn = open_session(self, deadline)
        # psycopg hands over each notification it reads, while any statement's answer is
        # read (heartbeats, other locks) or by read_idle(): none is left unread.
        conn.add_notify_handler(functools.partial(_notified, self))
        return conn

    def execute(
        self,
        query: str,
        params: dict[str, Any],
        *,
        session: int | None = None,
        wait: float | None = None,
        after_failure: Callable[[list[tuple[Any, ...]], bool], None] | None = None,
        deadline: float | None = None,
    ) -> list[tuple[Any, ...]]:
        """Run one statement and return its rows; on a broken connection raise ``LockError``.

        ``session``: run only on that session (``generation``), never on a new one, else
        raise :class:`SessionEnded` (a statement about an advisory key must not reconnect).
        ``wait``: seconds to wait for another thread's statement at most, else raise
        :class:`ConnectionBusy`. A statement with no answer within
        :data:`STATEMENT_DEADLINE` (a stopped server process, a stalled network), or by
        ``deadline`` (``time.monotonic()``, a blocking acquire's bound; it bounds opening a
        session too), gives its session up. An exception raised while the statement is in
        flight (a signal handler's) cancels and drains it before it propagates, so the
        connection stays usable. Whenever a statement that was sent fails,
        ``after_failure(rows, session_alive)`` runs first, still holding the connection:
        ``rows`` are what the statement returned anyway, if it completed.
        """
        statement, names = converted(query)
        values = [params[name] for name in names]
        if not self.lock.acquire(timeout=-1 if wait is None else wait):
            raise ConnectionBusy(
                f"The lock connection for database alias {self.alias!r} stayed busy with "
                f"another statement for {wait:.1f} s."
            )
        ended: int | None = None
        try:
            if session is not None and (not self.is_open() or self.generation != session):
                raise SessionEnded(
                    f"The lock session on database alias {self.alias!r} that held the key "
                    "has ended."
                )
            if self._conn is None or self._conn.closed or self._cursor is None:
                self._conn = self._connect(deadline)
            try:
                return self._run_or_retry(statement, values, deadline)
            except NoAnswer as exc:
                ended = self._abandon_session()  # no answer: no cancel either
                _call(after_failure, [], False)
                raise DatabaseUnavailable(
                    f"A lock statement on database alias {self.alias!r} got {exc}; the "
                    "session was given up."
                ) from None
            except psycopg.Error as exc:
                lost = self._conn.broken or self._conn.closed
                if lost:
                    ended = self._discard()
                _call(after_failure, [], not lost)
                if lost:
                    raise DatabaseUnavailable(
                        f"The lock connection for database alias {self.alias!r} was lost: "
                        f"{first_line(exc)}."
                    ) from None
                error = DatabaseUnavailable if is_unavailable(exc, self._conn) else LockError
                raise error(
                    f"A lock statement failed on database alias {self.alias!r}: {first_line(exc)}."
                ) from exc
            except BaseException:
                self.orphans_possible = True  # whatever it did, its caller never hears
                rows, ended = self._abort_in_flight()
                _call(after_failure, rows, ended is None)
                raise
        finally:
            self.lock.release()
            if ended is not None:
                _tell_session_ended(self, ended)

    def ensure_open(self, deadline: float | None = None) -> None:
        """Open the session now if it is not open (so that a pooler is looked for, and
        found, before the caller decides whether to take an advisory key); opening it is
        bounded by ``deadline`` (``time.monotonic()``) as well, if given."""
        if self._conn is not None and not self._conn.closed and self._cursor is not None:
            return
        with self.lock:
            if self._conn is None or self._conn.closed or self._cursor is None:
                self._conn = self._connect(deadline)

    def note_backend_pid(self, backend_pid: int) -> bool:
        """Compare the server process that ran a statement with this session's.

        A different one means a transaction-mode pooler sits in between: session advisory
        locks cannot be trusted there, so the advisory path is switched off for good.
        Returns ``True`` when this call is the one that found out.
        """
        if self.backend_pid is not None and backend_pid != self.backend_pid:
            self._found_pooler("its statements ran on different server processes")
        if self.pooled and not self._pooler_announced:
            self._pooler_announced = True
            return True
        return False

    def _found_pooler(self, evidence: str) -> None:
        if not self.pooled:
            self.pooled = True
            # Only worth a warning when the project has not switched the path off itself.
            log = logger.warning if get_setting("ADVISORY") is not False else logger.debug
            log(
                "django_pglock: the lock connection for database alias %r goes through a "
                "transaction-mode pooler (%s), so the advisory path is off. Set "
                "DJANGO_PGLOCK['ADVISORY'] = False for this deployment.",
                self.alias,
                evidence,
            )

    def fileno(self) -> int | None:
        """The socket of the open session, for the heartbeat thread to watch."""
        conn = self._conn
        if conn is None or conn.closed:
            return None
        try:
            return conn.fileno()
        except psycopg.Error:  # pragma: no cover - only if another thread closes it just now
            return None

    def readable_while_idle(self) -> bool:
        """True if the socket has input while no statement is in flight (not on Linux)."""
        with self.lock:
            fd = self.fileno()
            return fd is not None and bool(select.select([fd], [], [], 0)[0])

    def probe(self) -> bool:
        """Check a session the server may have closed; ``False`` (and closed) if it did."""
        ended = None
        with self.lock:
            if self._conn is None or self._conn.closed:
                return False
            try:
                self._conn.execute("SELECT 1", prepare=False)
                return True
            except psycopg.Error:
                ended = self._discard()
        if ended is not None:  # pragma: no branch - _discard() of an open session: its generation
            _tell_session_ended(self, ended)
        return False

    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def _abandon_session(self) -> int | None:
        """Give up a session that may still run a statement of ours: it is ended on the
        server from the next session (``sql.END_ABANDONED``), so that statement can never
        commit a grant nobody receives, and rows nobody owns are swept then."""
        if self.backend_pid is not None:  # pragma: no branch - the current session's, known
            self._abandoned.append((self.backend_pid, self._backend_start))
        self.orphans_possible = True
        return self._discard()

    def _discard(self) -> int | None:
        """Close the session; return its generation if one was open (its keys are gone:
        the caller tells the listeners once it has let go of the lock)."""
        conn, self._conn, self._cursor, self._tx = self._conn, None, None, None
        self._prepared = {}
        self.backend_pid = None
        if conn is None:
            return None
        with contextlib.suppress(psycopg.Error):
            conn.close()
        return self.generation

    def close(self) -> None:
        with self.lock:
            ended = self._discard()
        if ended is not None:
            _tell_session_ended(self, ended)


def _call(
    after_failure: Callable[[list[tuple[Any, ...]], bool], None] | None,
    rows: list[tuple[Any, ...]],
    alive: bool,
) -> None:
    if after_failure is not None:
        after_failure(rows, alive)


_registry: dict[str, LockConnection] = {}
_registry_pid = os.getpid()
_registry_lock = threading.Lock()


def get_connection(alias: str) -> LockConnection:
    """The dedicated connection of this process for ``alias`` (opened lazily)."""
    global _registry_pid
    conn = _registry.get(alias)
    if conn is not None and _registry_pid == os.getpid():
        return conn
    with _registry_lock:
        if _registry_pid != os.getpid():
            _forget_after_fork()
        conn = _registry.get(alias)
        if conn is None:
            conn = _registry[alias] = LockConnection(alias)
        return conn


#: The parent's connections, kept referenced in a forked child so that they are never
#: finalised there.
_inherited: list[LockConnection] = []


def _forget_after_fork() -> None:
    """Drop the parent's connections in a forked child without ending their sessions.

    The child's copy of each lock socket is pointed at ``/dev/null``: the parent's
    session (and the advisory keys it holds) must end when the parent dies, not live on
    in a child that keeps the socket open. Nothing is sent on it, and psycopg does not
    finish a connection from a process other than the one that opened it.
    """
    global _registry_pid, _registry_lock
    for conn in _registry.values():
        fd = conn.fileno()
        if fd is not None:
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, fd, inheritable=False)
                os.close(null)
        _inherited.append(conn)
    _registry.clear()
    _registry_pid = os.getpid()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
