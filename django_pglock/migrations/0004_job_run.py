"""Run history of singleton jobs."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0003_schedule_claim"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobRun",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                (
                    "token",
                    models.BigIntegerField(
                        blank=True, help_text="Fencing token of the run.", null=True
                    ),
                ),
                ("holder", models.CharField(max_length=255)),
                ("host", models.CharField(max_length=255)),
                ("pid", models.IntegerField()),
                ("description", models.TextField(blank=True)),
                ("started_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "duration",
                    models.FloatField(
                        blank=True, help_text="Seconds, by the database clock.", null=True
                    ),
                ),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("running", "running"),
                            ("succeeded", "succeeded"),
                            ("failed", "failed"),
                            ("lost", "lost"),
                            ("skipped", "skipped"),
                        ],
                        max_length=16,
                    ),
                ),
                (
                    "exit_code",
                    models.IntegerField(blank=True, help_text="For locked_run.", null=True),
                ),
            ],
            options={
                "verbose_name": "job run",
                "db_table": "django_pglock_jobrun",
                "ordering": ["-started_at"],
                "indexes": [
                    models.Index(fields=["name", "-started_at"], name="django_pglock_run_name_idx")
                ],
            },
        ),
    ]
