"""Prometheus metrics (``pip install "django-singleton-jobs[prometheus]"``).

Two parts, usable apart:

* :class:`PrometheusMetrics`, a metrics hook (``DJANGO_PGLOCK["METRICS"] =
  "django_pglock.contrib.prometheus.PrometheusMetrics"``): acquisitions, contention,
  skips, reclaims, losses and alerts per lock name; wait and hold durations; heartbeat
  latency. Counted in each process, as Prometheus client libraries do.
* :class:`JobHealthCollector`, read at scrape time from the database (so every process
  and every replica says the same): per job, its health state, overdue flag, last
  success time and last run duration. Declared jobs have their series (at zero) before
  their first run.

:func:`metrics_view` serves both in the standard exposition format; it answers staff and
callers with ``HEALTH_TOKEN`` (``Authorization: Bearer …``, which Prometheus's
``authorization`` scrape setting sends), like the health view's details.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Histogram,
        generate_latest,
    )
    from prometheus_client.core import GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError(
        "django_pglock.contrib.prometheus needs prometheus_client; install "
        '"django-singleton-jobs[prometheus]".'
    ) from exc

from ..access import may_see_details
from ..health import STATES, job_health

__all__ = ["JobHealthCollector", "PrometheusMetrics", "metrics_view", "register_job_collector"]

_DURATIONS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 1800, 3600, 14400)

ACQUISITIONS = Counter("django_pglock_acquisitions", "Grants of a lock.", ["name"], registry=None)
CONTENTIONS = Counter(
    "django_pglock_contentions", "Attempts that found a lock held.", ["name"], registry=None
)
SKIPS = Counter(
    "django_pglock_skips",
    "Job calls that did not run their body.",
    ["name", "reason"],
    registry=None,
)
RECLAIMS = Counter(
    "django_pglock_reclaims",
    "Grants that took over a stale or abandoned holder.",
    ["name"],
    registry=None,
)
LOSSES = Counter("django_pglock_losses", "Leases lost while held.", ["name"], registry=None)
ALERTS = Counter(
    "django_pglock_alerts", "Times a holder was seen in alert.", ["name"], registry=None
)
WAIT = Histogram(
    "django_pglock_wait_seconds",
    "Time from the first attempt to the grant.",
    ["name"],
    buckets=_DURATIONS,
    registry=None,
)
HOLD = Histogram(
    "django_pglock_hold_seconds",
    "Time a lease was held until its release.",
    ["name"],
    buckets=_DURATIONS,
    registry=None,
)
HEARTBEAT = Histogram(
    "django_pglock_heartbeat_latency_seconds",
    "Round trip of one heartbeat statement.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=None,
)
_HOOK_METRICS = (ACQUISITIONS, CONTENTIONS, SKIPS, RECLAIMS, LOSSES, ALERTS, WAIT, HOLD, HEARTBEAT)


class PrometheusMetrics:
    """The metrics hook: every method the lock engine calls, counted per lock name."""

    def acquired(self, name: str, wait_seconds: float) -> None:
        ACQUISITIONS.labels(name).inc()
        WAIT.labels(name).observe(wait_seconds)

    def released(self, name: str, held_seconds: float) -> None:
        HOLD.labels(name).observe(held_seconds)

    def contended(self, name: str) -> None:
        CONTENTIONS.labels(name).inc()

    def skipped(self, name: str, reason: str) -> None:
        SKIPS.labels(name, reason).inc()

    def stale_reclaimed(self, name: str) -> None:
        RECLAIMS.labels(name).inc()

    def alert(self, name: str, heartbeat_age: float) -> None:
        ALERTS.labels(name).inc()

    def lost(self, name: str) -> None:
        LOSSES.labels(name).inc()

    def heartbeat_latency(self, seconds: float) -> None:
        HEARTBEAT.observe(seconds)


class JobHealthCollector:
    """Per-job health series, read from the lock database at each scrape."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def describe(self) -> list[Any]:
        return []  # computed at scrape time: never collected at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "django_pglock_job_state",
            "1 for the job's current health state.",
            labels=["job", "state"],
        )
        overdue = GaugeMetricFamily(
            "django_pglock_job_overdue",
            "1 when a due start did not begin within its grace.",
            labels=["job"],
        )
        success = GaugeMetricFamily(
            "django_pglock_job_last_success_timestamp_seconds",
            "Start of the job's last successful run (0: never).",
            labels=["job"],
        )
        duration = GaugeMetricFamily(
            "django_pglock_job_last_run_duration_seconds",
            "Duration of the job's last finished run (0: none).",
            labels=["job"],
        )
        for job in job_health(using=self.using):
            for name in STATES:
                state.add_metric([job.name, name], 1.0 if job.state == name else 0.0)
            overdue.add_metric([job.name], 1.0 if job.state == "overdue" else 0.0)
            last = job.last_success_at
            success.add_metric([job.name], last.timestamp() if last else 0.0)
            duration.add_metric([job.name], job.last_duration or 0.0)
        yield from (state, overdue, success, duration)


_registered: set[int] = set()
_registering = threading.Lock()


def register_job_collector(
    registry: CollectorRegistry = REGISTRY, using: str | None = None
) -> None:
    """Add the hook's metrics and the job collector to ``registry`` (once)."""
    with _registering:
        if id(registry) in _registered:
            return
        for metric in _HOOK_METRICS:
            registry.register(metric)
        registry.register(JobHealthCollector(using))
        _registered.add(id(registry))


@never_cache
@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The default registry, with this app's metrics, in the exposition format."""
    if not may_see_details(request):
        return HttpResponse(
            "Forbidden: staff or HEALTH_TOKEN only.\n", status=403, content_type="text/plain"
        )
    register_job_collector()
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
