"""Run history written outside acquire and release: calls that did not run their body.

A recorded job whose call is skipped leaves one ``skipped`` run with the reason: the lock
was held elsewhere, the schedule slot had already started elsewhere, or a blocking wait
ran out of time. The runs that do run are started and finished by the acquire and
release statements themselves (see :mod:`.sql`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models

from . import sql, testcases
from .connection import get_connection
from .events import call_metrics
from .identity import current

if TYPE_CHECKING:
    from .inherit import InheritedLease
    from .lease import Lease
    from .lock import Lock

__all__ = ["SkipReason", "record_skipped", "record_skipped_under"]


class SkipReason(models.TextChoices):
    """Why a call did not run its body (``JobRun.reason`` of a ``skipped`` run)."""

    HELD = "held", "lock held elsewhere"
    SLOT_TAKEN = "slot-taken", "schedule slot already started"
    TIMED_OUT = "timed-out", "wait timed out"


def record_skipped(lock: Lock, reason: SkipReason, lease: Lease | None = None) -> None:
    """Record a skipped call of ``lock``'s job, and why (nothing unless ``lock.record``).

    Without a ``lease`` (the lock was not granted) this adds one finished ``skipped`` run.
    With one (granted, then skipped because its schedule slot had already started), the
    run its grant started is finished as ``skipped`` now; the release leaves a finished
    run as it is. The metrics hooks hear of every skip, recorded or not.
    """
    call_metrics(lock._hooks(), "skipped", lock.name, reason.value)
    if not lock.record:
        return
    if lease is not None:
        run_id = lease._run_id
        if run_id is not None:
            get_connection(lease.using).execute(
                sql.FINISH_SKIPPED_RUN, {"run_id": run_id, "reason": reason.value}
            )
        return
    identity = current()
    alias = lock._alias()
    rows = get_connection(alias).execute(
        sql.RECORD_SKIPPED,
        {
            "name": lock.name,
            "holder": identity.holder,
            "host": identity.host,
            "pid": identity.pid,
            "description": lock._description(),
            "reason": reason.value,
        },
    )
    testcases.note(alias, run_id=rows[0][0])  # inside a TestCase: undone when it ends


def record_skipped_under(inherited: InheritedLease, reason: SkipReason) -> None:
    """Finish the run of the parent whose grant this job inherited as ``skipped``: the
    job (``locked_run``'s) did not run its body. Nothing when the parent records no run;
    the parent's release leaves a finished run as it is."""
    get_connection(inherited.using).execute(
        sql.FINISH_SKIPPED_INHERITED_RUN,
        {"name": inherited.name, "token": inherited.token, "reason": reason.value},
    )
