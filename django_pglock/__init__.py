"""Singleton jobs for Django, backed by the PostgreSQL database the project already has."""

from __future__ import annotations

from .context import current_lease
from .decorators import singleton_job
from .exceptions import DatabaseUnavailable, LockError, LockNotAcquired, LockNotHeld
from .inherit import InheritedLease
from .lock import Lease, Lock

__all__ = [
    "DatabaseUnavailable",
    "InheritedLease",
    "Lease",
    "Lock",
    "LockError",
    "LockNotAcquired",
    "LockNotHeld",
    "current_lease",
    "singleton_job",
]
