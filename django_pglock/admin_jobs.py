"""The admin's jobs page: each job's health, its last runs and a chart of its recent runs.

One answer from :func:`~django_pglock.health.job_health` (the one ``pglock_status --jobs``
gives, episodes announced alike) and one statement for the recent runs of the jobs shown
(:data:`~django_pglock.sql.RECENT_RUNS`), both on the lock database. The chart is an SVG
drawn here, one bar per run, with no script. Served by :class:`~.admin.JobRunAdmin` at
``<admin>/django_pglock/jobrun/jobs/`` to the users who may view job runs.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import formats, timezone
from django.utils.html import format_html, format_html_join

from . import sql
from .admin_base import OUTCOME_COLOURS, badge
from .conf import get_setting, validate_alias
from .health import STATES, JobHealth, job_health

if TYPE_CHECKING:
    from .admin_base import LockDatabaseAdmin

__all__ = ["HEALTH_COLOURS", "RECENT", "RecentRun", "jobs_page", "recent_runs", "run_chart"]

HEALTH_COLOURS = {
    "healthy": "#2e7d32",
    "running": "#1565c0",
    "overdue": "#e65100",
    "failing": "#c62828",
    "too-long": "#ad1457",
    "abandoned": "#616161",
}
#: How many runs of each job the chart shows (skips left out).
RECENT = 20
PAGE_VAR = "p"
STATE_VAR = "state"

BAR_WIDTH, BAR_GAP, CHART_HEIGHT, MIN_HEIGHT = 7, 2, 30, 3.0


@dataclass(frozen=True)
class RecentRun:
    """One run of a job's chart; a run still going on has lasted ``duration`` so far."""

    started_at: datetime.datetime
    outcome: str
    duration: float


@dataclass(frozen=True)
class JobRow:
    """What one line of the page shows."""

    health: JobHealth
    badge: str
    detail: str
    outcome_badge: str
    last_duration: str
    spec: str
    held_for: str
    chart: str


def recent_runs(using: str, names: list[str], limit: int = RECENT) -> dict[str, list[RecentRun]]:
    """The last ``limit`` runs (skips left out) of each of ``names``, oldest first: one
    statement whatever the number of names, none for no name."""
    if not names:
        return {}
    found: dict[str, list[RecentRun]] = {name: [] for name in names}
    with connections[using].cursor() as cursor:
        cursor.execute(sql.RECENT_RUNS, {"names": names, "limit": limit})
        for name, started_at, outcome, duration in cursor.fetchall():
            found[name].append(RecentRun(started_at, outcome, max(float(duration or 0.0), 0.0)))
    return found


def seconds_text(seconds: float | None) -> str:
    """``0.4 s``, ``42 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``."""
    if seconds is None:
        return ""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    for unit, size, smaller, small_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if whole >= size:
            rest = (whole % size) // small_size
            return f"{whole // size} {unit}" + (f" {rest} {smaller}" if rest else "")
    return f"{whole} s"


def local_time(value: datetime.datetime) -> str:
    """``value`` in the active time zone, as the admin shows date-times."""
    return formats.date_format(timezone.localtime(value), "DATETIME_FORMAT")


def run_chart(name: str, runs: list[RecentRun]) -> str:
    """An SVG bar per run, oldest left, its height the run's duration (relative to the
    longest shown), its colour the outcome; each bar's ``<title>`` tells the exact values.
    Empty for no run."""
    if not runs:
        return ""
    longest = max(run.duration for run in runs) or 1.0
    step = BAR_WIDTH + BAR_GAP
    width = RECENT * step - BAR_GAP
    first = width - len(runs) * step + BAR_GAP  # the newest run at the right edge

    def bar(index: int, run: RecentRun) -> tuple[Any, ...]:
        height = max(MIN_HEIGHT, run.duration / longest * CHART_HEIGHT)
        took = seconds_text(run.duration) + (" so far" if run.outcome == "running" else "")
        title = f"{run.outcome}, {took}, started {local_time(run.started_at)}"
        colour = OUTCOME_COLOURS.get(run.outcome, "#616161")
        top = f"{CHART_HEIGHT - height:.1f}"
        return (first + index * step, top, f"{height:.1f}", colour, run.outcome, title)

    bars = format_html_join(
        "",
        '<rect x="{}" y="{}" width="' + str(BAR_WIDTH) + '" height="{}" fill="{}" '
        'class="run run-{}"><title>{}</title></rect>',
        (bar(index, run) for index, run in enumerate(runs)),
    )
    counts = Counter(run.outcome for run in runs)
    summary = ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items()))
    return format_html(
        '<svg class="run-chart" xmlns="http://www.w3.org/2000/svg" role="img" width="{}" '
        'height="{}" viewBox="0 0 {} {}" aria-label="{}">{}</svg>',
        width,
        CHART_HEIGHT,
        width,
        CHART_HEIGHT,
        f"The last {len(runs)} runs of {name}: {summary}",
        bars,
    )


def _spec_text(health: JobHealth) -> str:
    spec, parts = health.spec, []
    if spec.schedule:
        parts.append(f"schedule {spec.schedule}")
    if spec.every is not None:
        parts.append(f"every {seconds_text(spec.every)}")
    if spec.max_duration is not None:
        parts.append(f"at most {seconds_text(spec.max_duration)}")
    if spec.schedule or spec.every is not None:
        parts.append(f"grace {seconds_text(spec.grace)}")
    if not spec.declared:
        parts.append("not declared")
    return " · ".join(parts)


def _detail(health: JobHealth) -> str:
    """Why the job is in its state, with times in the active time zone (``detail`` of
    :class:`~.health.JobHealth` is for logs: database time, ISO 8601)."""
    holder, spec = health.holder, health.spec
    if health.state == "too-long" and holder is not None and spec.max_duration is not None:
        took, limit = seconds_text(holder["held_for"]), seconds_text(spec.max_duration)
        return f"running for {took}, longer than its max_duration, {limit}"
    if health.state == "overdue" and health.due is not None:
        return f"a start was due at {local_time(health.due)} and none began"
    if health.state == "failing" and health.last_outcome is not None:
        return f"its last run {health.last_outcome}"
    if health.state in ("running", "healthy"):
        return ""  # the holder's column and the last run say it all
    return health.detail


def _row(health: JobHealth, runs: list[RecentRun]) -> JobRow:
    outcome = health.last_outcome
    return JobRow(
        health=health,
        badge=badge(health.state, HEALTH_COLOURS.get(health.state, "#616161")),
        detail=_detail(health),
        outcome_badge=""
        if outcome is None
        else badge(outcome, OUTCOME_COLOURS.get(outcome, "#616161")),
        last_duration=seconds_text(health.last_duration),
        spec=_spec_text(health),
        held_for="" if health.holder is None else seconds_text(health.holder["held_for"]),
        chart=run_chart(health.name, runs),
    )


def _query(**params: Any) -> str:
    kept = {key: value for key, value in params.items() if value is not None}
    return "?" + urlencode(kept) if kept else "?"


def jobs_page(model_admin: LockDatabaseAdmin, request: HttpRequest) -> HttpResponse:
    """The page. ``?state=<health state>`` shows the jobs in that state; a value that is
    not a state (a typo, an old bookmark, a NUL byte) is ignored, as the other pages'
    filters do. ``?p=<n>`` is the page number, of the model admin's ``list_per_page`` jobs
    each: the recent runs are read for the jobs of one page only."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    alias = validate_alias(get_setting("DATABASE"))
    jobs = job_health(using=alias, announce=True)
    state = request.GET.get(STATE_VAR)
    if state not in STATES:
        state = None
    counts = Counter(job.state for job in jobs)
    shown = [job for job in jobs if state is None or job.state == state]
    page = Paginator(shown, model_admin.list_per_page).get_page(request.GET.get(PAGE_VAR))
    runs = recent_runs(alias, [job.name for job in page.object_list])
    opts = model_admin.model._meta
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Jobs",
        "subtitle": None,
        "opts": opts,
        "app_label": opts.app_label,
        "rows": [_row(job, runs.get(job.name, [])) for job in page.object_list],
        "page": page,
        "state": state,
        "total": len(jobs),
        "empty": model_admin.get_empty_value_display(),
        "choices": [
            {"label": "All", "count": len(jobs), "query": _query(), "selected": state is None},
            *(
                {
                    "label": name,
                    "count": counts[name],
                    "query": _query(state=name),
                    "selected": state == name,
                }
                for name in STATES
            ),
        ],
        "previous_query": _query(state=state, p=page.previous_page_number())
        if page.has_previous()
        else None,
        "next_query": _query(state=state, p=page.next_page_number()) if page.has_next() else None,
        "outcome_colours": [
            (outcome, colour) for outcome, colour in OUTCOME_COLOURS.items() if outcome != "skipped"
        ],
        "recent": RECENT,
    }
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "admin/django_pglock/jobrun/jobs.html", context)
