"""Declared jobs: ``DJANGO_PGLOCK["JOBS"]``, how often each must start and how long it may run.

::

    DJANGO_PGLOCK = {
        "JOBS": {
            "nightly_report": {"schedule": "0 3 * * *", "grace": "1h", "max_duration": "2h"},
            "sync-prices": {"every": "15m", "grace": "5m"},
        }
    }

``schedule`` (a cron expression) or ``every`` (a duration) says when a start is due;
``grace`` how late it may be before the job is ``overdue`` (default 5 minutes);
``max_duration`` how long a run may hold its lock before it is ``too long``. Durations are
seconds (a number) or strings such as ``"90s"``, ``"15m"``, ``"1h30m"``, ``"2d"``. A job
with a schedule that is not declared here is still watched: its claims carry its cron
expression (see :mod:`.schedule`).
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass

from .conf import MAX_SECONDS, generation, get_setting, setting_label

__all__ = ["DEFAULT_GRACE", "JobSpec", "declared_jobs", "parse_duration", "parse_jobs"]

#: How late a due start may be before its job is overdue, unless the job says otherwise.
DEFAULT_GRACE = 300.0
KEYS = ("schedule", "every", "grace", "max_duration")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([smhdw]))", re.ASCII)


@dataclass(frozen=True)
class JobSpec:
    """What a job promises: when its starts are due and how long a run may take."""

    name: str
    schedule: str | None = None
    every: float | None = None
    grace: float = DEFAULT_GRACE
    max_duration: float | None = None
    declared: bool = True  # False: known only from its schedule claims


def parse_duration(label: str, value: object) -> float:
    """Seconds from a number, a ``timedelta`` or a string like ``"1h30m"``; ``ValueError``
    naming ``label`` and the value otherwise."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().replace(" ", "")
        parts = _DURATION.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(
                f"{label}={value!r} is not a duration; use seconds (a number) or a string "
                "such as '90s', '15m', '1h30m' or '2d'."
            )
        seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    else:
        raise ValueError(
            f"{label}={value!r} is not a duration; use seconds (a number) or a string such "
            "as '90s', '15m', '1h30m' or '2d'."
        )
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(
            f"{label}={value!r} is out of range; it must be more than zero and at most 100 years."
        )
    return seconds


def _check_schedule(label: str, value: object) -> str:
    from django.core.exceptions import ImproperlyConfigured

    from .schedule import check_cron

    try:
        return check_cron(label, value)
    except ImproperlyConfigured as exc:  # cronsim is missing: reported like any bad entry
        raise ValueError(f"{label}: {exc}") from None


def _parse_job(name: object, entry: object) -> JobSpec:
    base = f"{setting_label('JOBS')}[{name!r}]"
    if not isinstance(name, str) or not name or name != name.strip() or len(name) > 255:
        raise ValueError(
            f"{setting_label('JOBS')} has the key {name!r}; a job's key is its lock name: a "
            "non-empty string without surrounding whitespace, at most 255 characters."
        )
    if not isinstance(entry, dict):
        raise ValueError(
            f"{base} = {entry!r} is not a dict; use for example "
            "{'schedule': '0 3 * * *', 'grace': '1h', 'max_duration': '2h'}."
        )
    unknown = sorted(str(key) for key in entry if key not in KEYS)
    if unknown:
        raise ValueError(
            f"{base} has unknown key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(KEYS)}."
        )
    if "schedule" in entry and "every" in entry:
        raise ValueError(f"{base} has both 'schedule' and 'every'; give one of them.")
    schedule = entry.get("schedule")
    every = entry.get("every")
    return JobSpec(
        name=name,
        schedule=None if schedule is None else _check_schedule(f"{base}['schedule']", schedule),
        every=None if every is None else parse_duration(f"{base}['every']", every),
        grace=parse_duration(f"{base}['grace']", entry.get("grace", DEFAULT_GRACE)),
        max_duration=(
            None
            if entry.get("max_duration") is None
            else parse_duration(f"{base}['max_duration']", entry["max_duration"])
        ),
    )


def parse_jobs(value: object) -> tuple[dict[str, JobSpec], list[str]]:
    """The valid jobs of a ``JOBS`` value, and one message per invalid entry."""
    if value is None:
        return {}, []
    if not isinstance(value, dict):
        return {}, [
            f"{setting_label('JOBS')} = {value!r} is not a dict; map each job's lock name to "
            "its promises, e.g. {'nightly_report': {'schedule': '0 3 * * *'}}."
        ]
    jobs: dict[str, JobSpec] = {}
    problems: list[str] = []
    for name, entry in value.items():
        try:
            jobs[name] = _parse_job(name, entry)
        except ValueError as exc:
            problems.append(str(exc))
    return jobs, problems


_declared: tuple[int, dict[str, JobSpec]] = (-1, {})


def declared_jobs() -> dict[str, JobSpec]:
    """The valid entries of ``DJANGO_PGLOCK["JOBS"]`` (invalid ones are reported by
    ``manage.py check`` as ``django_pglock.E014`` and left out here). Read again when
    ``override_settings`` changes a setting."""
    global _declared
    now = generation()
    if _declared[0] != now:
        _declared = (now, parse_jobs(get_setting("JOBS"))[0])
    return _declared[1]
