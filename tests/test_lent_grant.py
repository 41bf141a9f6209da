"""What ``locked_run`` lends its job besides the grant (issue 11, items 2 and 3), in process.

* Only the job's process group runs under the grant: the guardian names it in
  ``DJANGO_PGLOCK_JOB_PGID``, and a process outside it (``setsid``, a daemon) meets the
  lock as usual, with a warning saying why.
* ``locked_run --schedule`` passes the slot it claimed in ``DJANGO_PGLOCK_SLOT``: a
  ``@singleton_job(schedule=...)`` under the grant runs in exactly that slot (if it is a
  tick of its expression and the parent's claim), claims no other, and when it skips,
  the parent's run is finished as ``skipped`` (``slot-taken``).

The parent is this test's own lease, its row made to look held by this process's parent
(as ``locked_run`` holds its job's lock); the real processes are in
tests/test_attacks_issue11.py.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid

import pytest
from django.utils import timezone

from django_pglock import InheritedLease, Lease, Lock, current_lease, singleton_job
from django_pglock.inherit import parent_grant

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

YEARLY = "0 0 1 1 *"  # its current slot is this year's 1 January, last year's is a tick too
ELSEWHERE = "elsewhere:1:cafe"


def unique(label):
    return f"lent-{label}-{uuid.uuid4().hex[:8]}"


def lent(db, monkeypatch, lease, group=None, slot=None):
    """Offer ``lease`` to this process as a parent's grant: its row held by this process's
    parent, the variables as locked_run and the guardian set them."""
    db.execute(
        "UPDATE django_pglock_joblock SET pid = %s WHERE name = %s AND token = %s",
        [os.getppid(), lease.name, lease.token],
    )
    monkeypatch.setenv("DJANGO_PGLOCK_NAME", lease.name)
    monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(lease.token))
    monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp() if group is None else group))
    if slot is None:
        monkeypatch.delenv("DJANGO_PGLOCK_SLOT", raising=False)
    else:
        monkeypatch.setenv("DJANGO_PGLOCK_SLOT", slot)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "django_pglock"]


def claims(db, name):
    return db.execute(
        "SELECT slot, holder FROM django_pglock_scheduleclaim WHERE name = %s ORDER BY slot",
        [name],
    ).fetchall()


def run_of(db, name, token):
    return db.execute(
        "SELECT outcome, reason FROM django_pglock_jobrun WHERE name = %s AND token = %s",
        [name, token],
    ).fetchall()


def new_year(years_ago):
    """1 January 00:00 in the active zone, ``years_ago`` years before this year's."""
    year = timezone.localtime().year - years_ago
    return datetime.datetime(year, 1, 1, tzinfo=timezone.get_current_timezone())


def claimed(db, name, slot, holder):
    db.execute(
        "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at)"
        " VALUES (%s, %s, %s, now())",
        [name, slot, holder],
    )


# -- item 2: only the job's process group -------------------------------------------------


@pytest.mark.parametrize("group", ["other", "", "junk", "0"])
def test_a_process_outside_the_jobs_process_group_is_not_lent_the_grant(
    db, monkeypatch, caplog, group
):
    name = unique("group")
    parent = Lock(name).try_acquire()
    try:
        lent(db, monkeypatch, parent, group=str(os.getpgrp() + 1) if group == "other" else group)
        with caplog.at_level(logging.WARNING, logger="django_pglock"):
            assert parent_grant(Lock(name)) is None
        (message,) = warnings_of(caplog)
        assert f"lock {name!r} is tried as usual" in message
        if group == "other":
            assert f"process group {os.getpgrp() + 1} of locked_run's job" in message
            assert "setsid" in message
        else:
            assert f"DJANGO_PGLOCK_JOB_PGID={group!r}" in message

        @singleton_job(name)
        def job():
            return current_lease()

        assert job() is None  # the lock is held (by the parent): skipped, not lent

        monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job's group
        assert isinstance(parent_grant(Lock(name)), InheritedLease)
    finally:
        parent.release()


# -- item 3: the slot locked_run --schedule claimed ----------------------------------------


def test_a_scheduled_job_under_the_grant_runs_in_the_slot_its_parent_claimed(db, monkeypatch):
    """The parent claimed last year's tick (a slot computed now would be this year's): the
    job runs in that slot and claims no other."""
    name = unique("slot")
    parent = Lock(name, record=True).try_acquire()
    slot = new_year(1)
    try:
        claimed(db, name, slot, parent.holder)
        lent(db, monkeypatch, parent, slot=slot.isoformat())

        @singleton_job(name, schedule=YEARLY)
        def job():
            return current_lease()

        inherited = job()
        assert isinstance(inherited, InheritedLease) and inherited.slot == slot
        assert claims(db, name) == [(slot, parent.holder)]  # one run, one slot
        assert run_of(db, name, parent.token) == [("running", None)]  # the parent's to finish
    finally:
        parent.release()
    assert run_of(db, name, parent.token) == [("succeeded", None)]


def test_a_job_under_the_grant_whose_slot_is_anothers_finishes_the_parents_run_as_skipped(
    db, monkeypatch, caplog
):
    name = unique("taken")
    parent = Lock(name, record=True).try_acquire()
    slot = new_year(1)
    ran = []
    try:
        claimed(db, name, slot, ELSEWHERE)
        lent(db, monkeypatch, parent, slot=slot.isoformat())

        @singleton_job(name, schedule=YEARLY)
        def job():
            ran.append(current_lease())

        with caplog.at_level(logging.INFO, logger="django_pglock"):
            assert job() is None
        assert ran == []
        assert any(f"schedule slot {slot.isoformat()}" in m for m in warnings_of(caplog))
        assert claims(db, name) == [(slot, ELSEWHERE)]  # no slot of its own claimed instead
        assert run_of(db, name, parent.token) == [("skipped", "slot-taken")]
    finally:
        parent.release()
    assert run_of(db, name, parent.token) == [("skipped", "slot-taken")]  # release keeps it


@pytest.mark.parametrize("given", ["not a tick", "no offset", "junk"])
def test_a_slot_that_is_no_tick_of_the_jobs_schedule_is_ignored_with_a_warning(
    db, monkeypatch, caplog, given
):
    """The slot is computed as usual then: this year's, claimed under the parent."""
    name = unique("bad-slot")
    parent = Lock(name).try_acquire()
    last_year = new_year(1)
    text = {
        "not a tick": (last_year + datetime.timedelta(minutes=1)).isoformat(),
        "no offset": last_year.replace(tzinfo=None).isoformat(),
        "junk": "yesterday",
    }[given]
    try:
        lent(db, monkeypatch, parent, slot=text)

        @singleton_job(name, schedule=YEARLY)
        def job():
            return current_lease()

        with caplog.at_level(logging.WARNING, logger="django_pglock"):
            inherited = job()
        assert isinstance(inherited, InheritedLease)
        (message,) = warnings_of(caplog)
        assert "computed as usual" in message
        assert (text if given != "not a tick" else YEARLY) in message
        this_year = new_year(0)
        assert [slot for slot, _holder in claims(db, name)] == [this_year]
    finally:
        parent.release()


def test_a_slot_in_the_environment_without_a_grant_changes_nothing(monkeypatch):
    """A job that takes its own lock computes its own slot, whatever the variable says."""
    name = unique("own")
    monkeypatch.setenv("DJANGO_PGLOCK_SLOT", new_year(1).isoformat())

    @singleton_job(name, schedule=YEARLY)
    def job():
        return current_lease()

    assert isinstance(job(), Lease)
