"""Multi-process tests: real worker processes, real signals, the real PostgreSQL server.

Every test here starts `python -m tests.worker` processes (see its docstring for the line
protocol) and judges the outcome from the lock table itself, read on a separate autocommit
connection, so that what is asserted is what other processes would see. Nothing is mocked.

Time limits are chosen so that a correct library passes with a wide margin and a wrong one
(waiting for a threshold it should not wait for, or not waiting for one it must) fails.
Measured takeover and detection times are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from itertools import pairwise

import psycopg
import pytest
from django.contrib.auth.models import Group
from django.db import connection, transaction

from django_pglock import Lock
from django_pglock.operations import lock_status
from tests.faultkit import wait_until
from tests.procs import go_together

LOCK_TABLE = "django_pglock_joblock"
ROW_COLUMNS = (
    "name, token, holder, host, pid, backend_pid, acquired_at, last_heartbeat,"
    " heartbeat_interval, alert_after, stale_after, advisory"
)

# Thresholds small enough to watch a holder go alert and stale within a test.
SMALL = {"heartbeat_interval": 0.2, "alert_after": 0.6, "stale_after": 2.5}
SMALL_ARGS = ("--heartbeat-interval", "0.2", "--alert-after", "0.6", "--stale-after", "2.5")
# A new holder that must not heartbeat during the test, so its row stays byte-for-byte equal.
QUIET_ARGS = ("--heartbeat-interval", "30", "--alert-after", "60", "--stale-after", "600")


def unique_name(label):
    return f"proc-{label}-{uuid.uuid4().hex[:10]}"


@dataclass
class Db:
    """An autocommit connection to the test database, outside any Django transaction."""

    conn: psycopg.Connection

    def row(self, name):
        cur = self.conn.execute(
            f"SELECT {ROW_COLUMNS} FROM {LOCK_TABLE} WHERE name = %s",
            [name],
        )
        found = cur.fetchone()
        if found is None:
            return None
        return dict(zip([c.name for c in cur.description], found, strict=True))

    def heartbeat_age(self, name):
        """Seconds since the row's last heartbeat, by the database clock (None: no row)."""
        found = self.conn.execute(
            f"SELECT extract(epoch FROM now() - last_heartbeat)::float8"
            f" FROM {LOCK_TABLE} WHERE name = %s",
            [name],
        ).fetchone()
        return None if found is None else found[0]

    def db_state(self, name):
        """``ok`` / ``alert`` / ``stale`` of the row, by the database clock and its thresholds."""
        found = self.conn.execute(
            f"SELECT CASE WHEN now() - last_heartbeat > stale_after * interval '1 second'"
            f" THEN 'stale' WHEN now() - last_heartbeat > alert_after * interval '1 second'"
            f" THEN 'alert' ELSE 'ok' END FROM {LOCK_TABLE} WHERE name = %s",
            [name],
        ).fetchone()
        return None if found is None else found[0]

    def seconds_between(self, later, earlier):
        """``later - earlier`` in seconds, computed by the server (both are its timestamps)."""
        return self.conn.execute(
            "SELECT extract(epoch FROM %s::timestamptz - %s::timestamptz)::float8",
            [later, earlier],
        ).fetchone()[0]

    def lock_sessions(self):
        """Backend pids of the live lock connections (application_name 'django_pglock')."""
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE application_name = 'django_pglock' AND datname = current_database()"
        ).fetchall()
        return {pid for (pid,) in rows}

    def advisory_locks_of(self, backend_pid):
        return self.conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s",
            [backend_pid],
        ).fetchone()[0]


@pytest.fixture
def db(pg_url, test_db_name, clean_locks):
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield Db(conn)


def acquired_token(line):
    """The token of an ``ACQUIRED <token> [...]`` line."""
    words = line.split()
    assert words[0] == "ACQUIRED", line
    return int(words[1])


def start_holder(run_child, name, *options):
    """A `hold` worker that has acquired ``name``; returns (worker, token)."""
    holder = run_child("hold", "--name", name, *options)
    token = acquired_token(holder.expect("ACQUIRED"))
    return holder, token


def wait_for_new_session(db, before, timeout=15.0):
    """Block until a lock connection not in ``before`` shows up: a worker's first attempt."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = db.lock_sessions() - before
        if new:
            return new
        time.sleep(0.02)
    pytest.fail(f"no new lock connection appeared within {timeout}s")


def attempt_in_child(run_child, name, *options):
    """One non-blocking attempt from a fresh process: the ``try`` worker's answer line."""
    child = run_child("try", "--name", name, *options)
    line = child.read_line()
    assert child.finish() == 0, child.stderr_text
    return line


# -- 1. exclusion and immediate hand-over ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("advisory", ["on", "off"])
def test_second_process_is_refused_then_acquires_at_once_after_release(run_child, db, advisory):
    name = unique_name(f"handover-{advisory}")
    holder, token = start_holder(run_child, name, "--advisory", advisory)

    assert attempt_in_child(run_child, name, "--advisory", advisory) == "REFUSED"
    assert db.row(name)["token"] == token, "a refused attempt must not change the row"

    before = db.lock_sessions()
    waiter = run_child("wait", "--name", name, "--advisory", advisory, "--poll-interval", "0.2")
    wait_for_new_session(db, before)  # the waiter is polling now
    time.sleep(0.3)  # ... and has been refused at least once more
    assert waiter.lines.empty(), "the waiter must not get the lock while it is held"

    holder.send("release")
    released_at = time.monotonic()
    holder.expect("RELEASED")
    line = waiter.expect("ACQUIRED", timeout=5)
    handover = time.monotonic() - released_at
    print(f"\n[measure] hand-over after release (advisory {advisory}): {handover:.3f}s")
    assert handover < 1.0, (
        f"the waiter took {handover:.3f}s to acquire after release; a released lock must be "
        "free at once (poll_interval 0.2, stale_after 600)"
    )
    new_token = acquired_token(line)
    assert new_token > token
    assert db.row(name)["token"] == new_token
    assert db.row(name)["pid"] == waiter.pid

    waiter.send("release")
    waiter.expect("RELEASED")
    assert db.row(name) is None, "a clean release deletes the row"
    assert holder.finish() == 0
    assert waiter.finish() == 0


# -- 2. not inside the caller's transaction ----------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_lock_taken_inside_atomic_is_visible_at_once_and_survives_rollback(run_child, db):
    name = unique_name("atomic")
    group_name = unique_name("group")
    lease = None
    try:
        with transaction.atomic():
            assert connection.in_atomic_block
            Group.objects.create(name=group_name)  # proves the rollback below really happens
            lease = Lock(name).try_acquire()
            assert lease is not None
            # Another session sees the row while this transaction is still open...
            row = db.row(name)
            assert row is not None and row["token"] == lease.token
            assert row["pid"] == os.getpid()
            # ... and another process is refused while the atomic block is still open.
            assert attempt_in_child(run_child, name) == "REFUSED"
            assert connection.in_atomic_block
            raise Boom
    except Boom:
        pass
    assert lease is not None
    assert not Group.objects.filter(name=group_name).exists(), "the caller's work rolled back"

    row = db.row(name)
    assert row is not None, "the lock row must survive the caller's rollback"
    assert row["token"] == lease.token
    assert not lease.lost
    lease.check()  # still ours in the database
    assert attempt_in_child(run_child, name) == "REFUSED"

    lease.release()
    assert db.row(name) is None
    line = attempt_in_child(run_child, name)
    assert line.startswith("ACQUIRED")
    assert acquired_token(line) > lease.token


# -- 3. crash-fast: SIGKILL of the holder ------------------------------------------------


@pytest.mark.slow
def test_sigkill_of_holder_lets_a_waiter_take_over_within_poll_interval(run_child, db):
    name = unique_name("sigkill")
    poll = 0.2
    holder, token = start_holder(run_child, name, "--advisory", "on")  # stale_after: 600 s
    row = db.row(name)
    assert row["advisory"] is True and row["stale_after"] == 600.0
    assert db.advisory_locks_of(row["backend_pid"]) == 1

    before = db.lock_sessions()
    waiter = run_child("wait", "--name", name, "--advisory", "on", "--poll-interval", poll)
    wait_for_new_session(db, before)
    time.sleep(0.3)
    assert waiter.lines.empty(), "the waiter must not get the lock while the holder lives"

    holder.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    line = waiter.expect("ACQUIRED", timeout=10)
    takeover = time.monotonic() - killed_at
    print(f"\n[measure] takeover after SIGKILL (poll_interval {poll}): {takeover:.3f}s")
    assert takeover < poll + 1.0, (
        f"takeover after SIGKILL took {takeover:.3f}s; the limit is poll_interval + 1.0 = "
        f"{poll + 1.0:.1f}s (stale_after is 600 s, so only the advisory path can explain it)"
    )
    assert holder.wait(5) == -signal.SIGKILL
    new_token = acquired_token(line)
    assert new_token > token, f"tokens must strictly increase: {new_token} after {token}"
    new_row = db.row(name)
    assert new_row["token"] == new_token
    assert new_row["pid"] == waiter.pid
    waiter.send("release")
    waiter.expect("RELEASED")


def test_holder_granted_while_its_key_was_busy_takes_the_key_and_stays_crash_fast(run_child, db):
    """Two contenders racing for a free name: the one whose insert wins may not be the one
    whose statement took the advisory key first. The winner must take the key as soon as
    the other lets go of it, so that its crash still frees the name at once."""
    from django_pglock.sql import advisory_key

    name = unique_name("busy-key")
    key = advisory_key(name)
    db.conn.execute("SELECT pg_advisory_lock(%s)", [key])  # the racing contender's hold
    try:
        holder, token = start_holder(run_child, name, "--advisory", "on")
        row = db.row(name)
        assert row["advisory"] is False, "granted without the key: the row must not claim it"
        time.sleep(0.3)
        assert db.row(name)["advisory"] is False, "the key is still held by someone else"
    finally:
        db.conn.execute("SELECT pg_advisory_unlock(%s)", [key])
    adopted = wait_until(
        lambda: db.row(name)["advisory"] and db.advisory_locks_of(row["backend_pid"]) == 1,
        timeout=3.0,
    )
    assert adopted, "the holder never took its advisory key once it was free"
    assert db.row(name)["token"] == token

    poll = 0.2
    before = db.lock_sessions()
    waiter = run_child("wait", "--name", name, "--advisory", "on", "--poll-interval", poll)
    wait_for_new_session(db, before)
    holder.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    line = waiter.expect("ACQUIRED", timeout=10)
    takeover = time.monotonic() - killed_at
    print(f"\n[measure] takeover after SIGKILL of a holder that took its key late: {takeover:.3f}s")
    assert takeover < poll + 1.0, f"takeover took {takeover:.3f}s (stale_after is 600 s)"
    assert acquired_token(line) > token
    waiter.send("release")
    waiter.expect("RELEASED")


@pytest.mark.slow
def test_sigkill_of_a_table_only_holder_does_not_free_the_lock_before_stale(run_child, db):
    """Without the advisory path only staleness frees the lock: a dead holder still holds."""
    name = unique_name("sigkill-table")
    holder, token = start_holder(run_child, name, "--advisory", "off")
    assert db.row(name)["advisory"] is False
    holder.signal(signal.SIGKILL)
    assert holder.wait(5) == -signal.SIGKILL
    time.sleep(0.3)  # the server has ended the dead holder's session by now
    assert attempt_in_child(run_child, name) == "REFUSED"
    assert db.row(name)["token"] == token


# -- 4. a hung holder (SIGSTOP): alert, stale, reclaim, loud loss, fencing ---------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("advisory", ["off", "on"])
def test_stopped_holder_goes_alert_then_stale_and_never_touches_its_successor(
    run_child, db, advisory
):
    name = unique_name(f"sigstop-{advisory}")
    holder, token = start_holder(run_child, name, "--advisory", advisory, *SMALL_ARGS)
    time.sleep(0.5)  # a few heartbeats go through
    assert db.db_state(name) == "ok"
    old_backend = db.row(name)["backend_pid"]
    if advisory == "on":
        assert db.row(name)["advisory"] is True
        assert db.advisory_locks_of(old_backend) == 1

    holder.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    # A contender that keeps trying (poll 0.1) from the moment the holder hangs: it must not
    # get in before stale_after by the database clock, whatever its own thresholds are.
    waiter = run_child("wait", "--name", name, "--poll-interval", "0.1", *QUIET_ARGS)

    # Alert: past alert_after by the database clock, and reported so by lock_status().
    time.sleep(max(0.0, stopped_at + 0.9 - time.monotonic()))
    assert db.row(name)["token"] == token, "the hung holder was reclaimed before stale_after"
    assert waiter.lines.empty(), "the contender got in before stale_after"
    assert db.db_state(name) == "alert", f"heartbeat age {db.heartbeat_age(name)}"
    last_heartbeat = db.row(name)["last_heartbeat"]  # frozen: the holder is stopped
    statuses = {s.name: s for s in lock_status()}
    assert statuses[name].state == "alert"
    assert statuses[name].token == token
    assert SMALL["alert_after"] < statuses[name].heartbeat_age < SMALL["stale_after"]

    # Refused before stale_after, from this process too (with default thresholds of its own).
    assert Lock(name, advisory=advisory == "on").try_acquire() is None
    age = db.heartbeat_age(name)
    assert age < SMALL["stale_after"], f"the refused attempt came too late to count ({age}s)"
    assert db.row(name)["token"] == token

    # Stale: the waiter takes over, but not a moment before stale_after by the DB clock.
    line = waiter.expect("ACQUIRED", timeout=SMALL["stale_after"] + 5)
    takeover = time.monotonic() - stopped_at
    new_token = acquired_token(line)
    assert new_token > token
    new_row = db.row(name)
    assert new_row["token"] == new_token and new_row["pid"] == waiter.pid
    silent = db.seconds_between(new_row["acquired_at"], last_heartbeat)
    print(
        f"\n[measure] SIGSTOP (advisory {advisory}): reclaimed {takeover:.3f}s after the stop,"
        f" {silent:.3f}s after the holder's last heartbeat (stale_after {SMALL['stale_after']})"
    )
    assert silent >= SMALL["stale_after"], (
        f"a hung holder was reclaimed {silent:.3f}s after its last heartbeat, before "
        f"stale_after={SMALL['stale_after']}"
    )

    # The old holder resumes: it learns at once that it lost, and never touches the new row.
    holder.signal(signal.SIGCONT)
    resumed_at = time.monotonic()
    holder.expect("LOST_DETECTED", timeout=5)
    detection = time.monotonic() - resumed_at
    print(f"[measure] SIGSTOP (advisory {advisory}): LOST_DETECTED {detection:.3f}s after SIGCONT")
    assert detection < 1.0, f"the resumed holder took {detection:.3f}s to notice its loss"
    time.sleep(0.5)  # several of its heartbeat intervals: nothing may reach the new row
    # (The new holder may meanwhile take the advisory key the old one held, see below.)
    assert dict(db.row(name), advisory=None) == dict(new_row, advisory=None)
    holder.send("check")
    assert holder.read_line() == "LOST LockNotHeld"
    if advisory == "on":
        # "... and it releases its advisory lock when it learns it lost" (DESIGN.md §2).
        released = wait_until(lambda: db.advisory_locks_of(old_backend) == 0, timeout=1.0)
        assert released, (
            "the resumed holder learned it lost the lock but its session still holds the "
            "advisory key"
        )
        # The successor was granted while the hung holder's session still held the key:
        # it takes the key once it is free, so a crash of its own frees the name at once.
        adopted = wait_until(
            lambda: db.row(name)["advisory"] and db.advisory_locks_of(new_row["backend_pid"]),
            timeout=3.0,
        )
        assert adopted, "the new holder never took the advisory key the old one gave back"
        new_row = dict(new_row, advisory=True)
    holder.send("exit")
    assert holder.read_line() == "EXIT_RAISED LockNotHeld"
    assert holder.finish() == 0
    assert db.row(name) == new_row, "the stale holder's exit must not touch its successor's row"

    waiter.send("release")
    waiter.expect("RELEASED")
    assert db.row(name) is None


# -- 5. the holder's session is terminated by the server ---------------------------------


def _terminate_holder_session(db, name):
    backend_pid = db.row(name)["backend_pid"]
    found = db.conn.execute(
        "SELECT application_name FROM pg_stat_activity WHERE pid = %s", [backend_pid]
    ).fetchone()
    assert found == ("django_pglock",), f"row's backend_pid {backend_pid} is not a lock session"
    assert db.conn.execute("SELECT pg_terminate_backend(%s)", [backend_pid]).fetchone()[0]
    return backend_pid


@pytest.mark.slow
def test_terminated_session_is_detected_fast_and_the_lock_is_free_at_once(run_child, db):
    name = unique_name("terminate")
    holder, token = start_holder(run_child, name, "--advisory", "on")  # stale_after: 600 s
    _terminate_holder_session(db, name)
    terminated_at = time.monotonic()
    holder.expect("LOST_DETECTED", timeout=10)
    detection = time.monotonic() - terminated_at
    print(f"\n[measure] LOST_DETECTED after pg_terminate_backend: {detection:.3f}s")
    assert detection < 3.0, f"the holder noticed its session had ended after {detection:.3f}s"

    successor, new_token = start_holder(run_child, name, *QUIET_ARGS)
    assert new_token > token
    new_row = db.row(name)
    assert new_row["pid"] == successor.pid

    holder.send("exit")
    assert holder.read_line() == "EXIT_RAISED LockNotHeld"
    assert holder.finish() == 0
    assert db.row(name) == new_row, "the old holder's exit must not touch its successor's row"
    successor.send("exit")
    assert successor.read_line() == "EXITED"
    assert db.row(name) is None


@pytest.mark.slow
def test_terminated_session_of_a_table_only_holder_keeps_the_lease(run_child, db):
    """Table path: the row, not the session, is the truth; the holder reconnects and holds."""
    name = unique_name("terminate-table")
    holder, token = start_holder(run_child, name, "--advisory", "off", *SMALL_ARGS)
    assert db.row(name)["advisory"] is False
    old_backend = _terminate_holder_session(db, name)
    # Several heartbeat intervals: the holder reconnects and keeps heartbeating.
    time.sleep(1.0)
    assert holder.lines.empty(), "a table-only lease does not depend on its session"
    assert db.db_state(name) == "ok", "heartbeats must go on over a new session"
    assert old_backend not in db.lock_sessions()
    assert attempt_in_child(run_child, name) == "REFUSED"
    assert db.row(name)["token"] == token
    holder.send("check")
    assert holder.read_line() == "OK"
    holder.send("exit")
    assert holder.read_line() == "EXITED"
    assert db.row(name) is None


# -- 6. a forked child inherits no lease -------------------------------------------------


@pytest.mark.slow
def test_forked_child_inherits_no_lease_and_leaves_the_parents_row_alone(run_child, db):
    name = unique_name("fork")
    holder, token = start_holder(run_child, name, "--advisory", "on")
    before = db.row(name)

    holder.send("fork")
    line = holder.expect("FORKED")
    report = dict(word.split("=", 1) for word in line.split()[1:])
    assert report == {
        "lost": "True",
        "check": "LockNotHeld",
        "release": "ok",
        "try": "REFUSED",
        "status": "0",
    }, line

    holder.send("check")
    assert holder.read_line() == "OK", "the parent still holds after its child exited"
    holder.send("lost?")
    assert holder.read_line() == "LOST False"
    after = db.row(name)
    fixed = ("token", "holder", "host", "pid", "backend_pid", "acquired_at", "advisory")
    assert {k: after[k] for k in fixed} == {k: before[k] for k in fixed}
    assert after["token"] == token
    assert db.advisory_locks_of(after["backend_pid"]) == 1
    assert attempt_in_child(run_child, name) == "REFUSED"

    holder.send("exit")
    assert holder.read_line() == "EXITED"
    assert db.row(name) is None


# -- 7. contention: never two holders, nobody starves ------------------------------------


@pytest.mark.slow
def test_contending_processes_never_overlap_and_all_get_the_lock(run_child, db, tmp_path):
    name = unique_name("contend")
    log = tmp_path / "contend.log"
    options = ("--seconds", "6", "--log", log, "--poll-interval", "0.05", "--hold-for", "0.005")
    workers = [run_child("contend", "--name", name, *options, "--pause", "0.01") for _ in range(4)]
    go_together(workers)
    grants = {}
    for worker in workers:
        grants[worker.pid] = int(worker.expect("CONTENDED", timeout=20).split()[1])
        assert worker.finish() == 0, worker.stderr_text

    lines = [line.split() for line in log.read_text().splitlines()]
    events = [words for words in lines if words[0] != "LOST"]
    assert events, "nobody ever got the lock"
    intervals = []
    for i in range(0, len(events), 2):
        enter, leave = events[i], events[i + 1] if i + 1 < len(events) else None
        # With one holder at a time the log alternates ENTER/EXIT of the same grant;
        # two holders at once would interleave their lines.
        assert enter[0] == "ENTER" and leave is not None and leave[0] == "EXIT", (
            f"two holders at once near line {i + 1}: {enter} then {leave}"
        )
        assert enter[1] == leave[1] and enter[3] == leave[3], (enter, leave)
        intervals.append((int(enter[1]), float(enter[2]), float(leave[2]), int(enter[3])))
    for (pid_a, _, end_a, token_a), (pid_b, start_b, _, token_b) in pairwise(intervals):
        assert start_b >= end_a, f"{pid_b} entered at {start_b} before {pid_a} left at {end_a}"
        assert token_b > token_a, f"tokens must strictly increase: {token_b} after {token_a}"

    counts = {pid: 0 for pid in grants}
    for pid, *_ in intervals:
        counts[pid] += 1
    print(f"\n[measure] contention: {len(intervals)} grants in 6 s, per process {counts}")
    assert counts == grants, "every grant a worker counted is in the log, and only those"
    lost = [words for words in lines if words[0] == "LOST"]
    assert not lost, f"leases lost while held under plain contention: {lost[:5]}"
    assert all(n >= 1 for n in counts.values()), f"a process starved: {counts}"
    assert db.row(name) is None
