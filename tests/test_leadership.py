"""Leader election: one leader among replicas, counted from the outside.

``locked_run --wait --name beat --shell -- <program>`` run three times is the recipe for
one scheduler among replicas: the test kills the leader again and again (SIGKILL of its
``locked_run``, a clean SIGTERM, its program ending by itself), restarting each replica
that ended as a supervisor would, and judges from the leaders' own records
(``tests/leader_job.py``: a kernel ``flock`` that a second live leader cannot take, and
``O_APPEND`` lines stamped with the machine's monotonic clock) that there never were two
leaders, printing how long each failover took.

``Lock.leadership()`` (in-process leadership) is tested with real worker processes
(``tests/leader_worker.py``) and a forced release, and in this process for what leaving
the block means.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from django_pglock import Lock, LockNotAcquired
from django_pglock.leadership import Term
from django_pglock.liveness import ROW_GONE
from django_pglock.operations import force_release
from tests.subprocs import pid_gone, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("clean_locks"),
    pytest.mark.slow,
]

JOB = str(Path(__file__).with_name("leader_job.py"))
POLL = 0.2  # the standbys' --poll-interval
REPLICAS = 3
# A failover may take a poll interval and the time to stop the old leader's job; these
# bounds are generous for a busy 2-core machine. The measured times are printed.
FAILOVER_BOUND = 15.0


def unique(label):
    return f"lead-{label}-{uuid.uuid4().hex[:8]}"


class Records:
    """The leaders' own records (``tests/leader_job.py``), read from their log."""

    def __init__(self, path):
        self.path = Path(path)

    def lines(self):
        if not self.path.exists():
            return []
        return [line.split() for line in self.path.read_text().splitlines() if line]

    def starts(self):
        """``(job pid, locked_run pid, token, time)`` of each leader, in order."""
        return [
            (int(w[1]), int(w[2]), int(w[3]), float(w[4])) for w in self.lines() if w[0] == "start"
        ]

    def terms(self):
        """``job pid -> (first time, last time)`` of every line it wrote."""
        found: dict[int, list[float]] = {}
        for words in self.lines():
            if words[0] != "overlap":
                pid, at = int(words[1]), float(words[-1])
                first, last = found.setdefault(pid, [at, at])
                found[pid] = [min(first, at), max(last, at)]
        return {pid: (first, last) for pid, (first, last) in found.items()}

    def overlaps(self):
        return [words for words in self.lines() if words[0] == "overlap"]


def replica(procs, name, records, flock):
    return procs.django(
        "locked_run", "--wait", "--name", name, "--poll-interval", str(POLL),
        "--shell", "--", sys.executable, JOB, "--log", records.path, "--flock", flock,
    )  # fmt: skip


def next_leader(records, count, replicas, timeout=60.0):
    """Wait for the ``count``-th leader's start line; it and its replica."""

    def started():
        for proc in replicas:
            if proc.poll() is not None:
                pytest.fail(f"{proc} ended ({proc.poll()}) while standing by:\n{proc.stderr_text}")
        starts = records.starts()
        return starts[count - 1] if len(starts) >= count else None

    start = wait_until(started, timeout, f"no leader number {count} within {timeout}s")
    owner = [proc for proc in replicas if proc.pid == start[1]]
    assert len(owner) == 1, f"leader {start} does not run under one of {replicas}"
    return start, owner[0]


# The ways a leader's term ends, and locked_run's exit status for each.
ENDINGS = {
    "sigkill": -signal.SIGKILL,  # its locked_run killed (OOM, a node lost): guardian kills the job
    "sigterm": 0,  # its locked_run stopped cleanly: SIGTERM forwarded, the job's own status
    "exit": 7,  # the program ended by itself: locked_run exits with its status
}


def test_three_replicas_never_two_leaders_and_a_standby_takes_over(procs, tmp_path):
    name = unique("beat")
    records, flock = Records(tmp_path / "leaders.log"), tmp_path / "leader.flock"
    replicas = [replica(procs, name, records, flock) for _ in range(REPLICAS)]
    rounds = ["sigkill", "sigterm", "exit", "sigkill", "sigterm", "sigkill"]
    failovers: list[tuple[str, float]] = []
    (job, _, _, _), leader = next_leader(records, 1, replicas)
    for number, how in enumerate(rounds, start=2):
        standbys = [proc for proc in replicas if proc is not leader]
        # Every standby is still waiting (none skipped, none gave up).
        assert all(proc.poll() is None for proc in standbys)
        ended_at = time.monotonic()
        if how == "sigkill":
            leader.signal(signal.SIGKILL)
        elif how == "sigterm":
            leader.signal(signal.SIGTERM)
        else:
            os.kill(job, signal.SIGUSR1)
        (new_job, _, _, started_at), new_leader = next_leader(records, number, standbys)
        failovers.append((how, started_at - ended_at))
        assert leader.wait(30) == ENDINGS[how], leader.stderr_text
        wait_until(lambda job=job: pid_gone(job), 30, f"the old leader's job {job} still runs")
        # A supervisor (systemd, Kubernetes) restarts the replica; it stands by.
        replicas[replicas.index(leader)] = replica(procs, name, records, flock)
        job, leader = new_job, new_leader

    for proc in replicas:
        proc.signal(signal.SIGTERM)
    for proc in replicas:
        proc.wait(30)

    print("\n[measure] leader failover, end of the old term -> new leader's first line:")
    for how, took in failovers:
        print(f"[measure]   {how:8s} {took:.3f}s")
    assert records.overlaps() == [], f"a second leader ran while one lived: {records.overlaps()}"
    starts = records.starts()
    assert len(starts) == len(rounds) + 1, starts
    tokens = [token for _, _, token, _ in starts]
    assert tokens == sorted(set(tokens)), f"fencing tokens did not increase: {tokens}"
    terms = sorted(records.terms().values())
    for (_, ended), (began, _) in itertools.pairwise(terms):
        assert ended < began, f"two leaders' terms overlap: {terms}"
    for how, took in failovers:
        assert took < FAILOVER_BOUND, f"failover after {how} took {took:.1f}s"


# -- Lock.leadership(): in-process leader election ----------------------------------------


def leader_worker(procs, name):
    return procs.start(sys.executable, "-m", "tests.leader_worker", name, stdin=True)


def first_to(prefix, workers, timeout=60.0):
    """The first of ``workers`` to print a line starting with ``prefix``; it and the line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in workers:
            line = worker.line_within(prefix, 0.05)
            if line is not None:
                return worker, line.split()
    pytest.fail(f"none of {workers} printed {prefix!r} within {timeout}s")


def test_a_forced_release_demotes_the_leader_and_the_standby_is_elected(procs):
    name = unique("inproc")
    workers = [leader_worker(procs, name), leader_worker(procs, name)]
    leader, leading = first_to("LEADING", workers)
    standby = workers[1 - workers.index(leader)]
    token = int(leading[1])

    forced_at = time.monotonic()
    result = procs.run_django("pglock_release", name)
    assert result.returncode == 0, result.stderr
    demoted = leader.expect("DEMOTED", 30)
    left = leader.expect("LEFT", 30).split()
    assert int(demoted.split()[1]) == token
    assert left[1:3] == ["demoted", ROW_GONE.replace(" ", "_")]
    leader.expect("WAITING", 30)  # the demoted leader stands by again
    elected = standby.expect("LEADING", 30, skip=("WAITING",)).split()
    assert int(elected[1]) > token

    # A clean resignation: the old leader, standing by, is elected once it has left.
    resigned_at = time.monotonic()
    standby.send("resign")
    left = standby.expect("LEFT", 30).split()
    assert left[1:3] == ["resigned", "-"]
    again = leader.expect("LEADING", 30).split()
    assert float(again[-1]) > float(left[-1]), "elected before the old leader had left"
    assert int(again[1]) > int(elected[1])
    assert standby.wait(30) == 0

    demoted_after = float(demoted.split()[-1]) - forced_at
    print(
        f"\n[measure] forced release -> leader demoted {demoted_after:.3f}s"
        f", standby elected {float(elected[-1]) - forced_at:.3f}s"
        f"\n[measure] resignation -> standby elected {float(again[-1]) - resigned_at:.3f}s"
    )


def small_lock(name, heartbeat_interval=0.2):
    hb = heartbeat_interval
    return Lock(name, heartbeat_interval=hb, alert_after=max(0.6, 2 * hb), stale_after=3 + hb)


def test_leaving_a_demoted_term_is_quiet_and_the_callback_runs_once():
    name = unique("quiet")
    calls = []
    leadership = small_lock(name).leadership(on_demotion=calls.append)
    with leadership as lease:
        assert leadership.state is Term.LEADING and not leadership.demoted.is_set()
        force_release(name)
        assert leadership.wait(30), "the heartbeat thread never saw the forced release"
        assert lease.lost
        lease.check()  # raises LockNotHeld: it ends the block, quietly
        pytest.fail("check() of a demoted lease returned")
    assert leadership.state is Term.DEMOTED
    assert leadership.reason == ROW_GONE
    assert calls == [lease]


def test_another_exception_from_a_demoted_term_propagates():
    name = unique("raises")
    leadership = small_lock(name).leadership()
    with pytest.raises(ZeroDivisionError), leadership:
        force_release(name)
        assert leadership.wait(30)
        1 / 0  # noqa: B018
    assert leadership.state is Term.DEMOTED


def test_a_loss_found_only_when_leaving_is_a_demotion(db):
    name = unique("at-exit")
    calls = []
    # No heartbeat before the block ends: only the release finds the row gone.
    leadership = small_lock(name, heartbeat_interval=1).leadership(on_demotion=calls.append)
    with leadership as lease:
        force_release(name)
    assert leadership.state is Term.DEMOTED and leadership.demoted.is_set()
    assert calls == [lease]


def test_resigning_releases_the_lock_and_is_no_demotion(db):
    name = unique("resign")
    calls = []
    leadership = small_lock(name).leadership(on_demotion=calls.append)
    with leadership as lease:
        (held,) = db.execute(
            "SELECT count(*) FROM django_pglock_joblock WHERE name = %s AND token = %s",
            [name, lease.token],
        ).fetchone()
        assert held == 1
    assert leadership.state is Term.RESIGNED
    assert not leadership.demoted.is_set() and leadership.reason is None and calls == []
    (rows,) = db.execute(
        "SELECT count(*) FROM django_pglock_joblock WHERE name = %s", [name]
    ).fetchone()
    assert rows == 0
    with pytest.raises(RuntimeError, match="entered already"), leadership:
        pass


def test_a_timeout_raises_lock_not_acquired_naming_the_leader(procs):
    name = unique("timeout")
    holder = leader_worker(procs, name)
    token = holder.expect("LEADING", 60, skip=("WAITING",)).split()[1]
    leadership = Lock(name).leadership(timeout=0.5)
    match = f"Not elected leader of '{name}'.*token {token}"
    with pytest.raises(LockNotAcquired, match=match), leadership:
        pytest.fail("elected while another process leads")
    assert leadership.state is Term.RESIGNED


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_demotion": 5}, "on_demotion=5 is not callable"),
        ({"timeout": -1}, "timeout"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Lock(unique("bad")).leadership(**kwargs)
    with pytest.raises(ValueError, match=message):
        Lock(unique("bad")).leadership_async(**kwargs)


def test_async_leadership_wakes_its_waiter_on_demotion(db):
    name = unique("async")
    calls = []

    async def lead():
        leadership = small_lock(name).leadership_async(on_demotion=calls.append)
        async with leadership as lease:
            assert not await leadership.wait(0.05)
            db.execute("DELETE FROM django_pglock_joblock WHERE name = %s", [name])
            assert await leadership.wait(30)
        return leadership, lease

    leadership, lease = asyncio.run(lead())
    assert leadership.state is Term.DEMOTED and leadership.reason == ROW_GONE
    assert calls == [lease]
