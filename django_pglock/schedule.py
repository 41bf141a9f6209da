"""Schedule-slot mode: at most one start per cron tick, judged by the database clock.

A run belongs to the nearest tick of the cron expression, in the active time zone: the
next tick when it is at most ``SCHEDULE_TOLERANCE`` seconds ahead of the database clock
(and nearer than the previous one), else the latest tick at or before it. So a host whose
clock runs a little ahead, firing "03:00" while the database still reads 02:59:59.5,
starts the 03:00 slot like every other host, not the slot before it.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import sql, testcases
from .conf import get_setting, schedule_tolerance
from .connection import get_connection, validate_alias
from .identity import current

__all__ = ["ScheduleSlot", "check_cron"]

logger = logging.getLogger("django_pglock")


_SECOND = datetime.timedelta(seconds=1)


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise ImproperlyConfigured(
            "Schedule slots need the cronsim package; install django-singleton-jobs[schedule]."
        ) from None
    return cronsim


def _later(local: datetime.datetime, zone: datetime.tzinfo, seconds: int = 1) -> datetime.datetime:
    """``seconds`` real seconds after ``local``, in ``zone``. Computed in UTC: local
    wall-clock arithmetic drops ``fold``, so in the repeated hour of a DST change
    ``local + 1 s`` would be an hour earlier."""
    utc = local.astimezone(datetime.timezone.utc)
    return (utc + seconds * _SECOND).astimezone(zone)


def check_cron(label: str, value: object) -> str:
    """``value`` if it is a cron expression, else ``ValueError`` naming ``label`` and the
    fix (``ImproperlyConfigured`` when cronsim is not installed)."""
    cronsim = _cronsim()
    if not isinstance(value, str):
        raise ValueError(
            f"{label}={value!r} must be a cron expression string, such as '0 3 * * *'."
        )
    try:  # a fixed date: validating must not need settings
        cronsim.CronSim(value, datetime.datetime(2000, 1, 1))
    except cronsim.CronSimError as exc:
        raise ValueError(
            f"{label}={value!r} is not a valid cron expression ({exc}); use five fields, for "
            "example '0 3 * * *' for 03:00 every day."
        ) from None
    return value


class ScheduleSlot:
    """The current slot of a cron ``expression`` for the job ``name``.

    Slots are computed from the database clock, in the active time zone (``TIME_ZONE``,
    or the zone of ``timezone.override``), to the nearest tick within
    ``DJANGO_PGLOCK['SCHEDULE_TOLERANCE']`` seconds ahead: hosts whose clocks disagree a
    little still agree on the slot. :meth:`claim` records the start of the current slot
    and tells whether this caller was first. Every host must compute in the same zone.
    """

    def __init__(self, expression: str, name: str, using: str | None = None) -> None:
        self.expression = check_cron("schedule", expression)
        self.name = name
        self.using = using
        self.slot: datetime.datetime | None = None
        if settings.configured:  # else (decorating at import time) checked at claim
            schedule_tolerance()

    @property
    def slot_label(self) -> str:
        return self.slot.isoformat() if self.slot else "(not computed)"

    def current_slot(
        self, now: datetime.datetime, tolerance: float | None = None
    ) -> datetime.datetime:
        """The tick that a run at ``now`` (database clock) belongs to, in the active zone.

        The next tick if it is at most ``tolerance`` seconds after ``now`` (default: the
        ``SCHEDULE_TOLERANCE`` setting) and nearer than the previous one; else the
        latest tick at or before ``now``.
        """
        if tolerance is None:
            tolerance = schedule_tolerance()
        cronsim = _cronsim()
        # Cron ticks fall on whole seconds: from the whole second at or before now, the
        # first tick forward is after now, and reverse from a second later is at or before.
        zone = timezone.get_current_timezone()
        local = timezone.localtime(now, zone).replace(microsecond=0)
        previous: datetime.datetime = next(
            cronsim.CronSim(self.expression, _later(local, zone), reverse=True)
        )
        if tolerance > 0:
            following: datetime.datetime = next(cronsim.CronSim(self.expression, local))
            # Timestamps: differences across a DST change in the same zone are real seconds.
            ahead = following.timestamp() - now.timestamp()
            if ahead <= tolerance and ahead < now.timestamp() - previous.timestamp():
                return following
        return previous

    def is_tick(self, moment: datetime.datetime) -> bool:
        """Whether ``moment`` (aware) is a tick of the expression in the active time zone."""
        zone = timezone.get_current_timezone()
        local = timezone.localtime(moment, zone)
        if local.microsecond:
            return False
        tick: datetime.datetime = next(_cronsim().CronSim(self.expression, _later(local, zone, -1)))
        return tick.timestamp() == local.timestamp()

    def claim(self, parent: str | None = None, slot: datetime.datetime | None = None) -> bool:
        """Record the start of the current slot; ``True`` only for the first caller.

        ``parent``: the holder whose grant this run inherited (see :mod:`.inherit`); a
        slot that holder claimed already counts as claimed by this run. ``slot``: the
        slot that holder claimed for this run (``locked_run --schedule``): if it is a tick
        of this expression, the run is in exactly that slot (``True`` only if the
        parent's claim of it stands) instead of the slot computed now.
        """
        alias = validate_alias(self.using if self.using is not None else get_setting("DATABASE"))
        testcases.settle()  # what ended TestCase transactions left goes first
        # On the dedicated autocommit connection: a claim never joins the caller's
        # transaction, so it is visible to other hosts at once.
        conn = get_connection(alias)
        if parent is not None and slot is not None:
            if self.is_tick(slot):
                self.slot = timezone.localtime(slot, timezone.get_current_timezone())
                params = {"name": self.name, "slot": self.slot, "parent": parent}
                return bool(conn.execute(sql.SLOT_CLAIMED_BY, params))
            logger.warning(
                "django_pglock: the slot %s passed by the parent is not a tick of %r; the "
                "schedule slot of %r is computed as usual.",
                slot.isoformat(),
                self.expression,
                self.name,
            )
        ((now,),) = conn.execute(sql.NOW, {})
        self.slot = self.current_slot(now)
        params = {
            "name": self.name,
            "slot": self.slot,
            "holder": current().holder,
            "schedule": self.expression,
        }
        if parent is None:
            rows = conn.execute(sql.CLAIM_SLOT, params)
        else:
            rows = conn.execute(sql.CLAIM_SLOT_UNDER, {**params, "parent": parent})
        if rows:
            testcases.note(alias, claim_id=rows[0][0])  # inside a TestCase: undone when it ends
        return bool(rows)
