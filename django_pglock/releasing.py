"""Releasing a lease: the token-scoped delete, and its retries until it settles.

A release moves the lease to ``RELEASING`` at once, so it is never heartbeated again.
The delete then runs in the caller's thread; when it cannot run now (the server is
unreachable, a reader or a guarded transaction holds the row, or the lock connection
is busy while the lease is already lost), the heartbeat thread retries it with backoff
until it settles, so a process never keeps holding a lock it no longer wants.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from . import heartbeat, signals, sql
from .events import call_metrics, send
from .exceptions import ConnectionBusy, LockError
from .keys import key_shared
from .states import Key, State

if TYPE_CHECKING:
    from .connection import LockConnection

__all__ = ["ReleaseMixin"]

logger = logging.getLogger("django_pglock")

#: First delay before a failed or blocked release is tried again (doubling up to the
#: lease's heartbeat interval).
FIRST_RETRY = 0.1
#: How long the release of a lost lease waits for a busy lock connection at most (its
#: heartbeat may be stuck on an unresponsive server) before leaving it to the retries.
LOST_WAIT = 0.5


class ReleaseMixin:
    """The release half of a :class:`~django_pglock.lease.Lease`."""

    name: str
    token: int
    heartbeat_interval: float
    _row: str
    exit_code: int | None
    state: State
    _pid: int
    _conn: LockConnection
    _key: int
    _key_state: Key
    _generation: int
    _guarded: bool
    _outcome: str
    _run_id: int | None
    _lost_reason: str | None
    _started: float
    _deadline: float
    _lock: Any
    _state_lock: threading.RLock
    _release_lock: threading.Lock
    _release_retry_at = 0.0
    _release_delay = FIRST_RETRY
    _release_failures = 0  # attempts whose outcome is unknown (the statement failed)

    def _advance(self, to: State, reason: str | None = None) -> bool:  # pragma: no cover
        raise NotImplementedError

    def _session_ended(self) -> bool:  # pragma: no cover - defined by Lease
        raise NotImplementedError

    def _set_key(self, to: Key, generation: int | None = None) -> None:  # pragma: no cover
        raise NotImplementedError

    def _announce_lost(self, reason: str) -> None:  # pragma: no cover - defined by Lease
        raise NotImplementedError

    def release(self) -> None:
        """Release the lock: delete its row (scoped by token) and drop the advisory key.

        Safe to call more than once; in a forked child it does nothing (the lease
        belongs to the parent). From this call on the lease is never heartbeated again.
        If the delete cannot finish now, the heartbeat thread retries it until it
        settles and this raises :class:`LockError` saying so; a release waiting for a
        guarded transaction to end is finished the same way, without an error.
        """
        self._release()

    def _release(self, limit: float | None = None) -> None:
        """:meth:`release`, waiting at most ``limit`` s for a busy lock connection."""
        if os.getpid() != self._pid or not self._advance(State.RELEASING):
            return
        # A lost lease waits briefly for a busy lock connection (its heartbeat may be stuck
        # on an unresponsive server); a held one waits at most until its own deadline.
        held_wait = max(0.0, self._deadline - time.monotonic())
        wait = LOST_WAIT if self._lost_reason else held_wait
        wait = wait if limit is None else min(wait, limit)
        try:
            settled = self._finish_release(wait)
        except LockError as exc:
            self._retry_release_later()
            raise LockError(
                f"Releasing lock {self.name!r} (token {self.token}) did not finish: {exc} "
                "It is retried in the background until it settles."
            ) from None
        except BaseException:  # a signal handler's: the retries settle it
            self._retry_release_later()
            raise
        if not settled:  # a guarded transaction holds the row: delete once it ends
            self._retry_release_later()

    def _abandon(self) -> None:
        """Release from the heartbeat thread: for a grant nobody will use (its acquire
        was interrupted or cancelled). Does no I/O, so it is safe in an exception
        handler. Its run, if recorded, ends as ``failed``: its body never ran."""
        if self._advance(State.RELEASING):
            self._outcome = "failed"
            self._retry_release_later(at_once=True)

    def _retry_release_later(self, *, at_once: bool = False) -> None:
        if self.state is not State.RELEASING:
            return  # settled after all (by what an interrupted attempt returned)
        now = time.monotonic()
        with self._state_lock:
            self._release_retry_at = now if at_once else now + self._release_delay
            limit = max(FIRST_RETRY, self.heartbeat_interval)
            self._release_delay = min(self._release_delay * 2, limit)
        heartbeat.registry().add(self)  # type: ignore[arg-type]

    def _retry_release(self, now: float) -> float:
        """From the heartbeat thread: try the pending delete again if it is due;
        return when to look again."""
        if now < self._release_retry_at:
            return self._release_retry_at
        try:
            if self._finish_release(None):
                return now + 60.0
        except LockError as exc:
            log = logger.warning if self._release_failures == 1 else logger.debug
            log("django_pglock: releasing %r failed, retrying: %s", self.name, exc)
        self._retry_release_later()
        return self._release_retry_at

    def _finish_release(self, wait: float | None) -> bool:
        """Try the token-scoped delete once; ``True`` when the release has settled."""
        with self._release_lock:
            if self.state is State.RELEASED:
                return True
            try:
                return self._try_delete(wait)
            except BaseException:
                self._release_failures += 1
                raise

    def _try_delete(self, wait: float | None) -> bool:
        lock = self._conn.lock
        if not lock.acquire(timeout=-1 if wait is None else wait):
            raise ConnectionBusy(
                f"The lock connection for database alias {self._conn.alias!r} stayed busy "
                f"with another statement for {wait:.1f} s."
            )
        try:  # holding the connection: no grant can share the key meanwhile
            return self._delete(wait)
        finally:
            lock.release()

    def _delete(self, wait: float | None) -> bool:
        unlock = self._key_state is Key.HELD and not self._session_ended()
        # Another lease of this process that holds the same key (two names whose keys
        # collide) shares this session's one hold of it: the last of them gives it back.
        unlock = unlock and not key_shared(self._conn, self._key, exclude=self)
        params = {"name": self._row, "token": self.token, "advisory": unlock, "key": self._key}
        if self._run_id is None:
            statement = sql.RELEASE_GUARDED if self._guarded else sql.RELEASE
        else:
            statement = sql.RELEASE_GUARDED_RECORDED if self._guarded else sql.RELEASE_RECORDED
            params.update(run_id=self._run_id, outcome=self._outcome, exit_code=self.exit_code)
        # The key is unlocked only on the session that holds it: never on a new one.
        session = self._generation if unlock else None

        def failed(rows: list[tuple[Any, ...]], alive: bool) -> None:
            # (_finish_release counts the failure.)
            if rows:  # it ran after all (an interruption came before its answer was read)
                self._settle(rows[0])

        rows = self._conn.execute(
            statement, params, session=session, wait=wait, after_failure=failed
        )
        return self._settle(rows[0])

    def _settle(self, row: tuple[Any, ...]) -> bool:
        """Apply what a release statement did; ``True`` when the release has settled."""
        deleted, present, _ = row
        if present and not deleted:
            return False  # locked by a guarded transaction; retried once it ends
        with self._state_lock:
            if self.state is State.RELEASED:  # pragma: no cover - the caller checked, same lock
                return True
            if self._key_state is Key.HELD:
                self._set_key(Key.NONE)
            was_lost = self._lost_reason is not None
            # A row gone after an attempt whose outcome is unknown was most likely
            # deleted by that attempt: not a loss.
            gone = not deleted and not was_lost and not self._release_failures
            self._advance(State.RELEASED, "its row was gone at release" if gone else None)
        heartbeat.registry().discard(self)  # type: ignore[arg-type]
        if gone:
            self._announce_lost("its row was gone at release")
        if deleted and not was_lost:
            send(signals.lock_released, self._lock, lease=self)
            call_metrics(
                self._lock._hooks(), "released", self.name, time.monotonic() - self._started
            )
        return True
