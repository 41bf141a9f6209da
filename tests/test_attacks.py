"""Attacks on the promises of README.md / DESIGN.md §2, on a real server with real processes.

Each test reproduces a way the lock was held twice, leaked, or hung, found by attacking
the code; each failed before its fix and now shows the promise holds. Exclusion is judged
from the jobs' own O_APPEND log (``ENTER``/``EXIT`` lines with ``time.time()``), never from
the library's own view.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from django_pglock import Lock, LockError, protocol, sql
from django_pglock.connection import get_connection
from django_pglock.states import State
from tests import faultkit
from tests.faultkit import assert_exclusive, grants, read_log, require_local_backend
from tests.subprocs import open_db, wait_for_file, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

TABLE = "django_pglock_joblock"


@pytest.fixture
def db(pg_url, test_db_name):
    """A separate autocommit session on the test database: the view of another process."""
    with open_db(pg_url, test_db_name) as conn:
        yield conn


@pytest.fixture
def db2(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        yield conn


def unique(label: str) -> str:
    return f"attack-{label}-{uuid.uuid4().hex[:8]}"


def log_event(path: Path, event: str, token: int, name: str) -> None:
    """One line of the shared O_APPEND job log (the format of tests/chaos_worker.py)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        line = f"{event} {os.getpid()} {token} {time.time():.6f} {time.monotonic():.6f} {name}\n"
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def advisory_holds(db, backend_pid: int, name: str) -> int:
    """Whether the server process holds the advisory key of ``name`` (0 or 1)."""
    key = sql.advisory_key(name)
    (count,) = db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s"
        " AND objsubid = 1 AND classid = %s::oid AND objid = %s::oid",
        [backend_pid, (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF],
    ).fetchone()
    return int(count)


# A contender in another process: one non-blocking attempt (or blocking with a timeout),
# and on a grant an ENTER line in the job log, then EXIT once told to stop.
CONTENDER = textwrap.dedent(
    """
    import os, sys, time
    import django
    django.setup()
    from django_pglock import Lock
    name, log, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    def event(kind, token):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        line = f"{kind} {os.getpid()} {token} {time.time():.6f} {time.monotonic():.6f} {name}"
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
    lock = Lock(name, heartbeat_interval=0.3, alert_after=0.9, stale_after=60, poll_interval=0.05)
    lease = lock.acquire_or_raise(timeout) if timeout > 0 else lock.try_acquire()
    if lease is None:
        print("REFUSED", flush=True)
        sys.exit(0)
    event("ENTER", lease.token)
    print("GRANTED", lease.token, flush=True)
    sys.stdin.readline()
    event("EXIT", lease.token)
    lease.release()
    print("DONE", flush=True)
    """
)


def python_child(procs, code: str, *args: object):
    """``python -c code args`` with a stdin pipe (a tests.procs.Proc)."""
    return procs.start(sys.executable, "-c", code, *args, stdin=True)


class JobTimeout(BaseException):
    """What RQ's / Celery's SIGALRM handler raises in the middle of whatever runs."""


# -- 1. an interrupted release that completed unlocks the next lease's key -------------------


def test_an_interrupted_release_never_unlocks_the_next_leases_key(db, db2, procs, tmp_path):
    """A job-timeout signal lands during ``release()`` after the server has already run
    the release (row deleted, key unlocked) but before the client read the answer. The
    lease stays RELEASING with its key marked HELD; the same worker takes the name again
    (the key, count 1, on the same session). The heartbeat thread then retries the old
    release, whose unconditional ``pg_advisory_unlock`` gives back the *new* lease's key:
    the new row says ``advisory`` but its key is free, so any contender takes it over at
    once while the new holder believes it holds the lock."""
    name = unique("unlock")
    log = tmp_path / "jobs.log"
    options = dict(heartbeat_interval=0.3, alert_after=0.9, stale_after=60)
    first = Lock(name, **options).try_acquire()
    assert first is not None and first.advisory
    backend = get_connection("default").backend_pid
    log_event(log, "ENTER", first.token, name)

    # Another session holds the row (KEY SHARE, as a guard would): the release's DELETE waits.
    db.execute("BEGIN")
    db.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s FOR KEY SHARE", [name])

    def job_timeout(signum, frame):
        # Let the DELETE through, wait until the server has run it (row gone), then
        # raise, as a job timeout would, before the client has read the answer.
        db.execute("COMMIT")
        deadline = time.monotonic() + 10
        while db2.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s", [name]).fetchone():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        raise JobTimeout("job exceeded its time limit")

    previous = signal.signal(signal.SIGALRM, job_timeout)
    try:
        log_event(log, "EXIT", first.token, name)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(JobTimeout):
            first.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    # The worker goes on to its next run of the same job.
    second = Lock(name, **options).try_acquire()
    assert second is not None and second.advisory
    log_event(log, "ENTER", second.token, name)
    # The heartbeat thread settles the old release...
    wait_until(lambda: first.state is State.RELEASED, 10, "the old release never settled")
    # ...and a contender in another process tries once.
    contender = python_child(procs, CONTENDER, name, log, 0)
    line = contender.read_line(60)
    second_lost_then = second.lost
    if line.startswith("GRANTED"):
        # A careful job stops as soon as lease.lost turns true: the overlap is how long
        # this holder went on believing it held the lock (about one heartbeat interval).
        wait_until(lambda: second.lost, 10, "the new holder never learned of its loss")
        contender.send("stop")
        contender.expect("DONE")
    log_event(log, "EXIT", second.token, name)
    keys_now = advisory_holds(db, backend, name)
    second.release()
    assert_exclusive(grants(read_log(log)))
    assert line == "REFUSED", (
        f"the contender got {name!r} ({line}) while this process held it (lost={second_lost_then})"
    )
    assert keys_now == 1


# -- 2. locked_run stopped before its dead man's switch is armed -----------------------------

# A job for locked_run --shell: logs ENTER (its lock name and token come from the
# environment), works until killed; SIGTERM logs EXIT and ends it.
LOGGING_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    log, pidfile = sys.argv[1], sys.argv[2]
    name, token = os.environ["DJANGO_PGLOCK_NAME"], os.environ["DJANGO_PGLOCK_TOKEN"]
    def event(kind):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        line = f"{kind} {os.getpid()} {token} {time.time():.6f} {time.monotonic():.6f} {name}"
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
    def term(signum, frame):
        event("EXIT")
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    event("ENTER")
    with open(pidfile + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    while True:
        time.sleep(0.01)  # the work
    """
)
SMALL = ("--heartbeat-interval", "0.2", "--alert-after", "0.6", "--stale-after", "3")


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(word) for word in text.split()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def write_job(tmp_path: Path) -> Path:
    job = tmp_path / "logging_job.py"
    job.write_text(LOGGING_JOB)
    return job


def test_a_locked_run_stopped_as_it_starts_its_guardian_never_lets_two_jobs_run(procs, tmp_path):
    """locked_run hangs (SIGSTOP, or a machine too busy to schedule it) between starting
    the guardian and sending it the first ``expire`` order: the guardian starts the job
    with ``expire_at = inf``. Heartbeats stop, a contender reclaims at ``stale_after``, and
    the first job ran on: the dead man's switch that the README promises for "a hung
    locked_run" was not armed yet. It is now armed before the guardian starts."""
    name = unique("unarmed")
    log, job = tmp_path / "jobs.log", write_job(tmp_path)
    pid1, pid2 = tmp_path / "job1.pid", tmp_path / "job2.pid"
    first = procs.django(
        "locked_run",
        "--name",
        name,
        *SMALL,
        "--kill-grace",
        "60",
        "--shell",
        "--",
        sys.executable,
        job,
        log,
        pid1,
    )
    # Stop locked_run the moment it forks its guardian (before the guardian has even
    # exec'd, so before it can report the job started).
    deadline = time.monotonic() + 60
    while not children(first.pid):
        assert first.poll() is None, first.result().stderr
        assert time.monotonic() < deadline, "locked_run never started its guardian"
    os.kill(first.pid, signal.SIGSTOP)
    died: list[float] = []
    try:
        wait_for_file(pid1, 30)
        job1 = int(pid1.read_text())

        def watch_job1():  # when the first job is first seen dead (5 ms resolution)
            while alive(job1):
                time.sleep(0.005)
            died.append(time.time())

        watcher = threading.Thread(target=watch_job1, daemon=True)
        watcher.start()
        contender = procs.django(
            "locked_run",
            "--name",
            name,
            *SMALL,
            "--wait",
            "--poll-interval",
            "0.05",
            "--shell",
            "--",
            sys.executable,
            job,
            log,
            pid2,
        )
        wait_for_file(pid2, 30, procs=[contender])
        job1_alive_after_contender = alive(job1)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    wait_until(lambda: not alive(job1), 30, "the first job never ended")
    watcher.join(30)
    ended = died[0]
    contender.signal(signal.SIGTERM)
    procs.finish(contender, 30)
    procs.finish(first, 30)
    assert_exclusive(grants(read_log(log), ends={job1: ended}))
    assert not job1_alive_after_contender


# -- 3. a job member whose main thread exited looks "gone" while it still works ---------------

# locked_run --shell -- python THIS leader LOG READY: the leader starts a helper in its
# process group and exits. The helper's main thread ends with the raw exit syscall (as
# pthread_exit does); its worker thread goes on working. /proc shows such a process as
# "Z" (its thread-group leader is a zombie) although it runs.
ZOMBIE_LEADER_JOB = textwrap.dedent(
    """
    import ctypes, os, subprocess, sys, threading, time
    mode, log, ready = sys.argv[1], sys.argv[2], sys.argv[3]
    name, token = os.environ["DJANGO_PGLOCK_NAME"], os.environ["DJANGO_PGLOCK_TOKEN"]
    def event(kind):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        line = f"{kind} {os.getpid()} {token} {time.time():.6f} {time.monotonic():.6f} {name}"
        os.write(fd, (line + "\\n").encode())
        os.close(fd)
    if mode == "leader":
        subprocess.Popen([sys.executable, sys.argv[0], "helper", log, ready])
        while not os.path.exists(ready):
            time.sleep(0.01)
        sys.exit(0)
    def work():
        event("ENTER")
        with open(ready + ".tmp", "w") as out:
            out.write(str(os.getpid()))
        os.rename(ready + ".tmp", ready)
        while True:
            event("WORK")
            time.sleep(0.02)
    threading.Thread(target=work).start()
    while not os.path.exists(ready):
        time.sleep(0.01)
    ctypes.CDLL(None).syscall(60, 0)  # SYS_exit on x86_64: this thread only
    """
)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw syscall number for x86_64")
def test_a_job_process_whose_main_thread_exited_is_not_taken_for_gone(procs, tmp_path):
    """The guardian's ``group_alive`` counted a member whose /proc state is ``Z`` as gone.
    A process whose main thread has exited while its other threads run shows ``Z``: the
    guardian sent no SIGTERM, reported the group gone, locked_run released the lock, and a
    contender's job started while the helper's thread still worked under the old grant.
    Such a member now counts as alive (its thread count)."""
    name = unique("zombie-leader")
    log = tmp_path / "jobs.log"
    job = tmp_path / "zombie_job.py"
    job.write_text(ZOMBIE_LEADER_JOB)
    ready, pid2 = tmp_path / "helper.pid", tmp_path / "job2.pid"
    helper = None
    try:
        first = procs.django(
            "locked_run",
            "--name",
            name,
            *SMALL,
            "--kill-grace",
            "1",
            "--shell",
            "--",
            sys.executable,
            job,
            "leader",
            log,
            ready,
        )
        wait_for_file(ready, 30, procs=[first])
        helper = int(ready.read_text())
        contender = procs.django(
            "locked_run",
            "--name",
            name,
            *SMALL,
            "--wait",
            "--poll-interval",
            "0.05",
            "--shell",
            "--",
            sys.executable,
            write_job(tmp_path),
            log,
            pid2,
        )
        wait_for_file(pid2, 30, procs=[contender])
        entered = max(e.wall for e in read_log(log) if e.kind == "ENTER")

        def helper_worked_after_contender():
            return [
                e
                for e in read_log(log)
                if e.pid == helper and e.kind == "WORK" and e.wall > entered
            ]

        # A helper still at work logs every 20 ms: a second of silence says it stopped.
        worked = faultkit.wait_until(helper_worked_after_contender, 1.0)
    finally:
        if helper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)
    # The helper's last sign of work ends its grant: it writes every 20 ms while it runs.
    ended = max(e.wall for e in read_log(log) if e.pid == helper)
    contender.signal(signal.SIGTERM)
    procs.finish(contender, 30)
    procs.finish(first, 30)
    assert_exclusive(grants(read_log(log), ends={helper: ended}))
    assert not worked


# -- 4. a failed release still pending when the process exits is never retried ----------------

RELEASE_THEN_EXIT = textwrap.dedent(
    """
    import sys
    import django
    django.setup()
    from django_pglock import Lock, LockError
    from django_pglock import connection
    connection.LOCK_TIMEOUT = "300ms"  # only to keep the test short (5 s by default)
    name = sys.argv[1]
    lease = Lock(name, advisory=False, heartbeat_interval=0.5, alert_after=1.5,
                 stale_after=60).try_acquire()
    print("READY", lease.token, flush=True)
    sys.stdin.readline()
    try:
        lease.release()
        print("RELEASED", flush=True)
    except LockError as exc:
        print("FAILED", str(exc).splitlines()[0], flush=True)
    sys.stdin.readline()
    print("EXITING", flush=True)
    """
)


def test_a_failed_release_pending_at_exit_is_retried_before_the_process_ends(db, procs):
    """README: "A release that fails ... the heartbeat thread retries the delete until it
    settles, so the name is free within a few retries after the obstacle ends". A cron
    job's process typically exits right after its ``with`` block: the pending retry dies
    with the daemon heartbeat thread, and ``release_all_at_exit`` skips leases already in
    RELEASING. On the table path (ADVISORY=False, the README's advice behind a
    transaction-mode pooler) the name stays blocked for ``stale_after`` (600 s by default)
    although nobody wants it."""
    name = unique("exit-leak")
    child = python_child(procs, RELEASE_THEN_EXIT, name)
    token = int(child.expect("READY", 60).split()[1])
    db.execute("BEGIN")  # a reader holds the row for a moment (a guard, a report...)
    db.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s FOR KEY SHARE", [name])
    child.send("release")
    assert child.read_line(30).startswith("FAILED")
    db.execute("COMMIT")  # the obstacle ends
    child.send("exit")
    child.expect("EXITING")
    assert child.wait(30) == 0
    # The name should be free within a few retries (heartbeat_interval 0.5 s)...
    try:
        wait_until(
            lambda: db.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s", [name]).fetchone() is None,
            5,
            "",
        )
        leaked = False
    except pytest.fail.Exception:
        leaked = True
    found = db.execute(f"SELECT token FROM {TABLE} WHERE name = %s", [name]).fetchone()
    assert not leaked, (
        f"row of token {token} still blocks {name!r} after its process exited: {found}"
    )


# -- 5. a lock call on an unresponsive server never returns ------------------------------------


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


def test_try_acquire_on_an_unresponsive_server_returns_in_bounded_time(db, monkeypatch):
    """README: "A dead or partitioned server is noticed within about 25 s even with a
    statement in flight" and "Failure is bounded". A server process that stops answering
    (SIGSTOP here; a hung backend, a full disk, a stalled middlebox that still ACKs) never
    trips statement_timeout (the backend enforces it) nor tcp_user_timeout/keepalives (the
    peer's kernel ACKs everything): ``try_acquire()`` (blocking=False!) waited for ever.
    Every lock statement now has a client-side deadline (32 s; 1 s here, to keep it short)."""
    monkeypatch.setattr(protocol, "STATEMENT_DEADLINE", 1.0)
    conn = get_connection("default")
    conn.ensure_open()
    backend = conn.backend_pid
    require_local_backend(backend)
    done = threading.Event()
    outcome: list[object] = []
    stuck = unique("stuck")

    def attempt():
        try:
            outcome.append(Lock(stuck, advisory=False).try_acquire())
        except BaseException as exc:  # LockError is a fine answer; silence is not
            outcome.append(exc)
        done.set()

    os.kill(backend, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(backend) == "T", 5, "backend did not stop")
        threading.Thread(target=attempt, daemon=True).start()
        returned = done.wait(30)
    finally:
        os.kill(backend, signal.SIGCONT)
    done.wait(30)
    for item in outcome:
        if hasattr(item, "release"):
            item.release()
    assert returned, "try_acquire(blocking=False) did not return within 30 s"
    assert isinstance(outcome[0], LockError) and "no answer within 1 s" in str(outcome[0])
    # The session was given up; the next attempt opens a new one and works.
    lease = Lock(unique("after-stuck")).try_acquire()
    assert lease is not None and conn.backend_pid != backend
    lease.release()
    # The given-up server process was ended from the new session, so the acquire it still
    # held never granted a lock nobody receives (table path: it would block the name).
    wait_until(
        lambda: (
            not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend]).fetchone()
        ),
        30,
        "the given-up server process still runs",
    )
    assert db.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s", [stuck]).fetchone() is None
    again = Lock(stuck, advisory=False).try_acquire()
    assert again is not None
    again.release()
