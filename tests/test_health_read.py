"""How job health reads the run history (issue 14, performance): each job's last run, last
success and last failure come from its newest run when that run answers them, and from one
probe each otherwise; times come back in binary, in UTC whatever the session's time zone.

Real server; the runs are rows with fixed times, so each answer is known exactly.
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid

import pytest
from django.test import override_settings

from django_pglock.health import JobHealth, job_health

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

UTC = datetime.timezone.utc


def unique(label):
    return f"read-{label}-{uuid.uuid4().hex[:8]}"


def at(hour, minute=0):
    return datetime.datetime(2024, 5, 6, hour, minute, tzinfo=UTC)


def insert(db, name, *runs):
    """Runs as (outcome, started hour, finished hour or None)."""
    for outcome, started, finished in runs:
        db.execute(
            "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description,"
            " started_at, finished_at, duration, outcome) VALUES (%s, 'h', 'w', 1, '', %s, %s,"
            " 1.0, %s)",
            [name, at(started), None if finished is None else at(finished, 30), outcome],
        )


def health(name):
    (found,) = [job for job in job_health(announce=False) if job.name == name]
    return found


def test_the_newest_run_or_one_probe_answers_each_question(db):
    skipped_last = unique("skipped-last")  # newest skipped: the last run is the one before
    insert(db, skipped_last, ("succeeded", 1, 1), ("failed", 2, 2), ("skipped", 3, 3))
    succeeded_last = unique("ok-last")  # the last run is the last success; a probe the failure
    insert(db, succeeded_last, ("lost", 1, None), ("succeeded", 2, 2), ("skipped", 3, 3))
    failed_last = unique("bad-last")  # the last run is the last failure; a probe the success
    insert(db, failed_last, ("succeeded", 1, 1), ("succeeded", 2, None), ("failed", 3, 3))
    only_skipped = unique("only-skipped")  # history, but no run
    insert(db, only_skipped, ("skipped", 1, 1), ("skipped", 2, 2))
    running = unique("running")  # a run in progress is the last run, neither kind
    insert(db, running, ("failed", 1, 1), ("succeeded", 2, 2), ("running", 3, None))

    found = health(skipped_last)
    assert (found.last_outcome, found.last_started_at) == ("failed", at(2))
    assert (found.last_success_at, found.last_failure_at) == (at(1, 30), at(2, 30))
    assert found.state == "failing"

    found = health(succeeded_last)
    assert (found.last_outcome, found.last_finished_at) == ("succeeded", at(2, 30))
    # A lost run never finished: its start is when it failed.
    assert (found.last_success_at, found.last_failure_at) == (at(2, 30), at(1))
    assert found.state == "healthy"

    found = health(failed_last)
    # A success without a finish time counts from its start.
    assert (found.last_success_at, found.last_failure_at) == (at(2), at(3, 30))

    found = health(only_skipped)
    assert found.last_outcome is None and found.last_started_at is None
    assert (found.last_success_at, found.last_failure_at) == (None, None)
    assert found.state == "healthy"

    found = health(running)
    assert (found.last_outcome, found.last_finished_at) == ("running", None)
    assert (found.last_success_at, found.last_failure_at) == (at(2, 30), at(1, 30))


def test_a_job_health_has_every_field_its_constructor_would_set(db):
    name = unique("fields")
    insert(db, name, ("succeeded", 1, 1))
    with override_settings(DJANGO_PGLOCK={"JOBS": {name: {"schedule": "0 * * * *"}}}):
        found = health(name)
    assert set(vars(found)) == {field.name for field in dataclasses.fields(JobHealth)}
    assert dataclasses.replace(found) == found
    assert found.spec.schedule == "0 * * * *" and found.due is not None
    assert found.now.tzinfo is UTC and found.last_started_at.tzinfo is UTC


@pytest.mark.parametrize("zone", ["Europe/Berlin", "America/St_Johns"])
def test_a_session_in_another_time_zone_reads_the_same_instants_in_utc(db, zone):
    name = unique("zone")
    insert(db, name, ("failed", 1, 1), ("succeeded", 2, None))
    # Without USE_TZ, Django sets the session's time zone to TIME_ZONE.
    with override_settings(USE_TZ=False, TIME_ZONE=zone):
        found = health(name)
    times = (found.last_started_at, found.last_success_at, found.last_failure_at)
    assert times == (at(2), at(2), at(1, 30))
    assert all(value.tzinfo is UTC for value in (*times, found.now))
