"""Attacks on the newest promises (issue 11): ``abandoned`` status, ``locked_run`` lending its
grant, schedule slots, a blocking acquire riding through an outage.

Real server, real processes. A test here that fails shows a bug that is not fixed yet
(each docstring says what the user sees); the others pin an invariant an attack did not
break. Faults that must hit one exact statement (its commit reached the server, its answer
never reached the client) go through :class:`ReplyCutter`, a proxy that reads the
PostgreSQL protocol just far enough to recognise that statement and its answer.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import uuid
import zoneinfo
from collections.abc import Callable
from pathlib import Path

import pytest

from django_pglock import sql
from tests import faultkit
from tests.faultkit import (  # noqa: F401  (fixtures "pg", "fdb")
    Db,
    fault_db_fixture,
    fault_server_fixture,
    require_local_backend,
    worker_env,
)
from tests.subprocs import open_db, pid_gone, wait_until

# -- a proxy that cuts one answer --------------------------------------------------------

_INCOMPLETE = object()


def _first_value(buffer: bytes) -> object:
    """The first column of the first row of one complete answer (up to ReadyForQuery) in
    ``buffer``; ``None`` when it has no row; ``_INCOMPLETE`` until ReadyForQuery came."""
    at, first = 0, None
    while at + 5 <= len(buffer):
        kind = buffer[at : at + 1]
        (length,) = struct.unpack("!i", buffer[at + 1 : at + 5])
        end = at + 1 + length
        if end > len(buffer):
            return _INCOMPLETE
        if kind == b"D" and first is None:
            (size,) = struct.unpack("!i", buffer[at + 7 : at + 11])
            first = None if size < 0 else buffer[at + 11 : at + 11 + size]
        if kind == b"Z":
            return first
        at = end
    return _INCOMPLETE


def _rst(sock: socket.socket) -> None:
    """Reset ``sock`` (shut down first: another thread may be blocked reading it)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class ReplyCutter:
    """``127.0.0.1:<port>`` forwarding to the fault server, everything passed on, except:
    once :meth:`arm` was called, the first answer (to a statement whose text contains
    ``marker``) whose first value satisfies ``cut_if`` is never delivered: the server has
    committed it (its ReadyForQuery came), then both sides of that connection are reset.
    ``cut`` is set then. Statements must be sent unprepared (their text each time:
    ``PGLOCK_FAULT_NO_PREPARE=1``)."""

    def __init__(self, upstream_port: int, marker: bytes, cut_if: Callable[[object], bool]):
        self.upstream_port = upstream_port
        self.marker = marker
        self.cut_if = cut_if
        self.armed = threading.Event()
        self.cut = threading.Event()
        self.cut_value: object = None
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self.armed.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), 5)
            except OSError:
                return
            self._sockets += [client, upstream]
            watching = threading.Event()
            threading.Thread(
                target=self._up, args=(client, upstream, watching), daemon=True
            ).start()
            threading.Thread(
                target=self._down, args=(client, upstream, watching), daemon=True
            ).start()

    def _up(self, client: socket.socket, upstream: socket.socket, watching: threading.Event):
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if not self.cut.is_set() and self.marker in data:
                    watching.set()  # before the statement can be answered
                upstream.sendall(data)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_WR)

    def _down(self, client: socket.socket, upstream: socket.socket, watching: threading.Event):
        pending = b""
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                if not watching.is_set():
                    client.sendall(data)
                    continue
                pending += data
                value = _first_value(pending)
                if value is _INCOMPLETE:
                    continue
                # Armed by the time of the answer: a statement sent before arm() may run
                # after what the test did next (another session's unlock).
                if self.armed.is_set() and not self.cut.is_set() and self.cut_if(value):
                    self.cut_value = value
                    self.cut.set()
                    _rst(client)
                    _rst(upstream)
                    return
                client.sendall(pending)
                pending = b""
                watching.clear()
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in self._sockets:
            _rst(sock)


# -- fixtures of the fault server ----------------------------------------------------------


def unique(label: str) -> str:
    return f"attack11-{label}-{uuid.uuid4().hex[:8]}"


def cut_env(pg, proxy: ReplyCutter, **pglock: object) -> dict[str, str]:
    """A worker's environment: through ``proxy``, unprepared statements."""
    return worker_env(pg.url(port=proxy.port), pglock=pglock or None, PGLOCK_FAULT_NO_PREPARE="1")


def status_of(procs, pg, name: str) -> dict[str, object]:
    """``pglock_status --json`` (a real subprocess, straight to the server): ``name``'s row."""
    result = procs.start(
        sys.executable, "-m", "django", "pglock_status", "--json", env=worker_env(pg.url())
    ).result()
    assert result.returncode == 0, result.stderr
    return {row["name"]: row for row in json.loads(result.stdout)}[name]


def run_outcome(fdb: Db, name: str, token: int) -> str | None:
    found = fdb.execute(
        "SELECT outcome FROM django_pglock_jobrun WHERE name = %s AND token = %s", [name, token]
    ).fetchone()
    return None if found is None else str(found[0])


# -- item 1: a live holder shown abandoned -------------------------------------------------

# Holds argv[1] (recorded), heartbeating every 0.3 s; says HELD <token> <row advisory>;
# on each "state" line says STATE <check()> <lease.lost>.
KEEPER = """
import sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True, heartbeat_interval=0.3, alert_after=5,
             stale_after=60).try_acquire()
print("HELD", lease.token, lease.advisory, flush=True)
for line in sys.stdin:
    try:
        lease.check()
        held = "held"
    except Exception as exc:
        held = type(exc).__name__
    print("STATE", held, lease.lost, flush=True)
"""

# One attempt at argv[1]: GRANTED <token> or GRANTED None.
CONTENDER = """
import sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1]).try_acquire()
print("GRANTED", lease.token if lease else None, flush=True)
if lease:
    lease.release()
"""


@pytest.mark.slow
def test_a_key_adoption_whose_answer_is_lost_leaves_a_live_holder_abandoned(pg, fdb, procs):
    """BUG. A lease granted while its advisory key was busy (``Key.WANTED``) takes the key
    later (``ADOPT_KEY``: takes the key, marks the row ``advisory``). When that statement
    commits but its answer is lost with the connection, the lease carries on, on the table
    path, with a new session that does not hold the key; its row still says ``advisory``.
    So the live holder is shown ``abandoned`` (``--check`` passes, its run is closed as
    ``lost`` while it runs), and the next contender takes the name at once: two holders,
    until the first one's next heartbeat finds its row gone."""
    name = unique("adopt")
    proxy = ReplyCutter(pg.port, b"SET advisory = true", lambda value: value == b"t")
    key = sql.advisory_key(name)
    try:
        fdb.execute("SELECT pg_advisory_lock(%s)", [key])  # a contender's statement, held
        keeper = procs.start(sys.executable, "-c", KEEPER, name, env=cut_env(pg, proxy), stdin=True)
        _, token, advisory = keeper.expect("HELD").split()
        assert advisory == "False"  # granted on the table path: it wants its key
        assert not fdb.row(name)["advisory"]
        proxy.arm()
        fdb.execute("SELECT pg_advisory_unlock(%s)", [key])
        assert proxy.cut.wait(30), (
            f"the key adoption was never cut: row {fdb.row(name)}, stderr {keeper.stderr_text}"
        )
        row = fdb.row(name)
        assert row is not None and row["token"] == int(token) and row["advisory"]
        cut_at = fdb.execute("SELECT now()").fetchone()[0]

        def holder_says() -> list[str]:
            keeper.send("state")
            return keeper.expect("STATE").split()[1:]

        # Either the holder concludes it lost the lease (fine: it stops), or it goes on and
        # heartbeats its row on a new session: then it is a live holder.
        wait_until(
            lambda: holder_says()[1] == "True" or fdb.row(name)["last_heartbeat"] > cut_at,
            30,
            "the holder neither heartbeated nor gave up after the cut",
        )
        if holder_says() != ["held", "False"]:
            return  # it gave the lease up: no live holder to misjudge
        state = status_of(procs, pg, name)["state"]
        run = run_outcome(fdb, name, int(token))
        contender = procs.start(sys.executable, "-c", CONTENDER, name, env=worker_env(pg.url()))
        granted = contender.expect("GRANTED").split()[1]
        seen = {"status": state, "run": run, "contender granted": granted}
        assert seen == {"status": "ok", "run": "running", "contender granted": "None"}, (
            f"holder {token} was alive and heartbeating, yet: {seen}"
        )
    finally:
        proxy.close()


# Takes argv[1] once (table path, recorded) through a proxy that loses the grant's answer:
# blocking (argv[2] == "wait") or not. Says GRANTED <token> or UNAVAILABLE, then exits.
TAKER = """
import sys
import django
django.setup()
from django_pglock import DatabaseUnavailable, Lock
lock = Lock(sys.argv[1], advisory=False, record=True, poll_interval=0.1)
try:
    if sys.argv[2] == "wait":
        lease = lock.acquire_or_raise(timeout=60)
    else:
        lease = lock.try_acquire()
    print("GRANTED", lease.token, flush=True)
    lease.release()
except DatabaseUnavailable:
    print("UNAVAILABLE", flush=True)
"""


def grant_cutter(pg) -> ReplyCutter:
    """Loses the answer to the first acquire that granted (its first value is the token)."""
    return ReplyCutter(pg.port, b"ON CONFLICT (name) DO NOTHING", lambda value: value is not None)


@pytest.mark.slow
def test_a_grant_whose_answer_is_lost_is_released_and_never_used_by_a_waiter(pg, fdb, procs):
    """HOLDS (item 4). The server commits a grant (table path, so no session end frees it)
    and the connection is lost before the answer: the blocking waiter gets a new grant of
    its own, with a higher token, soon; the lost grant's row is released by the process
    that made it (never used by anyone), and its run is closed as lost."""
    name = unique("lost-grant")
    proxy = grant_cutter(pg)
    try:
        proxy.arm()
        taker = procs.start(sys.executable, "-c", TAKER, name, "wait", env=cut_env(pg, proxy))
        line = taker.expect("GRANTED", 60)
        assert proxy.cut.is_set()
        lost_token, token = int(proxy.cut_value), int(line.split()[1])
        assert token > lost_token
        assert taker.finish() == 0, taker.stderr_text
        assert run_outcome(fdb, name, lost_token) == "lost"
        assert run_outcome(fdb, name, token) == "succeeded"
        assert fdb.row(name) is None
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_grant_whose_answer_is_lost_by_a_process_that_then_exits_blocks_the_name(pg, fdb, procs):
    """BUG (item 4). Same lost answer, but the attempt was non-blocking: it raises
    ``DatabaseUnavailable`` and the process ends (a cron job does). The orphaned grant is
    released only by the heartbeat thread's sweep, which dies with the process; at
    interpreter exit nothing sweeps it. On the table path (``ADVISORY = False``, behind a
    transaction-mode PgBouncer) the name is then held by nobody, ``ok`` in
    ``pglock_status``, until ``stale_after`` (600 s by default): every run is skipped."""
    name = unique("orphan-at-exit")
    proxy = grant_cutter(pg)
    try:
        proxy.arm()
        taker = procs.start(sys.executable, "-c", TAKER, name, "once", env=cut_env(pg, proxy))
        taker.expect("UNAVAILABLE", 60)
        assert taker.finish() == 0, taker.stderr_text
        assert proxy.cut.is_set()
        orphan = int(proxy.cut_value)
        gone = faultkit.wait_until(lambda: fdb.row(name) is None, 10)
        left = fdb.row(name)
        assert gone, (
            f"grant {orphan} (nobody received it, its process has exited) still blocks "
            f"{name!r}: row {left}, state {status_of(procs, pg, name)['state']!r}"
        )
    finally:
        proxy.close()


# -- item 1: keys are per database -------------------------------------------------------

HOLD_FOREVER = """
import sys, time
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True).try_acquire()
print("HELD", lease.token, lease.advisory, flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture
def second_db(pg):
    """A second database on the fault server, with the lock tables."""
    name = "faults_second"
    with pg.connect("postgres") as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
    if not exists:
        pg.create_database(name)
        pg.migrate(name)
    return name


@pytest.mark.slow
def test_the_same_name_in_two_databases_of_one_server_is_judged_per_database(
    pg, fdb, second_db, procs
):
    """HOLDS (item 1). Advisory keys are per database: a live holder of ``name`` in one
    database says nothing about the row of ``name`` in another. The killed holder's row
    there is ``abandoned`` (and taken at once), the live one here stays ``ok``."""
    name = unique("two-dbs")
    here = procs.start(sys.executable, "-c", HOLD_FOREVER, name, env=worker_env(pg.url()))
    there = procs.start(sys.executable, "-c", HOLD_FOREVER, name, env=worker_env(pg.url(second_db)))
    assert here.expect("HELD").split()[2] == "True"
    assert there.expect("HELD").split()[2] == "True"
    there.kill()
    there.wait()
    other = Db(pg.url(second_db))
    try:
        wait_until(
            lambda: (
                not other.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = 'django_pglock'"
                    " AND datname = current_database()"
                ).fetchone()
            ),
            30,
            "the killed holder's session did not end",
        )
        result = procs.start(
            sys.executable,
            "-m",
            "django",
            "pglock_status",
            "--json",
            env=worker_env(pg.url(second_db)),
        ).result()
        (row,) = [r for r in json.loads(result.stdout) if r["name"] == name]
        assert row["state"] == "abandoned"
        assert status_of(procs, pg, name)["state"] == "ok"
        contender = procs.start(
            sys.executable, "-c", CONTENDER, name, env=worker_env(pg.url(second_db))
        )
        assert contender.expect("GRANTED").split()[1] != "None"  # taken at once there
        refused = procs.start(sys.executable, "-c", CONTENDER, name, env=worker_env(pg.url()))
        assert refused.expect("GRANTED").split()[1] == "None"  # and still held here
    finally:
        other.close()
        here.kill()


# -- item 2: locked_run lends its grant -----------------------------------------------------

JOB = "lease_job"  # tests/testapp: a @singleton_job command that reports current_lease()

# locked_run's job: starts `lease_job` detached (a session of its own, as a daemon or
# `setsid` does), waits until that process runs its body, and exits.
DETACH = """
import os, subprocess, sys, time
out, go, log = sys.argv[1:4]
with open(log, "ab") as sink:
    job = subprocess.Popen(
        [sys.executable, "-m", "django", "lease_job", "--out", out, "--wait-for", go],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink,
    )
deadline = time.monotonic() + 60
while not os.path.exists(out) and job.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
"""


@pytest.fixture
def test_db(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        yield conn


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_a_process_that_left_the_jobs_group_does_not_run_under_its_grant(procs, tmp_path):
    """BUG (item 2). A descendant of ``locked_run`` that left the job's process group
    (``setsid``, a daemon) is not part of the job: ``locked_run`` neither waits for it nor
    stops it on loss (README). Yet the grant is lent to it (its ancestors include the
    holder's pid), so its ``@singleton_job`` body runs under ``locked_run``'s token, and
    goes on after ``locked_run`` released the lock: the next instance is granted the name
    while that body still runs. Two holders."""
    from django_pglock import Lock

    out, go, log = tmp_path / "out.json", tmp_path / "go", tmp_path / "detached.log"
    runner = procs.django(
        "locked_run", "--name", JOB, "--shell", "--", sys.executable, "-c", DETACH, out, go, log
    )
    detached = None
    try:
        wait_until(lambda: out.exists() or runner.poll() is not None, 60, "nothing happened")
        if not out.exists():
            return  # the detached process did not run its body: nothing to overlap
        seen = json.loads(out.read_text())
        detached = seen["pid"]
        # The job (locked_run's child) has ended; the detached body waits for `go`.
        faultkit.wait_until(lambda: runner.poll() is not None, 10)
        running = not pid_gone(detached)
        successor = Lock(JOB).try_acquire()  # the next instance, on any host
        if successor is not None:
            successor.release()
        lease = seen["lease"] or {}
        both = running and successor is not None and lease.get("type") == "InheritedLease"
        assert not both, (
            f"pid {detached} runs its body under locked_run's grant (token {lease.get('token')}) "
            f"while the next instance was granted token {successor and successor.token}"
        )
    finally:
        go.touch()
        if detached is not None:
            wait_until(lambda: pid_gone(detached), 60, "the detached job did not end")
        assert procs.finish(runner).returncode == 0


# -- item 3: schedule slots ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_a_job_under_locked_run_that_skipped_its_slot_is_not_recorded_as_succeeded(
    procs, tmp_path, test_db
):
    """BUG (item 3). ``locked_run scheduled_lease_job`` (no ``--schedule``): the command runs
    under the grant, finds its schedule slot started elsewhere and skips without running
    its body ("Skipped ...: schedule slot ... already started"), exit 0. The run history
    says ``succeeded`` (reason empty), although the README promises ``skipped`` with the
    reason ``slot-taken`` for a call that did not run its body."""
    from django_pglock.schedule import ScheduleSlot

    job = "scheduled_" + JOB
    test_db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [job])
    test_db.execute("DELETE FROM django_pglock_jobrun WHERE name = %s", [job])
    # Another host started this minute's slot, and the next two (whichever the run meets).
    now = test_db.execute("SELECT now()").fetchone()[0]
    schedule = ScheduleSlot("* * * * *", job)
    for ahead in (0, 60, 120):
        slot = schedule.current_slot(now + datetime.timedelta(seconds=ahead))
        test_db.execute(
            "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at)"
            " VALUES (%s, %s, 'elsewhere:1:cafe', now())",
            [job, slot],
        )
    out = tmp_path / "out.json"
    try:
        result = procs.run_django("locked_run", job, "--out", out)
        assert result.returncode == 0, result.stderr
        assert "schedule slot" in result.stderr and not out.exists()  # the body never ran
        (run,) = test_db.execute(
            "SELECT outcome, reason FROM django_pglock_jobrun WHERE name = %s", [job]
        ).fetchall()
        assert run == ("skipped", "slot-taken"), f"recorded as {run} for a body that never ran"
    finally:
        test_db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [job])


def _db_second(test_db) -> float:
    return float(test_db.execute("SELECT extract(second FROM clock_timestamp())").fetchone()[0])


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_one_run_under_locked_run_schedule_claims_one_slot(procs, tmp_path, test_db):
    """BUG (item 3). ``locked_run --schedule`` claims the slot when it is granted; its
    ``@singleton_job(schedule=...)`` job computes the slot again when it starts, from the
    database clock then. Granted at hh:mm:53 (after a ``--wait``), it claims slot hh:mm;
    the job starts a few seconds later, past the tolerance boundary (hh:mm:55), computes
    slot hh:mm+1, which nobody claimed, and claims it too. One run, two slots: at hh:mm+1
    every host finds that slot taken and skips (``slot-taken``), so that tick never runs."""
    from django_pglock import Lock

    job = "scheduled_" + JOB
    test_db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [job])
    out = tmp_path / "out.json"
    holder = Lock(job).try_acquire()  # what the --wait waits for
    assert holder is not None
    try:
        if _db_second(test_db) > 40:
            time.sleep(61 - _db_second(test_db))
        # The job's process starts 3 s after the grant (a slow start, a wrapper script).
        runner = procs.django(
            "locked_run", "--schedule", "* * * * *", "--wait", "--poll-interval", "0.1",
            "--name", job, "--shell", "--", "sh", "-c",
            'sleep 3; exec "$0" -m django scheduled_lease_job --out "$1"', sys.executable, out,
        )  # fmt: skip
        time.sleep(max(0.0, 52.5 - _db_second(test_db)))
    finally:
        holder.release()
    result = procs.finish(runner)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["lease"]["type"] == "InheritedLease"  # it ran
    claims = test_db.execute(
        "SELECT slot, holder FROM django_pglock_scheduleclaim WHERE name = %s ORDER BY slot",
        [job],
    ).fetchall()
    test_db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [job])
    assert len(claims) == 1, f"one run claimed {len(claims)} slots: {claims}"


def _slot(expression: str, zone: str, utc: datetime.datetime) -> datetime.datetime:
    from django.utils import timezone

    from django_pglock.schedule import ScheduleSlot

    with timezone.override(zoneinfo.ZoneInfo(zone)):
        return ScheduleSlot(expression, "dst").current_slot(utc, tolerance=5.0)


@pytest.mark.parametrize(
    "expression, period", [("*/15 * * * *", 900), ("0 * * * *", 3600), ("* * * * *", 60)]
)
def test_a_tick_in_the_repeated_hour_of_a_dst_change_is_a_slot_of_its_own(expression, period):
    """BUG (item 3). Europe/Berlin, 2024-10-27: 02:00-03:00 local happens twice (CEST, then
    CET from 01:00 UTC). A run in the second pass is given the slot of the first pass, an
    hour earlier (``local + 1 s`` drops the fold): every run there finds its slot taken
    and is skipped as ``slot-taken`` although nobody started that tick; a host firing a
    few seconds early claims the right slot while the on-time ones compute the old one.
    Invariant: a run at ``now`` belongs to a tick at most ``SCHEDULE_TOLERANCE`` ahead and
    less than one period behind."""
    utc = datetime.timezone.utc
    start = datetime.datetime(2024, 10, 26, 23, 0, 30, tzinfo=utc)
    wrong = []
    for minute in range(0, 4 * 60, 1):
        now = start + datetime.timedelta(minutes=minute)
        slot = _slot(expression, "Europe/Berlin", now)
        behind = now.timestamp() - slot.timestamp()
        if not -5.0 <= behind < period:
            wrong.append(f"{now:%H:%M:%S} UTC -> {slot.isoformat()} ({behind:+.0f} s)")
    assert not wrong, f"{len(wrong)} runs got a slot that is not theirs, e.g. {wrong[:3]}"


# -- item 4: a blocking acquire with a timeout ---------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_a_blocking_acquire_on_an_unresponsive_server_ends_near_its_timeout():
    """BUG (item 4). ``acquire_or_raise(timeout=1)`` (also ``acquire(timeout=…)``,
    ``--wait --timeout``) on a server process that stopped answering (SIGSTOP here: a hung
    backend, a stalled network that still ACKs) returns only when the statement's own
    deadline (32 s) passes: "only its timeout ends the wait" does not hold, a caller that
    budgeted 1 s waits 32. (Opening a session likewise takes up to ``connect_timeout``,
    10 s per host, whatever the timeout.)"""
    from django_pglock import Lock
    from django_pglock.connection import get_connection

    conn = get_connection("default")
    conn.ensure_open()
    backend = conn.backend_pid
    require_local_backend(backend)
    done = threading.Event()
    outcome: list[object] = []

    def attempt() -> None:
        started = time.monotonic()
        try:
            outcome.append(Lock(unique("stopped"), advisory=False).acquire_or_raise(timeout=1))
        except Exception as exc:  # DatabaseUnavailable is the expected answer
            outcome.append(exc)
        outcome.append(time.monotonic() - started)
        done.set()

    os.kill(backend, signal.SIGSTOP)
    try:
        wait_until(
            lambda: Path(f"/proc/{backend}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
            5,
            "the server process did not stop",
        )
        threading.Thread(target=attempt, daemon=True).start()
        returned = done.wait(6)
    finally:
        os.kill(backend, signal.SIGCONT)
    assert done.wait(60)
    if hasattr(outcome[0], "release"):
        outcome[0].release()
    assert returned, (
        "acquire_or_raise(timeout=1) had not returned 6 s later; it returned only once the "
        f"server process was resumed, after {outcome[1]:.1f} s, with {outcome[0]!r}"
    )


# -- item 5: secrets in what commands print and store --------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_a_quoted_libpq_password_never_reaches_stderr_or_the_run_history(procs, test_db):
    """BUG (item 5). libpq's own syntax for a password with a space is a quoted value
    (``password='two words'``). ``locked_run`` redacts only up to the first space: the
    rest of the password is printed in the ``Skipped`` line and stored in the run
    history (``JobRun.description``, shown by the admin) and on the lock row."""
    from django_pglock import Lock

    name = unique("quoted")
    secret = "s3cret words"
    dsn = f"host=db.internal dbname=app password='{secret}'"
    program = ("--shell", "--", sys.executable, "-c", "pass", dsn)
    holder = Lock(name).try_acquire()
    try:
        skipped = procs.run_django("locked_run", "--name", name, *program)
    finally:
        holder.release()
    ran = procs.run_django("locked_run", "--name", name, *program)
    assert skipped.returncode == 0 and ran.returncode == 0, skipped.stderr + ran.stderr
    stored = [
        row[0]
        for row in test_db.execute(
            "SELECT description FROM django_pglock_jobrun WHERE name = %s", [name]
        ).fetchall()
    ]
    assert len(stored) == 2 and all("password=***" in text for text in stored), stored
    leaked = {
        where: text
        for where, text in (("stderr", skipped.stderr), *(("JobRun", t) for t in stored))
        if "words" in text or "s3cret" in text
    }
    assert not leaked, f"part of the password is shown: {leaked}"
