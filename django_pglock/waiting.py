"""The waiting policy of an acquire, shared by the sync and async shells."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any

from . import sql
from .conf import check_seconds
from .connection import get_connection
from .exceptions import DatabaseUnavailable
from .redaction import redact
from .wakeups import OFF, STARTED, Wake, wakeups

if TYPE_CHECKING:
    from .lock import Lock

__all__ = ["LEAST_ATTEMPT", "RETRY_FIRST", "RETRY_MAX", "WARN_EVERY", "Waiter"]

logger = logging.getLogger("django_pglock")

#: Backoff of a blocking acquire while the database is unavailable: the first retry
#: after about RETRY_FIRST seconds, doubling up to RETRY_MAX (each jittered down by up
#: to half).
RETRY_FIRST = 0.1
RETRY_MAX = 2.0
#: While the database stays unavailable, a waiter warns again every this many seconds.
WARN_EVERY = 60.0
#: The least time each attempt of a blocking acquire with a timeout gets to be answered,
#: even the last one, made at the timeout itself: a healthy server answers well within
#: it, so its session is not given up for a statement that was merely started late.
LEAST_ATTEMPT = 2.0


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
        self.timeout = timeout
        self.deadline = None if timeout is None else self.started + timeout
        self.outage: float | None = None  # since when the database is unavailable
        self.failures = 0  # failed attempts in a row, for the backoff
        self.warned_at = 0.0  # when the outage was last logged
        self.wake: Wake | None = None  # woken when the name is freed (see .wakeups)
        self.heard = False  # the lock session listens: a release wakes this waiter
        self.retry_now = False  # it just started listening: a release may have been missed
        self.over = False  # done(): never subscribed again (an attempt may still be running)
        self._subscribing = threading.Lock()  # subscribe() and done() may race (async shell)

    def bound(self) -> float | None:
        """When (``time.monotonic()``) the attempt starting now must have been answered:
        the timeout, or :data:`LEAST_ATTEMPT` seconds from now if that is later. ``None``
        without a timeout or for a non-blocking attempt: each statement then has its own
        deadline (:data:`~django_pglock.protocol.STATEMENT_DEADLINE`)."""
        if not self.blocking or self.deadline is None:
            return None
        return max(self.deadline, time.monotonic() + LEAST_ATTEMPT)

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

    def answered(self) -> None:
        """An attempt got an answer (a grant or a refusal): an outage is over."""
        if self.outage is not None and self.lock is not None:
            logger.warning(
                "django_pglock: database alias %r answers again after %.1f s; waiting for "
                "lock %r goes on.",
                self.lock._alias(),
                time.monotonic() - self.outage,
                self.lock.name,
            )
        self.outage, self.failures = None, 0

    def unavailable(self, exc: DatabaseUnavailable) -> float:
        """Seconds to wait before the next attempt after ``exc``; raises it when this
        acquire does not wait (``blocking=False``) or its timeout has passed.

        Only the timeout ends a blocking wait: a failover, a restart or a read-only
        standby before its promotion are waited out, with backoff.
        """
        if not self.blocking:
            raise exc
        now = time.monotonic()
        if self.outage is None or now - self.warned_at >= WARN_EVERY:
            # Once when the outage starts, then every WARN_EVERY seconds: a cause that
            # does not go away (a wrong password) is not waited out in silence.
            self.outage = now if self.outage is None else self.outage
            self.warned_at = now
            name = self.lock.name if self.lock is not None else "?"
            logger.warning(
                "django_pglock: waiting for lock %r: the database is unavailable (%s) for "
                "%.0f s; retrying until the timeout.",
                name,
                exc,
                now - self.outage,
            )
        self.failures += 1
        delay: float = min(RETRY_MAX, RETRY_FIRST * 2.0 ** (self.failures - 1))
        delay *= random.uniform(0.5, 1.0)
        if self.deadline is not None:
            remaining = self.deadline - now
            if remaining <= 0:
                raise DatabaseUnavailable(
                    f"Gave up waiting after {self.timeout:g} s (timeout): the database was "
                    f"unavailable for the last {now - self.outage:.1f} s: {exc}"
                ) from exc
            delay = min(delay, remaining)
        return delay

    def subscribe(self) -> None:
        """Before each attempt of a blocking acquire: be woken when the name is freed, from
        now on. A release that commits while the attempt runs is heard with its answer
        (when the session listens already) and makes the next sleep end at once; a
        subscription made after a refusal would have missed it. Never after :meth:`done`."""
        lock = self.lock
        if not self.blocking or lock is None:
            return
        with self._subscribing:
            if self.wake is None and not self.over:
                self.wake = wakeups().subscribe(lock._alias(), lock.name)

    def listen(self) -> None:
        """After a refused attempt of a blocking acquire: make sure the lock session
        listens (one ``LISTEN`` per session, only when it does not yet). A session that
        starts listening now did not hear a release committed before: the next attempt
        is made at once.
        """
        lock = self.lock
        if self.wake is None or lock is None:
            return  # not blocking, or the acquire is over (done)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return  # this wait is over
        alias = lock._alias()
        state = wakeups().ensure_listening(get_connection(alias), self.bound())
        self.heard = state != OFF
        self.retry_now = self.retry_now or state == STARTED

    def sleep(self, delay: float) -> None:
        """Sleep ``delay`` s before the next attempt, or until the name is freed."""
        if self.retry_now:
            self.retry_now = False
        elif self.wake is not None and self.heard:
            self.wake.wait(delay)
        else:
            time.sleep(delay)

    async def sleep_async(self, delay: float) -> None:
        """:meth:`sleep` for the async shell: the event loop is never blocked."""
        if self.retry_now:
            self.retry_now = False
        elif self.wake is not None and self.heard:
            await self.wake.wait_async(delay)
        else:
            await asyncio.sleep(delay)

    def done(self) -> None:
        """The acquire is over (granted, given up or interrupted): no more wake-ups."""
        with self._subscribing:
            self.over = True
            wake, self.wake = self.wake, None
        if wake is not None and self.lock is not None:
            wakeups().unsubscribe(self.lock._alias(), self.lock.name, wake)

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


def describe_holder(holder: dict[str, Any] | None) -> str:
    """Who holds a lock, as a refused attempt saw it: holder id, token, what runs."""
    if not holder:
        return "another process"
    text = f"{holder['holder']} (token {holder['token']}"
    if holder.get("description"):
        text += f", running {redact(str(holder['description']))!r}"
    return text + ")"
