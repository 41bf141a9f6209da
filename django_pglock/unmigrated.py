"""What the migrations create beyond the models, for databases built without them.

A project whose tests build tables from the models (pytest-django's ``--nomigrations``,
``"TEST": {"MIGRATE": False}``) gets the model tables, but not what the migrations add in
SQL: the fencing-token sequence (0001), without which every acquire fails, and the job
summaries with their triggers (0008), without which job health would see no history.
After every ``migrate`` (and every test ``flush``), a database where django_pglock's tables
exist but none of its migrations is recorded gets them, its jobs summarised, in one
transaction. Where the migrations ran, this costs a query or two.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, router, transaction
from django.db.migrations.recorder import MigrationRecorder

from .sql import SEQUENCE, TABLE
from .sql import summary_schema as summary

__all__ = ["complete"]

# Anything missing where the lock table exists?
_MISSING = f"""
SELECT to_regclass('{TABLE}') IS NOT NULL
       AND (to_regclass('{SEQUENCE}') IS NULL
            OR to_regclass('django_pglock_jobsummary') IS NULL
            OR ({summary.INSTALLED}) < %s)
"""


def complete(sender: Any = None, using: str = "default", **kwargs: Any) -> None:
    """``post_migrate`` receiver: add the sequence, the summaries and their triggers to
    ``using`` when its tables were built without migrations and lack them."""
    from .models import JobLock

    connection = connections[using]
    if connection.vendor != "postgresql" or not router.allow_migrate_model(using, JobLock):
        return
    recorder = MigrationRecorder(connection)
    if recorder.has_table() and recorder.migration_qs.filter(app="django_pglock").exists():
        return  # migrated (perhaps only up to an earlier migration): left as it is
    with connection.cursor() as cursor:
        cursor.execute(_MISSING, [summary.TRIGGERS])
        (missing,) = cursor.fetchone()
    if not missing:
        return
    statements = [
        f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint",
        *summary.TABLES,
        *summary.INSTALL,
        *summary.BACKFILL,
    ]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)
