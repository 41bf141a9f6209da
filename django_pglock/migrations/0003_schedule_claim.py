"""Schedule-slot claims for cron deduplication."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0002_drop_name_like_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="ScheduleClaim",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                (
                    "slot",
                    models.DateTimeField(help_text="Start of the schedule slot (database clock)."),
                ),
                ("holder", models.CharField(max_length=255)),
                ("claimed_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "schedule claim",
                "db_table": "django_pglock_scheduleclaim",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("name", "slot"), name="django_pglock_claim_name_slot"
                    )
                ],
            },
        ),
    ]
