"""Shared by the failover tests (tests/test_failover.py, tests/test_failover_replication.py):
thresholds and bounds, the ``pairs`` fixture (tests/standby.py), starting lock clients,
and reading the clients' ``O_APPEND`` log (``faultkit.read_log``) for the invariants.
"""

from __future__ import annotations

import sys
import uuid

import pytest

from tests import faultkit
from tests.faultkit import read_log
from tests.procs import go_together
from tests.standby import ReplicatedPair

# Small thresholds, so that a loss or a reclaim would happen within a test.
HB, ALERT, STALE = 0.5, 1.5, 5.0
SMALL = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", STALE)
# A table-path holder rides through only if the new primary takes its heartbeat before
# the holder's own deadline (stale_after minus the margin): ample for a busy machine.
RIDE_STALE = 30.0
RIDE = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", RIDE_STALE)
# On the table path with these, a row left behind would block its name for ten minutes.
TABLE_600 = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", 600.0)
TABLE_600 += ("--advisory", "off")
# Generous bounds for events on a loaded machine (the measured figures are far below).
EVENT = 30.0
# How late a lock call may return after its statement deadline, on a busy machine.
DEADLINE_SLACK = 10.0


def unique(label):
    return f"failover-{label}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(name="pairs")
def pairs_fixture():
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
