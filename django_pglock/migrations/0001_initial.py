"""Create the lock table and the fencing-token sequence."""

from django.db import migrations, models

from django_pglock.migrations._postgres import RunSQLOnPostgres


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="JobLock",
            fields=[
                ("name", models.CharField(max_length=255, primary_key=True, serialize=False)),
                (
                    "token",
                    models.BigIntegerField(
                        help_text="Fencing token: strictly increasing per grant."
                    ),
                ),
                (
                    "holder",
                    models.CharField(
                        help_text="Identifier of the holding process.", max_length=255
                    ),
                ),
                ("host", models.CharField(max_length=255)),
                ("pid", models.IntegerField(help_text="Process id of the holder on its host.")),
                (
                    "backend_pid",
                    models.IntegerField(help_text="Server process id of the holder's session."),
                ),
                (
                    "description",
                    models.TextField(blank=True, help_text="What runs under the lock."),
                ),
                ("acquired_at", models.DateTimeField()),
                ("last_heartbeat", models.DateTimeField()),
                (
                    "heartbeat_interval",
                    models.FloatField(help_text="Seconds between the holder's heartbeats."),
                ),
                (
                    "alert_after",
                    models.FloatField(help_text="Seconds without heartbeat before alert."),
                ),
                (
                    "stale_after",
                    models.FloatField(help_text="Seconds without heartbeat before reclaim."),
                ),
                (
                    "advisory",
                    models.BooleanField(
                        help_text="The holder also holds a session advisory lock (crash-fast takeover)."
                    ),
                ),
            ],
            options={
                "verbose_name": "job lock",
                "verbose_name_plural": "job locks",
                "db_table": "django_pglock_joblock",
                "ordering": ["-acquired_at"],
                "permissions": [("force_release_joblock", "Can force-release job locks")],
            },
        ),
        # Fencing tokens: one sequence, so tokens strictly increase across grants,
        # reclaims and forced releases. The ORM cannot declare a bare sequence.
        RunSQLOnPostgres(
            sql="CREATE SEQUENCE django_pglock_token_seq AS bigint",
            reverse_sql="DROP SEQUENCE django_pglock_token_seq",
        ),
    ]
