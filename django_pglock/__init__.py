"""Singleton jobs for Django, backed by the PostgreSQL database the project already has."""

from __future__ import annotations

from .decorators import singleton_job
from .exceptions import DatabaseUnavailable, LockError, LockNotAcquired, LockNotHeld
from .lock import Lease, Lock

__all__ = [
    "DatabaseUnavailable",
    "Lease",
    "Lock",
    "LockError",
    "LockNotAcquired",
    "LockNotHeld",
    "singleton_job",
]
