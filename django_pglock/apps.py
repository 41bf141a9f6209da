"""App configuration for django_pglock."""

from __future__ import annotations

from django.apps import AppConfig


class SingletonJobsConfig(AppConfig):
    name = "django_pglock"
    label = "django_pglock"
    verbose_name = "Singleton jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks as django_checks
        from django.db.models.signals import post_migrate

        from . import checks, testdb, unmigrated

        django_checks.register(checks.check_settings)
        django_checks.register(checks.check_database, django_checks.Tags.database)
        # Lock sessions close before Django creates or drops a (test) database.
        testdb.connect()
        # Tables built without the migrations (tests) get what those add in SQL.
        post_migrate.connect(
            unmigrated.complete, sender=self, dispatch_uid="django_pglock.unmigrated"
        )
