"""A lease's liveness: its local deadline, the holder's own alerts, and being lost.

The heartbeat thread confirms heartbeats (``_confirm``) and watches each lease
(``_watch``); a lease whose deadline passed, whose row is gone or whose advisory session
ended is lost (``_mark_lost``, through ``Lease._advance``) and says so once
(``_announce_lost``). ``_held_until`` and ``_contender_may_start`` tell ``locked_run``
when its job must have stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import heartbeat, signals, sql
from .events import call_metrics, send
from .identity import current
from .states import Key, State

if TYPE_CHECKING:
    from .connection import LockConnection
    from .lease import Lease
    from .lock import Lock

__all__ = ["ROW_GONE", "SESSION_ENDED", "LivenessMixin"]

logger = logging.getLogger("django_pglock")

ROW_GONE = "its row is gone or belongs to another holder"
SESSION_ENDED = "its database session ended, so a contender may take over at once"


class LivenessMixin:
    """The liveness half of a :class:`~django_pglock.lease.Lease`."""

    name: str
    token: int
    holder: str
    _row: str
    state: State
    alert_after: float
    stale_after: float
    _alerting: bool
    _confirmed_at: float
    _deadline: float
    _margin: float
    _pid: int
    _generation: int
    _key_state: Key
    _conn: LockConnection
    _lock: Lock
    _state_lock: threading.RLock
    _on_lost: list[Callable[[Lease], None]]

    if TYPE_CHECKING:  # defined by Lease and KeyMixin

        def _advance(self, to: State, reason: str | None = None) -> bool: ...
        def _session_ended(self) -> bool: ...
        def _give_back_key(self) -> None: ...

    def _confirm(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) updated the row, durably."""
        with self._state_lock:
            if sent > self._confirmed_at:
                self._confirmed_at = sent
                self._deadline = sent + self.stale_after - self._margin
            self._alerting = False

    def _watch(self, now: float) -> float:
        """Enforce the local deadline and raise alerts; return when to look again."""
        if self.state is not State.HELD:
            return now + 60.0
        if now > self._deadline:
            self._mark_lost("no heartbeat was confirmed before the local deadline")
            return now + 60.0
        age = now - self._confirmed_at
        with self._state_lock:
            alert = age > self.alert_after and not self._alerting
            self._alerting = self._alerting or alert
        if alert:
            holder = {"holder": self.holder, "host": current().host, "pid": self._pid}
            send(
                signals.lock_alert,
                self._lock,
                name=self.name,
                holder=holder,
                heartbeat_age=age,
                lease=self,
            )
            call_metrics(self._lock._hooks(), "alert", self.name, age)
        next_alert = self._confirmed_at + self.alert_after if not self._alerting else self._deadline
        return min(self._deadline, next_alert) + 0.001

    def _check_session(self, conn: LockConnection) -> None:
        """An advisory lease dies with the session that took the key."""
        if self._key_state is Key.HELD and self.state is State.HELD and self._session_ended():
            self._mark_lost("its database session ended, so a contender may take over at once")

    def _contender_may_start(self, reason: str | None) -> float:
        """When a contender may hold the name, for a lease being lost now.

        A gone row or an ended session (advisory path) lets one in at once; otherwise
        the last confirmed heartbeat (sent no later than the database stamped it) plus
        ``stale_after``, less half the safety margin to stop the work and reap it.
        """
        now = time.monotonic()
        if reason in (ROW_GONE, SESSION_ENDED):
            return now
        return max(now, self._held_until())

    def _held_until(self) -> float:
        """When work under the lease must have stopped if no later heartbeat is confirmed
        (``time.monotonic()``): the last confirmed heartbeat plus ``stale_after``, less
        half the safety margin. ``locked_run``'s guardian kills the job then."""
        return self._confirmed_at + self.stale_after - self._margin / 2

    def _session_fileno(self) -> int | None:
        """The socket of the session this lease was granted on, while it is the current
        one (``locked_run``'s guardian holds a duplicate to keep that session alive)."""
        return None if self._session_ended() else self._conn.fileno()

    def _mark_lost(self, reason: str, *, row_gone: bool = False) -> None:
        if row_gone:
            reason = ROW_GONE
        elif self._key_state is Key.HELD and self._session_ended():
            reason = SESSION_ENDED
        if not self._advance(State.LOST, reason):
            return
        if row_gone:
            # Someone else owns the name now: give the advisory key back at once.
            self._give_back_key()
        if self._key_state is not Key.HELD:
            heartbeat.registry().discard(self)  # type: ignore[arg-type]
        # Otherwise the row may still be ours (a missed deadline): the heartbeat thread
        # keeps the key, and so the holder's precedence, until the row is seen gone.
        self._announce_lost(reason)

    def _announce_lost(self, reason: str) -> None:
        logger.warning("django_pglock: lock %r (token %s) lost: %s", self.name, self.token, reason)
        send(signals.lock_lost, self._lock, lease=self, reason=reason)
        call_metrics(self._lock._hooks(), "lost", self.name)
        for callback in list(self._on_lost):
            try:
                callback(self)  # type: ignore[arg-type]
            except Exception:
                logger.exception("django_pglock: on_lost callback for %r raised", self.name)

    def _recheck_lost(self) -> None:
        """For a lease lost by its deadline: once its row is gone, give the key back."""
        rows = self._conn.execute(sql.CHECK, {"name": self._row, "token": self.token})
        if not rows[0][0] or self._key_state is not Key.HELD:
            self._give_back_key()
            heartbeat.registry().discard(self)  # type: ignore[arg-type]

    def _session_closed(self, generation: int) -> None:
        """The session ``generation`` ended: a key it held is gone with it."""
        if self._key_state is Key.HELD and self._generation == generation:
            if self.state is State.HELD:
                self._mark_lost(SESSION_ENDED)
            elif self.state is State.LOST:
                self._give_back_key()
                heartbeat.registry().discard(self)  # type: ignore[arg-type]
