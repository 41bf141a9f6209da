"""Database routers for the multi-database tests (tests/test_admin_multidb.py)."""

from __future__ import annotations

from typing import Any


class DefaultOnlyRouter:
    """Migrates every app on ``default`` only: django_pglock's tables never reach the
    lock database (``django_pglock.W003``)."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"


class LocksOnLocksRouter:
    """The router a careful project writes: django_pglock on ``locks``, the rest elsewhere."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label == "django_pglock":
            return db == "locks"
        return None
