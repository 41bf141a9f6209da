"""Exceptions raised by django_pglock."""

from __future__ import annotations

__all__ = ["LockError", "LockNotAcquired", "LockNotHeld"]


class LockError(Exception):
    """Base class of every error raised by a lock operation."""


class LockNotAcquired(LockError):
    """The lock is held elsewhere and could not be acquired in time."""


class LockNotHeld(LockError):
    """The lease was lost, released, or never belonged to this process."""
