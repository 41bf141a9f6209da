"""Schedule-slot mode: at most one start per cron tick, judged by the database clock."""

from __future__ import annotations

import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import sql
from .conf import get_setting
from .connection import get_connection, validate_alias
from .identity import current

__all__ = ["ScheduleSlot"]


def _cronsim() -> Any:
    try:
        import cronsim
    except ImportError:
        raise ImproperlyConfigured(
            "Schedule slots need the cronsim package; install django-singleton-jobs[schedule]."
        ) from None
    return cronsim


class ScheduleSlot:
    """The current slot of a cron ``expression`` for the job ``name``.

    Slots are computed from the database clock in the project's ``TIME_ZONE``, so hosts
    whose clocks disagree still agree on the slot. :meth:`claim` records the start of the
    current slot and tells whether this caller was first.
    """

    def __init__(self, expression: str, name: str, using: str | None = None) -> None:
        cronsim = _cronsim()
        if not isinstance(expression, str):
            raise ValueError(f"schedule={expression!r} must be a cron expression string.")
        try:  # a fixed date: validating must not need settings
            cronsim.CronSim(expression, datetime.datetime(2000, 1, 1))
        except cronsim.CronSimError as exc:
            raise ValueError(
                f"schedule={expression!r} is not a valid cron expression ({exc}); use five "
                "fields, for example '0 3 * * *' for 03:00 every day."
            ) from None
        self.expression = expression
        self.name = name
        self.using = using
        self.slot: datetime.datetime | None = None

    @property
    def slot_label(self) -> str:
        return self.slot.isoformat() if self.slot else "(not computed)"

    def current_slot(self, now: datetime.datetime) -> datetime.datetime:
        """The start of the slot that contains ``now`` (the latest tick at or before it)."""
        local = timezone.localtime(now).replace(microsecond=0) + datetime.timedelta(seconds=1)
        start: datetime.datetime = next(_cronsim().CronSim(self.expression, local, reverse=True))
        return start

    def claim(self, parent: str | None = None) -> bool:
        """Record the start of the current slot; ``True`` only for the first caller.

        ``parent``: the holder whose grant this run inherited (see :mod:`.inherit`); a
        slot that holder claimed already counts as claimed by this run.
        """
        alias = validate_alias(self.using if self.using is not None else get_setting("DATABASE"))
        # On the dedicated autocommit connection: a claim never joins the caller's
        # transaction, so it is visible to other hosts at once.
        conn = get_connection(alias)
        ((now,),) = conn.execute(sql.NOW, {})
        self.slot = self.current_slot(now)
        params = {"name": self.name, "slot": self.slot, "holder": current().holder}
        if parent is None:
            rows = conn.execute(sql.CLAIM_SLOT, params)
        else:
            rows = conn.execute(sql.CLAIM_SLOT_UNDER, {**params, "parent": parent})
        return bool(rows)
