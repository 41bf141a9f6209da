"""App configuration for django_pglock."""

from __future__ import annotations

from django.apps import AppConfig


class SingletonJobsConfig(AppConfig):
    name = "django_pglock"
    label = "django_pglock"
    verbose_name = "Singleton jobs"
    default_auto_field = "django.db.models.BigAutoField"
