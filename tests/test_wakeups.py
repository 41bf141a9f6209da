"""Instant handoff (issue 15, item 1): a release wakes the waiters of that name at once.

Real processes, the real server. Every waiter here polls only every 30 s (jittered to
15..30 s), so a grant within a few seconds of a release can only come from the
notification; and a waiting process sends no statement between its polls, which its
session's ``query_start`` (unchanged across the wait) shows from the outside.
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from tests.test_processes import (
    QUIET_ARGS,
    Db,
    acquired_token,
    start_holder,
    wait_for_new_session,
)

pytestmark = pytest.mark.slow

POLL = "30"  # the waiters' poll interval: far longer than any bound below
WOKEN_WITHIN = 5.0  # a notified waiter's grant, after the release, on a busy machine


@pytest.fixture
def db(pg_url, test_db_name, clean_locks):
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield Db(conn)


def unique(label):
    return f"wake-{label}-{uuid.uuid4().hex[:10]}"


def settled_waiter(db, before, idle_for=1.0, timeout=30.0):
    """The backend pid of the new waiter's lock session, once it has been idle for
    ``idle_for`` s (refused, listening, and sleeping until its next poll), and its
    ``query_start`` then."""
    (pid,) = wait_for_new_session(db, before)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = db.conn.execute(
            "SELECT state = 'idle' AND now() - state_change > %s * interval '1 second',"
            " query_start FROM pg_stat_activity WHERE pid = %s",
            [idle_for, pid],
        ).fetchone()
        if row is not None and row[0]:
            return pid, row[1]
        time.sleep(0.05)
    pytest.fail(f"the waiter's session {pid} did not settle within {timeout} s")


def query_start(db, pid):
    row = db.conn.execute("SELECT query_start FROM pg_stat_activity WHERE pid = %s", [pid])
    return row.fetchone()[0]


def test_a_release_wakes_a_waiter_in_another_process_at_once(run_child, db):
    name = unique("release")
    holder, token = start_holder(run_child, name, *QUIET_ARGS)
    before = db.lock_sessions()
    waiter = run_child("wait", "--name", name, "--poll-interval", POLL, "--timeout", "120")
    pid, started = settled_waiter(db, before)

    time.sleep(2.0)  # the window in which a waiting process must send nothing
    assert query_start(db, pid) == started, "the waiter sent a statement between its polls"
    assert waiter.lines.empty(), "the waiter must not get the lock while it is held"

    holder.send("release")
    released_at = time.monotonic()
    holder.expect("RELEASED")
    line = waiter.expect("ACQUIRED", timeout=WOKEN_WITHIN + 25)
    handoff = time.monotonic() - released_at
    print(f"\n[measure] handoff after release, poll interval {POLL} s: {handoff:.3f} s")
    assert handoff < WOKEN_WITHIN, f"the waiter was granted {handoff:.2f} s after the release"
    assert acquired_token(line) > token
    assert db.row(name)["pid"] == waiter.pid
    waiter.send("release")
    waiter.expect("RELEASED")


def test_a_forced_release_wakes_a_waiter_at_once(run_child, db, procs):
    name = unique("forced")
    _holder, token = start_holder(run_child, name, *QUIET_ARGS)
    before = db.lock_sessions()
    waiter = run_child("wait", "--name", name, "--poll-interval", POLL, "--timeout", "120")
    settled_waiter(db, before)

    result = procs.run_django("pglock_release", name, "--token", str(token))
    released_at = time.monotonic()
    assert result.returncode == 0, result.stderr
    line = waiter.expect("ACQUIRED", timeout=WOKEN_WITHIN + 25)
    handoff = time.monotonic() - released_at
    print(f"\n[measure] handoff after pglock_release: {handoff:.3f} s")
    assert handoff < WOKEN_WITHIN, f"the waiter was granted {handoff:.2f} s after the release"
    assert acquired_token(line) > token


ASYNC_WAITER = """
import asyncio, sys, time
import django
django.setup()
from django_pglock import Lock

async def main():
    lock = Lock(sys.argv[1], poll_interval=float(sys.argv[2]))
    ticks = 0

    async def ticker():  # the event loop stays free while the acquire waits
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    async with lock.acquire_async(timeout=120) as lease:
        print("ACQUIRED", lease.token, ticks, flush=True)
    task.cancel()

asyncio.run(main())
"""


def test_a_release_wakes_an_async_waiter_at_once(run_child, db, procs):
    name = unique("async")
    holder, token = start_holder(run_child, name, *QUIET_ARGS)
    before = db.lock_sessions()
    waiter = procs.python(ASYNC_WAITER, name, POLL)
    settled_waiter(db, before)

    holder.send("release")
    released_at = time.monotonic()
    holder.expect("RELEASED")
    line = waiter.expect("ACQUIRED", timeout=WOKEN_WITHIN + 25)
    handoff = time.monotonic() - released_at
    print(f"\n[measure] async handoff after release: {handoff:.3f} s")
    assert handoff < WOKEN_WITHIN, f"the waiter was granted {handoff:.2f} s after the release"
    _, granted, ticks = line.split()
    assert int(granted) > token
    assert int(ticks) > 50, "the event loop was blocked while the acquire waited"
    assert waiter.finish() == 0, waiter.stderr_text


def test_waiters_of_another_name_are_not_woken(run_child, db):
    """A release wakes the waiters of that name only: a waiter of another name is not
    even retried (its session stays idle)."""
    name, other = unique("one"), unique("other")
    holder, _ = start_holder(run_child, name, *QUIET_ARGS)
    other_holder, _ = start_holder(run_child, other, *QUIET_ARGS)
    before = db.lock_sessions()
    waiter = run_child("wait", "--name", other, "--poll-interval", POLL, "--timeout", "120")
    pid, started = settled_waiter(db, before)

    holder.send("release")
    holder.expect("RELEASED")
    time.sleep(1.0)  # a woken waiter would have retried by now
    assert query_start(db, pid) == started, "a release of another name woke the waiter"
    assert waiter.lines.empty()

    other_holder.send("release")  # its own name's release does wake it
    other_holder.expect("RELEASED")
    waiter.expect("ACQUIRED", timeout=WOKEN_WITHIN + 25)


def test_a_release_of_a_semaphore_slot_wakes_the_semaphores_waiters(run_child, db):
    """A slot above the first has a row name of its own; its release wakes the waiters
    of the semaphore's name, not of that row name."""
    name = unique("slots")
    first, _ = start_holder(run_child, name, "--limit", "2", *QUIET_ARGS)
    second, token = start_holder(run_child, name, "--limit", "2", *QUIET_ARGS)
    assert db.row(f"{name}\x1f2")["token"] == token, "the second holder holds slot 2"
    before = db.lock_sessions()
    waiter = run_child(
        "wait", "--name", name, "--limit", "2", "--poll-interval", POLL, "--timeout", "120"
    )
    settled_waiter(db, before)

    second.send("release")
    released_at = time.monotonic()
    second.expect("RELEASED")
    line = waiter.expect("ACQUIRED", timeout=WOKEN_WITHIN + 25)
    handoff = time.monotonic() - released_at
    print(f"\n[measure] handoff after a slot's release: {handoff:.3f} s")
    assert handoff < WOKEN_WITHIN, f"the waiter was granted {handoff:.2f} s after the release"
    assert db.row(f"{name}\x1f2")["pid"] == waiter.pid, f"the waiter took slot 2: {line!r}"
    assert first.lines.empty()
