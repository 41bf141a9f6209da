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

        from . import checks, testdb

        django_checks.register(checks.check_settings)
        django_checks.register(checks.check_database, django_checks.Tags.database)
        # Lock sessions close before Django creates or drops a (test) database.
        testdb.connect()
