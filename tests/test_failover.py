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

import time

import pytest

from tests import faultkit
from tests.failoverkit import (  # noqa: F401  (fixture "pairs")
    ALERT,
    EVENT,
    HB,
    RIDE,
    SMALL,
    TABLE_600,
    assert_tokens_above,
    client,
    entered,
    finish,
    pairs_fixture,
    row,
    unique,
    words,
)
from tests.faultkit import (  # noqa: F401  (fixtures "log", "procs")
    assert_exclusive,
    grants,
    log_fixture,
    measure,
    procs_fixture,
    read_log,
    worker_env,
)

pytestmark = pytest.mark.slow


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
    # (Seen by this test's polling, after pg_ctl promote returned: the waiter may be first.)
    measure(f"failover ({mode}): promotion seen after the crash", promoted - crashed)
    assert token > held
    assert row(pair.standby, name)[0] == token, "the grant is not on the new primary"
    waiter.send("release")
    waiter.expect("RELEASED", EVENT)
    finish(waiter)
    holder.send("release")  # already lost: releasing it must not touch the new grant
    holder.expect("RELEASED_ALL", EVENT, skip=("RELEASED",))
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


def test_guard_needs_close_old_connections_after_a_failover(pairs, procs, log):
    """``lease.guard()`` runs on Django's own connection, which Django does not reopen by
    itself outside a request: after the failover it fails there (the lease is still
    held, on the table path), and after ``close_old_connections()`` it fences a
    transaction on the new primary."""
    pair = pairs(sync=False)
    env = worker_env(pair.dsn())
    name = unique("guard")
    holder = client(procs, env, "hold", name, log, *RIDE, "--advisory", "off")
    held = int(words(holder.expect("GRANTED", 60))[1])
    holder.expect("READY")
    holder.send("guard")
    assert holder.expect("GUARDED", EVENT) == f"GUARDED {held}"  # Django's connection is open
    pair.wait_replayed()
    pair.fail_over()
    holder.send("guard")
    failed = holder.expect("GUARD_FAILED", EVENT)
    holder.send("check")
    assert holder.expect("OK", EVENT) == f"OK {held}", "the lease itself rode through"
    holder.send("close_old")
    holder.expect("CLOSED", EVENT)
    holder.send("guard")
    assert holder.expect("GUARDED", EVENT) == f"GUARDED {held}"
    print(f"[measure] guard() on Django's connection after the failover: {failed}")
    holder.send("release")
    holder.expect("RELEASED_ALL", EVENT, skip=("RELEASED",))
    finish(holder)
    assert row(pair.standby, name) is None


# -- 3. a release just before the crash ------------------------------------------------


def test_a_release_just_before_the_crash_does_not_come_back(pairs, procs, log):
    """Under synchronous replication a ``release()`` that returned is on the standby: the
    names are free on the new primary, at once (on the table path a row that came back
    would block its name until stale_after)."""
    pair = pairs(sync=True)
    env = worker_env(pair.dsn())
    name = unique("release")
    count = 6
    holder = client(procs, env, "hold", name, log, *TABLE_600, "--count", count)
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
    again = client(procs, env, "hold", name, log, *TABLE_600, "--count", count)
    again.expect("READY", EVENT, skip=("GRANTED",))  # every name granted at the first attempt
    new = {e.name: e.token for e in entered(log, after=promoted)}
    assert sorted(new) == sorted(tokens)
    assert min(new.values()) > max(tokens.values())
    again.send("release")
    again.expect("RELEASED_ALL", EVENT, skip=("RELEASED",))
    finish(again)
    finish(holder)


# -- 4. a grant committed on the standby that its caller never heard of ----------------


def test_a_grant_its_caller_never_heard_of_is_released_after_the_failover(pairs, procs, log):
    """The grant's commit reached the standby, but the primary crashed before its caller
    got the answer (here made certain: the standby holds back its replay and the primary
    waits for it, ``synchronous_commit = remote_apply``). After the promotion the new
    primary has a row of that process that no lease of it owns; on the table path it would
    block the name until stale_after. The process releases it after reconnecting, and
    its run is closed as lost."""
    pair = pairs(sync=True, remote_apply=True)
    env = worker_env(pair.dsn())
    name = unique("orphan")
    tries = client(procs, env, "try", name, log, *TABLE_600, "--record")
    tries.expect("READY", 60)
    tries.send("go")  # the lock session is open, its statements work
    _, outcome, first, _ = words(tries.expect("TRIED", EVENT))
    assert outcome == "ACQUIRED"
    pair.delay_replay()
    tries.send("go")
    waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
    assert faultkit.wait_until(lambda: pair.primary.query(waiting), EVENT), "no commit waited"
    pair.wait_received()  # the grant's commit is on the standby

    crashed = pair.crash_primary()
    outcome = words(tries.expect("TRIED", EVENT))
    assert outcome[1] != "ACQUIRED", outcome
    promoted = pair.promote()

    # The grant's run, started by the same statement, shows that it committed.
    runs = "SELECT token, outcome FROM django_pglock_jobrun WHERE name = %s ORDER BY token"
    (_, orphan) = [token for token, _ in pair.standby.query(runs, [name])]
    assert orphan > int(first)
    assert faultkit.wait_until(lambda: row(pair.standby, name) is None, EVENT), (
        f"the grant nobody holds (token {orphan}) still blocks the name: {row(pair.standby, name)}"
    )
    measure("a grant nobody holds: released after the crash", time.time() - crashed)
    measure("a grant nobody holds: released after the promotion", time.time() - promoted)
    assert dict(pair.standby.query(runs, [name]))[orphan] == "lost"
    again = client(procs, env, "try", name, log, *TABLE_600)
    again.expect("READY", 60)
    again.send("go")
    assert words(again.expect("TRIED", EVENT))[1] == "ACQUIRED"
    finish(again)
    finish(tries)
