"""Second round of attacks on issue 15's features: semaphores, instant handoff, leader
election.

Each test here reproduces one finding and fails on the code it was written against
(see the report of the wt-attack2 branch). Real server, real leases; real processes and
signals where the finding needs them. Every wait is for an event, bounded generously for
a busy machine.
"""

from __future__ import annotations

import signal
import uuid

import pytest

from django_pglock import Lock
from django_pglock.health import job_health
from django_pglock.operations import lock_status
from tests.subprocs import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

QUIET = {"heartbeat_interval": 30.0, "alert_after": 60.0, "stale_after": 600.0}
QUIET_ARGS = ("--heartbeat-interval", "30", "--alert-after", "60", "--stale-after", "600")


def unique(label):
    return f"atk15b-{label}-{uuid.uuid4().hex[:8]}"


def states(name):
    return {row.token: row.state for row in lock_status() if row.name == name}


# -- 1. job health: a semaphore job judged by its oldest slot holder alone --------------------


def test_job_health_a_semaphore_job_running_in_slot_two_is_not_abandoned(procs, db):
    """README, "Job health": ``running`` -- a run holds its lock; ``abandoned`` -- its
    lock's holder is gone. A semaphore job whose slot 1 holder (the oldest) was SIGKILLed
    while slot 2's holder is alive and running its recorded run is judged from slot 1's
    row alone: ``abandoned``, and the live run (and a too-long check of it) is hidden."""
    name = unique("health-abandoned")
    child = procs.child("hold", "--name", name, "--limit", "2", *QUIET_ARGS)
    child.expect("ACQUIRED")
    lease = Lock(name, limit=2, record=True, **QUIET).try_acquire()
    assert lease is not None and lease.slot == 2
    try:
        child.kill()
        wait_until(lambda: "abandoned" in states(name).values(), 30, "slot 1 never abandoned")
        (job,) = [j for j in job_health(announce=False) if j.name == name]
        assert job.state == "running", (job.state, job.detail, job.holder)
        assert job.holder is not None and job.holder["token"] == lease.token
    finally:
        lease.release()


def test_job_health_a_semaphore_job_running_in_slot_two_while_slot_one_is_stale(procs, db):
    """README, "Job health": a stale holder "does not make its job running: the job is
    judged as if nobody held it" -- but here another slot's holder is alive, its run
    recorded and running. The job is judged from the oldest (stale) slot holder alone,
    as if nobody held it: observed ``healthy`` (an ``every`` job would be ``overdue``,
    a problem for ``--check``), with no holder's run shown and ``max_duration`` never
    checked for the live one."""
    name = unique("health-stale")
    child = procs.child(
        "hold",
        "--name",
        name,
        "--limit",
        "2",
        "--heartbeat-interval",
        "0.2",
        "--alert-after",
        "0.5",
        "--stale-after",
        "2",
    )
    child.expect("ACQUIRED")
    lease = Lock(name, limit=2, record=True, **QUIET).try_acquire()
    assert lease is not None and lease.slot == 2
    try:
        child.signal(signal.SIGSTOP)  # slot 1's holder hangs: it turns stale
        wait_until(lambda: "stale" in states(name).values(), 30, "slot 1 never went stale")
        (job,) = [j for j in job_health(announce=False) if j.name == name]
        assert job.state == "running", (job.state, job.detail, job.holder)
    finally:
        child.signal(signal.SIGCONT)
        lease.release()


# -- 2. a forced release of a semaphore slot does not admit a waiter of the same process ---


def test_a_forced_release_of_a_slot_admits_a_waiter_of_the_holders_process_at_once(db):
    """README, "Semaphores": each holder gets "the same guarantees as the holder of a
    plain lock"; "Status and forced release" / "Leader election": a forced release lets a
    contender in at once (the plain acquire takes over the key hold of a lease of its own
    process that has not noticed yet, sql.acquire's ``kept``). A semaphore's acquire
    instead skips every slot whose key a lease of this process holds (``mine``), so after
    ``pglock_release --token`` of one of this process's slots, a waiter of this process
    is refused at every poll until the old lease's next heartbeat (30 s here) although the
    slot is free; a waiter in another process would have been admitted at once."""
    from django_pglock.operations import force_release

    name = unique("forced-same-process")
    lock = Lock(name, limit=2, **QUIET)
    first, second = lock.try_acquire(), lock.try_acquire()
    assert first is not None and second is not None and second.slot == 2
    try:
        assert force_release(name, token=second.token) is not None
        waiter = Lock(name, limit=2, poll_interval=0.1, **QUIET)
        lease = waiter.acquire_or_raise(timeout=5)  # far less than heartbeat_interval (30)
        assert lease.slot == 2
        lease.release()
    finally:
        first.release()
        second.release()
