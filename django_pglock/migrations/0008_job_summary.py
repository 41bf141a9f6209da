"""Job summaries: one row per job, kept by triggers on the run history and the schedule
claims, so that job health reads one row per job instead of probing its history; and the
stale marks, for the jobs whose summary a write could not update (see
``django_pglock.sql.summary``). Plain tables, not models: only the triggers write them.

The triggers are created, and every job with history or claims summarised, in this
migration's transaction: a run written while it runs waits for it and then goes through
the triggers. The statements come from ``django_pglock.sql.summary_schema`` (and
``summary``); a later change to
them freezes this version's text here and comes with a migration of its own.
"""

from django.db import migrations

from django_pglock.sql import summary_schema as summary

from ._postgres import RunSQLOnPostgres


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0007_semaphore"),
    ]

    operations = [
        RunSQLOnPostgres(
            sql=[*summary.TABLES, *summary.INSTALL, *summary.BACKFILL],
            reverse_sql=[*summary.UNINSTALL],
        ),
    ]
