"""Schedule slots and the run history of calls that did not run (issue 11, items 2 to 4).

* Pruning never deletes the claim of a job's latest slot, so the slot cannot start again
  (``locked_run`` and ``pglock_prune`` as real processes).
* A skipped call is recorded as ``skipped`` with the reason: the lock was held, the
  schedule slot had already started, or a blocking wait timed out; the admin shows it.
* The slot of a run is the nearest tick within ``SCHEDULE_TOLERANCE``, computed from the
  database clock in the active time zone.

Everything runs against the real PostgreSQL server.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import threading
import uuid
import zoneinfo

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_pglock import Lock, singleton_job
from django_pglock.models import JobRun, ScheduleClaim
from django_pglock.schedule import ScheduleSlot
from tests.subprocs import open_db, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

UTC = datetime.timezone.utc
KOLKATA = zoneinfo.ZoneInfo("Asia/Kolkata")  # UTC+05:30 all year: no DST in the way
RUNS = reverse("admin:django_pglock_jobrun_changelist")
# Once a year (00:00 on 1 January): the current slot is the same for every call of a
# test, unless the test runs across New Year.
YEARLY = "0 0 1 1 *"
QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}


@pytest.fixture
def db(pg_url, test_db_name):
    """A separate autocommit session on the test database (another process's view)."""
    with open_db(pg_url, test_db_name) as conn:
        yield conn


def unique(label):
    return f"slots-{label}-{uuid.uuid4().hex[:8]}"


def runs(name):
    return list(JobRun.objects.filter(name=name).order_by("started_at", "pk"))


def outcomes(name):
    return [(run.outcome, run.reason) for run in runs(name)]


def held_by_another_thread(name):
    """A lease on ``name`` granted to another thread (so this one may wait for it)."""
    leases = []
    thread = threading.Thread(target=lambda: leases.append(Lock(name, **QUIET).try_acquire()))
    thread.start()
    thread.join(30)
    (lease,) = leases
    assert lease is not None, f"could not take {name!r}"
    return lease


def claims(db, name):
    return db.execute(
        "SELECT slot FROM django_pglock_scheduleclaim WHERE name = %s ORDER BY slot", [name]
    ).fetchall()


# -- item 2: pruning keeps the claim of each job's latest slot -----------------------------


@pytest.mark.slow
def test_prune_keeps_the_current_slot_so_it_does_not_start_again(procs, tmp_path, db):
    name = unique("prune")
    first_pid, second_pid = tmp_path / "first", tmp_path / "second"
    command = ("locked_run", "--name", name, "--schedule", YEARLY, "exit_with", "0")
    first = procs.run_django(*command, "--pidfile", first_pid)
    assert first.returncode == 0, first.stderr
    assert first_pid.exists()
    ((slot,),) = claims(db, name)
    # The current slot was claimed two days ago (by the database clock), last year's a
    # year ago: both are older than the prune's cutoff.
    db.execute(
        "UPDATE django_pglock_scheduleclaim SET claimed_at = now() - interval '2 days'"
        " WHERE name = %s",
        [name],
    )
    db.execute(
        "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at)"
        " VALUES (%s, %s - interval '1 year', 'h', now() - interval '1 year')",
        [name, slot],
    )

    pruned = procs.run_django("pglock_prune", "--older-than", "2m")
    assert pruned.returncode == 0, pruned.stderr
    assert claims(db, name) == [(slot,)]  # last year's claim went; the current one stayed

    second = procs.run_django(*command, "--pidfile", second_pid)
    assert second.returncode == 0, second.stderr
    assert not second_pid.exists(), "the slot started a second time after pglock_prune"
    assert "schedule slot" in second.stderr
    assert outcomes(name) == [("succeeded", None), ("skipped", "slot-taken")]


def test_prune_deletes_a_jobs_older_claims_and_keeps_its_latest_whatever_its_age():
    long_ago = timezone.now() - datetime.timedelta(days=400)
    a, b = unique("a"), unique("b")
    for name, days_before in ((a, (3, 2, 1)), (b, (5,))):
        for days in days_before:
            ScheduleClaim.objects.create(
                name=name,
                slot=long_ago - datetime.timedelta(days=days),
                holder="h",
                claimed_at=long_ago,
            )
    out = io.StringIO()
    call_command("pglock_prune", "--older-than", "30d", stdout=out)
    assert "and 2 schedule claim(s)" in out.getvalue()
    kept = sorted(ScheduleClaim.objects.filter(name__in=[a, b]).values_list("name", "slot"))
    assert kept == sorted(
        [(a, long_ago - datetime.timedelta(days=1)), (b, long_ago - datetime.timedelta(days=5))]
    )


# -- item 3: skipped calls are recorded as skipped, with the reason --------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_whose_slot_started_elsewhere_is_recorded_as_skipped_slot_taken(kind):
    name = unique(f"slot-{kind}")
    ran = []

    if kind == "sync":

        @singleton_job(name, schedule=YEARLY, record=True)
        def job():
            ran.append(True)
            return "ran"

        call = job
    else:

        @singleton_job(name, schedule=YEARLY, record=True)
        async def async_job():
            ran.append(True)
            return "ran"

        def call():
            return asyncio.run(async_job())

    assert call() == "ran"
    assert call() is None  # same slot: the body did not run
    assert ran == [True]
    ran_once, skipped = runs(name)
    # The body of the second call never ran: its run is no success.
    assert [ran_once.outcome, skipped.outcome] == ["succeeded", "skipped"]
    assert [ran_once.reason, skipped.reason] == [None, "slot-taken"]
    assert skipped.finished_at is not None and skipped.duration is not None
    assert skipped.get_reason_display() == "schedule slot already started"


def test_a_call_that_finds_the_lock_held_is_recorded_as_skipped_held():
    name = unique("held")

    @singleton_job(name, record=True)
    def job():
        return "ran"

    lease = held_by_another_thread(name)
    try:
        assert job() is None
    finally:
        lease.release()
    assert job() == "ran"
    assert outcomes(name) == [("skipped", "held"), ("succeeded", None)]


def test_a_blocking_call_whose_wait_timed_out_is_recorded_as_skipped_timed_out():
    name = unique("timeout")

    @singleton_job(name, blocking=True, timeout=0.2, poll_interval=0.05, record=True)
    def job():
        return "ran"

    lease = held_by_another_thread(name)
    try:
        assert job() is None
    finally:
        lease.release()
    ((outcome, reason),) = outcomes(name)
    assert (outcome, reason) == ("skipped", "timed-out")


@pytest.mark.slow
def test_locked_run_records_held_and_timed_out_skips_with_their_reason(procs, tmp_path):
    name = unique("locked-run")
    pidfile = tmp_path / "pid"
    command = ("locked_run", "--name", name, "--poll-interval", "0.05")
    lease = Lock(name, **QUIET).try_acquire()
    assert lease is not None
    try:
        held = procs.run_django(*command, "exit_with", "0", "--pidfile", pidfile)
        waited = procs.run_django(
            *command, "--wait", "--timeout", "0.3", "exit_with", "0", "--pidfile", pidfile
        )
    finally:
        lease.release()
    assert held.returncode == 0, held.stderr
    assert waited.returncode == 0, waited.stderr
    assert not pidfile.exists()
    assert outcomes(name) == [("skipped", "held"), ("skipped", "timed-out")]


def test_an_unrecorded_call_whose_slot_started_elsewhere_records_nothing():
    name = unique("unrecorded")

    @singleton_job(name, schedule=YEARLY, record=False)
    def job():
        return "ran"

    assert job() == "ran"
    assert job() is None
    assert runs(name) == []


def test_run_history_admin_shows_and_filters_the_reason_of_a_skip(admin_client):
    name = unique("admin")

    @singleton_job(name, schedule=YEARLY, record=True)
    def job():
        return "ran"

    job()
    job()  # slot already started
    lease = held_by_another_thread(name)
    try:
        job()  # held
    finally:
        lease.release()
    ran, slot_taken, held = runs(name)

    page = admin_client.get(RUNS, {"name": name})
    assert page.status_code == 200
    html = page.content.decode()
    assert "schedule slot already started" in html and "lock held elsewhere" in html
    shown = admin_client.get(RUNS, {"name": name, "reason": "slot-taken"})
    assert {run.pk for run in shown.context["cl"].result_list} == {slot_taken.pk}
    shown = admin_client.get(RUNS, {"name": name, "reason": "held"})
    assert {run.pk for run in shown.context["cl"].result_list} == {held.pk}
    assert ran.reason is None


# -- item 4: the nearest tick within the tolerance, in the active time zone ------------------


def at(text, zone=UTC):
    return datetime.datetime.fromisoformat(text).replace(tzinfo=zone)


@pytest.mark.parametrize(
    "now",
    [
        "2026-03-10 02:59:59.500",  # half a second early: that host's clock is ahead
        "2026-03-10 03:00:00.200",
        "2026-03-10 02:59:55.000",  # just within the default 5 s
        "2026-03-10 03:00:00.000",
        "2026-03-10 14:00:00.000",
    ],
)
def test_a_run_just_before_a_tick_belongs_to_that_tick(now):
    slot = ScheduleSlot("0 3 * * *", "nightly")
    assert slot.current_slot(at(now)) == at("2026-03-10 03:00:00")


def test_a_run_further_before_the_tick_than_the_tolerance_belongs_to_the_slot_before():
    slot = ScheduleSlot("0 3 * * *", "nightly")
    assert slot.current_slot(at("2026-03-10 02:59:54.900")) == at("2026-03-09 03:00:00")
    with override_settings(DJANGO_PGLOCK={"SCHEDULE_TOLERANCE": 0}):
        assert slot.current_slot(at("2026-03-10 02:59:59.900")) == at("2026-03-09 03:00:00")
    with override_settings(DJANGO_PGLOCK={"SCHEDULE_TOLERANCE": 30}):
        assert slot.current_slot(at("2026-03-10 02:59:31")) == at("2026-03-10 03:00:00")


def test_with_ticks_closer_than_the_tolerance_a_run_belongs_to_the_nearest():
    every_two_seconds = ScheduleSlot("*/2 * * * * *", "often")  # a seconds field first
    assert every_two_seconds.current_slot(at("2026-03-10 03:00:00.400")) == at("2026-03-10 03:00")
    assert every_two_seconds.current_slot(at("2026-03-10 03:00:01.600")) == at(
        "2026-03-10 03:00:02"
    )


def test_slots_are_computed_in_the_active_time_zone():
    slot = ScheduleSlot("0 3 * * *", "nightly")
    now = at("2026-01-01 21:45")  # 03:15 on 2 January in Kolkata
    assert slot.current_slot(now) == at("2026-01-01 03:00")  # TIME_ZONE (UTC)
    with timezone.override(KOLKATA):
        in_kolkata = slot.current_slot(now)
    assert in_kolkata == at("2026-01-02 03:00", KOLKATA)
    assert in_kolkata == at("2026-01-01 21:30")


def test_a_claim_under_timezone_override_claims_the_slot_of_that_zone(db):
    name = unique("zone")
    with timezone.override(KOLKATA):
        assert ScheduleSlot("0 3 * * *", name).claim()
    ((slot,),) = claims(db, name)
    local = slot.astimezone(KOLKATA)
    assert (local.hour, local.minute, local.second) == (3, 0, 0)


def db_now(db):
    ((now,),) = db.execute("SELECT clock_timestamp()").fetchall()
    return now


def wait_for_db_clock(db, moment):
    wait_until(lambda: db_now(db) >= moment, 10, f"the database clock never reached {moment}")


@pytest.mark.slow
def test_claims_half_a_second_before_and_after_a_tick_claim_one_slot(db):
    """Two hosts fire the same tick: one whose clock is ahead claims while the database
    still reads just before the tick, the other just after it. One slot, one start.

    The tick is a second chosen a moment ahead of the database clock (a six-field
    expression, seconds first). On a machine too busy to claim before that tick, the
    attempt proves nothing and is made again with a new tick.
    """
    for _attempt in range(5):
        name = unique("skew")
        tick = timezone.localtime(db_now(db)).replace(microsecond=0)
        tick += datetime.timedelta(seconds=3)
        expression = f"{tick.second} {tick.minute} {tick.hour} {tick.day} {tick.month} *"
        wait_for_db_clock(db, tick - datetime.timedelta(seconds=0.5))
        ahead = ScheduleSlot(expression, name)
        assert ahead.claim()
        ((claimed_at,),) = db.execute(
            "SELECT claimed_at FROM django_pglock_scheduleclaim WHERE name = %s", [name]
        ).fetchall()
        if claimed_at >= tick:
            continue  # claimed after the tick after all: try again
        wait_for_db_clock(db, tick + datetime.timedelta(seconds=0.2))
        on_time = ScheduleSlot(expression, name)
        assert not on_time.claim(), "a second start in the same tick"
        assert ahead.slot == on_time.slot == tick
        assert claims(db, name) == [(tick,)]
        return
    pytest.fail("no claim came before its tick in 5 attempts")


def test_a_bad_schedule_tolerance_is_a_usage_error_naming_it(db):
    name = unique("bad-tolerance")
    with override_settings(DJANGO_PGLOCK={"SCHEDULE_TOLERANCE": 90}):
        with pytest.raises(CommandError, match=r"SCHEDULE_TOLERANCE.* = 90 ") as failure:
            call_command("locked_run", "--name", name, "--schedule", YEARLY, "--shell", "true")
        assert failure.value.returncode == 2
    assert claims(db, name) == []
    assert runs(name) == []
