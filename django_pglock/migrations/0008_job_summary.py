"""Job summaries: one row per job, kept by triggers on the run history and the schedule
claims, so that job health reads one row per job instead of probing its history; and the
stale marks, for the jobs whose summary a write could not update (see
``django_pglock.sql.summary``).

The triggers are created, and every job with history or claims summarised, in this
migration"s transaction: a run written while it runs waits for it and then goes through
the triggers. The statements come from ``django_pglock.sql.summary``; a later change to
them freezes this version"s text here and comes with a migration of its own.
"""

from django.db import migrations, models

from django_pglock.sql import summary

from ._postgres import RunSQLOnPostgres


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0007_semaphore"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobSummary",
            fields=[
                ("name", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("has_runs", models.BooleanField(default=False)),
                ("last_id", models.BigIntegerField(blank=True, null=True)),
                ("last_outcome", models.CharField(blank=True, max_length=16, null=True)),
                ("last_started_at", models.DateTimeField(blank=True, null=True)),
                ("last_finished_at", models.DateTimeField(blank=True, null=True)),
                ("last_duration", models.FloatField(blank=True, null=True)),
                ("last_host", models.CharField(blank=True, max_length=255, null=True)),
                ("success_id", models.BigIntegerField(blank=True, null=True)),
                ("success_started_at", models.DateTimeField(blank=True, null=True)),
                ("success_at", models.DateTimeField(blank=True, null=True)),
                ("failure_id", models.BigIntegerField(blank=True, null=True)),
                ("failure_started_at", models.DateTimeField(blank=True, null=True)),
                ("failure_at", models.DateTimeField(blank=True, null=True)),
                ("claim_slot", models.DateTimeField(blank=True, null=True)),
                ("claim_schedule", models.CharField(blank=True, max_length=255, null=True)),
            ],
            options={
                "verbose_name": "job summary",
                "verbose_name_plural": "job summaries",
                "db_table": "django_pglock_jobsummary",
            },
        ),
        migrations.CreateModel(
            name="StaleSummary",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(db_index=True, max_length=255)),
            ],
            options={
                "verbose_name": "stale job summary",
                "db_table": "django_pglock_stalesummary",
            },
        ),
        RunSQLOnPostgres(
            sql=[*summary.INSTALL, *summary.BACKFILL], reverse_sql=[*summary.UNINSTALL]
        ),
    ]
