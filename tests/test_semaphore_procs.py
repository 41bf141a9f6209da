"""Semaphores across real processes: the limit counted from the outside, crash-fast
takeover of a SIGKILLed slot holder, stale reclaim of a table-path slot, locked_run."""

from __future__ import annotations

import signal
import sys
import time
import uuid

import pytest

from django_pglock import Lock, signals, sql
from tests.procs import go_together

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

QUIET = ("--heartbeat-interval", "30", "--alert-after", "60", "--stale-after", "600")


def unique(label):
    return f"{label}-{uuid.uuid4().hex[:8]}"


def slots_by_token(db, name):
    found = db.execute(
        f"SELECT name, token FROM django_pglock_joblock WHERE {sql.base_name_sql('name')} = %s",
        [name],
    ).fetchall()
    return {token: sql.slot_of(row)[1] for row, token in found}


@pytest.mark.slow
@pytest.mark.parametrize("advisory", ["on", "off"])
def test_eight_processes_on_limit_three_never_exceed_three(procs, tmp_path, db, advisory):
    """Each worker appends ENTER after its grant and EXIT before its release to one
    O_APPEND log: the file's order is the order of those writes, so at any point of it the
    ENTERs without their EXIT were all held at once."""
    name = unique("sem-8")
    log = tmp_path / "sem.log"
    options = ("--limit", "3", "--seconds", "5", "--log", log, "--poll-interval", "0.02")
    options += ("--hold-for", "0.02", "--pause", "0.01", "--advisory", advisory)
    workers = [procs.child("contend", "--name", name, *options) for _ in range(8)]
    go_together(workers)
    grants = 0
    for worker in workers:
        grants += int(worker.expect("CONTENDED", timeout=60).split()[1])
        assert worker.finish() == 0, worker.stderr_text

    events = [line.split() for line in log.read_text().splitlines()]
    assert not [e for e in events if e[0] == "LOST"], "a lease was lost under contention"
    inside: dict[tuple[str, str], str] = {}  # (pid, token) -> slot
    most = 0
    last_token: dict[str, int] = {}
    for kind, pid, _when, token, slot in events:
        if kind == "ENTER":
            assert slot not in inside.values(), f"slot {slot} held twice at once: {inside}"
            inside[(pid, token)] = slot
            most = max(most, len(inside))
            assert len(inside) <= 3, f"{len(inside)} holders at once: {inside}"
            assert int(token) > last_token.get(slot, 0), f"slot {slot}: token {token} went down"
            last_token[slot] = int(token)
        else:
            assert inside.pop((pid, token)) == slot
    print(f"\n[measure] limit=3, 8 processes, advisory={advisory}: {grants} grants, max {most}")
    assert grants == len(events) // 2
    assert most == 3, f"the limit was never reached ({most}): the test proves nothing"
    assert set(last_token) == {"1", "2", "3"}
    assert slots_by_token(db, name) == {}


@pytest.mark.slow
def test_sigkilled_slot_holder_is_taken_over_at_once(procs, db):
    name = unique("sem-kill")
    holders = [procs.child("hold", "--name", name, "--limit", "3", *QUIET) for _ in range(3)]
    tokens = [int(holder.expect("ACQUIRED").split()[1]) for holder in holders]
    slots = slots_by_token(db, name)
    assert sorted(slots[t] for t in tokens) == [1, 2, 3]
    lock = Lock(name, limit=3, poll_interval=0.1)
    assert lock.try_acquire() is None
    victim = holders[1]
    victim.kill()
    killed_at = time.monotonic()
    reclaimed = []

    def receiver(sender, **kw):
        reclaimed.append(kw)

    signals.lock_reclaimed.connect(receiver)
    try:
        with lock.acquire(timeout=30) as lease:
            took = time.monotonic() - killed_at
            assert lease is not None
            print(f"\n[measure] semaphore slot takeover after SIGKILL: {took:.3f}s")
            assert took < 10, f"took {took:.1f}s; stale_after is 600 s: not the advisory path"
            assert lease.slot == slots[tokens[1]] and lease.token > max(tokens)
            assert reclaimed and reclaimed[0]["previous"]["token"] == tokens[1]
            assert reclaimed[0]["reason"] == "abandoned"
            others = [t for t in tokens if t != tokens[1]]
            assert set(slots_by_token(db, name)) == {*others, lease.token}
    finally:
        signals.lock_reclaimed.disconnect(receiver)


@pytest.mark.slow
def test_stale_table_path_slot_is_reclaimed(procs, db):
    name = unique("sem-stale")
    small = ("--heartbeat-interval", "0.2", "--alert-after", "0.6", "--stale-after", "2")
    args = ("--limit", "2", "--advisory", "off")
    first = procs.child("hold", "--name", name, *args, *small)
    second = procs.child("hold", "--name", name, *args, *QUIET)
    tokens = [int(p.expect("ACQUIRED").split()[1]) for p in (first, second)]
    slots = slots_by_token(db, name)
    first.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    lock = Lock(name, limit=2, advisory=False, poll_interval=0.1)
    with lock.acquire(timeout=60) as lease:
        waited = time.monotonic() - killed_at
        assert lease is not None and lease.slot == slots[tokens[0]]
        assert lease.token > max(tokens) and not lease.advisory
        assert waited > 1.0, f"reclaimed after {waited:.2f}s, before the row was stale"
        assert set(slots_by_token(db, name)) == {tokens[1], lease.token}
    second.kill()


@pytest.mark.slow
def test_locked_run_limit_lends_the_slot_grant(procs, db, tmp_path):
    """Two ``locked_run --limit 2`` jobs run at once, a third is skipped; each job's
    ``DJANGO_PGLOCK_TOKEN`` is its slot's grant."""
    name = unique("sem-run")
    stop = tmp_path / "stop"
    script = (
        "import os, sys, time; print('JOB', os.environ['DJANGO_PGLOCK_NAME'], "
        "os.environ['DJANGO_PGLOCK_TOKEN'], flush=True)\n"
        f"while not os.path.exists({str(stop)!r}): time.sleep(0.05)"
    )
    argv = ("locked_run", "--name", name, "--limit", "2", "--shell", "--")
    argv += (sys.executable, "-c", script)
    jobs = [procs.django(*argv) for _ in range(2)]
    lent = []
    for job in jobs:
        words = job.expect("JOB", timeout=60).split()
        assert words[1] == name
        lent.append(int(words[2]))
    held = slots_by_token(db, name)
    assert sorted(held.values()) == [1, 2]
    assert sorted(lent) == sorted(held)
    third = procs.finish(procs.django(*argv))
    assert third.returncode == 0 and "is held by" in third.stderr, third.stderr
    stop.touch()
    for job in jobs:
        assert procs.finish(job).returncode == 0
    assert slots_by_token(db, name) == {}
