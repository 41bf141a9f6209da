"""Exceptions raised by django_pglock."""

from __future__ import annotations

__all__ = ["LockError", "LockNotAcquired", "LockNotHeld"]


class LockError(Exception):
    """Base class of every error raised by a lock operation."""


class LockNotAcquired(LockError):
    """The lock is held elsewhere and could not be acquired in time."""


class LockNotHeld(LockError):
    """The lease was lost, released, or never belonged to this process."""


class SessionEnded(LockError):
    """The session a statement had to run on (the one holding a lease's key) has ended."""


class ConnectionBusy(LockError):
    """The lock connection stayed busy with another thread's statement for too long."""
