"""``locked_run``'s job is its whole process tree (DESIGN.md §2, "The job is the process tree").

Real ``manage.py locked_run`` processes against the test database, wrapping
``tests/tree_job.py`` (a leader with a child and a grandchild in its process group). A
sampler thread reads, every few milliseconds, the lock row's token and then which of the
job's processes still run (by pid *and* start time, so a reused pid never counts), so
"the lock was free while the job ran" is a sample, not a guess. The server's backend of
the lock connection is stopped with SIGSTOP for the stuck-connection cases (we must be
able to signal it: root, or the server's own user, on the same host).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from django_pglock.operations import force_release
from tests import faultkit
from tests.subprocs import wait_for_file, wait_until
from tests.tree_job import read_pids, running

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("clean_locks"),
    pytest.mark.slow,
]

EXIT_LOST = 75
JOB = str(Path(__file__).with_name("tree_job.py"))
# Small thresholds: heartbeat 0.2 s, alert 0.6 s, stale 3 s (safety margin 0.2 s).
SMALL = ("--heartbeat-interval", "0.2", "--alert-after", "0.6", "--stale-after", "3")
WAITER = ("--wait", "--poll-interval", "0.05")


def unique(label):
    return f"tree-{label}-{uuid.uuid4().hex[:8]}"


def locked_run(procs, name, *job, options=()):
    """Start ``locked_run --name <name> <options> --shell -- python tests/tree_job.py <job>``."""
    return procs.django(
        "locked_run", "--name", name, *options, "--shell", "--", sys.executable, JOB, *job
    )


def row_of(db, name):
    cur = db.execute("SELECT token, backend_pid FROM django_pglock_joblock WHERE name = %s", [name])
    return cur.fetchone()


def all_dead(tree):
    return not [pid for pid, started in tree if running(pid, started)]


class Watch:
    """Samples ``(time, token of the row or None, pids of the job still running)``.

    The row is read first and the processes after, so a sample with the job's token gone
    and a process running proves that the lock was free (or another's) while it ran.
    """

    def __init__(self, pg_url, dbname, name, pids_path, interval=0.005):
        self.name = name
        self.pids_path = Path(pids_path)
        self.samples: list[tuple[float, int | None, list[int]]] = []
        self.tree: list[tuple[int, int]] | None = None
        self._conn = psycopg.connect(pg_url, dbname=dbname, autocommit=True)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-watch", daemon=True)
        self._thread.start()

    def _run(self):
        query = "SELECT token FROM django_pglock_joblock WHERE name = %s"
        while not self._stop.is_set():
            if self.tree is None and self.pids_path.exists():
                self.tree = read_pids(self.pids_path)
            if self.tree is not None:
                found = self._conn.execute(query, [self.name]).fetchone()
                alive = [pid for pid, started in self.tree if running(pid, started)]
                self.samples.append((time.time(), None if found is None else found[0], alive))
            self._stop.wait(self._interval)

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        self._conn.close()

    def overlaps(self, token):
        """Samples in which the row was not ``token``'s while a process of the job ran."""
        return [s for s in self.samples if s[1] != token and s[2]]

    def last_alive(self):
        """The last time a process of the job was seen running."""
        return max((t for t, _, alive in self.samples if alive), default=None)

    def first_without(self, token):
        return min((t for t, found, _ in self.samples if found != token), default=None)


@pytest.fixture
def watches():
    started = []
    yield started
    for watch in started:
        watch.stop()


@pytest.fixture
def watch(pg_url, test_db_name, watches):
    def start(name, pids_path):
        found = Watch(pg_url, test_db_name, name, pids_path)
        watches.append(found)
        return found

    return start


def lock_sessions(db):
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'django_pglock'"
        " AND datname = current_database()"
    ).fetchall()
    return {pid for (pid,) in rows}


def process_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def children_of(pid):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append((int(entry.name), (entry / "cmdline").read_bytes()))
    return found


@contextlib.contextmanager
def stopped_backend(db, pid):
    """SIGSTOP the server process ``pid`` while it is idle (holding no row lock); SIGCONT after.

    Stopped in the middle of a heartbeat, it would keep the row locked and no contender
    could reclaim it; stopped idle, it is what a hung server session looks like.
    """
    faultkit.require_local_backend(pid)  # else a skip outside CI, a failure under CI
    try:
        for _ in range(500):
            os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: process_state(pid) == "T", 5, f"backend {pid} did not stop")
            (state,) = db.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = %s", [pid]
            ).fetchone()
            if state == "idle":
                break
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.003)
        else:
            pytest.fail(f"backend {pid} was never idle")
        yield
    except PermissionError:
        faultkit.require(False, f"this test cannot signal the server's process {pid} (run as root)")
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)


# -- the tree dies before anyone else holds the lock ----------------------------------------


def test_sigkill_of_locked_run_kills_the_whole_job_before_a_waiter_starts(
    procs, tmp_path, db, watch
):
    name = unique("kill9")
    pids, probe = tmp_path / "pids", tmp_path / "probe.json"
    first = locked_run(procs, name, "tree", "--pids", pids)
    wait_for_file(pids, procs=[first])
    tree = read_pids(pids)
    assert len(tree) == 4 and not all_dead(tree)
    token, _ = row_of(db, name)
    seen = watch(name, pids)

    before = lock_sessions(db)
    second = locked_run(procs, name, "probe", "--pids", pids, "--out", probe, options=WAITER)
    wait_until(lambda: lock_sessions(db) - before, 15, "the second locked_run never connected")
    killed_at = time.time()
    first.send_signal(signal.SIGKILL)
    result = procs.finish(second, timeout=30)
    assert result.returncode == 0, result.stderr
    found = json.loads(probe.read_text())
    assert found["alive"] == [], f"the first job's {found['alive']} ran when the second started"
    procs.finish(first, timeout=15)
    seen.stop()

    assert all_dead(tree)
    assert seen.overlaps(token) == []
    assert seen.last_alive() is not None and seen.last_alive() < found["time"]
    assert found["name"] == name
    assert int(found["token"]) > token
    took = found["time"] - killed_at
    print(f"\n[measure] SIGKILL of locked_run -> waiter's job started: {took:.3f}s")
    assert took < 5, f"the waiter started {took:.1f}s after the holder was killed"


def advisory_locks_of(db, backend):
    (count,) = db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s",
        [backend],
    ).fetchone()
    return count


def test_the_lock_session_outlives_a_killed_locked_run_until_its_job_is_gone(
    procs, tmp_path, db, watch
):
    """The guardian holds the lock connection's socket: with the guardian stopped, the
    SIGKILLed locked_run's server session (and its advisory key) stays up, and the waiter
    does not start; once the guardian runs again, it kills the job, exits, and only then
    the waiter starts."""
    name = unique("hold")
    pids, probe = tmp_path / "pids", tmp_path / "probe.json"
    first = locked_run(procs, name, "tree", "--pids", pids)
    wait_for_file(pids, procs=[first])
    tree = read_pids(pids)
    token, backend = row_of(db, name)
    assert advisory_locks_of(db, backend) == 1
    (guardian,) = [pid for pid, cmdline in children_of(first.pid) if b"guardian.py" in cmdline]
    seen = watch(name, pids)
    before = lock_sessions(db)
    second = locked_run(procs, name, "probe", "--pids", pids, "--out", probe, options=WAITER)
    wait_until(lambda: lock_sessions(db) - before, 15, "the second locked_run never connected")
    os.kill(guardian, signal.SIGSTOP)
    try:
        first.kill()
        first.wait(10)  # locked_run is gone (its pipes stay open in the job)
        # For a while (ten of the waiter's polls), the dead holder's session lives on.
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            assert advisory_locks_of(db, backend) == 1, "the lock session ended with locked_run"
            assert not probe.exists(), "the waiter started while the job ran"
            time.sleep(0.02)
        assert not all_dead(tree)
    finally:
        os.kill(guardian, signal.SIGCONT)
    result = procs.finish(second, timeout=30)
    assert result.returncode == 0, result.stderr
    found = json.loads(probe.read_text())
    seen.stop()
    assert found["alive"] == []
    assert all_dead(tree)
    assert seen.overlaps(token) == []


def test_sigterm_reaches_the_group_and_sigkill_follows_after_the_kill_grace(
    procs, tmp_path, db, watch
):
    name = unique("term")
    pids = tmp_path / "pids"
    runner = locked_run(
        procs, name, "tree", "--pids", pids, "--children-ignore-term", options=("--kill-grace", "1")
    )
    wait_for_file(pids, procs=[runner])
    tree = read_pids(pids)
    token, _ = row_of(db, name)
    seen = watch(name, pids)
    wait_until(lambda: seen.samples, 10, "the watch took no sample")
    termed_at = time.time()
    runner.send_signal(signal.SIGTERM)
    result = procs.finish(runner, timeout=20)
    seen.stop()

    assert result.returncode == 128 + signal.SIGTERM, result.stderr  # the leader's own end
    assert all_dead(tree)
    assert row_of(db, name) is None
    assert seen.overlaps(token) == [], "the lock was free while the job ran"
    last = seen.last_alive() - termed_at
    print(f"\n[measure] SIGTERM -> last process of the job seen running: {last:.3f}s")
    assert 0.8 < last < 4, "the children (ignoring SIGTERM) were not SIGKILLed at the grace"
    assert seen.first_without(token) > seen.last_alive()


def test_ctrl_c_reaches_the_job_exactly_once(procs, tmp_path):
    name = unique("int")
    pids, ints = tmp_path / "pids", tmp_path / "ints"
    runner = locked_run(procs, name, "count-int", "--pids", pids, "--out", ints)
    wait_for_file(pids, procs=[runner])
    # What a terminal does on Ctrl-C: SIGINT to its foreground process group, which is
    # locked_run's (subprocs starts it as the leader of a group of its own).
    os.killpg(runner.pid, signal.SIGINT)
    result = procs.finish(runner, timeout=15)
    assert result.returncode == 0, result.stderr
    assert ints.read_text() == "INT\n"


@pytest.mark.parametrize("ignoring", [False, True], ids=["leftovers-obey", "leftovers-ignore"])
def test_leftovers_of_a_clean_exit_are_stopped_before_the_lock_is_free(
    procs, tmp_path, db, watch, ignoring
):
    name = unique("leftover")
    pids = tmp_path / "pids"
    seen = watch(name, pids)
    job = ["tree", "--pids", pids, "--exit", "3"]
    if ignoring:
        job.append("--children-ignore-term")
    runner = locked_run(procs, name, *job, options=("--kill-grace", "0.5"))
    result = procs.finish(runner, timeout=20)
    seen.stop()
    tree = read_pids(pids)

    assert result.returncode == 3, result.stderr
    assert all_dead(tree)
    assert [s for s in seen.samples if s[1] is None and s[2]] == [], (
        "the lock was free while leftovers of the job ran"
    )
    if ignoring:  # SIGTERMed as the leader exits (ignored), SIGKILLed at the grace
        left = pids.stat().st_mtime  # the leader wrote the file and exited
        last = seen.last_alive() - left
        print(f"\n[measure] leader's exit -> leftovers ignoring SIGTERM last seen: {last:.3f}s")
        assert 0.4 < last < 3
        assert [s for s in seen.samples if s[0] > left + 0.3 and s[1] is not None and s[2]]


# -- lease loss: SIGKILL before a contender could take the lock, whatever the grace ------------


def test_lost_row_kills_the_job_at_once_whatever_the_grace(procs, tmp_path, db, watch):
    name = unique("gone")
    pids = tmp_path / "pids"
    runner = locked_run(
        procs,
        name,
        "tree",
        "--pids",
        pids,
        "--all-ignore-term",
        options=(*SMALL, "--kill-grace", "60"),
    )
    wait_for_file(pids, procs=[runner])
    tree = read_pids(pids)
    seen = watch(name, pids)
    released_at = time.time()
    assert force_release(name) is not None
    result = procs.finish(runner, timeout=20)
    seen.stop()

    assert result.returncode == EXIT_LOST, result.stderr
    assert all_dead(tree)
    killed = seen.last_alive() - released_at
    print(f"\n[measure] forced release -> job SIGKILLed: {killed:.3f}s (grace 60 s)")
    assert killed < 2, f"the job ran {killed:.1f}s after its row was gone"
    assert "kill grace" in result.stderr, result.stderr
    assert "terminating the command" in result.stderr


def stubborn_tree(procs, name, pids):
    """locked_run (kill grace 60) of a job tree whose every process ignores SIGTERM;
    returns the runner and the job's pids once they are all written."""
    runner = locked_run(
        procs,
        name,
        "tree",
        "--pids",
        pids,
        "--all-ignore-term",
        options=(*SMALL, "--kill-grace", "60"),
    )
    wait_for_file(pids, procs=[runner])
    return runner, read_pids(pids)


def test_missed_deadline_kills_the_job_before_a_contender_can_reclaim(procs, tmp_path, db, watch):
    """The lock's server session hangs: the holder concludes loss at its deadline and the
    job (ignoring SIGTERM, --kill-grace 60) is SIGKILLed before ``stale_after`` lets the
    waiting contender reclaim; the contender's job checks the first's processes at its start."""
    name = unique("deadline")
    pids, probe = tmp_path / "pids", tmp_path / "probe.json"
    runner, tree = stubborn_tree(procs, name, pids)
    token, backend = row_of(db, name)
    seen = watch(name, pids)
    with stopped_backend(db, backend):
        stopped_at = time.time()
        contender = locked_run(
            procs, name, "probe", "--pids", pids, "--out", probe, options=(*SMALL, *WAITER)
        )
        contended = procs.finish(contender, timeout=30)
        found = json.loads(probe.read_text())
        assert contended.returncode == 0, contended.stderr
    result = procs.finish(runner, timeout=20)
    seen.stop()

    assert found["alive"] == [], f"the first job's {found['alive']} ran when the contender started"
    assert all_dead(tree)
    assert seen.overlaps(token) == []
    killed = seen.last_alive() - stopped_at
    print(
        f"\n[measure] backend stopped -> job SIGKILLed {killed:.3f}s, "
        f"contender's job started {found['time'] - stopped_at:.3f}s (stale 3 s, grace 60 s)"
    )
    assert killed < 3.2
    assert result.returncode == EXIT_LOST, result.stderr
    assert "kill grace" in result.stderr, result.stderr


def test_exits_75_promptly_while_the_lock_connection_is_stuck(procs, tmp_path, db, watch):
    name = unique("stuck")
    pids = tmp_path / "pids"
    runner = locked_run(procs, name, "tree", "--pids", pids, options=(*SMALL, "--kill-grace", "10"))
    wait_for_file(pids, procs=[runner])
    tree = read_pids(pids)
    _, backend = row_of(db, name)
    seen = watch(name, pids)
    with stopped_backend(db, backend):
        stopped_at = time.time()
        result = procs.finish(runner, timeout=20)
        took = time.time() - stopped_at
        still_stopped = process_state(backend) == "T"
    seen.stop()

    print(f"\n[measure] backend stopped -> locked_run exited: {took:.3f}s (stale 3 s)")
    assert result.returncode == EXIT_LOST, result.stderr
    assert still_stopped  # it exited while its lock connection was still stuck
    assert all_dead(tree)
    assert took < 6, f"locked_run took {took:.1f}s to exit after losing its lease"


def test_if_the_guardian_dies_locked_run_kills_the_group_itself(procs, tmp_path, db, watch):
    name = unique("guardian")
    pids = tmp_path / "pids"
    runner = locked_run(procs, name, "tree", "--pids", pids, "--all-ignore-term")
    wait_for_file(pids, procs=[runner])
    tree = read_pids(pids)
    token, _ = row_of(db, name)
    (guardian,) = [pid for pid, cmdline in children_of(runner.pid) if b"guardian.py" in cmdline]
    seen = watch(name, pids)
    wait_until(lambda: seen.samples, 10, "the watch took no sample")
    os.kill(guardian, signal.SIGKILL)
    result = procs.finish(runner, timeout=20)
    seen.stop()

    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "guardian" in result.stderr
    assert all_dead(tree)
    assert row_of(db, name) is None
    assert seen.overlaps(token) == [], "the lock was free while the job ran"


def test_a_stopped_locked_run_cannot_let_its_job_outlive_the_lease(procs, tmp_path, db, watch):
    """locked_run itself hangs (SIGSTOP): its session stays up, its heartbeats stop, and a
    contender reclaims at ``stale_after``. The guardian's dead man's switch SIGKILLs the job
    (ignoring SIGTERM, --kill-grace 60) before that."""
    name = unique("hung")
    pids, probe = tmp_path / "pids", tmp_path / "probe.json"
    runner, tree = stubborn_tree(procs, name, pids)
    token, _ = row_of(db, name)
    seen = watch(name, pids)
    try:
        runner.send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        contender = locked_run(
            procs, name, "probe", "--pids", pids, "--out", probe, options=(*SMALL, *WAITER)
        )
        contended = procs.finish(contender, timeout=30)
        found = json.loads(probe.read_text())
        assert contended.returncode == 0, contended.stderr
    finally:
        runner.send_signal(signal.SIGCONT)
    result = procs.finish(runner, timeout=20)
    seen.stop()

    assert found["alive"] == [], f"the first job's {found['alive']} ran when the contender started"
    assert all_dead(tree)
    assert seen.overlaps(token) == []
    killed = seen.last_alive() - stopped_at
    print(
        f"\n[measure] locked_run stopped -> job SIGKILLed {killed:.3f}s, "
        f"contender's job started {found['time'] - stopped_at:.3f}s (stale 3 s, grace 60 s)"
    )
    assert result.returncode == EXIT_LOST, result.stderr
    assert "was lost" in result.stderr
