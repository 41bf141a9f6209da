"""Exceptions raised by django_pglock."""

from __future__ import annotations

__all__ = ["DatabaseUnavailable", "LockError", "LockNotAcquired", "LockNotHeld"]


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


class DatabaseUnavailable(LockError):
    """The lock database cannot be reached or cannot grant locks right now.

    Raised for a connection that cannot be opened or was lost, a statement with no answer
    within its bound, a server shutting down or starting up, and a read-only server (a
    standby not yet promoted). A blocking acquire retries these, with backoff, until its
    timeout; a non-blocking attempt raises it at once.
    """
