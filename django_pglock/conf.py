"""The ``DJANGO_PGLOCK`` settings dict, read lazily so that ``override_settings`` works."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from django.conf import settings

__all__ = ["DEFAULTS", "Thresholds", "get_setting", "validate_thresholds"]

SETTING_NAME = "DJANGO_PGLOCK"

DEFAULTS: dict[str, Any] = {
    "HEARTBEAT_INTERVAL": 10.0,
    "ALERT_AFTER": 30.0,
    "STALE_AFTER": 600.0,
    "POLL_INTERVAL": 0.5,
    "ADVISORY": True,
    "DATABASE": "default",
    "METRICS": None,
}


def get_setting(key: str) -> Any:
    """Return ``DJANGO_PGLOCK[key]``, or its default when the project does not set it."""
    configured = getattr(settings, SETTING_NAME, None) or {}
    return configured.get(key, DEFAULTS[key])


def check_seconds(label: str, value: object, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float number of seconds, or raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{label}={value!r} is not a number; pass a number of seconds.")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise ValueError(f"{label}={value!r} is out of range; it must be {bound} and finite.")
    return number


@dataclass(frozen=True)
class Thresholds:
    """The liveness thresholds a holder declares on its row, in seconds."""

    heartbeat_interval: float
    alert_after: float
    stale_after: float


def validate_thresholds(
    heartbeat_interval: object, alert_after: object, stale_after: object
) -> Thresholds:
    """Check the three thresholds and their order, raising ``ValueError`` with the fix."""
    hb = check_seconds("heartbeat_interval", heartbeat_interval)
    alert = check_seconds("alert_after", alert_after)
    stale = check_seconds("stale_after", stale_after)
    if not hb < alert < stale:
        raise ValueError(
            f"Thresholds heartbeat_interval={heartbeat_interval!r}, alert_after={alert_after!r}, "
            f"stale_after={stale_after!r} are out of order; they must satisfy "
            "heartbeat_interval < alert_after < stale_after."
        )
    return Thresholds(hb, alert, stale)
