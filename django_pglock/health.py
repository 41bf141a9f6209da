"""Job health: one function, one answer, for the command, the view, the admin and metrics.

A job's state, judged by the database clock:

* ``abandoned`` — its lock's holder is gone (the next contender takes it at once);
* ``too-long`` — a run holds its lock past the job's ``max_duration``;
* ``running`` — a run holds its lock;
* ``overdue`` — a start was due more than ``grace`` ago and no run started since;
* ``failing`` — its last finished run failed or was lost;
* ``healthy`` — none of these.

When a job is ``overdue`` or ``failing``, the first process to notice it (a status
check, the health view, a metrics scrape) sends ``job_overdue`` / ``job_failing``, once
per episode: the episode is a row that closes when the job is healthy again.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from . import signals, sql
from .conf import get_setting, schedule_tolerance
from .connection import validate_alias
from .events import send
from .health_reads import gone_holders, read_holders, read_rows
from .jobspec import DEFAULT_GRACE, JobSpec, declared_jobs
from .schedule import _cronsim

__all__ = ["PROBLEMS", "STATES", "JobHealth", "job_health"]

STATES = ("healthy", "running", "overdue", "failing", "too-long", "abandoned")
#: The states that make a job a problem (``--check`` and the health view fail on them).
PROBLEMS = ("overdue", "failing", "too-long")


@dataclass(frozen=True)
class JobHealth:
    """One job's health, with what it was judged from."""

    name: str
    state: str
    spec: JobSpec
    now: datetime.datetime
    last_outcome: str | None = None
    last_started_at: datetime.datetime | None = None
    last_finished_at: datetime.datetime | None = None
    last_duration: float | None = None
    last_host: str | None = None
    last_success_at: datetime.datetime | None = None  # when it finished (else started)
    last_failure_at: datetime.datetime | None = None  # the same, for failed or lost
    next_due: datetime.datetime | None = None
    due: datetime.datetime | None = None  # the latest start that should have happened
    holder: dict[str, Any] | None = None
    detail: str = ""
    episodes: tuple[str, ...] = field(default=())

    @property
    def problem(self) -> bool:
        return self.state in PROBLEMS

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO 8601."""

        def iso(value: datetime.datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        holder = None
        if self.holder is not None:
            holder = {**self.holder, "acquired_at": iso(self.holder["acquired_at"])}
        return {
            "name": self.name,
            "state": self.state,
            "detail": self.detail,
            "schedule": self.spec.schedule,
            "every": self.spec.every,
            "grace": self.spec.grace,
            "max_duration": self.spec.max_duration,
            "declared": self.spec.declared,
            "last_run": {
                "outcome": self.last_outcome,
                "started_at": iso(self.last_started_at),
                "finished_at": iso(self.last_finished_at),
                "duration": self.last_duration,
                "host": self.last_host,
            },
            "last_success_at": iso(self.last_success_at),
            "last_failure_at": iso(self.last_failure_at),
            "due": iso(self.due),
            "next_due": iso(self.next_due),
            "holder": holder,
        }


def _ticks(expression: str, now: datetime.datetime) -> tuple[datetime.datetime, datetime.datetime]:
    """The latest tick at or before ``now`` and the first after it, in ``TIME_ZONE``
    (never the zone a request activated: one job has one state, whoever asks)."""
    zone = timezone.get_default_timezone()
    return _zone_ticks(expression, int(now.timestamp()), zone)


@functools.lru_cache(maxsize=512)
def _zone_ticks(
    expression: str, second: int, zone: datetime.tzinfo
) -> tuple[datetime.datetime, datetime.datetime]:
    # Jobs of one call share their expression and the database clock: computed once.
    cronsim = _cronsim()
    local = datetime.datetime.fromtimestamp(second, zone)
    after = datetime.datetime.fromtimestamp(second + 1, zone)
    previous: datetime.datetime = next(cronsim.CronSim(expression, after, reverse=True))
    following: datetime.datetime = next(cronsim.CronSim(expression, local))
    return previous, following


def _due(
    spec: JobSpec,
    now: datetime.datetime,
    last_start: datetime.datetime | None,
    last_success: datetime.datetime | None,
    memo: dict[tuple[Any, ...], tuple[Any, ...]] | None = None,
) -> tuple[datetime.datetime | None, datetime.datetime | None, bool]:
    """(the start that was due at ``now - grace``, the next due start, overdue?).

    ``memo``, one per ``now``, keeps what depends only on ``now`` and the job's promises:
    the jobs of one call share their expressions and durations."""
    if spec.schedule:
        key: tuple[Any, ...] = (spec.schedule, spec.grace)
        ticks = None if memo is None else memo.get(key)
        if ticks is None:
            due, _ = _ticks(spec.schedule, now - datetime.timedelta(seconds=spec.grace))
            _, following = _ticks(spec.schedule, now)
            # A start a little before its tick (a host whose clock runs ahead) counts for it.
            early = due - datetime.timedelta(seconds=schedule_tolerance())
            ticks = (due, following, early)
            if memo is not None:
                memo[key] = ticks
        due, following, early = ticks
        return due, following, last_start is None or last_start < early
    if spec.every is not None:
        if last_success is None:
            return None, None, False  # nothing says when the first success was due
        key = (None, spec.every, spec.grace)
        spans = None if memo is None else memo.get(key)
        if spans is None:
            grace = datetime.timedelta(seconds=spec.grace)
            spans = (datetime.timedelta(seconds=spec.every), now - grace)
            if memo is not None:
                memo[key] = spans
        every, late = spans
        following = last_success + every
        started = last_start is not None and last_start >= following
        return following, following, late > following and not started
    return None, None, False


_new = object.__new__


def _judge(
    spec: JobSpec,
    row: tuple[Any, ...],
    memo: dict[tuple[Any, ...], tuple[Any, ...]],
) -> JobHealth:
    (name, now, outcome, started, finished, duration, host, success_at, failure_at) = row[:9]
    (claim_slot, _, token, holder_host, holder_pid, acquired_at, held_for, lock_state) = row[9:17]
    # The last run answers for the last success or failure when it is one (the statement
    # then sends NULL); a claim of a later slot is a later start.
    if outcome == "succeeded":
        success_at = finished or started
    elif outcome in ("failed", "lost"):
        failure_at = finished or started
    last_start = started
    if claim_slot is not None and (started is None or claim_slot > started):
        last_start = claim_slot
    due, next_due, overdue = _due(spec, now, last_start, success_at, memo)
    holder = None
    if token is not None:
        holder = {
            "token": token,
            "host": holder_host,
            "pid": holder_pid,
            "acquired_at": acquired_at,
            "held_for": held_for,
            "lock_state": lock_state,
        }
        if lock_state == "stale":
            token = None  # its next contender reclaims it: judged as if nobody held it
    if holder is not None and row[20]:  # its session is gone (sql.ABANDONED)
        state, detail = "abandoned", "its holder is gone; the next contender takes it at once"
    elif token is not None and spec.max_duration is not None and held_for > spec.max_duration:
        state = "too-long"
        detail = f"running for {held_for:.0f}s, longer than max_duration {spec.max_duration:g}s"
    elif token is not None:
        state, detail = "running", f"held by {holder_host}:{holder_pid} for {held_for:.0f}s"
    elif overdue:
        state = "overdue"
        detail = f"a start was due at {due.isoformat() if due else '?'} and none began"
    elif outcome in ("failed", "lost"):
        when = finished or started
        state = "failing"
        detail = f"its last run {outcome} at {when.isoformat() if when else '?'}"
    else:
        state, detail = "healthy", ""
    # Every field, set as the frozen dataclass's __init__ would, minus its sixteen
    # object.__setattr__ calls: a third of the Python time of a thousand jobs.
    health: JobHealth = _new(JobHealth)
    health.__dict__.update(
        {
            "name": name,
            "state": state,
            "spec": spec,
            "now": now,
            "last_outcome": outcome,
            "last_started_at": started,
            "last_finished_at": finished,
            "last_duration": duration,
            "last_host": host,
            "last_success_at": success_at,
            "last_failure_at": failure_at,
            "next_due": next_due,
            "due": due,
            "holder": holder,
            "detail": detail,
            "episodes": tuple(row[18]),
        }
    )
    return health


@functools.lru_cache(maxsize=4096)
def _undeclared(name: str, schedule: str | None) -> JobSpec:
    """The spec of a job known from its history or its claims only (one per name and
    expression: specs are frozen, so calls share them)."""
    return JobSpec(name, schedule=schedule, grace=DEFAULT_GRACE, declared=False)


def job_health(using: str | None = None, *, announce: bool = True) -> list[JobHealth]:
    """Every job's health (declared jobs, scheduled jobs, names with run history), by name.

    Three round trips, in one transaction bounded like the lock statements (5 s for a
    lock, 30 s for a statement): the grants on the advisory path, which of them are gone
    (skipped when there are none), then the jobs with their runs, claims and holders (a
    semaphore job's holder is a live one of its slots when there is one). With
    ``announce``, opens and closes health episodes and sends ``job_overdue`` /
    ``job_failing`` for the ones it opened.
    """
    alias = validate_alias(using if using is not None else get_setting("DATABASE"))
    declared = declared_jobs()
    with transaction.atomic(using=alias):
        # Gone holders first: a semaphore job is judged by a live holder of its slots.
        abandoned = gone_holders(alias, read_holders(alias))
        rows = read_rows(alias, declared, abandoned)
        memo: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # all rows share now()
        judged = []
        for row in rows:
            spec = declared.get(row[0]) or _undeclared(row[0], row[10] or None)
            judged.append(_judge(spec, row, memo))
        if announce:
            _announce(alias, judged)
    return judged


_SIGNALS = {"overdue": signals.job_overdue, "failing": signals.job_failing}


def _announce(alias: str, judged: Iterable[JobHealth]) -> None:
    """Open the episodes of overdue and failing jobs (announcing the new ones) and close
    the episodes of jobs that are no longer so."""
    with connections[alias].cursor() as cursor:
        for health in judged:
            current = [health.state] if health.state in _SIGNALS else []
            # An episode ends when the job is healthy again, or turns into the other kind;
            # a retry that is running (or too long, or abandoned) does not end it.
            ending = health.state == "healthy" or bool(current)
            if ending and set(health.episodes) - set(current):
                cursor.execute(sql.EPISODE_CLOSE, {"name": health.name, "open": current})
            if current and current[0] not in health.episodes:
                cursor.execute(sql.EPISODE_OPEN, {"name": health.name, "kind": current[0]})
                if cursor.fetchone() is not None:
                    send(_SIGNALS[current[0]], None, name=health.name, health=health)
