"""``Lock``: a named lock's options, and acquiring it (synchronous; ``aio`` wraps it).

The lease a grant yields lives in :mod:`.lease`; the waiting policy in :mod:`.waiting`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.conf import settings

from . import signals
from .acquisition import Acquisition
from .aio import AsyncAcquisition
from .attempt import AttemptMixin
from .conf import (
    Thresholds,
    check_seconds,
    generation,
    get_setting,
    setting_label,
    validate_thresholds,
)
from .connection import validate_alias
from .events import call_metrics, configured_metrics, send
from .exceptions import DatabaseUnavailable, LockNotAcquired
from .identity import default_description
from .leadership import AsyncLeadership, Leadership
from .lease import Lease, held_by_this_thread
from .options import Option, Resolved, validate_description, validate_limit, validate_name
from .waiting import Waiter

__all__ = ["Lease", "Lock", "validate_name"]

logger = logging.getLogger("django_pglock")


class Lock(AttemptMixin):
    """A named lock, held by at most one process at a time across all machines.

    ``Lock("nightly-report")`` costs nothing until it is acquired. Arguments left as
    ``None`` come from the ``DJANGO_PGLOCK`` setting at acquire time. Bad names and
    thresholds raise ``ValueError`` here; an unknown or non-PostgreSQL database alias
    raises ``ImproperlyConfigured``.

    ``limit=N`` makes it a semaphore: at most N holders at once, each in one of the
    slots 1..N with its own fencing token, heartbeat and takeover (see README,
    "Semaphores"). ``Lock(name)`` is ``Lock(name, limit=1)``: slot 1 of the name.
    """

    def __init__(
        self,
        name: str,
        *,
        using: str | None = None,
        heartbeat_interval: float | None = None,
        alert_after: float | None = None,
        stale_after: float | None = None,
        poll_interval: float | None = None,
        advisory: bool | None = None,
        metrics: Any = None,
        description: str | None = None,
        record: bool = False,
        limit: int = 1,
    ) -> None:
        self.name = validate_name(name)
        self.limit = validate_limit(limit, self.name)
        for label, value in (
            ("heartbeat_interval", heartbeat_interval),
            ("alert_after", alert_after),
            ("stale_after", stale_after),
            ("poll_interval", poll_interval),
        ):
            if value is not None:
                check_seconds(label, value)
        if advisory is not None and not isinstance(advisory, bool):
            raise ValueError(f"advisory={advisory!r} must be True, False or None (from settings).")
        if using is not None and settings.configured:
            validate_alias(using)
        if description is not None:
            description = validate_description(description)
        # Arguments as given; None means "from DJANGO_PGLOCK", resolved at each use.
        self._arguments: dict[str, Any] = {
            "database": using,
            "heartbeat_interval": heartbeat_interval,
            "alert_after": alert_after,
            "stale_after": stale_after,
            "poll_interval": poll_interval,
            "advisory": advisory,
        }
        if not isinstance(record, bool):
            raise ValueError(f"record={record!r} must be True or False.")
        self._cached: Resolved | None = None
        self._cached_params: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.metrics = metrics
        self.record = record
        self.description = description
        if heartbeat_interval is not None and alert_after is not None and stale_after is not None:
            validate_thresholds(heartbeat_interval, alert_after, stale_after)
        elif settings.configured and (heartbeat_interval, alert_after, stale_after) != (None,) * 3:
            self._resolve_thresholds()  # partial arguments must fit the current settings

    def __repr__(self) -> str:
        return (
            f"<Lock {self.name!r}>"
            if self.limit == 1
            else f"<Lock {self.name!r} limit={self.limit}>"
        )

    # -- configuration, resolved at acquire time so override_settings works ------------

    using = Option[str]("database", str, "The database alias.")
    heartbeat_interval = Option[float]("heartbeat_interval", float, "Seconds between heartbeats.")
    alert_after = Option[float]("alert_after", float, "Seconds without heartbeat before alert.")
    stale_after = Option[float]("stale_after", float, "Seconds without heartbeat before reclaim.")
    poll_interval = Option[float]("poll_interval", float, "Seconds between blocking attempts.")
    advisory = Option[bool]("advisory", bool, "Whether the advisory path is wanted.")

    def _resolved(self) -> Resolved:
        """The options as they stand now; resolved again only after a settings change."""
        cached = self._cached
        if cached is None or cached.generation != generation() or cached.name is not self.name:
            cached = self._cached = Resolved(self)
        return cached

    def _alias(self) -> str:
        return self._resolved().alias

    def _option(self, argument: str) -> tuple[Any, str]:
        """An argument's value and label, falling back to the setting of that name."""
        value = self._arguments[argument]
        if value is not None:
            return value, "using" if argument == "database" else argument
        key = argument.upper()
        return get_setting(key), setting_label(key)

    def _resolve_thresholds(self) -> Thresholds:
        (hb, hb_label), (alert, alert_label), (stale, stale_label) = (
            self._option(attribute)
            for attribute in ("heartbeat_interval", "alert_after", "stale_after")
        )
        return validate_thresholds(hb, alert, stale, (hb_label, alert_label, stale_label))

    def _thresholds(self) -> Thresholds:
        return self._resolved().thresholds

    def _poll_interval(self) -> float:
        return self._resolved().poll

    def _description(self) -> str:
        return self.description if self.description is not None else default_description()

    def _hooks(self) -> tuple[Any, ...]:
        """The metrics hooks to call: this lock's ``metrics`` and the configured one."""
        try:
            configured = configured_metrics()
        except Exception:
            logger.exception("django_pglock: DJANGO_PGLOCK['METRICS'] could not be loaded")
            configured = None
        if configured is None:
            return () if self.metrics is None else (self.metrics,)
        return (configured,) if self.metrics is None else (self.metrics, configured)

    # -- acquiring -----------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> Acquisition:
        """Context manager yielding a :class:`Lease`, or ``None`` if not acquired.

        ``blocking=False`` makes one attempt; ``blocking=True`` retries as soon as the
        name is released (PostgreSQL ``NOTIFY``), and every ``poll_interval``
        (jittered) in any case, until acquired or ``timeout`` seconds have passed
        (``None``: no limit). Leaving the block releases the lock.
        """
        waiter = self._waiter(blocking, timeout)
        return Acquisition(self, waiter)

    def try_acquire(self) -> Lease | None:
        """One attempt: a :class:`Lease` (call ``release()`` when done), or ``None``.

        Raises :class:`LockError` at once if the calling thread already holds the name.
        """
        started = time.monotonic()
        lease, _ = self._attempt(first=True, want_holder=False, sync=True)
        if lease is not None:
            self._granted(lease, started, sync=True)
        return lease

    def acquire_or_raise(
        self, timeout: float | None = None, *, blocking: bool | None = None
    ) -> Lease:
        """A :class:`Lease`, or :class:`LockNotAcquired` naming the current holder.

        With no ``timeout`` this makes one attempt; with ``timeout`` it waits up to that
        many seconds; ``blocking=True`` with no timeout waits as long as it takes.
        """
        waiter = self._waiter(timeout is not None if blocking is None else blocking, timeout)
        lease = self._acquire(waiter)
        if lease is None:
            mine = self._held_by_this_thread()
            if mine is not None:
                raise self._held_here(mine)
            held = (
                "held by another process"
                if self.limit == 1
                else f"full ({self.limit} of {self.limit} held)"
            )
            raise LockNotAcquired(f"Lock {self.name!r} is {held}; try again later.")
        return lease

    def _held_by_this_thread(self) -> Lease | None:
        """The lease of this plain lock the calling thread holds (a thread may hold
        several slots of a semaphore, so a semaphore has none)."""
        return held_by_this_thread(self._alias(), self.name) if self.limit == 1 else None

    def _held_here(self, lease: Lease) -> LockNotAcquired:
        return LockNotAcquired(
            f"Lock {self.name!r} is already held by this thread ({lease!r}); a thread cannot "
            "wait for a name it holds. Use the lease it holds, or release it first."
        )

    def _waiter(self, blocking: bool, timeout: float | None) -> Waiter:
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking={blocking!r} must be True or False.")
        waiter = Waiter(blocking, timeout, self._poll_interval())
        waiter.lock = self
        return waiter

    def acquire_async(
        self, blocking: bool = True, timeout: float | None = None
    ) -> AsyncAcquisition:
        """Async context manager: ``async with lock.acquire_async() as lease`` (or ``None``).

        Same semantics as :meth:`acquire`; waiting never blocks the event loop.
        """
        return AsyncAcquisition(self, self._waiter(blocking, timeout))

    def leadership(
        self, timeout: float | None = None, *, on_demotion: Callable[[Lease], Any] | None = None
    ) -> Leadership:
        """Leader election: ``with lock.leadership() as lease:`` waits until elected.

        Raises :class:`LockNotAcquired` if ``timeout`` s pass first. On demotion (the
        lease lost) sets the returned object's ``demoted`` event and calls
        ``on_demotion(lease)``; the body must then stop leading. See :mod:`.leadership`.
        """
        return Leadership(self.acquire(True, timeout), on_demotion)

    def leadership_async(
        self, timeout: float | None = None, *, on_demotion: Callable[[Lease], Any] | None = None
    ) -> AsyncLeadership:
        """``async with lock.leadership_async() as lease:``; as :meth:`leadership`."""
        return AsyncLeadership(self.acquire_async(True, timeout), on_demotion)

    def _acquire(self, waiter: Waiter) -> Lease | None:
        """The synchronous shell: attempt, sleep, attempt again.

        A thread that waits for a name it holds itself would wait for ever (or until its
        timeout): that raises :class:`LockNotAcquired` at once, naming the lease.
        """
        mine = self._held_by_this_thread()
        if mine is not None and waiter.blocking:
            raise self._held_here(mine)
        try:
            while True:
                try:
                    lease = self._attempt_once(waiter, sync=True)
                except DatabaseUnavailable as exc:
                    time.sleep(waiter.unavailable(exc))
                    continue
                if lease is not None:
                    return lease
                delay = waiter.next_delay()
                if delay is None:
                    return None
                waiter.sleep(delay)  # or until a release of the name wakes it
        finally:
            waiter.done()

    def _attempt_once(self, waiter: Waiter, *, sync: bool = False) -> Lease | None:
        """One attempt on behalf of ``waiter``; signals and metrics for its outcome.

        ``sync``: the attempt is made by the thread that will hold the lease (not by the
        async shell's worker thread), so that thread holding the name already is an error.
        """
        first = waiter.attempts == 0
        waiter.subscribe()  # a blocking one hears a release committed during the attempt
        lease, waiter.holder = self._attempt(first=first, sync=sync, deadline=waiter.bound())
        waiter.answered()
        waiter.attempts += 1
        if lease is not None:
            self._granted(lease, waiter.started, sync=sync)
        else:
            waiter.listen()  # a blocking one is woken when the name is freed
        return lease

    def _granted(self, lease: Lease, started: float, *, sync: bool = False) -> None:
        """Tell the receivers; a grant whose caller never gets it is released."""
        try:
            send(signals.lock_acquired, self, lease=lease)
            hooks = self._hooks()
            if hooks:
                call_metrics(hooks, "acquired", self.name, time.monotonic() - started)
            if sync:
                lease._own()
        except BaseException:  # e.g. a signal handler's exception: nobody will use it
            lease._abandon()
            raise
