"""``@singleton_job`` on functions, keyed jobs, coroutines, management commands and
schedule slots, through the public API and against the real PostgreSQL server.

Multi-process tests start real interpreters (`python -c ...`, `python -m django ...`)
that reach pytest-django's test database through `child_env`.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import socket
import sys
import threading
import time

import pytest
from django.core.management import call_command

from django_pglock import Lock, singleton_job
from django_pglock.models import ScheduleClaim
from django_pglock.operations import force_release
from tests.subprocs import open_db, wait_for_early_in_minute, wait_for_file
from tests.testapp import jobs

DB = pytest.mark.django_db(transaction=True)

# Run in a child: wait at a file barrier (so that both children call at the same moment),
# then call tests.testapp.jobs.<func>(*args) and print the result as JSON.
CHILD = """
import json, os, pathlib, sys, time
import django
django.setup()
from tests.testapp import jobs
barrier = pathlib.Path(sys.argv[1])
func = getattr(jobs, sys.argv[2])
args = json.loads(sys.argv[3])
(barrier / f"ready-{os.getpid()}").touch()
deadline = time.monotonic() + 30
while not (barrier / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.005)
print(json.dumps(func(*args)))
"""


def lock_row(db, name):
    return db.execute(
        "SELECT token, holder, pid FROM django_pglock_joblock WHERE name = %s", [name]
    ).fetchone()


def call_together(procs, tmp_path, func, *args, count=2):
    """Start ``count`` children calling ``jobs.<func>(*args)`` at once; their Results."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    children = [procs.python(CHILD, barrier, func, json.dumps(args)) for _ in range(count)]
    for child in children:
        wait_for_file(barrier / f"ready-{child.pid}", procs=children)
    (barrier / "go").touch()
    return children, [procs.finish(child) for child in children]


def skip_messages(caplog):
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "django_pglock" and "skipped" in record.getMessage().lower()
    ]


# -- names ------------------------------------------------------------------------------


@DB
@pytest.mark.usefixtures("clean_locks")
def test_bare_decorator_names_the_lock_after_module_and_qualname():
    name = "tests.testapp.jobs.refresh"
    assert f"{jobs.refresh.__module__}.{jobs.refresh.__qualname__}" == name  # wraps() kept it
    # While it runs, the table holds exactly its own row, under that name.
    assert jobs.refresh() == [name]
    lease = Lock(name).try_acquire()
    assert lease is not None
    try:
        assert jobs.refresh() is None  # skipped: the lock of that name is held
    finally:
        lease.release()
    assert jobs.refresh() == [name]


@DB
@pytest.mark.usefixtures("clean_locks")
def test_bare_decorator_on_a_nested_function_uses_its_qualname():
    @singleton_job
    def inner():
        other = Lock(f"{__name__}.{inner_qualname}").try_acquire()
        if other is not None:
            other.release()
        return other is None

    inner_qualname = "test_bare_decorator_on_a_nested_function_uses_its_qualname.<locals>.inner"
    assert inner() is True  # the name is taken by the running call itself


# -- one function, two processes -------------------------------------------------------


@DB
@pytest.mark.slow
@pytest.mark.usefixtures("clean_locks")
def test_decorated_function_runs_in_exactly_one_of_two_processes(procs, tmp_path, db):
    lines = tmp_path / "lines.txt"
    children, results = call_together(procs, tmp_path, "report", str(lines), 1.5)
    for result in results:
        assert result.returncode == 0, result.stderr
    ran = lines.read_text().splitlines()
    assert len(ran) == 1, ran
    winner_pid = int(ran[0].split()[1])
    assert winner_pid in {child.pid for child in children}
    outputs = sorted(json.loads(result.stdout) is None for result in results)
    assert outputs == [False, True]
    for child, result in zip(children, results, strict=True):
        value = json.loads(result.stdout)
        if child.pid == winner_pid:
            assert value == f"report done by {winner_pid}"
        else:
            assert value is None  # the skipped call returns None
    assert lock_row(db, "nightly-report") is None  # the winner released on return


@DB
@pytest.mark.usefixtures("clean_locks")
def test_skipped_call_returns_none_and_logs_the_lock_and_its_holder(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="django_pglock")
    lines = tmp_path / "lines.txt"
    lease = Lock("nightly-report").try_acquire()
    assert lease is not None
    try:
        assert jobs.report(str(lines)) is None
    finally:
        lease.release()
    assert not lines.exists()  # the body never ran
    (message,) = skip_messages(caplog)
    assert "'nightly-report'" in message
    assert lease.holder in message
    # Once free, it runs and returns its value.
    assert jobs.report(str(lines)) == f"report done by {os.getpid()}"
    assert len(lines.read_text().splitlines()) == 1


# -- keyed locks -------------------------------------------------------------------------


@DB
@pytest.mark.usefixtures("clean_locks")
def test_keyed_job_excludes_the_same_tenant_and_lets_another_run(db):
    started, proceed = threading.Event(), threading.Event()
    results = {}

    def tenant_one():
        results["first"] = jobs.advance_pipeline(1, started=started, proceed=proceed)

    thread = threading.Thread(target=tenant_one, name="tenant-1")
    thread.start()
    try:
        assert started.wait(15), "tenant 1 never started"
        assert lock_row(db, "training:1") is not None
        assert jobs.advance_pipeline(1) is None  # same tenant: skipped
        # Another tenant runs while tenant 1 is still running.
        other = jobs.advance_pipeline(2)
        assert other == f"advanced 2 in {threading.current_thread().name}"
        assert lock_row(db, "training:1") is not None
        assert lock_row(db, "training:2") is None  # released on return
    finally:
        proceed.set()
        thread.join(30)
    assert not thread.is_alive()
    assert results["first"] == "advanced 1 in tenant-1"
    assert lock_row(db, "training:1") is None
    assert jobs.advance_pipeline(1) == f"advanced 1 in {threading.current_thread().name}"


def test_key_gets_the_call_arguments():
    seen = []

    def key(*args, **kwargs):
        seen.append((args, kwargs))
        raise LookupError("stop before any lock is taken")

    @singleton_job(key=key)
    def job(a, b=None):
        raise AssertionError("must not run")

    with pytest.raises(LookupError):
        job(1, b=2)
    assert seen == [((1,), {"b": 2})]


# -- async --------------------------------------------------------------------------------


@DB
@pytest.mark.usefixtures("clean_locks")
def test_async_job_is_skipped_while_held_and_runs_when_free(db):
    calls = []
    lease = Lock("async-sync").try_acquire()
    assert lease is not None
    try:
        assert asyncio.run(jobs.sync(calls)) is None
    finally:
        lease.release()
    assert calls == []
    assert asyncio.run(jobs.sync(calls)) == "synced"
    assert calls == [os.getpid()]
    assert lock_row(db, "async-sync") is None


@DB
@pytest.mark.usefixtures("clean_locks")
def test_async_job_gathered_five_times_runs_once(db):
    calls = []
    ticks = []

    async def main():
        async def ticker():
            # The event loop keeps running while the job holds the lock.
            for _ in range(5):
                ticks.append(1)
                await asyncio.sleep(0.05)

        results = await asyncio.gather(*(jobs.sync(calls, 0.6) for _ in range(5)), ticker())
        return results[:5]

    results = asyncio.run(main())
    assert results.count("synced") == 1
    assert results.count(None) == 4
    assert len(calls) == 1
    assert len(ticks) == 5
    assert lock_row(db, "async-sync") is None


# -- management command -------------------------------------------------------------------


@DB
@pytest.mark.slow
@pytest.mark.usefixtures("clean_locks")
def test_decorated_command_started_twice_runs_once(procs, tmp_path, db):
    marker = tmp_path / "marker"
    args = ("slow_job", "--seconds", "3", "--marker", marker)
    children = [procs.django(*args), procs.django(*args)]
    results = [procs.finish(child) for child in children]
    for result in results:
        assert result.returncode == 0, result.stderr
    ran = marker.read_text().splitlines()
    assert len(ran) == 1, ran
    winner_pid = int(ran[0].removeprefix("RAN "))
    by_pid = {child.pid: result for child, result in zip(children, results, strict=True)}
    assert winner_pid in by_pid
    winner = by_pid.pop(winner_pid)
    (loser,) = by_pid.values()
    assert winner.stdout.strip() == "RAN"
    assert winner.stderr == ""
    assert "RAN" not in loser.stdout
    assert len(loser.stderr_lines) == 1, loser.stderr
    host = re.escape(socket.gethostname())
    assert re.match(rf"Skipped .*'slow_job'.*held by {host}:{winner_pid}:", loser.stderr), (
        loser.stderr
    )
    assert lock_row(db, "slow_job") is None


@DB
@pytest.mark.usefixtures("clean_locks")
def test_decorated_command_lock_is_named_after_the_command(tmp_path):
    marker = tmp_path / "marker"
    lease = Lock("slow_job").try_acquire()
    assert lease is not None
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("slow_job", marker=str(marker), stdout=out, stderr=err)
    finally:
        lease.release()
    assert not marker.exists()
    assert out.getvalue() == ""
    assert len(err.getvalue().splitlines()) == 1
    assert lease.holder in err.getvalue()
    call_command("slow_job", marker=str(marker), stdout=out, stderr=err)
    assert marker.read_text() == f"RAN {os.getpid()}\n"


# -- bad decorator arguments --------------------------------------------------------------


def _generator():
    yield 1


async def _async_generator():
    yield 1


def _function():
    return 1


@pytest.mark.parametrize(
    ("make", "fix"),
    [
        pytest.param(
            lambda: singleton_job("a-name", key=lambda: "x"), "pass one", id="name-and-key"
        ),
        pytest.param(
            lambda: singleton_job(key="training:1"), "not callable", id="key-not-callable"
        ),
        pytest.param(
            lambda: singleton_job("t", timeout=5),
            "drop the timeout or pass blocking=True",
            id="timeout-without-blocking",
        ),
        pytest.param(
            lambda: singleton_job("g")(_generator),
            "Wrap a function that consumes it",
            id="generator",
        ),
        pytest.param(
            lambda: singleton_job("g")(_async_generator),
            "Wrap a function that consumes it",
            id="async-generator",
        ),
        pytest.param(
            lambda: singleton_job(_generator),
            "Wrap a function that consumes it",
            id="bare-on-generator",
        ),
        pytest.param(
            lambda: singleton_job("th", heartbeat_interval=30, alert_after=10, stale_after=600),
            "heartbeat_interval < alert_after < stale_after",
            id="thresholds-out-of-order",
        ),
        pytest.param(
            lambda: singleton_job("th", stale_after=-1),
            "greater than zero",
            id="negative-threshold",
        ),
        pytest.param(
            lambda: singleton_job("s", schedule="every night"),
            "five fields",
            id="invalid-cron",
        ),
        pytest.param(
            lambda: singleton_job("s", schedule="61 * * * *"),
            "five fields",
            id="cron-minute-out-of-range",
        ),
        pytest.param(lambda: singleton_job(""), "non-empty", id="empty-name"),
        pytest.param(lambda: singleton_job("b", blocking="yes"), "True or False", id="blocking"),
        pytest.param(lambda: singleton_job("x")(42), "callable", id="not-callable"),
    ],
)
def test_bad_decorator_arguments_fail_at_decoration_time(make, fix):
    with pytest.raises(ValueError, match=re.escape(fix)):
        make()


def test_valid_decorations_do_not_touch_the_database():
    # No django_db mark: any query here would fail the test.
    singleton_job(_function)
    singleton_job("name", blocking=True, timeout=3)(_function)
    singleton_job(key=lambda: "k")(_function)
    singleton_job("slot", schedule="0 3 * * *")(_function)


# -- schedule slots -----------------------------------------------------------------------


@DB
@pytest.mark.slow
@pytest.mark.usefixtures("clean_locks")
def test_schedule_slot_runs_once_per_slot_across_processes(procs, tmp_path, db, caplog):
    caplog.set_level(logging.INFO, logger="django_pglock")
    db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = 'slot-job'")
    minute = wait_for_early_in_minute(db)
    lines = tmp_path / "lines.txt"

    _children, results = call_together(procs, tmp_path, "slot_job", str(lines), 0.5)
    for result in results:
        assert result.returncode == 0, result.stderr
    assert len(lines.read_text().splitlines()) == 1
    assert sorted(json.loads(r.stdout) is None for r in results) == [False, True]

    # The first run has finished and the lock is free ...
    lease = Lock("slot-job").try_acquire()
    assert lease is not None
    lease.release()
    # ... yet a later call in the same slot (here: another process, this one) is skipped.
    assert jobs.slot_job(str(lines)) is None
    assert len(lines.read_text().splitlines()) == 1
    (message,) = skip_messages(caplog)
    assert "schedule slot" in message and "'slot-job'" in message
    claims = list(ScheduleClaim.objects.filter(name="slot-job").values_list("slot", flat=True))
    assert claims == [minute], "the test crossed a minute boundary"
    assert lock_row(db, "slot-job") is None


@DB
@pytest.mark.usefixtures("clean_locks")
@pytest.mark.slow
def test_schedule_slot_claimed_by_the_first_call_skips_the_second(db):
    wait_for_early_in_minute(db, latest=50)
    calls = []

    @singleton_job("slot-once", schedule="* * * * *")
    def once():
        calls.append(1)
        return "ran"

    db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = 'slot-once'")
    assert once() == "ran"
    assert once() is None
    assert calls == [1]


# -- known problems (these tests fail until the library is fixed) -------------------------


@DB
@pytest.mark.usefixtures("clean_locks")
@pytest.mark.slow
def test_cancelled_async_job_leaves_no_lock_behind(pg_url, test_db_name, db):
    """Cancelling a coroutine while its acquire statement is in flight must not leak a lease.

    ``asyncio.wait_for(job(), ...)``, a task group failing, a server shutting down: any
    cancellation can land while ``acquire_async`` awaits the thread that runs the acquire
    statement. Here the statement is held up by a table lock taken in another session, so
    the cancellation lands there every time.
    """
    calls = []
    with open_db(pg_url, test_db_name) as blocker:
        blocker.autocommit = False

        async def main():
            blocker.execute("LOCK TABLE django_pglock_joblock IN ACCESS EXCLUSIVE MODE")
            task = asyncio.create_task(jobs.sync(calls))
            await asyncio.sleep(0.5)  # the acquire statement now waits for the table lock
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            blocker.commit()  # let the statement finish, after its caller has gone

        try:
            asyncio.run(main())
            assert calls == []  # the job body never ran ...
            leaked = wait_until_gone(db, "async-sync", timeout=2.0)
            # ... so nothing may hold its lock: nobody would ever release it, and the
            # heartbeat thread keeps such a row fresh for as long as the process lives.
            assert leaked is None, f"cancelled call left lock 'async-sync' held: {leaked}"
        finally:
            force_release("async-sync")


def wait_until_gone(db, name, timeout):
    deadline = time.monotonic() + timeout
    while (row := lock_row(db, name)) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return row


@pytest.mark.parametrize(
    "decorator",
    [
        'singleton_job("waits", blocking=True, timeout=3)',
        'singleton_job("nightly", schedule="0 3 * * *")',
    ],
)
def test_decorating_at_import_time_does_not_need_settings(procs, decorator):
    """Settings are read lazily (DESIGN.md section 3), so decorating a function must work
    before Django is configured: modules with decorated jobs are imported early."""
    env = {k: v for k, v in procs.env.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "from django_pglock import singleton_job\n"
        f"@{decorator}\n"
        "def job():\n"
        "    return 1\n"
        "print('decorated')\n"
    )
    result = procs.finish(procs.start(sys.executable, "-c", code, env=env))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "decorated\n"
