"""``Lease``: a granted lock, its lifecycle states, and the one place where they change.

A lease is in exactly one :class:`~.states.State`. Every change goes through
``Lease._advance``, which checks it against :data:`~.states.TRANSITIONS`; the callers
then do the change's work (signals, the registry, statements) outside the state lock.
The advisory key a lease may hold on the lock connection's session is a second, smaller
machine (:class:`~.states.Key`, :mod:`.keys`); releasing is in :mod:`.releasing`, and
the local deadline, alerts and loss in :mod:`.liveness`.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from django.db import connections

from . import beats, sql
from .conf import Thresholds
from .connection import LockConnection
from .exceptions import LockError, LockNotHeld
from .keys import KeyMixin
from .liveness import LivenessMixin
from .releasing import ReleaseMixin
from .states import TRANSITIONS, Key, State

if TYPE_CHECKING:
    from .lock import Lock

__all__ = ["TRANSITIONS", "Lease", "State"]

logger = logging.getLogger("django_pglock")


#: Leases not yet released, by token (weakly: a lease its caller dropped is an orphan).
_unreleased: weakref.WeakValueDictionary[int, Lease] = weakref.WeakValueDictionary()


def unreleased_tokens() -> list[int]:
    """Tokens of this process's leases whose rows it may still own, on every alias: two
    aliases may name one database (a token of another database only spares a row)."""
    return [lease.token for lease in list(_unreleased.values())]


#: Which lease each thread holds by name, so that the same thread acquiring a name it
#: holds fails at once instead of waiting for itself: (alias, name) -> lease.
_owned: dict[tuple[str, str], Lease] = {}


def safety_margin(thresholds: Thresholds) -> float:
    """How long before ``stale_after`` the holder gives up on an unconfirmed lease."""
    return min(thresholds.heartbeat_interval, thresholds.stale_after * 0.1)


def held_by_this_thread(alias: str, name: str) -> Lease | None:
    """The lease on ``name`` that the calling thread holds, if any."""
    lease = _owned.get((alias, name))
    if lease is None or lease._owner is not threading.current_thread():
        return None
    return lease if lease.state is State.HELD and lease._pid == os.getpid() else None


class Lease(LivenessMixin, KeyMixin, ReleaseMixin):
    """A granted lock: the right to run until released or lost.

    Attributes: ``name``, ``token`` (the fencing token of this grant), ``holder`` (this
    process's holder id), ``acquired_at`` (database time), ``using`` (database alias),
    ``state`` (a :class:`State`), ``slot`` (1..``limit``: which of a semaphore's slots
    this grant holds; 1 for a plain lock) and ``limit`` (the lock's ``limit``). A lease
    is also a context manager: leaving it releases the lock, and raises
    :class:`LockNotHeld` if the lease was lost while the block ran without error.
    """

    state = State.HELD
    _lost_reason: str | None = None
    _alerting = False
    _guarded = False  # guard() was called: the release must not wait for the row
    _outcome = "succeeded"
    _owner: threading.Thread | None = None
    #: Exit status of the wrapped program, recorded in the run history (locked_run).
    exit_code: int | None = None
    #: Once lost: the monotonic instant by which work done under the lease must have
    #: stopped, because a contender may hold the name from then on (``None`` while held).
    kill_deadline: float | None = None

    def __init__(
        self,
        lock: Lock,
        conn: LockConnection,
        token: int,
        acquired_at: datetime.datetime,
        advisory: bool,
        sent: float,
        thresholds: Thresholds,
        run_id: int | None,
        *,
        holder: str,
        key: int,
        slot: int = 1,
        row: str | None = None,
    ) -> None:
        self.name = lock.name
        self.slot = slot
        self.limit = lock.limit
        # The row this grant owns: the name, or the slot's (sql.slot_row). Every
        # statement about this grant names the row.
        self._row = lock.name if row is None else row
        self.token = token
        self.holder = holder
        self.acquired_at = acquired_at
        self.using = conn.alias
        self.heartbeat_interval = thresholds.heartbeat_interval
        self.alert_after = thresholds.alert_after
        self.stale_after = thresholds.stale_after
        self.advisory = advisory
        self._key_state = Key.NONE
        self._lock = lock
        self._conn = conn
        self._key = key
        self._generation = conn.generation
        self._pid = conn.pid
        self._margin = safety_margin(thresholds)
        self._confirmed_at = sent
        self._deadline = sent + thresholds.stale_after - self._margin
        self._started = sent
        self._state_lock = threading.RLock()
        self._release_lock = threading.Lock()
        self._on_lost: list[Callable[[Lease], None]] = []
        self._run_id = run_id  # the JobRun row of a recorded run
        _unreleased[token] = self
        if advisory:
            self._set_key(Key.HELD)

    def __repr__(self) -> str:
        slot = f" slot={self.slot}/{self.limit}" if self.limit > 1 or self.slot > 1 else ""
        return f"<Lease {self.name!r}{slot} token={self.token} {self.state.value}>"

    # -- the one place where the state changes ----------------------------------------

    def _advance(self, to: State, reason: str | None = None) -> bool:
        """Move to ``to`` if :data:`TRANSITIONS` allows it; ``False`` (no change) if not.

        ``reason`` records why the lease is lost (with ``LOST``, or with ``RELEASED``
        when the release found the row gone).
        """
        with self._state_lock:
            if to not in TRANSITIONS[self.state]:
                return False
            if to is State.LOST:  # before the reason: whoever sees a loss sees when
                self.kill_deadline = self._contender_may_start(reason)
            self.state = to
            if reason is not None and self._lost_reason is None:
                self._lost_reason = reason
        if _owned.get((self.using, self._row)) is self:
            _owned.pop((self.using, self._row), None)  # no thread holds it any longer
        if to is State.RELEASED:
            _unreleased.pop(self.token, None)
        return True

    def _own(self) -> None:
        """Record the calling thread as this lease's holder (sync acquires only)."""
        self._owner = threading.current_thread()
        _owned[(self.using, self._row)] = self

    # -- public API -------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        """``True`` once the lease may have been lost (it never becomes ``False`` again)."""
        if os.getpid() != self._pid:
            return True
        if self.state is State.HELD and time.monotonic() > self._deadline:
            self._mark_lost("no heartbeat was confirmed before the local deadline")
        return self._lost_reason is not None

    def check(self) -> None:
        """Raise :class:`LockNotHeld` unless the lease is held, asking the database."""
        self._require_held()
        rows = self._conn.execute(sql.CHECK, {"name": self._row, "token": self.token})
        self._check_session(self._conn)
        if not rows[0][0]:
            self._mark_lost("its row is gone or belongs to another holder", row_gone=True)
        self._require_held()

    def guard(self) -> None:
        """Fence the caller's transaction: call inside ``transaction.atomic(using=...)``.

        Locks the lease's row in that transaction so that no reclaim or forced release
        can happen before it ends; raises :class:`LockNotHeld` if the lease is gone.
        Heartbeats go on meanwhile, and releasing the lease inside the transaction does
        not deadlock: the row is deleted as soon as the transaction ends.
        """
        self._require_held()
        connection = connections[self.using]
        if not connection.in_atomic_block:
            raise LockError(
                f"lease.guard() for lock {self.name!r} ran outside a transaction; call it inside "
                f"transaction.atomic(using={self.using!r}) so the fence lasts until commit."
            )
        self._guarded = True
        with connection.cursor() as cursor:
            cursor.execute(sql.GUARD, {"name": self._row, "token": self.token})
            row = cursor.fetchone()
        if row is None:
            self._mark_lost("its row is gone or belongs to another holder", row_gone=True)
        self._require_held()

    def beat(self) -> None:
        """Heartbeat now (the heartbeat thread does this on its own every interval)."""
        self._require_held()
        beats.beat(self._conn, [self])
        self._check_session(self._conn)
        self._require_held()

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Call ``callback(lease)`` (from the heartbeat thread) when the lease is lost."""
        self._on_lost.append(callback)
        if self._lost_reason is not None:
            callback(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = self.lost
        if lost:
            self._outcome = "lost"
        elif exc_type is not None:
            self._outcome = "failed"
        try:
            self.release()
        except LockError as error:
            logger.warning("django_pglock: %s", error)
        # A row found gone at release was lost while the block ran, too.
        lost = lost or self._lost_reason is not None
        if lost and exc_type is None:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) was lost while the block ran: "
                f"{self._lost_reason or 'it belongs to the parent process'}."
            )

    # -- internals used by the heartbeat thread ---------------------------------------

    def _require_held(self) -> None:
        if os.getpid() != self._pid:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) belongs to process {self._pid}; "
                "a forked child inherits no lease. Acquire the lock in the child instead."
            )
        if self.lost:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) was lost: {self._lost_reason}."
            )
        if self.state is not State.HELD:
            raise LockNotHeld(f"Lock {self.name!r} (token {self.token}) was released.")

    def _session_ended(self) -> bool:
        conn = self._conn
        return not conn.is_open() or conn.generation != self._generation

    def _usable_for_key(self) -> bool:
        return self.state is State.HELD and self._conn.generation == self._generation


def _forget_after_fork() -> None:
    _owned.clear()  # a forked child inherits no lease
    _unreleased.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
