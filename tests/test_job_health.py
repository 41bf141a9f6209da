"""Job health (issue 14): overdue, failing, too-long, running, abandoned, healthy.

Real server, real processes for the runs (``locked_run`` in subprocesses); health is
judged in this process with ``DJANGO_PGLOCK["JOBS"]`` set by ``override_settings``. Short
``every`` / ``grace`` durations stand in for a nightly schedule; waits are for the state
the test expects, never fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from django_pglock import Lock, signals
from django_pglock.health import job_health
from django_pglock.jobspec import parse_duration, parse_jobs
from tests.subprocs import pid_gone, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def unique(label):
    return f"health-{label}-{uuid.uuid4().hex[:8]}"


def health_of(name):
    (found,) = [job for job in job_health() if job.name == name]
    return found


def jobs(**entries):
    return override_settings(DJANGO_PGLOCK={"JOBS": entries})


def run(procs, name, code, *extra):
    result = procs.run_django("locked_run", "--name", name, *extra, "exit_with", str(code))
    assert result.returncode == code, result.stderr
    return result


def test_a_job_whose_hosts_all_stop_turns_overdue_after_its_grace(procs):
    name = unique("overdue")
    with jobs(**{name: {"every": "2s", "grace": "1s"}}):
        run(procs, name, 0)
        assert health_of(name).state == "healthy"
        # Nobody runs it any more: 2 s after its success a start is due, 1 s later overdue.
        found = wait_until(
            lambda: (h := health_of(name)).state == "overdue" and h, 30, "never turned overdue"
        )
        assert found.last_outcome == "succeeded"
        assert found.next_due is not None and found.due is not None
        assert "due" in found.detail
        run(procs, name, 0)  # a run starts: healthy again
        assert health_of(name).state == "healthy"


def test_a_scheduled_job_with_no_start_since_its_last_tick_is_overdue(db):
    name = unique("cron")
    # Every minute, one second of grace; the last start was ten minutes ago.
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome) VALUES (%s, 'h', 'host', 1, '', now() - interval"
        " '10 minutes', now() - interval '10 minutes', 0.1, 'succeeded')",
        [name],
    )
    with jobs(**{name: {"schedule": "* * * * *", "grace": 1}}):
        found = health_of(name)
        assert found.state == "overdue", found
        assert found.next_due > found.now > found.due
    with jobs(**{name: {"schedule": "* * * * *", "grace": "1h"}}):
        assert health_of(name).state == "healthy"  # ten minutes late is within an hour


def test_a_failing_job_turns_failing_and_is_announced_once_per_episode(procs):
    name = unique("failing")
    heard = []

    def on_failing(sender, name, health, **kwargs):
        heard.append((name, health.state))

    signals.job_failing.connect(on_failing)
    try:
        with jobs(**{name: {}}):
            run(procs, name, 3)
            found = health_of(name)
            assert found.state == "failing" and found.last_outcome == "failed"
            assert found.last_failure_at is not None and found.last_success_at is None
            health_of(name)  # noticed again: the same episode
            assert heard == [(name, "failing")]
            run(procs, name, 0)
            assert health_of(name).state == "healthy"
            run(procs, name, 1)
            assert health_of(name).state == "failing"
            assert heard == [(name, "failing"), (name, "failing")]  # a new episode
    finally:
        signals.job_failing.disconnect(on_failing)


def test_a_run_past_its_max_duration_is_too_long_and_then_healthy(procs):
    name = unique("long")
    with jobs(**{name: {"max_duration": 1}}):
        holder = procs.django("locked_run", "--name", name, "slow_job", "--seconds", "600")
        wait_until(lambda: health_of(name).state in ("running", "too-long"), 30, "never ran")
        found = wait_until(
            lambda: (h := health_of(name)).state == "too-long" and h, 30, "never too long"
        )
        assert found.holder["pid"] > 0 and "max_duration" in found.detail
        os.killpg(holder.popen.pid, signal.SIGTERM)
        holder.result(30)
        assert health_of(name).state in ("healthy", "failing")


def test_a_killed_advisory_holder_makes_its_job_abandoned(procs):
    name = unique("abandoned")
    holder = procs.child("hold", "--name", name)
    holder.expect("ACQUIRED")
    with jobs(**{name: {}}):  # declared: a job even before its first recorded run
        assert health_of(name).state == "running"
        os.kill(holder.popen.pid, signal.SIGKILL)
        wait_until(lambda: pid_gone(holder.popen.pid), 30, "holder did not die")
        # The server ends the holder's session once it sees the connection close.
        wait_until(lambda: health_of(name).state == "abandoned", 30, "never abandoned")


def test_a_semaphore_job_held_only_in_a_higher_slot_is_running_then_abandoned(procs):
    """A semaphore's slots above the first are rows of their own: a job held only there
    is running, and abandoned once that holder is gone."""
    name = unique("slots")
    first = procs.child("hold", "--name", name, "--limit", "2")
    first.expect("ACQUIRED")
    second = procs.child("hold", "--name", name, "--limit", "2")
    second.expect("ACQUIRED")
    first.send("release")
    first.expect("RELEASED")
    with jobs(**{name: {}}):
        found = health_of(name)
        assert found.state == "running", found.detail
        assert found.holder["pid"] == second.pid
        os.kill(second.popen.pid, signal.SIGKILL)
        wait_until(lambda: pid_gone(second.popen.pid), 30, "holder did not die")
        wait_until(lambda: health_of(name).state == "abandoned", 30, "never abandoned")


def test_an_undeclared_scheduled_job_is_known_from_its_claim(procs):
    name = unique("claimed")
    run(procs, name, 0, "--schedule", "0 0 1 1 *")
    found = health_of(name)
    assert found.spec.schedule == "0 0 1 1 *" and not found.spec.declared
    assert found.state == "healthy"


def test_pglock_status_jobs_table_json_and_check(procs, capsys):
    bad, good = unique("bad"), unique("good")
    run(procs, bad, 2)
    run(procs, good, 0)
    with jobs(**{bad: {}, good: {}}):
        call_command("pglock_status", "--jobs")
        out = capsys.readouterr().out
        assert bad in out and "FAILING" in out and good in out
        call_command("pglock_status", "--jobs", "--json")
        data = {job["name"]: job for job in json.loads(capsys.readouterr().out)}
        assert data[bad]["state"] == "failing" and data[good]["state"] == "healthy"
        assert data[bad]["last_run"]["outcome"] == "failed"
        with pytest.raises(CommandError) as raised:
            call_command("pglock_status", "--jobs", "--check")
        assert raised.value.returncode == 1
        err = capsys.readouterr().err
        assert f"{bad}: failing:" in err and good not in err
        call_command("pglock_status", "--jobs", "--check", "--fail-on", "overdue")
        with pytest.raises(CommandError, match="unknown state"):
            call_command("pglock_status", "--jobs", "--check", "--fail-on", "brokn")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(90, 90.0), ("90s", 90.0), ("15m", 900.0), ("1h30m", 5400.0), ("2d", 172800.0)],
)
def test_durations(value, seconds):
    assert parse_duration("x", value) == seconds


@pytest.mark.parametrize("value", ["", "1x", "h", -1, 0, True, "1h 2", None, [1]])
def test_bad_durations_name_the_value(value):
    with pytest.raises(ValueError, match="x="):
        parse_duration("x", value)


def test_bad_jobs_are_reported_with_e014(settings):
    from django_pglock.checks import check_settings

    settings.DJANGO_PGLOCK = {
        "JOBS": {
            "a": {"schedule": "nope"},
            "b": {"every": "1h", "schedule": "* * * * *"},
            "c": {"grace": "soon"},
            "d": {"colour": "red"},
            "ok": {"schedule": "0 3 * * *", "grace": "1h", "max_duration": "2h"},
        }
    }
    ids = [message.id for message in check_settings()]
    assert ids == ["django_pglock.E014"] * 4
    valid, problems = parse_jobs(settings.DJANGO_PGLOCK["JOBS"])
    assert list(valid) == ["ok"] and len(problems) == 4
    settings.DJANGO_PGLOCK = {"JOBS": ["a"]}
    assert [m.id for m in check_settings()] == ["django_pglock.E014"]


def test_a_lock_without_history_is_not_a_job():
    name = unique("plain")
    with Lock(name).acquire():
        assert name not in {job.name for job in job_health()}
