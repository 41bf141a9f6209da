"""Exclusion at the edges of one process: reconnects, failed and interrupted statements,
forks, odd session defaults, and a stale holder's heartbeat.

Each test reproduces a way the lock used to be held twice, held for ever, or wedged, on a
real server; the multi-process ones use real processes and real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psycopg
import pytest

from django_pglock import Lock, LockError, LockNotHeld, signals
from django_pglock import opening as opening_module
from django_pglock.connection import get_connection
from django_pglock.heartbeat import registry
from django_pglock.states import Key, State
from tests.faultkit import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = "django_pglock_joblock"


@pytest.fixture
def db(pg_url, test_db_name):
    """A separate autocommit session on the test database: the view of another process."""
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


@pytest.fixture(autouse=True)
def fresh_session():
    """Each test here starts on a new lock session (some change its settings)."""
    get_connection("default").close()
    yield
    get_connection("default").close()


def row(db, name):
    found = db.execute(
        f"SELECT token, last_heartbeat, backend_pid, advisory FROM {TABLE} WHERE name = %s",
        [name],
    ).fetchone()
    fields = ("token", "beat", "pid", "advisory")
    return None if found is None else dict(zip(fields, found, strict=True))


def key_held_by(db, backend_pid):
    """How many advisory locks the given server process holds."""
    return db.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted",
        [backend_pid],
    ).fetchone()[0]


# -- 5. a session killed under another thread's statement --------------------------------


def test_a_session_killed_during_another_threads_statement_loses_its_advisory_leases_at_once(
    db,
):
    lease = Lock("reset-race", heartbeat_interval=0.2, alert_after=0.6, stale_after=6).try_acquire()
    table_only = Lock("reset-race-table", advisory=False).try_acquire()
    assert lease is not None and lease.advisory and table_only is not None
    conn = get_connection("default")
    backend = conn.backend_pid
    started = threading.Event()
    failed: list[BaseException] = []

    def long_statement():
        started.set()
        try:
            conn.execute("SELECT pg_sleep(5)", {})
        except LockError as exc:
            failed.append(exc)

    other = threading.Thread(target=long_statement)
    other.start()
    started.wait()
    assert wait_until(
        lambda: db.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND query LIKE '%%pg_sleep%%'",
            [backend],
        ).fetchone(),
        10,
    )
    db.execute("SELECT pg_terminate_backend(%s)", [backend])
    other.join(10)
    assert failed, "the statement on the killed session did not fail"
    # Both sides learn at once: the moment the statement failed, before any reconnect.
    assert lease.lost and lease.state is State.LOST
    assert "session ended" in str(lease._lost_reason)
    assert lease.kill_deadline is not None and lease.kill_deadline <= time.monotonic()
    # A heartbeat on a new session never confirms it again.
    with pytest.raises(LockNotHeld):
        lease.beat()
    # The table-path lease is not judged by the session: it survives the reconnect.
    table_only.check()
    table_only.beat()
    assert not table_only.lost
    contender = Lock("reset-race").try_acquire()
    assert contender is not None and contender.token > lease.token
    contender.release()
    table_only.release()
    lease.release()


# -- 6. a release that fails once --------------------------------------------------------


def test_a_failed_release_is_retried_until_it_settles_and_never_heartbeated_again(db, monkeypatch):
    monkeypatch.setattr(opening_module, "LOCK_TIMEOUT", "100ms")
    get_connection("default").close()  # the next session takes the short lock_timeout
    lease = Lock(
        "release-retry", heartbeat_interval=0.1, alert_after=0.3, stale_after=3
    ).try_acquire()
    assert lease is not None
    with db.transaction():
        # A reader holds the row past lock_timeout: the delete cannot take its row lock.
        db.execute(f"SELECT 1 FROM {TABLE} WHERE name = 'release-retry' FOR SHARE")
        with pytest.raises(LockError, match="retried in the background"):
            lease.release()
        assert lease.state is State.RELEASING
        beat_then = row(db, "release-retry")["beat"]
        # Not heartbeated any more: several intervals pass without a new heartbeat.
        assert registry().leases("default").count(lease) == 1
        deadline = lease._release_retry_at + 0.5
        while time.monotonic() < deadline:
            time.sleep(0.05)
        assert row(db, "release-retry")["beat"] == beat_then
        assert lease.state is State.RELEASING
    # The reader is gone: the heartbeat thread's retry deletes the row.
    assert wait_until(lambda: row(db, "release-retry") is None, 10)
    assert wait_until(lambda: lease.state is State.RELEASED, 10)
    assert lease not in registry().leases("default")
    lease.release()  # a no-op now
    again = Lock("release-retry").try_acquire()
    assert again is not None
    again.release()


# -- 7. an exception raised by a signal handler during a lock statement ------------------


class JobTimeout(Exception):
    """What RQ's or Celery's SIGALRM handler raises in the middle of whatever runs."""


def test_a_signal_handler_exception_during_a_lock_statement_leaves_the_connection_usable(db):
    other = Lock("interrupt-other").try_acquire()
    assert other is not None and other.advisory
    backend = get_connection("default").backend_pid
    # An uncommitted insert of the same name makes the acquire wait (for lock_timeout).
    db.execute("BEGIN")
    db.execute(
        f"INSERT INTO {TABLE} (name, token, holder, host, pid, backend_pid, description,"
        " acquired_at, last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory)"
        " VALUES ('interrupt', nextval('django_pglock_token_seq'), 'x', 'x', 1, 1, 'x',"
        " now(), now(), 10, 30, 600, false)"
    )

    def timeout(signum, frame):
        raise JobTimeout("job exceeded its time limit")

    previous = signal.signal(signal.SIGALRM, timeout)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(JobTimeout):
            Lock("interrupt").try_acquire()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    db.execute("ROLLBACK")
    # The same session goes on: the other lease survives, with its key.
    conn = get_connection("default")
    assert conn.backend_pid == backend
    other.check()
    other.beat()
    assert not other.lost and key_held_by(db, backend) == 1
    # A free name can be locked, and so can the name once the insert is gone.
    for name in ("interrupt-free", "interrupt"):
        lease = Lock(name).try_acquire()
        assert lease is not None, name
        lease.release()
    other.release()


class Interrupted(BaseException):
    """Like KeyboardInterrupt: not caught by a signal receiver's error handling."""


def test_a_grant_interrupted_before_its_caller_gets_it_is_released(db):
    def receiver(sender, lease, **kwargs):
        raise Interrupted

    signals.lock_acquired.connect(receiver)
    try:
        with pytest.raises(Interrupted):
            Lock(
                "interrupted-grant", heartbeat_interval=0.2, alert_after=0.6, stale_after=6
            ).try_acquire()
    finally:
        signals.lock_acquired.disconnect(receiver)
    # Nobody holds the grant, so the heartbeat thread releases it.
    assert wait_until(lambda: row(db, "interrupted-grant") is None, 10)
    assert not [lease for lease in registry().leases() if lease.name == "interrupted-grant"]
    lease = Lock("interrupted-grant").try_acquire()
    assert lease is not None
    lease.release()


# -- 9. a forked child that keeps the parent's socket ------------------------------------


FORKING_HOLDER = """
import os, signal, sys, time
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1]).try_acquire()
assert lease is not None and lease.advisory
child = os.fork()
if child == 0:
    time.sleep(120)  # a worker that lives on, with whatever it inherited
    os._exit(0)
print("READY", lease.token, child, flush=True)
time.sleep(120)
"""


def test_a_forked_child_does_not_keep_its_dead_parents_lock_alive(db, procs):
    holder = procs.python(FORKING_HOLDER, "forked-parent")
    child_pid = None
    try:
        line = holder.expect("READY").split()
        token, child_pid = int(line[1]), int(line[2])
        holder.kill()  # the parent dies (not its process group): its forked child runs on
        holder.wait(10)
        # The parent's session ends with the parent: a contender takes over at once
        # (stale_after is 600 s here).
        lease = Lock("forked-parent", poll_interval=0.05).acquire_or_raise(timeout=20)
        assert lease.token > token
        lease.release()
    finally:
        if child_pid:
            with_suppressed_kill(child_pid)


def with_suppressed_kill(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- 10. a repeatable-read default on the role or database --------------------------------


def test_repeatable_read_as_the_database_default_still_refuses_cleanly(db, test_db_name):
    db.execute(
        f'ALTER DATABASE "{test_db_name}" SET default_transaction_isolation = "repeatable read"'
    )
    try:
        get_connection("default").close()  # a new session, with the database default
        holder = Lock("rr", advisory=False).try_acquire()
        assert holder is not None
        conn = get_connection("default")
        assert conn.execute("SHOW default_transaction_isolation", {}) == [("read committed",)]
        errors, refused = [], 0
        for _ in range(50):
            try:
                assert Lock("rr", advisory=False).try_acquire() is None
                refused += 1
            except LockError as exc:  # pragma: no cover - the failure this test is about
                errors.append(exc)
        assert not errors and refused == 50
        holder.release()
    finally:
        db.execute(f'ALTER DATABASE "{test_db_name}" RESET default_transaction_isolation')
        get_connection("default").close()


# -- the fencing of heartbeats -----------------------------------------------------------


def test_an_old_leases_heartbeat_never_touches_its_successors_row(db):
    old = Lock("fenced-beat", heartbeat_interval=5, alert_after=10, stale_after=60).try_acquire()
    assert old is not None
    # A forced release, then a new holder (in another thread, as another process would).
    db.execute(f"DELETE FROM {TABLE} WHERE name = 'fenced-beat'")
    new = []
    helper = threading.Thread(
        target=lambda: new.append(Lock("fenced-beat", advisory=False).try_acquire())
    )
    helper.start()
    helper.join()
    successor = new[0]
    assert successor is not None and successor.token > old.token
    db.execute(
        f"UPDATE {TABLE} SET last_heartbeat = now() - interval '1 hour' WHERE name = 'fenced-beat'"
    )
    before = row(db, "fenced-beat")["beat"]
    with pytest.raises(LockNotHeld):
        old.beat()
    assert old.lost
    after = row(db, "fenced-beat")
    assert after["token"] == successor.token and after["beat"] == before
    successor.release()
    old.release()


def test_every_lease_state_change_follows_the_transition_table():
    from django_pglock.states import TRANSITIONS

    lease = Lock("transitions").try_acquire()
    assert lease is not None and lease.state is State.HELD
    for state in State:
        allowed = TRANSITIONS[state]
        assert state not in allowed  # no state changes to itself
    assert lease._advance(State.RELEASED) is False  # HELD may not skip the release
    assert lease.state is State.HELD
    lease.release()
    assert lease.state is State.RELEASED
    assert lease._advance(State.HELD) is False and lease._advance(State.LOST) is False
    assert lease.state is State.RELEASED and lease._key_state is Key.NONE
