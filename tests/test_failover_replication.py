"""Failover and replication: what reaches the standby decides what the new primary knows.

A promoted standby that inherited ``synchronous_standby_names`` (every commit waits for a
standby it does not have), a burst of grants across the failover under synchronous
replication (no token repeats), and, for contrast, asynchronous replication with lag
(tokens do repeat, which is why the README asks for synchronous replication where
fencing must survive a failover). Set up and judged as in tests/test_failover.py.
"""

from __future__ import annotations

import time

import pytest

import django_pglock
from django_pglock import protocol
from tests import faultkit
from tests.failoverkit import (  # noqa: F401  (fixture "pairs")
    ALERT,
    DEADLINE_SLACK,
    EVENT,
    HB,
    SMALL,
    TABLE_600,
    assert_tokens_above,
    burst,
    client,
    entered,
    finish,
    granted_after,
    pairs_fixture,
    repeated_tokens,
    stop_all,
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


# -- 1. a promoted standby that inherited synchronous_standby_names --------------------


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
    tries = client(procs, env, "try", name, log, *TABLE_600)
    tries.expect("READY", 60)
    bound = protocol.STATEMENT_DEADLINE
    asked = time.monotonic()
    tries.send("go")
    outcome = words(tries.expect("TRIED", bound + DEADLINE_SLACK))
    returned = time.monotonic() - asked
    measure("inherited synchronous_standby_names: a try_acquire returned after", returned)
    assert issubclass(getattr(django_pglock, outcome[1], type(None)), django_pglock.LockError), (
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

    assert faultkit.wait_until(acquired, EVENT, interval=0.1), (
        f"the name stayed blocked after the setting was fixed: {tries.seen[-5:]}; rows: "
        f"{pair.standby.query('SELECT name, token, holder FROM django_pglock_joblock')}"
    )
    measure("inherited synchronous_standby_names: granted after the fix", time.monotonic() - fixed)
    finish(tries)


# -- 2. a burst of grants across the failover ------------------------------------------


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
