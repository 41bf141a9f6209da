"""The health endpoint: ``path("health/", include("django_pglock.urls"))``.

JSON with a top-level ``"status"``: ``"healthy"`` (HTTP 200) when no job is ``overdue``,
``failing`` or ``too-long``, else ``"unhealthy"`` (HTTP 503); ``"unavailable"`` (503) when
the lock database cannot be read. Anonymous callers get the status alone; staff and
callers with ``DJANGO_PGLOCK["HEALTH_TOKEN"]`` (``Authorization: Bearer …``) also get the
counts per state and every job's health. Never cached.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from django.db import DatabaseError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from .access import may_see_details
from .exceptions import LockError
from .health import STATES, job_health

__all__ = ["health"]

logger = logging.getLogger("django_pglock")


@never_cache
@require_safe
def health(request: HttpRequest) -> JsonResponse:
    """Overall job health for probes and uptime checkers (see the module docstring)."""
    try:
        # Inside: reading the session's user needs the database too.
        details = may_see_details(request)
        jobs = job_health()
    except (DatabaseError, LockError) as exc:
        # The reason goes to the log, not to the caller (it may name hosts).
        logger.warning("django_pglock: the health view could not read job health: %s", exc)
        return JsonResponse({"status": "unavailable"}, status=503)
    problems = [job for job in jobs if job.problem]
    body: dict[str, Any] = {"status": "unhealthy" if problems else "healthy"}
    if details:
        counts = Counter(job.state for job in jobs)
        body["counts"] = {state: counts.get(state, 0) for state in STATES}
        body["problems"] = [f"{job.name}: {job.state}: {job.detail}" for job in problems]
        body["jobs"] = [job.as_dict() for job in jobs]
    return JsonResponse(body, status=503 if problems else 200)
