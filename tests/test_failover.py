"""Failover: the primary crashes (``pg_ctl stop -m immediate``) and its streaming standby is
promoted, with every client on a multi-host DSN (``target_session_attrs=read-write``).

Each test starts its own pair of PostgreSQL 15 servers (tests/standby.py) and real lock
clients (``python -m tests.failover_worker``, ``python -m tests.chaos_worker``), and
judges the outcome from outside the library: the clients append ``ENTER`` / ``EXIT`` /
``LOST`` lines with their own clocks and tokens to one ``O_APPEND`` log, and the test
asserts that no two grants of one name overlap, that tokens strictly increase, and that
no token granted after the failover is at or below one granted before it. The old
primary is never started again (it is fenced, as it must be). Waits are for events (a
line, a row, a server leaving recovery), never fixed sleeps. Measured failover times are
printed as ``[measure]`` lines (``pytest -s``).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from django_pglock import protocol
from tests import faultkit
from tests.faultkit import (  # noqa: F401  (fixtures "log", "procs")
    assert_exclusive,
    grants,
    log_fixture,
    measure,
    procs_fixture,
    read_log,
    worker_env,
)
from tests.procs import go_together
from tests.standby import ReplicatedPair

pytestmark = pytest.mark.slow

# Small thresholds, so that a loss or a reclaim would happen within a test.
HB, ALERT, STALE = 0.5, 1.5, 5.0
SMALL = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", STALE)
# A table-path holder rides through only if the new primary takes its heartbeat before
# the holder's own deadline (stale_after minus the margin): ample for a busy machine.
RIDE_STALE = 30.0
RIDE = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", RIDE_STALE)
# Generous bounds for events on a loaded machine (the measured figures are far below).
EVENT = 30.0
# How late a lock call may return after its statement deadline, on a busy machine.
DEADLINE_SLACK = 10.0


def unique(label):
    return f"failover-{label}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pairs():
    """Make a ReplicatedPair (``pairs(sync=...)``); every one is stopped at teardown."""
    made = []

    def make(**kwargs):
        pair = ReplicatedPair(**kwargs)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def client(procs, env, command, name, log, *args):
    """Start ``python -m tests.failover_worker <command>`` on ``name``."""
    argv = [sys.executable, "-m", "tests.failover_worker", command, "--name", name]
    return procs.start(*argv, "--log", log, *args, env=env, stdin=True)


def words(line):
    return line.split()


def entered(log, *, after=None, before=None):
    """The ENTER events of the log, by wall time."""
    return [
        e
        for e in read_log(log)
        if e.kind == "ENTER"
        and (after is None or e.wall >= after)
        and (before is None or e.wall < before)
    ]


def row(node, name):
    """(token, holder) of ``name``'s row on ``node``, or None."""
    found = node.query("SELECT token, holder FROM django_pglock_joblock WHERE name = %s", [name])
    return found[0] if found else None


def assert_tokens_above(log, crashed):
    """Every token granted after the crash is above every token granted before it."""
    before = [e.token for e in entered(log, before=crashed)]
    after = [e.token for e in entered(log, after=crashed)]
    assert before and after, (before, after)
    assert min(after) > max(before), (
        f"a token granted after the failover ({min(after)}) is not above one granted "
        f"before it ({max(before)})"
    )


def finish(proc):
    """Close stdin, wait for the end; the child must exit 0."""
    result = proc.result()
    assert result.returncode == 0, (
        f"{proc} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    )
    return result


# -- 1. an advisory holder and a blocking waiter ---------------------------------------


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_advisory_holder_and_blocking_waiter_across_a_failover(pairs, procs, log, mode):
    """The holder learns of its loss when its session ends; the waiter's one blocking
    ``acquire()`` rides through the failover (the old primary gone, the standby read-only
    until promoted) and is granted on the new primary, with a token above every token
    granted before; nobody overlaps."""
    pair = pairs(sync=mode == "sync")
    env = worker_env(pair.dsn())
    name = unique(f"wait-{mode}")
    # Some grants before the holder's, so that "every token before" is more than one.
    tries = client(procs, env, "try", name, log, *SMALL)
    tries.expect("READY", 60)
    for _ in range(3):
        tries.send("go")
        assert words(tries.expect("TRIED", EVENT))[1] == "ACQUIRED"
    finish(tries)
    holder = client(procs, env, "hold", name, log, *SMALL)
    held = int(words(holder.expect("GRANTED", 60))[1])
    holder.expect("READY")
    waiter = client(procs, env, "wait", name, log, *SMALL, "--poll-interval", 0.1)
    waiter.expect("READY", 60)
    waiter.expect("CONTENDED", EVENT)
    if mode == "async":
        pair.wait_replayed()  # lag would be another test: tokens then may repeat

    crashed, promoted = pair.fail_over()

    lost = words(holder.expect("LOST_DETECTED", EVENT))
    assert int(lost[1]) == held
    measure(
        f"failover ({mode}): advisory holder learned of its loss after", float(lost[2]) - crashed
    )
    line = waiter.expect("GRANTED", 2 * EVENT, skip=("CONTENDED",))
    _, token, at, _ = words(line)
    token, at = int(token), float(at)
    measure(f"failover ({mode}): blocking waiter granted after the crash", at - crashed)
    measure(f"failover ({mode}): blocking waiter granted after the promotion", at - promoted)
    measure(f"failover ({mode}): promotion seen after the crash", promoted - crashed)
    assert token > held
    assert row(pair.standby, name)[0] == token, "the grant is not on the new primary"
    waiter.send("release")
    waiter.expect("RELEASED", EVENT)
    finish(waiter)
    holder.send("release")  # already lost: releasing it must not touch the new grant
    holder.expect("RELEASED_ALL", EVENT)
    finish(holder)

    all_grants = grants(read_log(log))
    assert [g.token for g in all_grants if g.lost] == [held]
    assert_exclusive(all_grants)
    assert_tokens_above(log, crashed)
    assert row(pair.standby, name) is None, "a release on the new primary did not stick"


# -- 2. a table-path holder rides through ---------------------------------------------


def test_table_path_holder_rides_through_a_failover(pairs, procs, log):
    """Without the advisory path the row is the truth: the holder reconnects to the new
    primary before its own deadline, keeps its lease and its row, and a contender that
    retried all along is granted only after the holder releases."""
    pair = pairs(sync=False)
    env = worker_env(pair.dsn())
    name = unique("ride")
    holder = client(procs, env, "hold", name, log, *RIDE, "--advisory", "off")
    held = int(words(holder.expect("GRANTED", 60))[1])
    holder.expect("READY")
    contender = procs.worker(
        env,
        *("job", "--name", name, "--log", log, *RIDE, "--advisory", "off"),
        *("--poll-interval", 0.1, "--hold-for", 0.01, "--once"),
    )
    contender.ready()
    pair.wait_replayed()
    (before,) = pair.primary.query(
        "SELECT last_heartbeat FROM django_pglock_joblock WHERE name = %s", [name]
    )[0]

    crashed, promoted = pair.fail_over()

    def beat_on_new_primary():
        found = pair.standby.query(
            "SELECT token FROM django_pglock_joblock WHERE name = %s AND last_heartbeat > %s",
            [name, before],
        )
        return found and found[0][0] == held

    assert faultkit.wait_until(beat_on_new_primary, EVENT), (
        "the holder's heartbeats never reached the new primary"
    )
    landed = time.time()
    label = "failover (async): table-path holder's first heartbeat on the new primary after the"
    measure(f"{label} crash", landed - crashed)
    measure(f"{label} promotion", landed - promoted)
    holder.send("check")
    assert holder.expect("OK", EVENT, skip=("LOST_DETECTED",)) == f"OK {held}"
    assert not [line for line in holder.seen if line.startswith("LOST")], holder.seen
    assert row(pair.standby, name)[0] == held
    assert not entered(log, after=crashed), "the contender got in while the holder held"

    holder.send("release")
    assert holder.expect("RELEASED", EVENT).split()[1] == str(held)
    taken = int(contender.expect("GRANTED", EVENT, skip=("FAIL", "LEFT")).split()[1])
    assert taken > held
    contender.send("stop")
    finish(contender)
    finish(holder)
    all_grants = grants(read_log(log))
    assert not [g for g in all_grants if g.lost]
    assert_exclusive(all_grants)
    assert [g.token for g in all_grants] == [held, taken]


# -- 3. a release just before the crash ------------------------------------------------


def test_a_release_just_before_the_crash_does_not_come_back(pairs, procs, log):
    """Under synchronous replication a ``release()`` that returned is on the standby: the
    names are free on the new primary, at once (on the table path a row that came back
    would block its name until stale_after)."""
    pair = pairs(sync=True)
    env = worker_env(pair.dsn())
    name = unique("release")
    count = 6
    stale = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", 600)
    holder = client(procs, env, "hold", name, log, *stale, "--advisory", "off", "--count", count)
    holder.expect("READY", 60, skip=("GRANTED",))
    tokens = {e.name: e.token for e in entered(log)}
    assert len(tokens) == count

    holder.send("release")
    released = []
    for _ in range(count):
        line = words(holder.expect("RELEASED", EVENT))
        assert line[0] == "RELEASED", f"a release failed before the crash: {line}"
        released.append(float(line[2]))
    crashed = pair.crash_primary()
    promoted = pair.promote()
    holder.expect("RELEASED_ALL", EVENT)
    gaps = [crashed - at for at in released]
    measure("sync: the last release returned before the crash by", 1000 * min(gaps), "ms")
    measure("sync: the first release returned before the crash by", 1000 * max(gaps), "ms")

    back = pair.standby.query(
        "SELECT name, token FROM django_pglock_joblock WHERE name LIKE %s", [f"{name}-%"]
    )
    assert not back, f"released locks came back on the new primary: {back}"
    again = client(procs, env, "hold", name, log, *stale, "--advisory", "off", "--count", count)
    again.expect("READY", EVENT, skip=("GRANTED",))  # every name granted at the first attempt
    new = {e.name: e.token for e in entered(log, after=promoted)}
    assert sorted(new) == sorted(tokens)
    assert min(new.values()) > max(tokens.values())
    again.send("release")
    again.expect("RELEASED_ALL", EVENT, skip=("RELEASED",))
    finish(again)
    finish(holder)


# -- 4. a promoted standby that inherited synchronous_standby_names --------------------


def test_an_inherited_synchronous_standby_names_does_not_hang_a_lock_call(pairs, procs, log):
    """The promoted standby kept ``synchronous_standby_names = '*'`` and has no standby of
    its own: every commit waits for ever, and ``statement_timeout`` does not cover that
    wait. A lock call still ends within its statement deadline, with a ``LockError``;
    once the setting is fixed the name is free again (a grant that committed locally
    while nobody waited for it is not left blocking it)."""
    pair = pairs(sync=True, inherit_sync=True)
    env = worker_env(pair.dsn())
    name = unique("syncwait")
    pair.fail_over()
    tries = client(procs, env, "try", name, log, *SMALL, "--advisory", "off")
    tries.expect("READY", 60)
    bound = protocol.STATEMENT_DEADLINE
    asked = time.monotonic()
    tries.send("go")
    outcome = words(tries.expect("TRIED", bound + DEADLINE_SLACK))
    returned = time.monotonic() - asked
    measure("inherited synchronous_standby_names: a try_acquire returned after", returned)
    assert outcome[1] == "LockError", (
        f"a grant the new primary could not confirm was handed out, or the call failed "
        f"otherwise: {outcome}; stderr:\n{tries.stderr_text[-2000:]}"
    )
    assert float(outcome[3]) <= bound + DEADLINE_SLACK

    # The operator fixes the setting; the name must not stay blocked by what the hung
    # statement committed locally.
    pair.standby.query("ALTER SYSTEM SET synchronous_standby_names = ''")
    pair.standby.query("SELECT pg_reload_conf()")
    fixed = time.monotonic()

    def acquired():
        tries.send("go")
        return words(tries.expect("TRIED", bound + DEADLINE_SLACK))[1] == "ACQUIRED"

    assert faultkit.wait_until(acquired, STALE, interval=0.1), (
        f"the name stayed blocked after the setting was fixed: {tries.seen[-5:]}; rows: "
        f"{pair.standby.query('SELECT name, token, holder FROM django_pglock_joblock')}"
    )
    measure("inherited synchronous_standby_names: granted after the fix", time.monotonic() - fixed)
    finish(tries)


# -- 5. a burst of grants across the failover ------------------------------------------


def burst(procs, env, name, log, names):
    """Three processes taking turns on ``names`` names as fast as they can."""
    args = ["job", "--name", name, "--names", names, "--log", log, *SMALL, "--wait-go"]
    args += ["--poll-interval", 0.05, "--hold-for", 0.005, "--pause", 0.01]
    workers = [procs.worker(env, *args) for _ in range(3)]
    go_together(workers)
    return workers


def granted_after(log, at, count):
    """Wait until ``count`` grants have been logged since wall time ``at``."""
    return faultkit.wait_until(lambda: len(entered(log, after=at)) >= count, 2 * EVENT)


def stop_all(workers):
    for worker in workers:
        worker.send("stop")
    for worker in workers:
        finish(worker)


def repeated_tokens(events):
    tokens = [e.token for e in events if e.kind == "ENTER"]
    return sorted({t for t in tokens if tokens.count(t) > 1})


def test_a_burst_of_grants_across_a_failover_repeats_no_token(pairs, procs, log):
    """Grants as fast as three processes can take them, on two names, across the failover,
    under synchronous replication: every grant on the new primary has a token above every
    grant before the crash, no token is granted twice, nobody overlaps."""
    pair = pairs(sync=True)
    name = unique("burst")
    workers = burst(procs, worker_env(pair.dsn()), name, log, 2)
    assert granted_after(log, 0, 40), "no burst of grants"

    crashed, promoted = pair.fail_over()

    assert granted_after(log, promoted, 40), "the burst did not go on on the new primary"
    back = entered(log, after=pair.down_at)[0]  # the old primary was gone by then
    measure(
        "failover (sync burst): first grant on the new primary after the crash", back.wall - crashed
    )
    stop_all(workers)
    events = read_log(log)
    assert not repeated_tokens(events), f"tokens granted twice: {repeated_tokens(events)[:20]}"
    assert_exclusive(grants(events))
    assert_tokens_above(log, crashed)
    fails = [e for e in events if e.kind == "FAIL"]
    print(f"[measure] sync burst: {len(entered(log))} grants, {len(fails)} failed attempts")


def test_asynchronous_lag_lets_tokens_repeat_after_a_failover(pairs, procs, log):
    """What synchronous replication prevents, as the README says: the standby fell behind
    (its replication stalled, then cut by the crash), so the promoted standby's token
    sequence is behind the tokens already handed out, and they are handed out again. The
    holders of the lost grants learned of their loss when their sessions ended: still
    nobody overlaps in time."""
    pair = pairs(sync=False, lag_proxy=True)
    name = unique("lag")
    workers = burst(procs, worker_env(pair.dsn()), name, log, 4)
    assert granted_after(log, 0, 10), "no burst of grants"
    pair.stall_replication()
    stalled = time.time()
    # More grants than the 32 values a sequence logs ahead: the standby's value is behind.
    assert granted_after(log, stalled, 80), "no burst of grants while the standby lagged"
    crashed = pair.crash_primary()
    pair.cut_replication()
    promoted = pair.promote()
    assert granted_after(log, promoted, 80), "the burst did not go on on the new primary"
    stop_all(workers)
    events = read_log(log)
    repeated = repeated_tokens(events)
    measure(
        f"async, standby {crashed - stalled:.1f} s behind: tokens granted twice", len(repeated), ""
    )
    assert repeated, "no token repeated although the new primary missed the latest grants"
    assert not faultkit.overlaps(grants(events))
