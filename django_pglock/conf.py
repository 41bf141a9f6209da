"""The ``DJANGO_PGLOCK`` settings dict, read lazily so that ``override_settings`` works."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import connections

__all__ = [
    "DEFAULTS",
    "Thresholds",
    "ThresholdsError",
    "ThresholdsOutOfOrder",
    "ThresholdsTooTight",
    "generation",
    "get_setting",
    "kind_of",
    "read_setting",
    "schedule_tolerance",
    "validate_alias",
    "validate_thresholds",
]

SETTING_NAME = "DJANGO_PGLOCK"

DEFAULTS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL": 10.0,
    "ALERT_AFTER": 30.0,
    "STALE_AFTER": 600.0,
    "POLL_INTERVAL": 0.5,
    "ADVISORY": True,
    "DATABASE": "default",
    "METRICS": None,
    "RECORD_RUNS": True,
    "SCHEDULE_TOLERANCE": 5.0,
    "JOBS": None,
    "HEALTH_TOKEN": None,
}


_cache: dict[str, Any] | None = None
_generation = 0


def get_setting(key: str) -> Any:
    """Return ``DJANGO_PGLOCK[key]``, or its default when the project does not set it.

    The dict is read on first use and again after ``override_settings`` changes it.
    """
    global _cache
    configured = _cache
    if configured is None:
        configured = _cache = read_setting()
    return configured.get(key, DEFAULTS[key])


def read_setting() -> dict[str, Any]:
    """The ``DJANGO_PGLOCK`` dict as the project set it: ``{}`` when unset or ``None``.

    The one reader of the setting (the lock engine, the commands and the system checks),
    so that all of them accept and refuse the same values: anything but a dict or
    ``None`` raises ``ImproperlyConfigured`` (``manage.py check`` reports it as E001).
    """
    configured = getattr(settings, SETTING_NAME, None)
    if configured is None:
        return {}
    if not isinstance(configured, dict):
        raise ImproperlyConfigured(
            f"{SETTING_NAME} is {configured!r}, not a dict; set it to a dict such as "
            f"{{'STALE_AFTER': 600.0}} or remove it."
        )
    return configured


def generation() -> int:
    """A number that changes whenever ``override_settings`` changes any setting.

    Values derived from settings (a lock's resolved thresholds, alias and advisory
    choice) are cached against it, so that an attempt does not resolve them again.
    """
    return _generation


def _reload(*, setting: str, **kwargs: Any) -> None:
    global _cache, _generation
    _generation += 1
    if setting == SETTING_NAME:
        _cache = None


setting_changed.connect(_reload)


def kind_of(value: object) -> str:
    """The type of ``value`` for a message, with its article: "an int", "a bytes object"."""
    if value is None:
        return "None"
    name = type(value).__name__
    if name in ("bytes", "bytearray", "memoryview"):
        return f"a {name} object"
    article = "an" if name[:1].lower() in "aeiou" and not name.startswith("UU") else "a"
    return f"{article} {name}"


def setting_label(key: str) -> str:
    """How to name a setting in an error message."""
    return f"{SETTING_NAME}[{key!r}]"


#: Longer than any job needs, and well inside what PostgreSQL intervals can hold.
MAX_SECONDS = 100 * 365 * 24 * 3600.0


def check_seconds(label: str, value: object, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float number of seconds, or raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{label}={value!r} is not a number; pass a number of seconds.")
    number = float(value)
    too_small = number < 0 or (number == 0 and not allow_zero)
    if not math.isfinite(number) or too_small or number > MAX_SECONDS:
        bound = "zero or more" if allow_zero else "greater than zero"
        raise ValueError(
            f"{label}={value!r} is out of range; it must be {bound} and finite, at most "
            f"{MAX_SECONDS:.0f} seconds (100 years)."
        )
    return number


#: The largest ``SCHEDULE_TOLERANCE``: half a minute, the shortest period of a five-field
#: cron expression, so that the nearest tick is never in doubt.
MAX_SCHEDULE_TOLERANCE = 30.0


def is_schedule_tolerance(value: object) -> bool:
    """Whether ``value`` can be ``SCHEDULE_TOLERANCE``: 0 to 30 seconds."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and 0 <= value <= MAX_SCHEDULE_TOLERANCE
    )


def schedule_tolerance() -> float:
    """``DJANGO_PGLOCK['SCHEDULE_TOLERANCE']`` in seconds, or ``ImproperlyConfigured``."""
    value = get_setting("SCHEDULE_TOLERANCE")
    if not is_schedule_tolerance(value):
        raise ImproperlyConfigured(
            f"{setting_label('SCHEDULE_TOLERANCE')} = {value!r} is not a number of seconds "
            f"from 0 to {MAX_SCHEDULE_TOLERANCE:g}; use a float such as 5.0 (how far ahead "
            "of the database clock a host may fire a cron tick)."
        )
    return float(value)


@dataclass(frozen=True)
class Thresholds:
    """The liveness thresholds a holder declares on its row, in seconds."""

    heartbeat_interval: float
    alert_after: float
    stale_after: float


class ThresholdsError(ValueError):
    """Thresholds that are numbers but cannot work together.

    ``problem`` says what is wrong with which values and ``fix`` what to change (the
    system checks show them as message and hint, each subclass under its own id); the
    exception's message is both, joined by ``joiner``.
    """

    def __init__(self, problem: str, fix: str = "", joiner: str = " ") -> None:
        super().__init__(joiner.join(part for part in (problem, fix) if part))
        self.problem = problem
        self.fix = fix


class ThresholdsOutOfOrder(ThresholdsError):
    """Not ``heartbeat_interval < alert_after < stale_after``."""


class ThresholdsTooTight(ThresholdsError):
    """``stale_after < 2 * heartbeat_interval``: the holder's deadline comes too soon."""


#: stale_after must be at least this many heartbeat intervals. The holder gives up on its
#: own ``stale_after - min(heartbeat_interval, 0.1 * stale_after)`` after its last confirmed
#: heartbeat; at two intervals that is at least 1.8 intervals, so a heartbeat may be late.
MIN_STALE_HEARTBEATS = 2


def validate_thresholds(
    heartbeat_interval: object,
    alert_after: object,
    stale_after: object,
    labels: tuple[str, str, str] = ("heartbeat_interval", "alert_after", "stale_after"),
) -> Thresholds:
    """Check the three thresholds and how they relate, raising ``ValueError`` with the fix.

    They must satisfy ``heartbeat_interval < alert_after < stale_after`` and
    ``stale_after >= 2 * heartbeat_interval``. ``labels`` name the values in the message
    (an argument such as ``stale_after``, or a setting such as
    ``DJANGO_PGLOCK['STALE_AFTER']``).
    """
    hb = check_seconds(labels[0], heartbeat_interval)
    alert = check_seconds(labels[1], alert_after)
    stale = check_seconds(labels[2], stale_after)
    if not hb < alert < stale:
        raise ThresholdsOutOfOrder(
            f"Thresholds {labels[0]}={heartbeat_interval!r}, {labels[1]}={alert_after!r}, "
            f"{labels[2]}={stale_after!r} are out of order",
            "they must satisfy heartbeat_interval < alert_after < stale_after.",
            joiner="; ",
        )
    if stale < MIN_STALE_HEARTBEATS * hb:
        deadline = stale - min(hb, 0.1 * stale)
        raise ThresholdsTooTight(
            f"Thresholds {labels[0]}={heartbeat_interval!r} and {labels[2]}={stale_after!r} "
            f"cannot keep a lease: a holder gives up {round(deadline, 3)!r} s after its last "
            "confirmed heartbeat (stale_after minus a margin), too little room for a late "
            "heartbeat; stale_after must be at least twice heartbeat_interval.",
            # Doubling and halving a float are exact: these values satisfy the rule.
            f"Use {labels[2]}={MIN_STALE_HEARTBEATS * hb!r} or more, or "
            f"{labels[0]}={stale / MIN_STALE_HEARTBEATS!r} or less.",
        )
    return Thresholds(hb, alert, stale)


def validate_alias(alias: object) -> str:
    """Return ``alias`` if it names a PostgreSQL database, else raise ``ImproperlyConfigured``."""
    if not isinstance(alias, str) or alias not in connections.settings:
        known = ", ".join(repr(a) for a in connections.settings) or "none"
        raise ImproperlyConfigured(
            f"Database alias {alias!r} is not in settings.DATABASES (known aliases: {known}); "
            "pass using= one of them or set DJANGO_PGLOCK['DATABASE']."
        )
    vendor = connections[alias].vendor
    if vendor != "postgresql":
        raise ImproperlyConfigured(
            f"Database alias {alias!r} uses the {vendor!r} backend; django_pglock needs "
            "PostgreSQL: point using= at an alias with ENGINE 'django.db.backends.postgresql'."
        )
    return alias
