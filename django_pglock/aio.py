"""The async shell around :class:`~django_pglock.Lock`: no logic of its own.

Each acquire statement runs in a worker thread and waiting is awaited (a sleep, or a
wake-up when the name is released), so the event loop is never blocked; the decisions
are the sync core's.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .acquisition import AcquisitionBase
from .exceptions import DatabaseUnavailable

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["AsyncAcquisition"]


class _Handoff:
    """Hands a lease from the worker thread to the awaiting task, or gives it up when
    that task was cancelled meanwhile: a cancelled acquire never leaks a held lock, and
    its run (the body never ran) is recorded as ``failed``, never as a success.

    A grant given up is released by the heartbeat thread (``Lease._abandon``: no I/O
    here, neither in the event loop nor in the worker thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._lease: Lease | None = None

    def run(self, attempt: Callable[[], Lease | None]) -> Lease | None:
        lease = attempt()
        with self._lock:
            if not self._abandoned:
                self._lease = lease
                return lease
        if lease is not None:
            lease._abandon()  # cancelled while the statement ran
        return None

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            lease, self._lease = self._lease, None
        if lease is not None:
            lease._abandon()  # granted, but cancelled before the task got it


class AsyncAcquisition(AcquisitionBase):
    """What ``Lock.acquire_async()`` returns: ``async with`` yields a Lease or ``None``."""

    async def __aenter__(self) -> Lease | None:
        waiter = self._waiter
        try:
            while True:
                handoff = _Handoff()
                try:
                    lease = await asyncio.to_thread(
                        handoff.run, functools.partial(self._lock._attempt_once, waiter)
                    )
                except asyncio.CancelledError:
                    handoff.abandon()  # the statement runs on in its thread
                    raise
                except DatabaseUnavailable as exc:
                    await asyncio.sleep(waiter.unavailable(exc))
                    continue
                if lease is not None:
                    self.lease = lease
                    return lease
                delay = waiter.next_delay()
                if delay is None:
                    return None
                await waiter.sleep_async(delay)  # or until a release of the name wakes it
        finally:
            waiter.done()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.lease is not None:
            await asyncio.to_thread(self.lease.__exit__, exc_type, exc, tb)
