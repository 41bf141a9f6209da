"""A `django-health-check` check for job health (``pip install
"django-singleton-jobs[health-check]"``).

With django-health-check 4 (Django 5.2+), list it among the view's checks::

    path("ht/", HealthCheckView.as_view(checks=[
        "health_check.checks.Database",
        "django_pglock.contrib.health_check.JobHealthCheck",
    ]))

With django-health-check 3 (it supports Django 4.2), add
``"django_pglock.contrib.health_check.JobHealthCheckConfig"`` to ``INSTALLED_APPS`` after
``"health_check"``:
its app registers :class:`JobHealthBackend`.

The check fails when a job is ``overdue``, ``failing`` or ``too-long``. Its message gives
the number of such jobs per state, never their names: health-check pages are often public
(``pglock_status --jobs`` and the token-protected health view name them).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from asgiref.sync import sync_to_async
from django.apps import AppConfig

from ..health import PROBLEMS, job_health

try:
    from health_check.exceptions import ServiceUnavailable
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError(
        "django_pglock.contrib.health_check needs django-health-check; install "
        '"django-singleton-jobs[health-check]".'
    ) from exc

__all__ = ["JobHealthCheck", "problem_message"]


def problem_message(using: str | None = None) -> str | None:
    """``None`` when no job is a problem, else "2 job(s) need attention: 1 overdue, ..."."""
    counts = Counter(job.state for job in job_health(using=using) if job.state in PROBLEMS)
    if not counts:
        return None
    parts = ", ".join(f"{counts[state]} {state}" for state in PROBLEMS if counts[state])
    return f"{sum(counts.values())} job(s) need attention: {parts}."


try:  # django-health-check 4
    from health_check.base import HealthCheck
except ImportError:  # django-health-check 3
    HealthCheck = None


if HealthCheck is not None:

    @dataclasses.dataclass
    class JobHealthCheck(HealthCheck):  # type: ignore[misc]
        """Job health as a django-health-check 4 check."""

        using: str | None = None

        async def run(self) -> None:
            # In the request's own thread (thread_sensitive), whose connections Django
            # closes when the request ends: an executor thread's would be left open.
            message = await sync_to_async(problem_message, thread_sensitive=True)(self.using)
            if message:
                raise ServiceUnavailable(message)

else:  # django-health-check 3 (what Django 4.2 installs)
    try:  # 3.20 and later
        from health_check.backends import HealthCheck as _Backend
    except ImportError:  # pragma: no cover - earlier 3.x
        from health_check.backends import BaseHealthCheckBackend as _Backend

    class JobHealthBackend(_Backend):  # type: ignore[misc]
        """Job health as a django-health-check 3 backend."""

        critical_service = True

        def check_status(self, subset: Any = None) -> None:
            message = problem_message()
            if message:
                self.add_error(ServiceUnavailable(message))

        def __repr__(self) -> str:
            return "JobHealth"

    JobHealthCheck = JobHealthBackend  # type: ignore[misc]


class JobHealthCheckConfig(AppConfig):
    """Registers :class:`JobHealthBackend` with django-health-check 3."""

    name = "django_pglock.contrib.health_check"
    label = "django_pglock_health_check"
    verbose_name = "Singleton jobs health check"

    def ready(self) -> None:
        if HealthCheck is None:  # pragma: no cover - django-health-check 3 only
            from health_check.plugins import plugin_dir

            plugin_dir.register(JobHealthCheck)
