"""Why a skipped run did not run its body."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0004_job_run"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobrun",
            name="reason",
            field=models.CharField(
                blank=True,
                choices=[
                    ("held", "lock held elsewhere"),
                    ("slot-taken", "schedule slot already started"),
                    ("timed-out", "wait timed out"),
                ],
                help_text="Why a skipped run did not run its body (empty for other outcomes).",
                max_length=16,
                null=True,
            ),
        ),
    ]
