"""What ``Lock.acquire()`` returns: a context manager that acquires on enter."""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lease import Lease
    from .lock import Lock
    from .waiting import Waiter

__all__ = ["Acquisition", "AcquisitionBase"]


class AcquisitionBase:
    """What the sync and async acquisitions share: the lock, its waiter, the lease."""

    def __init__(self, lock: Lock, waiter: Waiter) -> None:
        self._lock = lock
        self._waiter = waiter
        self.lease: Lease | None = None

    @property
    def holder(self) -> dict[str, Any] | None:
        """The holder that made the last attempt fail (``None`` if none is known)."""
        return self._waiter.current_holder()


class Acquisition(AcquisitionBase, AbstractContextManager["Lease | None"]):
    """What ``Lock.acquire()`` returns: acquires on enter, releases on exit."""

    def __enter__(self) -> Lease | None:
        self.lease = self._lock._acquire(self._waiter)
        return self.lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.lease is not None:
            self.lease.__exit__(exc_type, exc, tb)
