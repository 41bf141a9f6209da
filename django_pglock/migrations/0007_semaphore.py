"""Semaphores: each row carries the limit its holder declared (1 for a plain lock).

On PostgreSQL the column keeps a database default of 1, so that statements that do not
name it (those of a version that predates it, during a rolling deploy) store 1.
"""

from django.db import migrations, models

from ._postgres import RunSQLOnPostgres


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0006_job_health"),
    ]

    operations = [
        migrations.AddField(
            model_name="joblock",
            name="slot_limit",
            field=models.IntegerField(
                default=1,
                help_text="How many holders the holder's lock admits at once (1: a plain "
                "lock); a semaphore's slots above the first have rows named after it "
                "(see slot).",
            ),
        ),
        RunSQLOnPostgres(
            "ALTER TABLE django_pglock_joblock ALTER COLUMN slot_limit SET DEFAULT 1",
            "ALTER TABLE django_pglock_joblock ALTER COLUMN slot_limit DROP DEFAULT",
        ),
    ]
