"""Edges of django_pglock that the scenario tests do not reach, each on a real server.

Every test here drives one path of the library that only a rare event takes: an
interruption at a given instant of a statement, a race between two threads, a pooler,
a malformed order to the guardian, a child process, an operator's odd input. The event is
produced for real (a signal handler that raises, a stopped server process, a thread held
at a lock, a second session that holds a row or a table), and the test asserts what the
library does about it, as seen from the database or from outside the process.

Races are made deterministic by holding the lock the other thread needs and waiting until
that thread is seen (in its stack) blocked on it; nothing here waits a fixed time.

Some reproduce bugs these paths showed, since fixed: a session given up after an
interruption is ended on the server, the heartbeat thread survives a lock socket closed
while it gathers them, and the orphan sweep spares leases held through another alias.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import copy
import datetime
import fcntl
import inspect
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import termios
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings
from django.urls import reverse
from psycopg import sql as pgsql

from django_pglock import (
    Lock,
    LockNotHeld,
    heartbeat,
    keys,
    protocol,
    sessionevents,
    signals,
    singleton_job,
    sql,
)
from django_pglock import attempt as attempt_module
from django_pglock import connection as connection_module
from django_pglock.aio import _Handoff
from django_pglock.checks import check_database, check_settings
from django_pglock.connection import LockConnection, get_connection, on_session_end
from django_pglock.events import configured_metrics
from django_pglock.guardian import group_alive
from django_pglock.heartbeat import registry
from django_pglock.management.commands import locked_run
from django_pglock.models import JobRun, ScheduleClaim
from django_pglock.options import Option
from django_pglock.schedule import ScheduleSlot
from django_pglock.states import Key, State
from django_pglock.supervisor import GuardedJob
from tests.faultkit import require, require_local_backend

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

REPO_ROOT = Path(__file__).resolve().parent.parent
TABLE = "django_pglock_joblock"
WAIT = 30.0  # generous: the suite must hold when every core is busy


class JobTimeout(BaseException):
    """What a job runner's SIGALRM handler raises in the middle of whatever runs."""


class EdgeMetrics:
    """A metrics hook for DJANGO_PGLOCK['METRICS'] (importable as tests.test_edges.EdgeMetrics)."""

    def __init__(self):
        self.calls = []

    def acquired(self, name, seconds):
        self.calls.append(("acquired", name))


# -- helpers -----------------------------------------------------------------------------------


def unique(label):
    return f"edge-{label}-{uuid.uuid4().hex[:8]}"


def wait_until(predicate, timeout=WAIT, message="condition not reached"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{message} within {timeout}s")
        time.sleep(0.005)


def frames(thread):
    """The Python frames ``thread`` is in now, innermost first."""
    frame = sys._current_frames().get(thread.ident)
    found = []
    while frame is not None:
        found.append(frame)
        frame = frame.f_back
    return found


def line_of(function, text):
    """The line number of the first line of ``function`` that contains ``text``."""
    lines, first = inspect.getsourcelines(function)
    for offset, line in enumerate(lines):
        if text in line:
            return first + offset
    raise AssertionError(f"{text!r} not in {function.__qualname__}")


def blocked_at(thread, function, text):
    """Wait until ``thread``'s innermost Python frame is ``function`` at its line holding
    ``text`` (a ``with <lock>:`` the thread waits for: the wait itself is in C)."""
    code = function.__code__
    line = line_of(function, text)

    def there():
        found = frames(thread)
        return bool(found) and found[0].f_code is code and found[0].f_lineno == line

    wait_until(there, message=f"{thread.name} did not block in {function.__qualname__}")


def in_psycopg_wait(thread):
    """``thread`` waits for a server's answer inside psycopg's ``Connection.wait``."""
    found = frames(thread)
    return bool(found) and (
        found[0].f_code.co_name == "wait"
        and found[0].f_code.co_filename.endswith(os.path.join("psycopg", "connection.py"))
    )


def heartbeat_thread():
    thread = registry()._thread
    assert thread is not None and thread.is_alive()
    return thread


def heartbeat_asleep(thread):
    """``thread`` (the heartbeat thread) sleeps in epoll, its lock sockets registered, and
    no wake-up is pending: it stays there until a timeout, a wake-up or a closed socket."""
    found = frames(thread)
    if not found or found[0].f_code is not heartbeat._hung_up.__code__:
        return False
    if found[0].f_lineno != line_of(heartbeat._hung_up, "poller.poll("):
        return False
    pending = array.array("i", [0])
    fcntl.ioctl(registry()._wake_r, termios.FIONREAD, pending)
    return pending[0] == 0


def process_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


@contextlib.contextmanager
def stopped(pid):
    """The server process ``pid`` stopped (SIGSTOP) for the block: it reads nothing and
    answers nothing, as a hung backend or a stalled network."""
    require_local_backend(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(pid) == "T", message="the server process did not stop")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def interrupt_main(ready, raising=JobTimeout, before=None, signum=signal.SIGUSR1):
    """While the block runs in the main thread: once ``ready()`` is true, a signal makes
    the main thread run ``before()`` and raise ``raising`` wherever it is."""
    main = threading.main_thread()
    assert threading.current_thread() is main
    fired = threading.Event()
    stop = threading.Event()

    def handler(signum, frame):
        if before is not None:
            before()
        raise raising()

    def watch():
        deadline = time.monotonic() + WAIT
        while not stop.is_set() and time.monotonic() < deadline:
            if ready():
                fired.set()
                signal.pthread_kill(main.ident, signum)
                return
            time.sleep(0.002)

    previous = signal.signal(signum, handler)
    watcher = threading.Thread(target=watch, name="edge-interrupter", daemon=True)
    watcher.start()
    try:
        yield fired
    finally:
        stop.set()
        watcher.join()
        signal.signal(signum, previous)
    assert fired.is_set(), "the interruption never came"


def activity(db, pid):
    """(state, query_start, wait_event_type) of server process ``pid``."""
    return db.execute(
        "SELECT state, query_start, wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid]
    ).fetchone()


def waiting_on_lock(db, pid):
    found = activity(db, pid)
    return found is not None and found[2] == "Lock"


def row_of(db, name):
    return db.execute(
        f"SELECT token, holder, advisory, backend_pid FROM {TABLE} WHERE name = %s", [name]
    ).fetchone()


def advisory_holds(db, backend_pid):
    (count,) = db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = %s",
        [backend_pid],
    ).fetchone()
    return int(count)


def other_thread(target):
    """Run ``target()`` in a new thread; returns (thread, results list)."""
    results = []

    def run():
        try:
            results.append(target())
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=run, name="edge-other", daemon=True)
    thread.start()
    return thread, results


def acquired_in_another_thread(lock):
    thread, results = other_thread(lock.try_acquire)
    thread.join(WAIT)
    lease = results[0]
    assert lease is not None and not isinstance(lease, BaseException), lease
    return lease


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def db(pg_url, test_db_name):
    """A separate autocommit session on the test database: the view of another process."""
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


@pytest.fixture
def db2(pg_url, test_db_name):
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


@pytest.fixture
def private_conn():
    """Lock connections of the test's own (not the process's registered one), closed at
    the end. Their session ends are told to the listeners like any other's, so tests using
    them hold no lease meanwhile."""
    made = []

    def make(alias="default"):
        conn = LockConnection(alias)
        made.append(conn)
        return conn

    yield make
    for conn in made:
        conn.close()


@pytest.fixture
def edge_alias():
    """Extra database aliases on the test database, with OPTIONS of the test's choosing.

    Each has its own lock connection in the process registry, so that what a test does to
    it (a pooler found, settings changed) never reaches the ``default`` alias.
    """
    made = []

    def make(options=None):
        alias = f"edge_{uuid.uuid4().hex[:8]}"
        settings_dict = copy.deepcopy(connections["default"].settings_dict)
        settings_dict["OPTIONS"] = {**settings_dict.get("OPTIONS", {}), **(options or {})}
        connections.settings[alias] = settings_dict
        made.append(alias)
        return alias

    yield make
    for alias in made:
        conn = connection_module._registry.get(alias)
        if conn is not None:
            # A sweep after an interruption (it may reopen the session) is over first.
            if conn.orphans_possible:
                registry().sweep_soon(alias)
            wait_until(lambda conn=conn: not conn.orphans_possible, message="no sweep")
            with conn.lock:
                pass
        with registry()._lock:
            registry()._leases.pop(alias, None)
        conn = connection_module._registry.pop(alias, None)
        if conn is not None:
            conn.close()
        with contextlib.suppress(Exception):
            connections[alias].close()
            del connections[alias]
        del connections.settings[alias]


@pytest.fixture
def shadow(db):
    """A schema whose ``pg_backend_pid()`` a session can be made to call instead of the
    server's (``search_path=<schema>,pg_catalog,public``): a way to make one given
    statement of one given session fail or stall, on the real server."""
    schema = f"pglock_edge_{uuid.uuid4().hex[:8]}"
    db.execute(pgsql.SQL("CREATE SCHEMA {}").format(pgsql.Identifier(schema)))

    def define(body):
        db.execute(
            pgsql.SQL(
                "CREATE OR REPLACE FUNCTION {}.pg_backend_pid() RETURNS int LANGUAGE plpgsql"
                " AS $fn$ {} $fn$"
            ).format(pgsql.Identifier(schema), pgsql.SQL(body))
        )
        return {"options": f"-c search_path={schema},pg_catalog,public"}

    yield define
    db.execute(pgsql.SQL("DROP SCHEMA {} CASCADE").format(pgsql.Identifier(schema)))


@pytest.fixture
def children(child_env):
    """Start child processes (each in a session of its own); killed with their process
    groups at teardown."""
    started = []

    def start(argv, env=None, **kwargs):
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=REPO_ROOT,
            env=child_env if env is None else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **kwargs,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


def finish(proc, timeout=60):
    """Wait for a child started by ``children``; (returncode, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not end within {timeout}s\n{out}\n{err}")
    return proc.returncode, out, err


def python_code(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


# -- statements interrupted in flight (protocol.py, attempt.py, connection.py) ----------------


def finished_since(db, pid, started):
    """Server process ``pid`` ran a statement that began after ``started`` and is idle."""
    state, query_start, _ = activity(db, pid)
    return state == "idle" and query_start is not None and query_start > started


def test_a_prepare_interrupted_after_it_worked_is_remembered(db, private_conn):
    conn = private_conn()
    conn.ensure_open()
    backend = conn.backend_pid
    before = activity(db, backend)[1]
    main = threading.main_thread()
    with stopped(backend):

        def answered():  # in the signal handler: let the server prepare, then interrupt
            os.kill(backend, signal.SIGCONT)
            wait_until(lambda: finished_since(db, backend, before))

        with (
            interrupt_main(lambda: in_psycopg_wait(main), before=answered),
            pytest.raises(JobTimeout),
        ):
            conn.execute(sql.CHECK, {"name": unique("prep"), "token": 1})
    # The session lives on, and knows the statement is prepared: running it again uses the
    # prepared statement (preparing it twice would fail and look like a pooler).
    assert conn.is_open() and conn.backend_pid == backend
    assert conn.execute(sql.CHECK, {"name": unique("prep"), "token": 1}) == [(False,)]
    assert not conn.pooled
    prepared = conn.execute("SELECT count(*)::int FROM pg_prepared_statements", {})
    assert prepared == [(2,)]  # CHECK, and this statement itself


def test_a_prepare_interrupted_before_it_worked_is_prepared_again(db, db2, private_conn):
    conn = private_conn()
    conn.ensure_open()
    backend = conn.backend_pid
    main = threading.main_thread()
    # Another session holds the lock table: preparing a statement on it waits.
    locker = db2
    locker.execute("BEGIN")
    locker.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
    try:
        with (
            interrupt_main(lambda: waiting_on_lock(db, backend) and in_psycopg_wait(main)),
            pytest.raises(JobTimeout),
        ):
            conn.execute(sql.CHECK, {"name": unique("unprep"), "token": 1})
    finally:
        locker.execute("ROLLBACK")
    # The cancelled prepare is not taken for a prepared statement: the next run prepares
    # it (running a statement that was never prepared would fail and look like a pooler).
    assert conn.is_open() and conn.backend_pid == backend
    assert conn.execute(sql.CHECK, {"name": unique("unprep"), "token": 1}) == [(False,)]
    assert not conn.pooled


def test_an_interrupted_statement_the_server_never_answers_gives_the_session_up(
    monkeypatch, private_conn
):
    monkeypatch.setattr(protocol, "DRAIN_TIMEOUT", 0.5)
    conn = private_conn()
    conn.ensure_open()
    backend = conn.backend_pid
    ended = []
    listener = lambda lock_conn, generation: ended.append((lock_conn, generation))  # noqa: E731
    on_session_end(listener)
    main = threading.main_thread()
    try:
        with stopped(backend):
            started = time.monotonic()
            with interrupt_main(lambda: in_psycopg_wait(main)), pytest.raises(JobTimeout):
                conn.execute(sql.NOW, {})
            # Cancelled, then drained for DRAIN_TIMEOUT at most: the session is given up
            # (the stopped server process would hold the caller for ever otherwise).
            assert time.monotonic() - started < WAIT
            assert not conn.is_open()
            assert (conn, 1) in ended  # leases on that session learn at once
    finally:
        sessionevents._session_listeners.remove(listener)
    conn.execute(sql.NOW, {})
    assert conn.is_open() and conn.backend_pid != backend and conn.generation == 2


def test_an_interruption_psycopg_settles_itself_leaves_the_session_usable(db, private_conn):
    """KeyboardInterrupt and SystemExit are cancelled and drained by psycopg itself."""
    conn = private_conn()
    conn.ensure_open()
    backend = conn.backend_pid
    main = threading.main_thread()
    with (
        stopped(backend),
        interrupt_main(
            lambda: in_psycopg_wait(main),
            raising=SystemExit,
            before=lambda: os.kill(backend, signal.SIGCONT),
        ),
        pytest.raises(SystemExit),
    ):
        conn.execute(sql.NOW, {})
    assert conn.is_open() and conn.backend_pid == backend
    assert len(conn.execute(sql.NOW, {})) == 1


def test_an_interruption_psycopg_gives_up_on_leaves_a_closed_session(db, monkeypatch, edge_alias):
    """A SystemExit while the server does not answer: psycopg's own cancellation finds no
    answer either and closes the connection; the acquire's stray-key cleanup then has no
    session to run on, and the next statement opens a new one."""
    monkeypatch.setattr(protocol, "STATEMENT_DEADLINE", 1.0)
    alias = edge_alias()  # a session of its own, where nothing is prepared yet: what the
    conn = get_connection(alias)  # stopped server process gets is the acquire's prepare
    conn.ensure_open()
    backend = conn.backend_pid
    name = unique("gave-up")
    main = threading.main_thread()
    with stopped(backend):
        with (
            interrupt_main(lambda: in_psycopg_wait(main), raising=SystemExit),
            pytest.raises(SystemExit),
        ):
            Lock(name, using=alias, advisory=True).try_acquire()
        assert not conn.is_open()
    wait_until(lambda: process_state(backend) is None, message="the server process lives on")
    assert row_of(db, name) is None
    lease = Lock(name, using=alias).try_acquire()
    assert lease is not None and conn.backend_pid != backend
    lease.release()


def test_an_interruption_whose_handler_closed_the_lock_connection_leaves_it_closed(db, edge_alias):
    """The signal handler that interrupts a statement closes the lock connection itself
    (as a shutdown handler may) before it raises: nothing is left to cancel or drain, and
    the acquire's stray-key cleanup has no session to run on."""
    alias = edge_alias()  # a session of its own, where nothing is prepared yet: what the
    conn = get_connection(alias)  # stopped server process gets is the acquire's prepare
    conn.ensure_open()
    backend = conn.backend_pid
    name = unique("handler-closed")
    main = threading.main_thread()
    with stopped(backend):
        with (
            interrupt_main(lambda: in_psycopg_wait(main), before=conn.close),
            pytest.raises(JobTimeout),
        ):
            Lock(name, using=alias).try_acquire()
        assert not conn.is_open()
    wait_until(lambda: process_state(backend) is None, message="the server process lives on")
    assert row_of(db, name) is None
    lease = Lock(name, using=alias).try_acquire()
    assert lease is not None and conn.backend_pid != backend
    lease.release()


@pytest.mark.parametrize("raising", [JobTimeout, SystemExit], ids=["drain-gives-up", "psycopg"])
def test_an_acquire_given_up_on_a_stopped_server_grants_nothing_when_it_resumes(
    db, monkeypatch, edge_alias, raising
):
    monkeypatch.setattr(protocol, "DRAIN_TIMEOUT", 0.5)
    monkeypatch.setattr(protocol, "STATEMENT_DEADLINE", 1.0)
    name = unique("resumed")
    alias = edge_alias()
    # Prepared on the session: what the stopped server process gets is the acquire itself.
    warm_up(unique("warm"), using=alias, advisory=False)
    conn = get_connection(alias)
    backend = conn.backend_pid
    main = threading.main_thread()
    with stopped(backend):
        with (
            interrupt_main(lambda: in_psycopg_wait(main), raising=raising),
            pytest.raises(raising),
        ):
            Lock(name, using=alias, advisory=False).try_acquire()
        assert not conn.is_open()
        # The process goes on on a new session; the sweep for orphaned grants runs there.
        warm_up(unique("next"), using=alias, advisory=False)
        wait_until(lambda: not conn.orphans_possible, message="no sweep")
        with conn.lock:  # the sweep has finished
            pass
    # The stopped server process resumes: whatever it had queued must not grant.
    wait_until(lambda: process_state(backend) is None, message="the server process lives on")
    assert row_of(db, name) is None, "a grant nobody owns blocks the name"


def warm_up(name, **options):
    """Grant and release ``name`` once, so that the acquire and release statements are
    prepared on the lock session (an interrupted statement is then the acquire itself)."""
    lease = Lock(name, **options).try_acquire()
    assert lease is not None
    lease.release()


def test_a_grant_interrupted_before_its_answer_was_read_is_released(db, edge_alias):
    name = unique("orphan")
    alias = edge_alias()
    warm_up(unique("warm"), using=alias)
    conn = get_connection(alias)
    backend = conn.backend_pid
    main = threading.main_thread()
    with stopped(backend):

        def granted():  # the server grants, then the interruption comes
            os.kill(backend, signal.SIGCONT)
            wait_until(lambda: row_of(db, name) is not None and activity(db, backend)[0] == "idle")

        with (
            interrupt_main(lambda: in_psycopg_wait(main), before=granted),
            pytest.raises(JobTimeout),
        ):
            Lock(name, using=alias).try_acquire()
    # Nobody received the grant: the heartbeat thread releases it, key and row.
    wait_until(lambda: row_of(db, name) is None, message="the orphaned grant was kept")
    wait_until(lambda: advisory_holds(db, backend) == 0, message="its advisory key was kept")
    assert conn.backend_pid == backend
    lease = Lock(name, using=alias).try_acquire()
    assert lease is not None
    lease.release()


def test_an_interrupted_attempt_on_a_name_this_process_holds_keeps_the_holders_key(db, edge_alias):
    name = unique("mine")
    alias = edge_alias()
    warm_up(unique("warm"), using=alias)
    holder = acquired_in_another_thread(Lock(name, using=alias, **QUIET))
    conn = get_connection(alias)
    backend = conn.backend_pid
    assert advisory_holds(db, backend) == 1
    before = activity(db, backend)[1]
    main = threading.main_thread()
    with stopped(backend):

        def refused():
            os.kill(backend, signal.SIGCONT)
            wait_until(lambda: finished_since(db, backend, before))

        with (
            interrupt_main(lambda: in_psycopg_wait(main), before=refused),
            pytest.raises(JobTimeout),
        ):
            Lock(name, using=alias).try_acquire()
    # The refused attempt never took the key (this session holds it for the holder):
    # giving a stray key back must not take the holder's.
    assert advisory_holds(db, backend) == 1
    holder.check()
    assert row_of(db, name)[0] == holder.token
    holder.release()
    assert advisory_holds(db, backend) == 0


def test_a_grant_whose_takeover_bookkeeping_is_interrupted_is_released(db):
    name = unique("takeover")
    # A dead holder's row, stale by its own thresholds: the next attempt takes it over.
    db.execute(
        f"INSERT INTO {TABLE} (name, token, holder, host, pid, backend_pid, description,"
        " acquired_at, last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory)"
        " VALUES (%s, nextval('django_pglock_token_seq'), 'gone:1:x', 'gone', 1, 1, '',"
        " now() - interval '1 hour', now() - interval '1 hour', 1, 2, 10, false)",
        [name],
    )

    def receiver(sender, **kwargs):
        raise JobTimeout  # a BaseException: receivers' exceptions are otherwise logged

    acquired = []

    def on_acquired(sender, lease, **kwargs):
        acquired.append(lease)

    signals.lock_reclaimed.connect(receiver)
    signals.lock_acquired.connect(on_acquired)
    try:
        with pytest.raises(JobTimeout):
            Lock(name).try_acquire()
    finally:
        signals.lock_reclaimed.disconnect(receiver)
        signals.lock_acquired.disconnect(on_acquired)
    assert not acquired  # the caller never got it: the heartbeat thread releases it
    wait_until(lambda: row_of(db, name) is None, message="the interrupted takeover was kept")


def test_a_grant_its_receiver_released_and_then_interrupted_is_not_released_twice(db):
    name = unique("receiver")
    seen = []

    def receiver(sender, lease, **kwargs):
        lease.release()
        seen.append(lease)
        raise SystemExit(3)

    signals.lock_acquired.connect(receiver)
    try:
        with pytest.raises(SystemExit):
            Lock(name).try_acquire()
    finally:
        signals.lock_acquired.disconnect(receiver)
    (lease,) = seen
    assert lease.state is State.RELEASED
    assert row_of(db, name) is None
    assert lease not in registry().leases()


# -- the lock connection (connection.py) -------------------------------------------------------


def test_a_session_end_listener_is_registered_once(private_conn):
    calls = []

    def listener(conn, generation):
        calls.append(generation)

    on_session_end(listener)
    on_session_end(listener)
    try:
        conn = private_conn()
        conn.ensure_open()
        conn.close()
    finally:
        sessionevents._session_listeners.remove(listener)
    assert calls == [1]


def test_a_statement_bound_to_an_ended_session_never_opens_a_new_one(private_conn):
    conn = private_conn()
    conn.ensure_open()
    session = conn.generation
    conn.close()
    with pytest.raises(connection_module.SessionEnded):
        conn.execute(sql.UNLOCK, {"key": 1, "name": "n", "token": None}, session=session)
    assert not conn.is_open() and conn.generation == session
    conn.ensure_open()
    with pytest.raises(connection_module.SessionEnded):
        conn.execute(
            sql.UNLOCK, {"key": 1, "name": "n", "token": None}, session=session
        )  # a later session is not it
    assert conn.generation == session + 1


def test_readable_while_idle_tells_a_session_the_server_closed(db, private_conn):
    """The heartbeat's way of noticing a closed session where epoll is missing."""
    conn = private_conn()
    assert not conn.readable_while_idle()  # nothing open
    conn.ensure_open()
    assert not conn.readable_while_idle()
    db.execute("SELECT pg_terminate_backend(%s)", [conn.backend_pid])
    wait_until(conn.readable_while_idle, message="the closed session never became readable")
    assert not conn.probe()  # and probing it ends it here too
    assert not conn.is_open()


def test_a_closed_session_another_thread_replaced_meanwhile_is_not_reported(db, caplog):
    lease = Lock(unique("replaced"), advisory=False, **QUIET).try_acquire()
    conn = lease._conn
    thread = heartbeat_thread()
    wait_until(lambda: heartbeat_asleep(thread))
    with caplog.at_level(logging.WARNING, logger="django_pglock"):
        with conn.lock:
            db.execute("SELECT pg_terminate_backend(%s)", [conn.backend_pid])
            # The heartbeat thread sees the server close the session and waits to probe it;
            # meanwhile this thread finds it closed, and its next statement opens a new one.
            blocked_at(thread, LockConnection.probe, "with self.lock:")
            with pytest.raises(connection_module.LockError, match="was lost"):
                lease.check()
            lease.check()
        wait_until(lambda: heartbeat_asleep(thread))
    # The probe finds the new session alive: nothing to report, nothing closed.
    assert "closed by the server" not in caplog.text
    assert conn.is_open()
    lease.release()


def test_prepared_statements_that_vanish_mean_a_pooler(caplog, private_conn):
    conn = private_conn()
    assert len(conn.execute(sql.NOW, {})) == 1  # prepared on the session
    # What a transaction-mode pooler does behind the client's back: the next statement
    # runs on a server connection where nothing of this session is prepared.
    conn._conn.execute("DEALLOCATE ALL", prepare=False)
    with caplog.at_level(logging.WARNING, logger="django_pglock"):
        assert len(conn.execute(sql.NOW, {})) == 1  # run again, unprepared
    assert conn.pooled
    assert "its prepared statements came and went" in caplog.text
    conn._conn.execute("DEALLOCATE ALL", prepare=False)
    assert len(conn.execute(sql.NOW, {})) == 1  # never prepared again


def test_a_session_whose_setup_fails_is_closed(db, edge_alias, shadow, private_conn):
    options = shadow(
        """BEGIN
        IF current_setting('application_name') = 'django_pglock' THEN
            RAISE EXCEPTION 'setup refused by the test';
        END IF;
        RETURN pg_catalog.pg_backend_pid();
        END"""
    )
    conn = private_conn(edge_alias(options))

    def lock_sessions():
        found = db.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'django_pglock'"
        ).fetchall()
        return {pid for (pid,) in found}

    before = lock_sessions()
    with pytest.raises(connection_module.LockError) as failure:
        conn.ensure_open()
    assert "Could not set up the lock connection" in str(failure.value)
    assert "setup refused by the test" in str(failure.value)
    assert not conn.is_open() and conn.generation == 0
    wait_until(lambda: lock_sessions() <= before, message="the failed session stayed open")


def test_a_pooler_announced_while_an_attempt_waited_takes_its_grant_off_the_advisory_path(
    db, edge_alias, caplog
):
    alias = edge_alias()
    warm_up(unique("warm"), using=alias)
    conn = get_connection(alias)
    waiting, first = unique("waiting"), unique("first")
    with conn.lock:
        thread, results = other_thread(Lock(waiting, using=alias).try_acquire)
        # The waiting attempt chose the advisory path before the pooler showed itself.
        blocked_at(thread, attempt_module.AttemptMixin._attempt, "conn.lock.acquire(")
        conn._conn.execute("DEALLOCATE ALL")  # the pooler's doing (see above)
        with caplog.at_level(logging.WARNING, logger="django_pglock"):
            found = Lock(first, using=alias).try_acquire()
        assert conn.pooled and found is not None
    thread.join(WAIT)
    (lease,) = results
    assert lease is not None and not isinstance(lease, BaseException), lease
    # Granted with its key, then taken off the advisory path: no contender may judge
    # the row by this session any longer.
    assert row_of(db, waiting)[2] is False and row_of(db, first)[2] is False
    assert lease._key_state is Key.NONE
    assert advisory_holds(db, conn.backend_pid) == 0
    lease.release()
    found.release()
    assert row_of(db, waiting) is None and row_of(db, first) is None


RACES = """
import sys, threading, time
import django
django.setup()
from django_pglock import connection, heartbeat

def frames(thread):
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        yield frame
        frame = frame.f_back

def wait_blocked(threads, code):
    deadline = time.monotonic() + 30
    while not all(next(frames(t), None) is not None and next(frames(t)).f_code is code
                  for t in threads):
        assert time.monotonic() < deadline, "threads never blocked"
        time.sleep(0.002)

def race(lock, target, code):
    # Both threads find nothing and wait for the lock; the first creates, the second
    # finds what the first created.
    results = []
    with lock:
        threads = [threading.Thread(target=lambda: results.append(target())) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_blocked(threads, code)
    for thread in threads:
        thread.join()
    return results

first, second = race(heartbeat._registry_lock, heartbeat.registry, heartbeat.registry.__code__)
assert first is second, "two registries"
first, second = race(connection._registry_lock, lambda: connection.get_connection("default"),
                     connection.get_connection.__code__)
assert first is second, "two lock connections"

conn = first
with conn.lock:
    opened = []
    threads = [threading.Thread(target=conn.ensure_open) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_blocked(threads, type(conn).ensure_open.__code__)
    conn.ensure_open()  # this thread opens it while the two wait
for thread in threads:
    thread.join()
assert conn.is_open() and conn.generation == 1, conn.generation
print("OK", flush=True)
"""


def test_first_uses_racing_in_two_threads_share_one_registry_and_one_session(children):
    code, out, err = finish(children(python_code(RACES)))
    assert (code, out.strip()) == (0, "OK"), err


FORK = """
import os, sys, time
import django
django.setup()
from django_pglock import Lock, LockNotHeld
from django_pglock.connection import get_connection
from django_pglock.heartbeat import registry

lease = Lock(sys.argv[1], advisory=False, heartbeat_interval=100, alert_after=200,
             stale_after=3000).try_acquire()
import inspect
from django_pglock.heartbeat import _hung_up
source, first = inspect.getsourcelines(_hung_up)
poll = first + next(i for i, line in enumerate(source) if "poller.poll(" in line)
heartbeat = registry()._thread
while True:  # asleep, its sockets registered: closing one cannot race with it
    frame = sys._current_frames()[heartbeat.ident]
    if frame.f_code is _hung_up.__code__ and frame.f_lineno == poll:
        break
    time.sleep(0.002)
parent_conn = get_connection("default")
parent_conn.close()  # the lock connection is closed when the process forks
pid = os.fork()
if pid == 0:
    problems = []
    if lease.lost is not True:
        problems.append("the inherited lease does not look lost")
    try:
        lease.check()
        problems.append("check() passed in the child")
    except LockNotHeld as exc:
        if "belongs to process" not in str(exc):
            problems.append(str(exc))
    if get_connection("default") is parent_conn:
        problems.append("the child uses the parent's lock connection")
    print("CHILD", "; ".join(problems) or "ok", flush=True)
    sys.exit(0)  # the normal interpreter exit, as a pre-fork worker's
_, status = os.waitpid(pid, 0)
lease.check()
lease.release()
print("PARENT", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_inherits_no_lease_and_no_lock_connection(db, children):
    name = unique("fork")
    code, out, err = finish(children([*python_code(FORK), name]))
    assert code == 0, err
    assert out.split("\n")[:2] == ["CHILD ok", "PARENT 0"], out + err
    assert row_of(db, name) is None


RAW_FORK = """
import ctypes, os, sys
import django
django.setup()
from django_pglock.connection import get_connection

conn = get_connection("default")
conn.ensure_open()
pid = ctypes.CDLL(None).fork()  # a C-level fork: none of Python's at-fork hooks run
if pid == 0:
    print("CHILD", "own" if get_connection("default") is not conn else "parent's", flush=True)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("PARENT", os.waitstatus_to_exitcode(status), conn.execute("SELECT 1 AS one", {}), flush=True)
"""


def test_a_child_forked_behind_pythons_back_opens_its_own_lock_connection(children):
    code, out, err = finish(children(python_code(RAW_FORK)))
    assert code == 0, err
    # The child's copy of the parent's socket was pointed at /dev/null before anything
    # could be sent on it: the parent's session lives on.
    assert out.splitlines() == ["CHILD own", "PARENT 0 [(1,)]"], out + err


# -- looking for a pooler when the session opens (pooler.py) -----------------------------------
# Each probe runs against the real server; the shadow pg_backend_pid() makes one of its
# statements fail, answer nothing or answer late, as a pooler in trouble would.

# True in the lock session's own probe statements (not in its setup statement).
SESSION_PROBE = (
    "current_setting('application_name') = 'django_pglock'"
    " AND current_query() = 'SELECT pg_backend_pid()'"
)


def opened_without_evidence(alias, private_conn, caplog):
    conn = private_conn(alias)
    with caplog.at_level(logging.DEBUG, logger="django_pglock"):
        conn.ensure_open()
    assert conn.is_open() and not conn.pooled
    return caplog.text


def test_a_pooler_probe_on_a_session_that_fails_is_no_evidence(
    edge_alias, shadow, private_conn, caplog
):
    options = shadow(
        f"""BEGIN
        IF {SESSION_PROBE} THEN
            RAISE EXCEPTION 'the session is refused its probe';
        END IF;
        RETURN pg_catalog.pg_backend_pid();
        END"""
    )
    logged = opened_without_evidence(edge_alias(options), private_conn, caplog)
    assert "the session is refused its probe" in logged


@pytest.mark.parametrize(
    ("answer", "logged"),
    [
        ("RAISE EXCEPTION 'the probe is refused'; RETURN 0;", "the probe is refused"),
        ("RETURN NULL;", "no answer"),
    ],
    ids=["error", "null"],
)
def test_a_pooler_probe_without_a_usable_answer_is_no_evidence(
    edge_alias, shadow, private_conn, caplog, answer, logged
):
    options = shadow(
        f"""BEGIN
        IF current_setting('application_name') = 'django_pglock probe' THEN {answer} END IF;
        RETURN pg_catalog.pg_backend_pid();
        END"""
    )
    assert logged in opened_without_evidence(edge_alias(options), private_conn, caplog)


def test_a_pooler_probe_whose_connection_breaks_is_no_evidence(
    edge_alias, shadow, private_conn, caplog
):
    # The session's probe statement ends the probe's connection on the server.
    options = shadow(
        f"""BEGIN
        IF {SESSION_PROBE} THEN
            PERFORM pg_terminate_backend(pid, 10000) FROM pg_stat_activity
            WHERE application_name = 'django_pglock probe' AND datname = current_database();
        END IF;
        RETURN pg_catalog.pg_backend_pid();
        END"""
    )
    logged = opened_without_evidence(edge_alias(options), private_conn, caplog)
    assert "pooler probe on alias" in logged
    assert "terminating connection due to administrator command" in logged


def test_a_pooler_probe_past_its_time_is_no_evidence(edge_alias, shadow, private_conn, caplog):
    # Each of the session's statements takes 0.6 s and the probe's 0.2 s: by the second
    # round the probe's time (1 s in all) is up before its answer can come.
    options = shadow(
        f"""BEGIN
        IF {SESSION_PROBE} THEN
            PERFORM pg_sleep(0.6);
        ELSIF current_setting('application_name') = 'django_pglock probe' THEN
            PERFORM pg_sleep(0.2);
        END IF;
        RETURN pg_catalog.pg_backend_pid();
        END"""
    )
    logged = opened_without_evidence(edge_alias(options), private_conn, caplog)
    assert "got no server process within 1.0 s" in logged


# -- leases and the heartbeat thread (lease.py, heartbeat.py, keys.py) -------------------------

QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}
# Short thresholds: a lease whose heartbeats are held back is lost within 2 s.
BRIEF = {"heartbeat_interval": 0.2, "alert_after": 0.5, "stale_after": 2.0}


def test_a_lease_is_its_own_context_manager(db):
    name = unique("ctx")
    with Lock(name).try_acquire() as lease:
        assert row_of(db, name)[0] == lease.token
    assert row_of(db, name) is None and lease.state is State.RELEASED


def test_on_lost_callbacks_added_late_run_at_once_and_failing_ones_are_logged(db, caplog):
    name = unique("on-lost")
    lease = Lock(name).try_acquire()

    def broken(lease):
        raise RuntimeError("a bug in the callback")

    lease.on_lost(broken)
    db.execute(f"DELETE FROM {TABLE} WHERE name = %s", [name])
    with caplog.at_level(logging.ERROR, logger="django_pglock"), pytest.raises(LockNotHeld):
        lease.check()
    assert f"on_lost callback for {name!r} raised" in caplog.text
    late = []
    lease.on_lost(late.append)
    assert late == [lease]
    lease.release()


def test_an_older_heartbeat_confirmed_late_never_moves_the_deadline_back():
    lease = Lock(unique("late-beat"), **QUIET).try_acquire()
    conn = lease._conn
    with conn.lock:
        thread, results = other_thread(lease.beat)  # sent first, waits for the connection
        blocked_at(thread, LockConnection.execute, "self.lock.acquire(")
        lease.beat()  # sent later, confirmed first (this thread holds the connection)
        confirmed = lease._held_until()
    thread.join(WAIT)
    assert results == [None]
    assert lease._held_until() == confirmed
    lease.release()


def test_a_lease_sees_its_session_end_before_the_listener_tells_it(db):
    name = unique("session-end")
    lease = Lock(name, **QUIET).try_acquire()
    assert lease._key_state is Key.HELD
    thread = heartbeat_thread()
    wait_until(lambda: heartbeat_asleep(thread))
    lost = []

    def receiver(sender, lease, reason, **kwargs):
        lost.append(reason)

    signals.lock_lost.connect(receiver)
    try:
        with lease._state_lock:
            # The server ends the session: the heartbeat thread notices, closes it and
            # tells the leases, waiting for this one...
            db.execute("SELECT pg_terminate_backend(%s)", [lease._conn.backend_pid])
            blocked_at(thread, type(lease)._advance, "with self._state_lock:")
            # ...which sees the session gone on its own meanwhile.
            with pytest.raises(LockNotHeld, match="database session ended"):
                lease.beat()
        wait_until(lambda: heartbeat_asleep(thread))
    finally:
        signals.lock_lost.disconnect(receiver)
    assert lease.state is State.LOST
    assert lost == ["its database session ended, so a contender may take over at once"]
    lease.release()


def test_a_lease_lost_by_its_deadline_gives_its_key_up_when_its_session_ends(db):
    name = unique("deadline-key")
    lease = Lock(name, **BRIEF).try_acquire()
    conn = lease._conn
    backend = conn.backend_pid
    with conn.lock:  # no heartbeat gets through: the lease's own deadline passes
        wait_until(lambda: lease.state is State.LOST, message="the lease was never lost")
        # Its row may still be its own: it keeps the key, and so its precedence.
        assert lease._key_state is Key.HELD and lease in registry().leases()
        assert advisory_holds(db, backend) == 1
        blocked_at(heartbeat_thread(), LockConnection.execute, "self.lock.acquire(")
        conn.close()  # (the heartbeat thread waits for the connection meanwhile)
    assert lease._key_state is Key.NONE and lease not in registry().leases()
    # The key went with the session: a contender takes the name over at once.
    other = acquired_in_another_thread(Lock(name))
    assert other.token > lease.token
    other.release()
    lease.release()


def test_a_lease_released_while_the_heartbeat_looks_at_it_is_left_alone(db, caplog):
    name = unique("released-in-tick")
    lease = Lock(name, **BRIEF).try_acquire()
    thread = heartbeat_thread()
    with caplog.at_level(logging.WARNING, logger="django_pglock"):
        with lease._state_lock:
            registry().wake()  # a tick now, whatever it planned
            # The heartbeat thread looks at the lease (and waits for it) in its tick...
            wait_until(
                lambda: [f.f_code.co_name for f in frames(thread)[:2]] == ["_watch", "_tick"],
                message="the heartbeat thread never looked at the lease",
            )
            lease.release()  # ...while this thread releases it.
        assert row_of(db, name) is None
        # It goes on to the next wait, neither beating nor watching the released lease.
        wait_until(lambda: heartbeat_asleep(thread))
    assert lease.state is State.RELEASED and lease not in registry().leases()
    assert "heartbeat" not in caplog.text


def test_a_lease_granted_without_its_key_gives_it_up_when_its_session_changes(db, caplog):
    name = unique("wanted")
    key = sql.advisory_key(name)
    db.execute("SELECT pg_advisory_lock(%s)", [key])  # a contender's statement holds the key
    try:
        with caplog.at_level(logging.DEBUG, logger="django_pglock"):
            lease = Lock(name, **QUIET).try_acquire()
            assert lease._key_state is Key.WANTED and row_of(db, name)[2] is False
            # The session ends before the key could be taken: taking it needs that very
            # session, so the heartbeat thread's attempts fail (and are retried)...
            db.execute("SELECT pg_terminate_backend(%s)", [lease._conn.backend_pid])
            wait_until(lambda: f"taking {name!r}'s key failed" in caplog.text)
            # ...until a new session is open: then the lease stops wanting the key.
            lease.beat()
            wait_until(lambda: lease._key_state is Key.NONE, message="the lease still wants it")
    finally:
        db.execute("SELECT pg_advisory_unlock(%s)", [key])
    lease.check()
    assert row_of(db, name)[2] is False
    assert advisory_holds(db, lease._conn.backend_pid) == 0
    lease.release()


def interrupt_a_grant(db, alias, name, raising):
    """Try to acquire ``name`` on ``alias`` (its acquire statement prepared), and have
    ``raising`` land once the server granted, before the answer is read."""
    warm_up(unique("warm"), using=alias)
    backend = get_connection(alias).backend_pid
    main = threading.main_thread()
    with stopped(backend):

        def granted():
            os.kill(backend, signal.SIGCONT)
            wait_until(lambda: row_of(db, name) is not None and activity(db, backend)[0] == "idle")

        with (
            interrupt_main(lambda: in_psycopg_wait(main), raising=raising, before=granted),
            pytest.raises(raising),
        ):
            Lock(name, using=alias).try_acquire()
    return backend


def test_a_grant_psycopg_drained_after_an_interruption_is_swept(db, caplog, edge_alias):
    """A SystemExit lands once the server granted. psycopg 3.3 drains the answer itself,
    so the grant never reaches the caller and the heartbeat thread's sweep releases row and
    key; psycopg 3.2 leaves the drain to the lock connection, which sees the grant and
    hands it to the heartbeat thread to release. Either way nothing stays held."""
    name = unique("swept")
    alias = edge_alias()
    with caplog.at_level(logging.WARNING, logger="django_pglock"):
        backend = interrupt_a_grant(db, alias, name, SystemExit)
        wait_until(lambda: row_of(db, name) is None, message="the orphaned grant was kept")
    wait_until(lambda: advisory_holds(db, backend) == 0, message="its advisory key was kept")
    lease = Lock(name, using=alias).try_acquire()
    assert lease is not None
    lease.release()


def test_a_sweep_on_one_alias_spares_leases_held_through_another_of_the_same_database(
    db, edge_alias
):
    held = Lock(unique("other-alias"), **QUIET).try_acquire()  # on "default"
    alias = edge_alias()  # the same database
    name = unique("swept-here")
    try:
        interrupt_a_grant(db, alias, name, SystemExit)
        wait_until(lambda: row_of(db, name) is None, message="the orphaned grant was kept")
        held.check()
        assert row_of(db, held.name)[0] == held.token
    finally:
        with contextlib.suppress(LockNotHeld):
            held.release()


class DeadServer:
    """A TCP port where every connection is closed at once; counts the attempts."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.attempts = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.attempts += 1
            client.close()

    def close(self):
        self.sock.close()


def test_a_failing_heartbeat_is_retried_sooner_and_reported_once(db, edge_alias, caplog):
    alias = edge_alias()
    name = unique("failing")
    thresholds = {**BRIEF, "stale_after": 60.0}  # heartbeats every 0.2 s, never lost here
    lease = Lock(name, using=alias, advisory=False, **thresholds).try_acquire()
    settings_dict = connections[alias].settings_dict
    saved = {key: settings_dict[key] for key in ("HOST", "PORT")}
    dead = DeadServer()
    try:
        with caplog.at_level(logging.WARNING, logger="django_pglock"):
            settings_dict.update(HOST="127.0.0.1", PORT=str(dead.port))
            # The server ends the session: every new one fails to open from now on.
            db.execute("SELECT pg_terminate_backend(%s)", [lease._conn.backend_pid])
            # Retried (every 0.1 s while failing) and reported once.
            wait_until(lambda: dead.attempts >= 4, message="the heartbeat was not retried")
            failures = [r for r in caplog.records if "heartbeat on" in r.getMessage()]
            assert len(failures) == 1, caplog.text
            # The server is back: the next heartbeat gets through.
            settings_dict.update(saved)
            (before,) = db.execute(
                f"SELECT last_heartbeat FROM {TABLE} WHERE name = %s", [name]
            ).fetchone()
            wait_until(
                lambda: db.execute(
                    f"SELECT last_heartbeat > %s FROM {TABLE} WHERE name = %s", [before, name]
                ).fetchone()[0],
                message="the heartbeat never recovered",
            )
    finally:
        settings_dict.update(saved)
        dead.close()
    lease.check()
    lease.release()


def test_a_key_taken_while_its_lease_was_being_released_is_given_back(db):
    name = unique("adopt-released")
    key = sql.advisory_key(name)
    db.execute("SELECT pg_advisory_lock(%s)", [key])  # a contender's statement holds the key
    held_by_test = True
    try:
        lease = Lock(name, **QUIET).try_acquire()
        assert lease._key_state is Key.WANTED
        conn = lease._conn
        thread = heartbeat_thread()
        with conn.lock:
            # The heartbeat thread comes to take the key (it retries within a second)...
            blocked_at(thread, keys.KeyMixin._adopt_key, "with conn.lock:")
            db.execute("SELECT pg_advisory_unlock(%s)", [key])
            held_by_test = False
            # ...while another thread releases the lease.
            releaser, results = other_thread(lease.release)
            blocked_at(releaser, type(lease)._finish_release, "with self._release_lock:")
            assert lease.state is State.RELEASING
    finally:
        if held_by_test:
            db.execute("SELECT pg_advisory_unlock(%s)", [key])
    releaser.join(WAIT)
    assert results == [None]
    # The key it took for a lease no longer held was given back, and the row is gone.
    assert row_of(db, name) is None
    assert advisory_holds(db, conn.backend_pid) == 0
    assert lease.state is State.RELEASED


def test_a_lease_lost_by_its_deadline_keeps_its_key_while_its_row_is_its_own(db):
    name = unique("keeps-key")
    lease = Lock(name, **BRIEF).try_acquire()
    conn = lease._conn
    backend = conn.backend_pid
    with conn.lock:  # no heartbeat gets through: the lease's own deadline passes
        wait_until(lambda: lease.state is State.LOST, message="the lease was never lost")
    # The heartbeat thread looks at the row again and again: still its own, so the key
    # (and with it the holder's precedence) is kept.
    seen = activity(db, backend)[1]
    wait_until(lambda: activity(db, backend)[1] > seen, message="the row was not looked at")
    seen = activity(db, backend)[1]
    wait_until(lambda: activity(db, backend)[1] > seen, message="the row was not looked at")
    assert lease in registry().leases() and lease._key_state is Key.HELD
    assert advisory_holds(db, backend) == 1
    # Once the row is gone, the key is given back.
    db.execute(f"DELETE FROM {TABLE} WHERE name = %s", [name])
    wait_until(lambda: lease not in registry().leases(), message="the lost lease was kept")
    assert lease._key_state is Key.NONE and advisory_holds(db, backend) == 0
    lease.release()


def test_a_release_pending_when_its_session_ends_finishes_on_the_next_one(db):
    name = unique("pending-session")
    lease = Lock(name, **QUIET).try_acquire()
    with transaction.atomic():
        lease.guard()
        lease.release()  # waits for this transaction, still holding its key
        assert lease.state is State.RELEASING and lease._key_state is Key.HELD
        conn, generation = lease._conn, lease._conn.generation
        db.execute("SELECT pg_terminate_backend(%s)", [conn.backend_pid])  # the key goes too
        wait_until(lambda: not conn.is_open() or conn.generation != generation)
        assert lease.state is State.RELEASING
    wait_until(lambda: row_of(db, name) is None, message="the release never finished")
    wait_until(lambda: lease.state is State.RELEASED)  # (its thread learns it just after)
    assert lease._key_state is Key.NONE


def test_a_lock_connection_closed_while_the_heartbeat_gathers_its_sockets_keeps_it_alive(db):
    lease = Lock(unique("gathering"), **QUIET).try_acquire()
    conn = lease._conn
    thread = heartbeat_thread()
    unopened = f"edge_unopened_{uuid.uuid4().hex[:8]}"  # its lock connection does not exist yet
    died = []
    pytest_hook = threading.excepthook

    def excepthook(args):
        if args.thread is thread:
            died.append(args.exc_value)
        else:
            pytest_hook(args)

    threading.excepthook = excepthook
    try:
        with lease._state_lock:
            registry().wake()  # a tick now, whatever it planned
            # The heartbeat thread is in its tick, past taking the list of aliases...
            wait_until(
                lambda: [f.f_code.co_name for f in frames(thread)[:2]] == ["_watch", "_tick"]
            )
            registry().sweep_soon(unopened)  # ...so it meets this alias only in its wait.
            connection_module._registry_lock.acquire()
        try:
            # It has taken the default connection's socket, and waits to make the other's.
            blocked_at(thread, connection_module.get_connection, "with _registry_lock:")
            conn.close()  # another thread closes that socket meanwhile
        finally:
            connection_module._registry_lock.release()
        wait_until(lambda: heartbeat_asleep(thread) or not thread.is_alive())
        assert thread.is_alive(), f"the heartbeat thread died: {died!r}"
    finally:
        threading.excepthook = pytest_hook
        with registry()._lock:
            registry()._leases.pop(unopened, None)
        connection_module._registry.pop(unopened, None)
        lease.release()


# -- waiting for a holder that committed after the attempt's snapshot (waiting.py) ------------


def insert_uncommitted(session, name):
    """Another holder's grant, in a transaction of ``session`` that has not committed."""
    session.execute("BEGIN")
    session.execute(
        f"INSERT INTO {TABLE} (name, token, holder, host, pid, backend_pid, description,"
        " acquired_at, last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory)"
        " VALUES (%s, nextval('django_pglock_token_seq'), 'elsewhere:7:abcd', 'elsewhere', 7,"
        " 7, 'the other job', now(), now(), 1, 2, 600, false)",
        [name],
    )


def test_a_holder_that_committed_after_the_attempts_snapshot_is_read_again(db, db2):
    name = unique("late-holder")
    conn = get_connection("default")
    conn.ensure_open()
    insert_uncommitted(db2, name)
    acquisition = Lock(name).acquire(blocking=False)
    thread, results = other_thread(acquisition.__enter__)
    wait_until(lambda: waiting_on_lock(db, conn.backend_pid))  # behind the uncommitted row
    db2.execute("COMMIT")
    thread.join(WAIT)
    assert results == [None]
    # The attempt's snapshot saw no holder; asking for it reads the row that won.
    holder = acquisition.holder
    assert holder is not None and holder["holder"] == "elsewhere:7:abcd"
    assert holder["description"] == "the other job"
    acquisition.__exit__(None, None, None)


def test_a_skipped_job_whose_holder_is_gone_by_then_names_no_one(db, db2, caplog):
    name = unique("gone-holder")
    ran = []

    @singleton_job(name)
    def job():
        ran.append(True)

    def contended(sender, name, holder, **kwargs):
        if sender.name == name and holder is None:
            db.execute(f"DELETE FROM {TABLE} WHERE name = %s", [name])  # the holder finished

    conn = get_connection("default")
    conn.ensure_open()
    insert_uncommitted(db2, name)
    signals.lock_contended.connect(contended)
    try:
        with caplog.at_level(logging.INFO, logger="django_pglock"):
            thread, results = other_thread(job)
            wait_until(lambda: waiting_on_lock(db, conn.backend_pid))
            db2.execute("COMMIT")
            thread.join(WAIT)
    finally:
        signals.lock_contended.disconnect(contended)
    assert results == [None] and not ran
    assert f"lock {name!r} is held by another process" in caplog.text


# -- the async shell's handoff (aio.py) --------------------------------------------------------


def test_a_cancelled_acquire_that_got_nothing_has_nothing_to_release():
    handoff = _Handoff()
    handoff.abandon()  # the awaiting task was cancelled first
    assert handoff.run(lambda: None) is None


def test_a_cancelled_acquire_whose_grant_was_handed_over_releases_it(db):
    name = unique("handoff")
    handoff = _Handoff()
    lease = handoff.run(Lock(name).try_acquire)  # granted and handed over...
    assert lease is not None and row_of(db, name)[0] == lease.token
    handoff.abandon()  # ...to a task cancelled before it could take it
    wait_until(lambda: row_of(db, name) is None, message="the abandoned grant was kept")
    wait_until(lambda: lease.state is State.RELEASED)  # (its thread learns it just after)


# -- the admin's forced release, with odd forms (admin.py) -------------------------------------

HOLDERS = reverse("admin:django_pglock_joblock_changelist")


def force_release_post(client, **data):
    response = client.post(HOLDERS, {"action": "force_release", "index": "0", **data}, follow=True)
    assert response.status_code == 200
    return [(message.level_tag, message.message) for message in response.context["messages"]]


def test_forcing_the_release_of_locks_no_longer_held(admin_client):
    assert force_release_post(admin_client, _selected_action=[unique("gone")]) == [
        ("warning", "None of the selected locks is held any more.")
    ]


def test_an_incomplete_confirmation_releases_nothing(admin_client, db):
    name = unique("incomplete")
    lease = Lock(name, **QUIET).try_acquire()
    shown = force_release_post(
        admin_client,
        _selected_action=[name],
        post="yes",
        lock_name=[name, name],
        lock_token=[str(lease.token)],
    )
    assert shown == [("error", "The confirmation form was incomplete.")]
    assert row_of(db, name)[0] == lease.token
    lease.release()


def test_a_confirmation_with_unusable_tokens_releases_nothing(admin_client, db):
    garbled, zero = unique("garbled"), unique("zero")
    leases = [Lock(name, **QUIET).try_acquire() for name in (garbled, zero)]
    shown = force_release_post(
        admin_client,
        _selected_action=[garbled, zero],
        post="yes",
        lock_name=[garbled, zero],
        lock_token=["12abc", "0"],
    )
    assert shown == [("error", "token=0 is not a fencing token; pass a positive integer.")]
    assert [row_of(db, name)[0] for name in (garbled, zero)] == [le.token for le in leases]
    for lease in leases:
        lease.release()


# -- settings, checks and small pieces ---------------------------------------------------------


def test_record_runs_must_be_a_bool():
    with override_settings(DJANGO_PGLOCK={"RECORD_RUNS": "yes"}):
        assert [message.id for message in check_settings()] == ["django_pglock.E010"]


def test_the_database_check_leaves_a_lock_alias_that_is_not_postgresql_alone():
    with override_settings(DJANGO_PGLOCK={"DATABASE": "sqlite"}):
        assert check_database(databases=["sqlite"]) == []


def test_the_configured_metrics_hook_is_made_once_per_path():
    path = "tests.test_edges.EdgeMetrics"
    with override_settings(DJANGO_PGLOCK={"METRICS": path}):
        first = configured_metrics()
        with override_settings(USE_TZ=True):  # any settings change: a new generation
            again = configured_metrics()
    assert isinstance(first, EdgeMetrics) and again is first


def test_a_metrics_hook_that_cannot_be_loaded_never_stops_a_grant(db, caplog):
    name = unique("bad-metrics")
    with (
        override_settings(DJANGO_PGLOCK={"METRICS": "tests.no_such_module.Metrics"}),
        caplog.at_level(logging.ERROR, logger="django_pglock"),
    ):
        lease = Lock(name).try_acquire()
    assert lease is not None and row_of(db, name)[0] == lease.token
    assert "DJANGO_PGLOCK['METRICS'] could not be loaded" in caplog.text
    lease.release()


def test_lock_arguments_and_their_descriptions():
    with pytest.raises(ValueError, match="record='yes' must be True or False"):
        Lock("x", record="yes")
    assert repr(Lock("nightly-report")) == "<Lock 'nightly-report'>"
    assert isinstance(Lock.heartbeat_interval, Option)
    assert "The argument, else the setting" in Lock.stale_after.__doc__


def test_singleton_job_refuses_bad_record_values_and_tasks():
    with pytest.raises(ValueError, match="record='yes' must be True, False or None"):
        singleton_job("x", record="yes")

    class Task:  # what django.tasks' @task returns: the function is its .func
        def func(self):
            pass

        def enqueue(self):
            pass

    with pytest.raises(ValueError, match="put @task above @singleton_job"):
        singleton_job("x")(Task())


def test_history_rows_describe_themselves():
    slot = datetime.datetime(2026, 1, 1, 3, 0, tzinfo=datetime.timezone.utc)
    claim = ScheduleClaim(name="nightly", slot=slot, holder="h", claimed_at=slot)
    assert str(claim) == "nightly @ 2026-01-01T03:00:00+00:00"
    run = JobRun(name="nightly", outcome="succeeded", started_at=slot)
    assert str(run) == "nightly succeeded at 2026-01-01T03:00:00+00:00"


def test_schedule_slots_need_cronsim_and_a_string(monkeypatch):
    with pytest.raises(ValueError, match="must be a cron expression string"):
        ScheduleSlot(300, "x")
    monkeypatch.setitem(sys.modules, "cronsim", None)  # not installed
    with pytest.raises(ImproperlyConfigured, match="need the cronsim package"):
        ScheduleSlot("0 3 * * *", "x")


def test_an_async_job_whose_schedule_slot_started_elsewhere_is_skipped():
    name = unique("async-slot")
    ran = []

    # Once a year: the current slot is the same for both calls below.
    @singleton_job(name, schedule="0 0 1 1 *")
    async def job():
        ran.append(True)
        return "ran"

    assert asyncio.run(job()) == "ran"
    assert asyncio.run(job()) is None
    assert ran == [True]


def test_pruning_history_on_an_alias_that_is_not_postgresql_is_a_usage_error():
    with pytest.raises(CommandError, match="sqlite") as failure:
        call_command("pglock_prune", "--older-than", "1d", "--database", "sqlite")
    assert failure.value.returncode == 2


# -- releasing (releasing.py) ------------------------------------------------------------------


def test_a_release_waiting_for_its_guarded_transaction_is_retried_until_it_ends(db):
    name = unique("guarded")
    lease = Lock(name, **QUIET).try_acquire()
    backend = lease._conn.backend_pid
    with transaction.atomic():
        lease.guard()
        lease.release()  # the row is locked by this very transaction: the delete waits
        assert lease.state is State.RELEASING and row_of(db, name) is not None
        tried = activity(db, backend)[1]
        # The heartbeat thread tries again, in vain while the transaction lasts.
        wait_until(lambda: activity(db, backend)[1] > tried, message="the release was not retried")
        assert row_of(db, name) is not None
    wait_until(lambda: row_of(db, name) is None, message="the release never finished")
    wait_until(lambda: lease.state is State.RELEASED)  # (its thread learns it just after)


# -- locked_run (management/commands/locked_run.py) --------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("soon", "'soon' is not a number of seconds"),
        ("-1", "'-1' must be zero or more seconds"),
        ("nan", "'nan' must be zero or more seconds"),
        ("inf", "'inf' must be zero or more seconds"),
    ],
)
def test_locked_run_refuses_durations_that_are_not_seconds(value, message):
    with pytest.raises(CommandError, match=message):
        call_command("locked_run", "--timeout", value, "--shell", "--", "true")


def test_locked_run_cannot_wrap_itself():
    with pytest.raises(CommandError, match="cannot wrap itself") as failure:
        call_command("locked_run", "locked_run", "exit_with", "0")
    assert failure.value.returncode == 2


def test_locked_run_skipped_with_jitter_and_no_record_leaves_no_history(db):
    name = unique("skip-unrecorded")
    holder = acquired_in_another_thread(Lock(name, **QUIET))
    stderr = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command(
            "locked_run",
            "--name",
            name,
            "--jitter",
            "0.01",
            "--no-record",
            "--shell",
            "--",
            "true",
            stderr=stderr,
        )
    assert exited.value.code == 0
    assert f"lock {name!r} is held by {holder.holder}" in stderr.getvalue()
    assert not JobRun.objects.filter(name=name).exists()
    holder.release()


def test_locked_run_with_no_session_to_hand_over_still_guards_its_job(db):
    """A table-path lease whose session ended (it is reopened by the next statement) has
    no socket to hand to the guardian: the job runs all the same."""
    name = unique("no-socket")
    lease = Lock(name, advisory=False, **QUIET).try_acquire()
    db.execute("SELECT pg_terminate_backend(%s)", [lease._conn.backend_pid])
    wait_until(lambda: not lease._conn.is_open())  # the heartbeat thread noticed
    command = locked_run.Command(stdout=io.StringIO(), stderr=io.StringIO())
    command.terminated = False  # as handle() sets it
    options = {"kill_grace": 5.0, "shell": True, "on_lost": "terminate"}
    job = [sys.executable, "-c", "import sys; sys.exit(5)"]
    assert command._supervise(lease, job, options) == 5
    lease.check()
    lease.release()
    assert row_of(db, name) is None


DUP_FAILS = """
import os, resource, sys, threading, time
import django
django.setup()
from django_pglock import Lock
from django_pglock.heartbeat import registry
from django_pglock.management.commands.locked_run import _lock_socket

lease = Lock(sys.argv[1], heartbeat_interval=100, alert_after=200, stale_after=3000).try_acquire()
fd = _lock_socket(lease)
assert fd is not None
os.close(fd)
heartbeat = registry()._thread
deadline = time.monotonic() + 30
while sys._current_frames()[heartbeat.ident].f_code.co_name != "_hung_up":
    assert time.monotonic() < deadline  # the heartbeat thread sleeps, holding its fds
    time.sleep(0.002)
lowest_free = os.dup(0)
os.close(lowest_free)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no descriptor left
try:
    fd = _lock_socket(lease)
finally:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
lease.release()
print("SOCKET", fd, flush=True)
"""


def test_locked_run_without_a_descriptor_to_spare_hands_no_socket_over(db, children):
    name = unique("no-fd")
    code, out, err = finish(children([*python_code(DUP_FAILS), name]))
    assert (code, out.strip()) == (0, "SOCKET None"), err
    assert row_of(db, name) is None


MANAGE_PY = """
import os, sys
sys.path.insert(0, {root!r})
with open({log!r}, "a", encoding="utf-8") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
from django.core.management import execute_from_command_line
execute_from_command_line(sys.argv)
"""


def test_locked_run_started_through_manage_py_runs_the_command_through_it(db, children, tmp_path):
    log = tmp_path / "argv.log"
    manage = tmp_path / "manage.py"
    manage.write_text(MANAGE_PY.format(root=str(REPO_ROOT), log=str(log)))
    name = unique("manage-py")
    code, _, err = finish(
        children([sys.executable, manage, "locked_run", "--name", name, "exit_with", "6"])
    )
    assert code == 6, err
    assert log.read_text().splitlines() == [f"locked_run --name {name} exit_with 6", "exit_with 6"]
    assert row_of(db, name) is None


def children_of(pid):
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(child) for child in found]


def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pending_signals(pid):
    """The signals pending for process ``pid`` and for its main thread (a bit mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def test_a_signal_to_locked_run_before_its_job_started_reaches_the_job(db, children):
    name = unique("early-signal")
    run = children(
        [
            sys.executable,
            "-m",
            "django",
            "locked_run",
            "--name",
            name,
            "--shell",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
        ]
    )

    def guardian():
        for child in children_of(run.pid):
            if b"guardian.py" in cmdline(child):
                return child
        return None

    guardian_pid = wait_until(guardian, message="locked_run started no guardian")
    os.kill(guardian_pid, signal.SIGSTOP)  # the job cannot start meanwhile
    try:
        wait_until(lambda: process_state(guardian_pid) == "T")
        os.kill(run.pid, signal.SIGTERM)
        # Delivered (to the main thread waiting for the guardian's report): its handler
        # runs before anything else there, while the job has not started.
        wait_until(lambda: not pending_signals(run.pid) & (1 << (signal.SIGTERM - 1)))
    finally:
        os.kill(guardian_pid, signal.SIGCONT)
    code, _, err = finish(run)
    assert code == 128 + signal.SIGTERM, err  # the job got the SIGTERM once it started
    assert row_of(db, name) is None


LEAVES_A_LEFTOVER = """
import os, signal, subprocess, sys, time
leftover, leader = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
''', leftover])
while not os.path.exists(leftover):
    time.sleep(0.01)
open(leader + ".tmp", "w").write(str(os.getpid()))
os.replace(leader + ".tmp", leader)
sys.exit(3)
"""


def pid_gone(pid):
    return process_state(pid) in (None, "Z")


def read_pid(path):
    return int(path.read_text()) if path.exists() else None


def test_a_lease_lost_after_the_job_exited_kills_its_leftovers_and_keeps_its_status(
    db, children, tmp_path
):
    name = unique("leftover")
    leftover_file, leader_file = tmp_path / "leftover.pid", tmp_path / "leader.pid"
    run = children(
        [
            sys.executable,
            "-m",
            "django",
            "locked_run",
            "--name",
            name,
            "--kill-grace",
            "60",
            "--heartbeat-interval",
            "0.2",
            "--alert-after",
            "0.5",
            "--stale-after",
            "30",
            "--shell",
            "--",
            sys.executable,
            "-c",
            LEAVES_A_LEFTOVER,
            leftover_file,
            leader_file,
        ]
    )
    leader = wait_until(lambda: read_pid(leader_file), message="the job never started")
    leftover = read_pid(leftover_file)
    # The leader exited (and was reaped); its leftover ignores SIGTERM and runs on.
    wait_until(lambda: process_state(leader) is None, message="the leader was not reaped")
    assert not pid_gone(leftover)
    db.execute(f"DELETE FROM {TABLE} WHERE name = %s", [name])  # forced release
    code, _, err = finish(run)
    assert code == 3, err  # the job's own status
    assert "terminating the command" not in err
    assert "may take the lock at once, so the kill grace is cut from 60s to 0.0s" in err
    assert "The command's own exit status is kept." in err
    assert pid_gone(leftover)


def test_a_lease_lost_with_time_to_spare_is_not_cut_short(db, db2, children, tmp_path):
    """Lost by its own deadline (no heartbeat confirmed): a contender may only take over
    later, so a kill grace shorter than that is kept as it is."""
    name = unique("kept-grace")
    pidfile = tmp_path / "job.pid"
    run = children(
        [
            sys.executable,
            "-m",
            "django",
            "locked_run",
            "--name",
            name,
            "--kill-grace",
            "0",
            "--heartbeat-interval",
            "1",
            "--alert-after",
            "2",
            "--stale-after",
            "8",
            "exit_with",
            "0",
            "--seconds",
            "120",
            "--pidfile",
            pidfile,
        ]
    )
    job = wait_until(lambda: read_pid(pidfile), message="the job never started")
    # Heartbeats skip a row another transaction has locked: none is confirmed any more.
    db2.execute("BEGIN")
    db2.execute(f"SELECT 1 FROM {TABLE} WHERE name = %s FOR UPDATE", [name])
    try:
        wait_until(lambda: pid_gone(job), timeout=60, message="the job outlived the lease")
    finally:
        db2.execute("ROLLBACK")
    code, _, err = finish(run)
    assert code == locked_run.EXIT_LOST, err
    assert "was lost; terminating the command." in err
    assert "kill grace is cut" not in err


# -- the guardian and locked_run's end of it (guardian.py, supervisor.py) ----------------------

SLEEPER = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], "w").write("usr1"))
open(sys.argv[2] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(120)
"""


def started_job(tmp_path, code=SLEEPER, grace=30.0):
    """A GuardedJob (a real guardian process) running ``code``; its marker and pid files."""
    marker, pidfile = tmp_path / "marker", tmp_path / "job.pid"
    job = GuardedJob([sys.executable, "-c", code, marker, pidfile], dict(os.environ), grace=grace)
    wait_until(lambda: read_pid(pidfile), message="the job never started")
    return job, marker


def test_the_guardian_ignores_orders_it_cannot_read(tmp_path):
    job, marker = started_job(tmp_path)
    try:
        job._order("reboot now")  # not an order
        job._order("signal 15")  # one argument short
        job.forward(signal.SIGUSR1, None)  # a signal with no SIGKILL to follow
        wait_until(marker.exists, message="the forwarded signal never came")
        assert not pid_gone(job.pid)  # neither of the others did anything
    finally:
        job.kill()
        job.wait_gone()
    assert job.gone and job.exit_code == -signal.SIGKILL and not job.guardian_failed


def test_a_job_being_killed_is_sent_no_other_signal(tmp_path):
    job, marker = started_job(tmp_path)
    # Both orders in one write: the guardian reads them together, the kill first.
    job._order(f"kill\nsignal {int(signal.SIGUSR1)} -1.0")
    job.wait_gone()
    assert job.exit_code == -signal.SIGKILL and not job.guardian_failed
    assert not marker.exists()  # no SIGUSR1 reached it


# Much memory, all of it touched: a SIGKILLed process takes a while to be gone.
HEAVY = """
import os, sys, time
ballast = bytearray(os.urandom(1)) * (512 * 1024 * 1024)
open(sys.argv[2] + ".tmp", "w").write(str(os.getpid()))
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(120)
"""


def test_a_guardian_that_fails_kills_its_job_before_it_dies(tmp_path, capfd):
    job, _ = started_job(tmp_path, code=HEAVY)
    leader = job.pid
    job._order("signal TERM 1")  # garbled: the guardian fails on it
    job.wait_gone()
    assert job.process.returncode == 1
    assert "ValueError" in capfd.readouterr().err  # its traceback
    # It killed the job and waited for it to be gone before it died.
    assert job.guardian_failed and job.gone and job.exit_code is None
    assert pid_gone(leader)


def test_a_guardian_whose_locked_run_is_gone_before_it_starts_starts_no_job(tmp_path):
    from django_pglock import guardian

    marker = tmp_path / "started"
    orders_r, orders_w = os.pipe()
    reports_r, reports_w = os.pipe()
    os.close(orders_w)  # locked_run died right after starting the guardian
    try:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-I", guardian.__file__, str(orders_r), str(reports_w)),
                *("-1", "1", "", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"),
            ],
            pass_fds=[orders_r, reports_w],
        )
    finally:
        os.close(orders_r)
        os.close(reports_w)
    with os.fdopen(reports_r, "rb") as reports:
        assert reports.read() == b"failed 0\n"
    assert proc.wait(WAIT) == 127
    assert not marker.exists()


def test_a_group_of_another_user_counts_as_alive(child_env):
    require(
        os.geteuid() == 0 and Path("/usr/bin/setpriv").exists(),
        "needs root and setpriv to run a process that may not signal another user",
    )
    member = subprocess.Popen(["sleep", "120"], user=65534, start_new_session=True)
    try:
        code = "import sys; from django_pglock.guardian import group_alive; "
        code += "print(group_alive(int(sys.argv[1])))"
        # Root without CAP_KILL: kill() on another user's group fails with EPERM.
        result = subprocess.run(
            [
                *("/usr/bin/setpriv", "--inh-caps=-kill", "--bounding-set=-kill"),
                *(sys.executable, "-c", code, str(member.pid)),
            ],
            cwd=REPO_ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert result.stdout.strip() == "True", result.stderr
        assert group_alive(member.pid)
    finally:
        member.kill()
        member.wait()
    assert not group_alive(member.pid)


GROUP_ALIVE = """
import os, sys
from django_pglock.guardian import group_alive
try:
    print(sorted(os.listdir("/proc")))
except OSError as exc:
    print(type(exc).__name__)
print(group_alive(int(sys.argv[1])), flush=True)
"""


@pytest.mark.parametrize(
    ("setup", "sees"),
    [
        # A /proc whose process entries cannot be read (a process that ended between
        # listing and reading, a stat without its fields).
        (
            "mount -t tmpfs none /proc && mkdir /proc/4242 /proc/4343"
            " && printf garbage > /proc/4242/stat && exec",
            "['4242', '4343']",
        ),
        # A /proc that cannot be listed at all.
        (
            "mount -t tmpfs -o mode=000 none /proc && exec /usr/bin/setpriv"
            " --inh-caps=-dac_override,-dac_read_search"
            " --bounding-set=-dac_override,-dac_read_search",
            "PermissionError",
        ),
    ],
    ids=["unreadable-entries", "unlistable"],
)
def test_a_group_is_trusted_to_kill_when_proc_tells_nothing(child_env, setup, sees):
    require(
        os.geteuid() == 0 and Path("/usr/bin/unshare").exists(),
        "needs root and unshare to give a process a /proc of its own",
    )
    member = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        # In a mount namespace of its own, so that only that process sees this /proc.
        script = f'{setup} "$0" -c "$1" "$2"'
        result = subprocess.run(
            [
                *("/usr/bin/unshare", "--mount", "--propagation", "private", "sh", "-c", script),
                *(sys.executable, GROUP_ALIVE, str(member.pid)),
            ],
            cwd=REPO_ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert result.stdout.split("\n")[:2] == [sees, "True"], result.stderr
    finally:
        member.kill()
        member.wait()


def pipes():
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                found.add(int(fd))
    return found


def test_a_guardian_that_cannot_be_started_leaves_no_pipe_open():
    before = pipes()
    with pytest.raises(ValueError, match="null byte"):
        GuardedJob(["no\0such-program"], dict(os.environ), grace=1.0)
    assert pipes() == before


def test_a_finished_guarded_job_takes_no_more_orders(tmp_path):
    job = GuardedJob([sys.executable, "-c", "pass"], dict(os.environ), grace=1.0)
    job.wait_gone()  # its reports are read here, to the last
    assert job.gone and job.exit_code == 0 and not job.guardian_failed
    job.wait_gone()  # nothing left to wait for
    read_end, write_end = os.pipe()  # may get the number the order pipe had
    try:
        job.forward(signal.SIGTERM, 1.0)
        job.kill()
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):
            os.read(read_end, 100)  # nothing was written anywhere
    finally:
        os.close(read_end)
        os.close(write_end)


# -- migrations on PostgreSQL and on other databases (migrations/_postgres.py) ----------------

MIGRATE = """
from django.core.management import call_command
import django
django.setup()
from django.db import connections
for alias in ("default", "sqlite"):
    call_command("migrate", database=alias, verbosity=0)
    call_command("migrate", "django_pglock", "zero", database=alias, verbosity=0)
    tables = connections[alias].introspection.table_names()
    print(alias, "django_pglock_joblock" in tables, flush=True)
with connections["default"].cursor() as cursor:
    cursor.execute("SELECT to_regclass('django_pglock_token_seq')")
    print("sequence", cursor.fetchone()[0], flush=True)
"""


def test_the_lock_tables_migrate_back_and_forth_on_postgresql_and_elsewhere(
    pg_url, child_env, children
):
    scratch = f"pglock_edge_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(scratch)))
        try:
            env = {**child_env, "PGLOCK_TEST_DB_NAME": scratch}
            code, out, err = finish(children(python_code(MIGRATE), env=env))
        finally:
            admin.execute(
                pgsql.SQL("DROP DATABASE {} WITH (FORCE)").format(pgsql.Identifier(scratch))
            )
    assert code == 0, err
    assert out.split() == ["default", "False", "sqlite", "False", "sequence", "None"]
