"""Third round of attacks on issue 15's semaphores: chaos with real processes.

README, "Semaphores": ``Lock(name, limit=N)`` admits at most N holders at once, each
holder's fencing token is strictly increasing per slot, a plain ``Lock(name)`` is slot 1
and counts against the semaphore, crash-fast takeover on the advisory path, stale reclaim
on the table path.

The strict chaos test: 8 ``tests.worker contend`` processes on one name -- semaphore
workers on ``limit=3`` (advisory path), semaphore workers on the table path with a short
``stale_after`` (so a killed holder's slot is reclaimed as stale), plain ``Lock(name)``
workers (slot 1) -- loop acquire / ENTER / EXIT / release, appending to one ``O_APPEND``
log. Meanwhile this process SIGKILLs workers (mostly ones that hold a slot right now, by
the log) and starts replacements. No forced releases, so the strict invariant holds:

* at every point of the log, at most 3 holders are inside (ENTER without EXIT) whose
  lease was not lost, and no slot has two of them;
* per slot, tokens strictly increase in the order of the ENTER lines.

A kill is written to the log as ``KILL <pid>`` while the victim is frozen (SIGSTOP,
waited for): it cannot write any more, and its session (so its slot) is still held; then
SIGKILL. From that line on its open interval is closed. A logged interval (ENTER written
after the grant, EXIT before the release) lies inside the real hold, so any overlap seen
in the log was real. Holders whose lease was lost (a LOST line: a live holder's row was
reclaimed as stale on a busy machine, documented) are left out of the count and of the
token order, and are counted and printed.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid

import pytest

from django_pglock import sql
from tests.subprocs import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

LIMIT = 3
RUN_SECONDS = 35.0  # how long the workers contend in all
CHAOS_SECONDS = 25.0  # kills happen within this, then the workers finish in peace
KILLS = 14

BASE = ("--poll-interval", "0.05", "--hold-for", "0.03", "--pause", "0.02")
# Advisory semaphore workers: quiet heartbeat, crash-fast takeover only.
ADVISORY_SEM = ("--limit", str(LIMIT), "--advisory", "on")
# Table-path semaphore workers: a killed holder's slot is reclaimed after stale_after.
TABLE_SEM = ("--limit", str(LIMIT), "--advisory", "off")
TABLE_TIMES = ("--heartbeat-interval", "0.3", "--alert-after", "1.5", "--stale-after", "4")
# Plain Lock(name) workers: slot 1 of the semaphore.
PLAIN = ("--advisory", "on")
PLAIN_TABLE = ("--advisory", "off")

KINDS = {
    "sem-adv": ADVISORY_SEM,
    "sem-table": TABLE_SEM + TABLE_TIMES,
    "plain-adv": PLAIN,
    "plain-table": PLAIN_TABLE + TABLE_TIMES,
}
MIX = ["sem-adv"] * 3 + ["sem-table"] * 2 + ["plain-adv"] * 2 + ["plain-table"]


def unique(label):
    return f"atk15c-{label}-{uuid.uuid4().hex[:8]}"


def parse(line):
    """(kind, pid, token, slot) of one log line; plain workers' lines have no slot: 1."""
    words = line.split()
    if words[0] == "KILL":
        return "KILL", words[1], None, None
    kind, pid, _when, token = words[:4]
    slot = words[4] if len(words) > 4 else "1"
    return kind, pid, int(token), slot


def inside_now(log):
    """pids inside (ENTER without EXIT/LOST/KILL) at the end of the log so far."""
    inside = set()
    for line in log.read_text().splitlines():
        kind, pid, *_ = parse(line)
        if kind == "ENTER":
            inside.add(pid)
        else:
            inside.discard(pid)
    return inside


def enters(log):
    return sum(1 for line in log.read_text().splitlines() if line.startswith("ENTER"))


def frozen(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except FileNotFoundError:
        return True  # gone is as good as frozen


def judge(lines):
    """Replay the log: max concurrency of unlost holders, violations, per-slot tokens."""
    lost_tokens = {parse(ln)[2] for ln in lines if ln.startswith("LOST")}
    inside: dict[tuple[str, int], str] = {}  # (pid, token) -> slot, unlost only
    last_token: dict[str, tuple[int, int]] = {}  # slot -> (token, line number)
    most = 0
    violations = []
    for number, line in enumerate(lines):
        kind, pid, token, slot = parse(line)
        if kind == "KILL":
            for key in [k for k in inside if k[0] == pid]:
                del inside[key]
            continue
        if kind != "ENTER":
            inside.pop((pid, token), None)
            continue
        if token in lost_tokens:
            continue
        if slot in inside.values():
            violations.append((number, f"slot {slot} held twice at once: {dict(inside)}"))
        inside[(pid, token)] = slot
        most = max(most, len(inside))
        if len(inside) > LIMIT:
            violations.append((number, f"{len(inside)} holders at once: {dict(inside)}"))
        previous = last_token.get(slot)
        if previous is not None and token <= previous[0]:
            violations.append(
                (number, f"slot {slot}: token {token} after {previous[0]} (line {previous[1]})")
            )
        last_token[slot] = (token, number)
    return most, violations, lost_tokens, last_token


def excerpt(lines, number, around=12):
    start = max(0, number - around)
    return "\n".join(f"{i:6d}  {lines[i]}" for i in range(start, min(len(lines), number + 3)))


@pytest.mark.slow
def test_semaphore_chaos_kills_table_path_and_plain_mix_never_exceed_the_limit(procs, tmp_path, db):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    name = unique("chaos")
    log = tmp_path / "chaos.log"
    started = time.monotonic()
    end_at = started + RUN_SECONDS

    def start(kind, go_now):
        remaining = max(2.0, end_at - time.monotonic())
        args = ("contend", "--name", name, "--log", log, "--seconds", f"{remaining:.1f}")
        worker = procs.child(*args, *BASE, *KINDS[kind])
        worker.kind = kind
        if go_now:
            worker.ready(60)
            worker.send("go")
        return worker

    workers = [start(kind, go_now=False) for kind in MIX]
    for worker in workers:
        worker.ready(60)
    for worker in workers:
        worker.send("go")
    wait_until(lambda: log.exists() and enters(log) >= 10, 60, "no grants at the start")

    kills = []  # (pid, kind, was inside)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        chaos_end = time.monotonic() + CHAOS_SECONDS
        while len(kills) < KILLS and time.monotonic() < chaos_end:
            # Wait for some grants since the last kill (an event, not a sleep).
            target = enters(log) + rng.randint(2, 8)
            wait_until(lambda t=target: enters(log) >= t, 60, "grants stopped")
            holding = inside_now(log)
            by_pid = {str(w.pid): w for w in workers if w.poll() is None}
            candidates = [by_pid[p] for p in holding if p in by_pid]
            if not candidates or rng.random() < 0.25:
                candidates = list(by_pid.values())
            victim = rng.choice(candidates)
            victim.signal(signal.SIGSTOP)
            wait_until(lambda v=victim: frozen(v.pid), 30, "victim never stopped")
            was_inside = str(victim.pid) in inside_now(log)
            os.write(fd, f"KILL {victim.pid}\n".encode())
            victim.kill()
            victim.wait(30)
            kills.append((victim.pid, victim.kind, was_inside))
            workers.remove(victim)
            workers.append(start(victim.kind, go_now=True))
    finally:
        os.close(fd)

    grants = 0
    for worker in workers:
        grants += int(worker.expect("CONTENDED", timeout=120).split()[1])
        assert worker.finish(60) == 0, worker.stderr_text

    lines = log.read_text().splitlines()
    most, violations, lost_tokens, last_token = judge(lines)
    n_enter = sum(1 for ln in lines if ln.startswith("ENTER"))
    holders_killed = sum(1 for k in kills if k[2])
    print(
        f"\n[chaos] seed={seed} limit={LIMIT}: {n_enter} ENTERs ({grants} completed by "
        f"survivors), {len(kills)} kills ({holders_killed} while inside: "
        f"{[k[1] for k in kills if k[2]]}), lost leases {len(lost_tokens)}, max "
        f"concurrency {most}, last tokens {dict((s, t) for s, (t, _) in last_token.items())}"
    )
    if violations:
        number, what = violations[0]
        pytest.fail(
            f"{len(violations)} violations (seed {seed}); first: {what}\n{excerpt(lines, number)}"
        )
    assert most == LIMIT, f"the limit was never reached ({most}): the test proves nothing"
    assert set(last_token) == {"1", "2", "3"}
    assert holders_killed >= 3, f"only {holders_killed} kills hit a holder: too little chaos"
    # What is left in the table: only rows of killed table-path holders (never released).
    left = db.execute(
        f"SELECT name, token FROM django_pglock_joblock WHERE {sql.base_name_sql('name')} = %s",
        [name],
    ).fetchall()
    killed_pids = {str(k[0]) for k in kills}
    survivor_tokens = {
        parse(ln)[2] for ln in lines if ln.startswith("ENTER") and ln.split()[1] not in killed_pids
    }
    assert not {token for _, token in left} & survivor_tokens, f"a survivor's row is left: {left}"


def test_the_judge_sees_an_excess_and_a_token_going_down():
    """The log replay itself: a fourth unlost holder, and a slot's token going down, are
    caught; a killed holder's open interval and a lost holder are not counted."""
    ok = [
        "ENTER 1 0 10 1",
        "ENTER 2 0 11 2",
        "ENTER 3 0 12 3",
        "KILL 3",
        "ENTER 4 0 13 3",
        "ENTER 5 0 14 1",
        "LOST 5 0 14 1",
        "EXIT 4 0 13 3",
    ]
    assert judge(ok)[:2] == (3, [])
    excess = ["ENTER 1 0 10 1", "ENTER 2 0 11 2", "ENTER 3 0 12 3", "ENTER 4 0 13"]
    assert any("4 holders" in what for _, what in judge(excess)[1])
    down = ["ENTER 1 0 10 2", "EXIT 1 0 10 2", "ENTER 2 0 9 2"]
    assert any("went" in what or "after" in what for _, what in judge(down)[1])
