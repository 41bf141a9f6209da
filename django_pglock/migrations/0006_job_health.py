"""Job health: a claim carries its job's cron expression; health episodes; indexes for
each job's last success and last failure."""

from django.db import migrations, models

from ._postgres import RunSQLOnPostgres


class Migration(migrations.Migration):
    dependencies = [
        ("django_pglock", "0005_job_run_reason"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobEpisode",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=255)),
                ("kind", models.CharField(max_length=16)),
                ("since", models.DateTimeField()),
            ],
            options={
                "verbose_name": "job health episode",
                "db_table": "django_pglock_jobepisode",
            },
        ),
        migrations.AddField(
            model_name="scheduleclaim",
            name="schedule",
            field=models.CharField(
                blank=True,
                default="",
                help_text="The job's cron expression, so that its next start is known to be due.",
                max_length=255,
            ),
        ),
        # A database default as well, so that a claim inserted by a release that predates
        # this column (a rolling deploy) still succeeds.
        RunSQLOnPostgres(
            sql="ALTER TABLE django_pglock_scheduleclaim ALTER COLUMN schedule SET DEFAULT ''",
            reverse_sql=migrations.RunSQL.noop,
        ),
        migrations.AddIndex(
            model_name="jobrun",
            index=models.Index(
                condition=models.Q(("outcome", "succeeded")),
                fields=["name", "-started_at"],
                name="django_pglock_run_ok_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="jobrun",
            index=models.Index(
                condition=models.Q(("outcome__in", ["failed", "lost"])),
                fields=["name", "-started_at"],
                name="django_pglock_run_bad_idx",
            ),
        ),
        migrations.AddConstraint(
            model_name="jobepisode",
            constraint=models.UniqueConstraint(
                fields=("name", "kind"), name="django_pglock_episode_name_kind"
            ),
        ),
    ]
