"""The waiting policy of an acquire, shared by the sync and async shells."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from . import sql
from .conf import check_seconds
from .connection import get_connection

if TYPE_CHECKING:
    from .lock import Lock

__all__ = ["Waiter"]


class Waiter:
    """The waiting policy shared by the sync and async shells."""

    def __init__(self, blocking: bool, timeout: float | None, poll_interval: float) -> None:
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
            if not blocking:
                raise ValueError(
                    f"timeout={timeout!r} was given with blocking=False; drop the timeout "
                    "or pass blocking=True."
                )
        self.blocking = blocking
        self.attempts = 0
        self.holder: dict[str, Any] | None = None  # the holder seen by the last attempt
        self.lock: Lock | None = None  # whose attempts these are
        self.poll_interval = poll_interval
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout

    def current_holder(self) -> dict[str, Any] | None:
        """The holder seen by the last refused attempt; read now if it committed after
        that attempt's snapshot (one more statement, only in that race)."""
        if self.holder is None and self.attempts and self.lock is not None:
            lock = self.lock
            found = get_connection(lock._alias()).execute(sql.HOLDER, {"name": lock.name})
            if found:
                fields = ("token", "holder", "host", "pid", "acquired_at", "description")
                self.holder = dict(zip((*fields, "heartbeat_age"), found[0][:7], strict=True))
        return self.holder

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next attempt, or ``None`` to give up."""
        if not self.blocking:
            return None
        delay = self.poll_interval * random.uniform(0.5, 1.0)
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return None
            delay = min(delay, remaining)
        return delay
