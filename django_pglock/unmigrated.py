"""What the migrations create beyond the models, for databases built without them.

A project whose tests build tables from the models (pytest-django's ``--nomigrations``,
``"TEST": {"MIGRATE": False}``) gets the tables, but not what the migrations add in SQL:
the fencing-token sequence (0001), without which every acquire fails, and the triggers
that keep the job summaries (0008), without which job health would read summaries that
nobody keeps. After every ``migrate`` (and every test ``flush``), each database with the
tables but without those gets them, its jobs summarised, in one transaction. Where the
migrations ran, this costs one query.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, router, transaction

from .sql import SEQUENCE, TABLE, summary

__all__ = ["complete"]

_MISSING = f"""
SELECT to_regclass('{TABLE}') IS NOT NULL AND to_regclass('{SEQUENCE}') IS NULL,
       to_regclass('django_pglock_jobsummary') IS NOT NULL AND ({summary.INSTALLED}) < %s
"""


def complete(sender: Any = None, using: str = "default", **kwargs: Any) -> None:
    """``post_migrate`` receiver: add the sequence and the triggers to ``using`` where
    its tables lack them."""
    from .models import JobLock

    connection = connections[using]
    if connection.vendor != "postgresql" or not router.allow_migrate_model(using, JobLock):
        return
    with connection.cursor() as cursor:
        cursor.execute(_MISSING, [summary.TRIGGERS])
        (no_sequence, no_triggers) = cursor.fetchone()
    if not (no_sequence or no_triggers):
        return
    with transaction.atomic(using=using), connection.cursor() as cursor:
        if no_sequence:
            cursor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint")
        if no_triggers:
            for statement in [*summary.INSTALL, *summary.BACKFILL]:
                cursor.execute(statement)
