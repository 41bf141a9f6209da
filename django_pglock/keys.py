"""The advisory key a lease may hold on its lock connection's session.

A small machine of its own (:class:`~.states.Key`): a lease granted on the advisory
path holds the key; one granted while a racing contender's statement held the key wants
it, and the heartbeat thread takes it when it can; a lease gives the key back when it is
released or its row is seen gone. Every change goes through ``KeyMixin._set_key``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from . import sql
from .exceptions import LockError
from .states import Key

if TYPE_CHECKING:
    from .connection import LockConnection

__all__ = ["FIRST_KEY_RETRY", "LAST_KEY_RETRY", "KeyMixin", "key_shared", "keys_held"]


#: How soon a lease granted without its advisory key tries to take it again (doubling up
#: to its heartbeat interval, at most LAST_KEY_RETRY).
FIRST_KEY_RETRY = 0.05
LAST_KEY_RETRY = 1.0
ADOPTION_IN_DOUBT = (
    "its session ended while it took its advisory key, so its row may say it holds a key "
    "nobody holds: a contender may take over at once"
)


def key_shared(conn: LockConnection, key: int, exclude: object = None) -> bool:
    """Whether a lease of this process (other than ``exclude``) holds advisory ``key`` on
    the current session of ``conn``. A session holds a key once, for every lease whose
    row says so (see sql.acquire's ``maybe_held``): the last of them gives it back. Call
    while holding ``conn.lock``."""
    from . import heartbeat

    generation = conn.generation
    return any(
        lease is not exclude
        and lease._key == key
        and lease._key_state is Key.HELD
        and lease._generation == generation
        for lease in heartbeat.registry().leases(conn.alias)
    )


def keys_held(conn: LockConnection) -> set[int]:
    """The advisory keys leases of this process hold on the current session of ``conn``
    (:func:`key_shared` for every key at once). Call while holding ``conn.lock``."""
    from . import heartbeat

    generation = conn.generation
    return {
        lease._key
        for lease in heartbeat.registry().leases(conn.alias)
        if lease._key_state is Key.HELD and lease._generation == generation
    }


class KeyMixin:
    """The key half of a :class:`~django_pglock.lease.Lease`."""

    name: str
    token: int
    advisory: bool
    _row: str
    heartbeat_interval: float
    _key: int
    _key_state: Key
    _conn: LockConnection
    _generation: int
    _state_lock: threading.RLock
    _release_lock: threading.Lock
    _key_retry_at = 0.0
    _key_retry_delay = FIRST_KEY_RETRY

    def _session_ended(self) -> bool:  # pragma: no cover - defined by Lease
        raise NotImplementedError

    def _usable_for_key(self) -> bool:  # pragma: no cover - defined by Lease
        raise NotImplementedError

    def _mark_lost(self, reason: str, *, row_gone: bool = False) -> None:  # pragma: no cover
        raise NotImplementedError

    def _set_key(self, to: Key, generation: int | None = None) -> None:
        """The one place where the key state changes (caller holds ``_state_lock``)."""
        if to is Key.HELD:
            if generation is not None:
                self._generation = generation
            self.advisory = True
        self._key_state = to

    def _claim_key(self) -> bool:
        """Take the duty to unlock the advisory key; true at most once per lease, and
        only while the session that took the key is still the current one."""
        with self._state_lock:
            held = self._key_state is Key.HELD and not self._session_ended()
            if self._key_state is Key.HELD:
                self._set_key(Key.NONE)
            return held

    def _give_back_key(self) -> None:
        # Under the connection's lock from the claim to the unlock: no attempt of another
        # thread of this process runs between them, so none finds the key unclaimed and
        # takes it again (advisory locks nest) while this unlock is pending.
        with self._conn.lock:
            if not self._claim_key():
                return
            # If the session ended meanwhile, the key went with it; another lease of
            # this process holding the same key keeps the hold.
            if key_shared(self._conn, self._key, exclude=self):
                return
            with contextlib.suppress(LockError):
                params = {"key": self._key, "name": self._row, "token": self.token}
                self._conn.execute(sql.UNLOCK, params, session=self._generation)

    def _adopted_on_ended_session(self, conn: LockConnection) -> bool:
        """After an adoption whose answer was lost with its session: did it commit?

        Read on a new session (a session given up for not answering is ended on the
        server first, so the statement cannot commit later). ``True`` when the row says
        advisory, or when that cannot be read: then a contender may take over at once.
        """
        try:
            rows = conn.execute(sql.ADOPTED, {"name": self._row, "token": self.token})
        except LockError:
            return True
        return bool(rows and rows[0][0])

    def _adopt_key(self, conn: LockConnection, now: float) -> None:
        """Try once to take the advisory key this lease was granted without.

        A contender held the key for the length of its own statement when this lease
        was granted; once this session holds it and the row says so, a crash of this
        process frees the name at once, as for any other advisory lease.
        """
        with self._release_lock:  # a release cannot claim the key meanwhile
            with self._state_lock:
                if not self._usable_for_key() or conn.pooled:
                    self._set_key(Key.NONE)
                    return
            # Marked held before the connection is let go, so that no other thread's
            # failed attempt takes this key for a stray one and unlocks it.
            in_doubt: list[bool] = []

            def failed(rows: list[tuple[Any, ...]], alive: bool) -> None:
                # No answer and no session: the row may now say this lease holds the
                # key on a session that has ended, so a contender may take the name at
                # once. The lease cannot tell: it is lost.
                if not alive:
                    in_doubt.append(True)

            try:
                with conn.lock:
                    rows = conn.execute(
                        sql.ADOPT_KEY,
                        {"name": self._row, "token": self.token, "key": self._key},
                        session=self._generation,
                        after_failure=failed,
                    )
                    generation = conn.generation
                    with self._state_lock:
                        if not rows[0][0]:
                            self._key_retry_at = now + self._key_retry_delay
                            self._key_retry_delay = min(
                                self._key_retry_delay * 2, self.heartbeat_interval, LAST_KEY_RETRY
                            )
                            return
                        if self._usable_for_key() and conn.generation == generation:
                            self._set_key(Key.HELD, generation)
                            return
                        self._set_key(Key.NONE)
            except LockError:
                if in_doubt and self._adopted_on_ended_session(conn):
                    with self._state_lock:
                        self._set_key(Key.NONE)
                    self._mark_lost(ADOPTION_IN_DOUBT)
                raise
        # Lost while the key was being taken: nobody else will give it back.
        with contextlib.suppress(LockError):
            params = {"key": self._key, "name": self._row, "token": self.token}
            conn.execute(sql.UNLOCK, params, session=generation)
