"""In-process semantics of Lock and Lease, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg
import pytest
from django.db import connection, transaction

from django_pglock import Lease, Lock, LockError, LockNotAcquired, LockNotHeld, signals, sql
from django_pglock import connection as connection_module
from django_pglock.connection import get_connection
from django_pglock.operations import force_release, lock_status
from django_pglock.states import Key

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


@pytest.fixture
def db(pg_url, test_db_name):
    """A separate autocommit session on the test database: the view of another process."""
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


def row(db, name):
    return db.execute(
        "SELECT token, holder, host, pid, backend_pid, advisory FROM django_pglock_joblock"
        " WHERE name = %s",
        [name],
    ).fetchone()


def test_acquire_and_release(db):
    lease = Lock("basic").try_acquire()
    assert isinstance(lease, Lease)
    assert lease.name == "basic"
    assert isinstance(lease.token, int) and lease.token > 0
    assert lease.acquired_at.tzinfo is not None
    assert not lease.lost
    token, holder, host, pid, backend_pid, advisory = row(db, "basic")
    assert token == lease.token and holder == lease.holder
    assert str(pid) in holder and host in holder
    assert advisory is True
    assert backend_pid == get_connection("default").backend_pid
    lease.release()
    assert row(db, "basic") is None
    lease.release()  # idempotent
    with pytest.raises(LockNotHeld):
        lease.check()


def test_second_lock_object_in_same_process_is_refused():
    first = Lock("same-process").try_acquire()
    assert first is not None
    assert Lock("same-process").try_acquire() is None
    first.release()
    again = Lock("same-process").try_acquire()
    assert again is not None and again.token > first.token
    again.release()


def test_context_manager_releases_and_yields_none_when_held(db):
    with Lock("ctx").acquire(blocking=False) as lease:
        assert lease is not None
        assert row(db, "ctx")[0] == lease.token
        with Lock("ctx").acquire(blocking=False) as other:
            assert other is None
    assert row(db, "ctx") is None


def acquired_in_another_thread(name: str) -> Lease:
    """A lease taken by another thread (a thread waiting for its own lease fails at once)."""
    leases: list[Lease | None] = []
    helper = threading.Thread(target=lambda: leases.append(Lock(name).try_acquire()))
    helper.start()
    helper.join()
    assert leases[0] is not None
    return leases[0]


def test_blocking_acquire_times_out_then_succeeds_after_release():
    holder = acquired_in_another_thread("wait")
    started = time.monotonic()
    with Lock("wait", poll_interval=0.05).acquire(timeout=0.4) as lease:
        waited = time.monotonic() - started
        assert lease is None
    assert 0.4 <= waited < 1.5
    threading.Timer(0.3, holder.release).start()
    started = time.monotonic()
    with Lock("wait", poll_interval=0.05).acquire(timeout=5) as lease:
        assert lease is not None
        assert 0.25 <= time.monotonic() - started < 2


def test_acquire_or_raise():
    lock = Lock("or-raise", poll_interval=0.05)
    lease = acquired_in_another_thread("or-raise")
    with pytest.raises(LockNotAcquired) as info:
        Lock("or-raise").acquire_or_raise()
    assert isinstance(info.value, LockError)
    assert "'or-raise'" in str(info.value)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired):
        Lock("or-raise", poll_interval=0.05).acquire_or_raise(timeout=0.3)
    assert time.monotonic() - started >= 0.3
    lease.release()
    lock.acquire_or_raise(timeout=1).release()


def test_waiting_for_a_name_this_thread_holds_fails_at_once_naming_the_lease(db):
    held = Lock("mine", poll_interval=0.05).acquire_or_raise()
    for wait in (
        lambda: Lock("mine").acquire_or_raise(timeout=30),
        lambda: Lock("mine").acquire(timeout=30).__enter__(),
        lambda: Lock("mine").acquire(blocking=True).__enter__(),
        lambda: Lock("mine").acquire_or_raise(),
    ):
        started = time.monotonic()
        with pytest.raises(LockNotAcquired, match=f"held by this thread .*token={held.token}"):
            wait()
        assert time.monotonic() - started < 5  # not the 30 s timeout
    # A one-shot attempt is simply refused; another thread waits as a contender does.
    assert Lock("mine").try_acquire() is None
    threading.Timer(0.2, held.release).start()
    other = []
    waiter = threading.Thread(
        target=lambda: other.append(Lock("mine").acquire_or_raise(timeout=30))
    )
    waiter.start()
    waiter.join(30)
    assert other and other[0].token > held.token
    other[0].release()
    # Once released, this thread may take the name again.
    Lock("mine").acquire_or_raise(timeout=5).release()
    assert row(db, "mine") is None


def test_threads_in_one_process_exclude_each_other():
    inside = 0
    most_inside = 0
    entries: dict[int, int] = {}
    guard = threading.Lock()
    stop_at = time.monotonic() + 3

    def work(index):
        nonlocal inside, most_inside
        lock = Lock("threads", poll_interval=0.01)
        while time.monotonic() < stop_at:
            with lock.acquire(timeout=5) as lease:
                assert lease is not None
                with guard:
                    inside += 1
                    most_inside = max(most_inside, inside)
                    entries[index] = entries.get(index, 0) + 1
                time.sleep(0.005)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most_inside == 1
    assert sorted(entries) == list(range(6)), entries


def test_tokens_strictly_increase_across_grants_forced_releases_and_reclaims(db):
    tokens = []
    for _ in range(3):
        lease = Lock("tokens").try_acquire()
        tokens.append(lease.token)
        lease.release()
    lease = Lock("tokens").try_acquire()
    tokens.append(lease.token)
    assert force_release("tokens")["token"] == lease.token
    lease2 = Lock("tokens", advisory=False, heartbeat_interval=5, alert_after=10, stale_after=20)
    granted = lease2.try_acquire()
    tokens.append(granted.token)
    # Make the row stale by the database clock, then reclaim it.
    db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - interval '1 hour'"
        " WHERE name = 'tokens'"
    )
    reclaimed = Lock("tokens").try_acquire()
    assert reclaimed is not None
    tokens.append(reclaimed.token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    with pytest.raises(LockNotHeld):
        granted.check()
    reclaimed.release()
    with pytest.raises(LockNotHeld):
        lease.__exit__(None, None, None)


def test_lock_taken_inside_atomic_is_visible_at_once_and_survives_rollback(db):
    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        lease = Lock("atomic").try_acquire()
        assert row(db, "atomic")[0] == lease.token  # visible outside the transaction
        raise Boom
    assert row(db, "atomic")[0] == lease.token  # not rolled back with the caller
    lease.check()
    lease.release()
    assert row(db, "atomic") is None


def test_forced_release_makes_holder_lose_loudly(db):
    lost = []

    def on_lost(sender, lease, reason, **kwargs):
        lost.append((lease.token, reason))

    signals.lock_lost.connect(on_lost)
    try:
        with pytest.raises(LockNotHeld), Lock("forced").acquire(blocking=False) as lease:
            assert force_release("forced", token=lease.token) is not None
            with pytest.raises(LockNotHeld):
                lease.beat()
            assert lease.lost
            with pytest.raises(LockNotHeld):
                lease.check()
        assert lost and lost[0][0] == lease.token
    finally:
        signals.lock_lost.disconnect(on_lost)


def test_exit_never_masks_a_propagating_exception():
    with pytest.raises(ZeroDivisionError), Lock("masked").acquire(blocking=False) as lease:
        force_release("masked")
        lease.beat  # noqa: B018 - the lease is lost; the block fails on its own
        1 / 0  # noqa: B018


def test_forced_release_with_wrong_token_releases_nothing(db):
    lease = Lock("wrong-token").try_acquire()
    assert force_release("wrong-token", token=lease.token + 1000) is None
    assert row(db, "wrong-token")[0] == lease.token
    lease.check()
    lease.release()


def test_check_and_beat_refresh_the_row(db):
    lease = Lock("beat").try_acquire()
    before = db.execute(
        "SELECT last_heartbeat FROM django_pglock_joblock WHERE name = 'beat'"
    ).fetchone()[0]
    time.sleep(0.05)
    lease.beat()
    lease.check()
    after = db.execute(
        "SELECT last_heartbeat FROM django_pglock_joblock WHERE name = 'beat'"
    ).fetchone()[0]
    assert after > before
    lease.release()


def test_heartbeat_thread_keeps_a_lease_alive(db):
    lock = Lock("alive", heartbeat_interval=0.1, alert_after=0.4, stale_after=1.0)
    with lock.acquire(blocking=False) as lease:
        for _ in range(10):
            time.sleep(0.25)
            age = db.execute(
                "SELECT extract(epoch FROM now() - last_heartbeat) FROM django_pglock_joblock"
                " WHERE name = 'alive'"
            ).fetchone()[0]
            assert age < 0.4
            assert not lease.lost
        assert [s.state for s in lock_status() if s.name == "alive"] == ["ok"]
        # Nobody can reclaim a lease that keeps heartbeating, even past stale_after.
        assert Lock("alive").try_acquire() is None


def test_holder_concludes_loss_before_the_row_turns_stale(db):
    """Heartbeats that cannot land (row locked elsewhere) end in loss before stale_after."""
    lost_at = []
    lock = Lock("deadline", heartbeat_interval=0.1, alert_after=0.3, stale_after=1.5)
    lease = lock.try_acquire()
    lease.on_lost(lambda lease: lost_at.append(time.monotonic()))
    started = time.monotonic()
    with psycopg.connect(db.info.dsn, autocommit=False) as blocker:
        # A row lock that conflicts with the heartbeat's FOR NO KEY UPDATE.
        blocker.execute("SELECT 1 FROM django_pglock_joblock WHERE name = 'deadline' FOR UPDATE")
        deadline = time.monotonic() + 5
        while not lost_at and time.monotonic() < deadline:
            time.sleep(0.02)
        stale = db.execute(
            "SELECT now() - last_heartbeat > stale_after * interval '1 second'"
            " FROM django_pglock_joblock WHERE name = 'deadline'"
        ).fetchone()[0]
        blocker.rollback()
    assert lost_at, "the holder never concluded loss"
    assert lost_at[0] - started < 1.5
    assert stale is False  # the holder knew before any contender could take over
    assert lease.lost
    with pytest.raises(LockNotHeld):
        lease.__exit__(None, None, None)
    assert row(db, "deadline") is None  # leaving still releases the row


def test_guard_holds_off_forced_release_until_commit(db):
    lease = Lock("guard").try_acquire()
    released_at = []

    def release_by_force():
        force_release("guard")
        released_at.append(time.monotonic())
        connection.close()

    with transaction.atomic():
        lease.guard()
        worker = threading.Thread(target=release_by_force)
        worker.start()
        time.sleep(0.5)
        assert not released_at, "the forced release did not wait for the guard"
        lease.beat()  # the guard does not block the holder's own heartbeat
        committed_at = time.monotonic()
    worker.join(5)
    assert released_at and released_at[0] >= committed_at
    with pytest.raises(LockNotHeld):
        lease.check()
    with transaction.atomic(), pytest.raises(LockNotHeld):
        lease.guard()


def test_guard_holds_off_reclaim_until_commit(db):
    lease = Lock("guard-reclaim", advisory=False).try_acquire()
    with transaction.atomic():
        lease.guard()
        db.execute(
            "UPDATE django_pglock_joblock SET last_heartbeat = now() - interval '1 hour'"
            " WHERE name = 'guard-reclaim'"
        )
        # Stale by the database clock, but fenced: the contender is refused, not blocked.
        started = time.monotonic()
        assert Lock("guard-reclaim").try_acquire() is None
        assert time.monotonic() - started < 1
    successor = Lock("guard-reclaim").try_acquire()
    assert successor is not None and successor.token > lease.token
    with transaction.atomic(), pytest.raises(LockNotHeld):
        lease.guard()
    successor.release()


def test_guard_outside_a_transaction_is_refused():
    lease = Lock("guard-outside").try_acquire()
    with pytest.raises(LockError, match=r"transaction\.atomic"):
        lease.guard()
    lease.release()


def test_leaving_the_block_inside_a_guarded_transaction_does_not_deadlock(db):
    started = time.monotonic()
    with transaction.atomic():
        with Lock("guard-exit").acquire(blocking=False) as lease:
            lease.guard()
        assert time.monotonic() - started < 2
        assert row(db, "guard-exit") is not None  # the row waits for the commit
    deadline = time.monotonic() + 3
    while row(db, "guard-exit") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert row(db, "guard-exit") is None
    assert Lock("guard-exit").try_acquire() is not None


def test_all_leases_share_one_connection(db):
    leases = [Lock(f"shared-{i}").try_acquire() for i in range(20)]
    backends = {r[0] for r in db.execute("SELECT DISTINCT backend_pid FROM django_pglock_joblock")}
    assert backends == {get_connection("default").backend_pid}
    for lease in leases:
        lease.release()


@pytest.fixture(params=["direct", "direct-unprepared", "cursor"])
def statement_path(request):
    """Run the test's statements through the direct libpq path (prepared, or unprepared as
    behind a transaction-mode pooler), or through a psycopg cursor (what the connection
    falls back to when psycopg lacks the direct path's parts)."""
    conn = get_connection("default")
    conn.close()  # a fresh session
    conn._direct = request.param != "cursor"
    with conn.lock:  # open it (nothing prepared yet), then choose
        conn._conn = conn._connect()
    conn._prepare = request.param != "direct-unprepared"
    yield request.param
    conn.close()
    conn._direct = connection_module.Protocol.direct_available


def test_both_statement_paths_grant_refuse_reclaim_and_release(db, statement_path):
    """Every outcome of the lock statements reads the same through either path: the grant's
    timestamp and flags, the holder a refusal reports, a reclaim, a recorded release with
    NULL and non-NULL parameters, and a server error raised as LockError."""
    first = Lock("paths", record=True).try_acquire()
    assert first is not None and first.advisory is True
    assert first.acquired_at.tzinfo is not None
    with Lock("paths").acquire(blocking=False) as refused:
        assert refused is None
    attempt = Lock("paths").acquire(blocking=False)
    with attempt as lease:
        assert lease is None
        holder = attempt.holder
    assert holder is not None and holder["token"] == first.token
    assert holder["holder"] == first.holder and holder["heartbeat_age"] >= 0
    # The holder stopped long ago and left the advisory path: any contender reclaims.
    db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - interval '1 hour',"
        " advisory = false WHERE name = 'paths'"
    )
    second = Lock("paths", record=True).try_acquire()
    assert second is not None and second.token > first.token
    assert row(db, "paths")[0] == second.token
    with pytest.raises(LockNotHeld):
        first.beat()
    second.exit_code = 3
    second.release()
    assert row(db, "paths") is None
    runs = db.execute(
        "SELECT token, outcome, exit_code FROM django_pglock_jobrun WHERE name = 'paths'"
        " ORDER BY token"
    ).fetchall()
    assert runs == [(first.token, "lost", None), (second.token, "succeeded", 3)]
    with pytest.raises(LockError, match="bigint"):
        get_connection("default").execute("SELECT %(token)s::bigint", {"token": "not a number"})
    third = Lock("paths").try_acquire()  # the session survived the error
    assert third is not None
    third.release()
    prepared = get_connection("default").execute("SELECT name FROM pg_prepared_statements", {})
    assert bool(prepared) == (statement_path != "direct-unprepared"), prepared


def test_prepared_statements_are_named_after_their_text(db):
    """A prepared statement's name only ever means one statement (text and parameter
    types), so a session behind a pooler cannot run another client's statement by name;
    the same statement gets the same name in another session, whatever ran before it."""

    def cycle_and_names():
        lease = Lock("named").try_acquire()
        assert lease is not None
        lease.release()
        rows = get_connection("default").execute(
            "SELECT statement, name FROM pg_prepared_statements", {}
        )
        return dict(rows)

    get_connection("default").close()
    first = cycle_and_names()
    get_connection("default").close()
    get_connection("default").execute(sql.NOW, {})  # another statement prepared first
    second = cycle_and_names()
    assert len(first) >= 3 and len(second) == len(first) + 1, (first, second)
    assert all(name.startswith("django_pglock_") for name in second.values()), second
    assert len(set(second.values())) == len(second)
    assert all(second[statement] == name for statement, name in first.items())


def test_advisory_lease_is_lost_when_its_session_is_terminated(db):
    lease = Lock("terminated", heartbeat_interval=5, alert_after=10, stale_after=60).try_acquire()
    backend = row(db, "terminated")[4]
    started = time.monotonic()
    db.execute("SELECT pg_terminate_backend(%s)", [backend])
    while not lease.lost and time.monotonic() - started < 5:
        time.sleep(0.01)
    assert lease.lost
    assert time.monotonic() - started < 2
    successor = Lock("terminated").try_acquire()  # abandoned: taken over at once
    assert successor is not None
    successor.release()
    with pytest.raises(LockNotHeld):
        lease.__exit__(None, None, None)


def test_table_only_lease_survives_a_reconnect(db):
    lock = Lock("reconnect", advisory=False, heartbeat_interval=0.1, alert_after=0.5, stale_after=3)
    lease = lock.try_acquire()
    db.execute("SELECT pg_terminate_backend(%s)", [row(db, "reconnect")[4]])
    time.sleep(0.6)
    assert not lease.lost
    lease.check()
    assert Lock("reconnect").try_acquire() is None
    lease.release()


def test_signals_and_metrics_fire_and_failing_hooks_change_nothing():
    events = []

    class Metrics:
        def acquired(self, name, wait):
            events.append(("acquired", name))
            raise RuntimeError("metrics backend down")

        def released(self, name, held):
            events.append(("released", name))

        def contended(self, name):
            events.append(("contended", name))

    def receiver(sender, **kwargs):
        events.append(("signal", kwargs.get("lease") and kwargs["lease"].name))
        raise RuntimeError("receiver bug")

    signals.lock_acquired.connect(receiver)
    try:
        lock = Lock("hooks", metrics=Metrics())
        with lock.acquire(blocking=False) as lease:
            assert lease is not None
            assert lock.try_acquire() is None
        assert Lock("hooks").try_acquire() is not None
    finally:
        signals.lock_acquired.disconnect(receiver)
    assert ("acquired", "hooks") in events
    assert ("released", "hooks") in events
    assert ("contended", "hooks") in events
    assert ("signal", "hooks") in events


def test_async_waiters_exclude_each_other_without_blocking_the_loop():
    async def main():
        ticks = 0
        inside = 0
        most_inside = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        async def waiter():
            nonlocal inside, most_inside
            async with Lock("async", poll_interval=0.02).acquire_async(timeout=10) as lease:
                assert lease is not None
                inside += 1
                most_inside = max(most_inside, inside)
                await asyncio.sleep(0.05)
                inside -= 1

        tick_task = asyncio.create_task(ticker())
        started = time.monotonic()
        await asyncio.gather(*(waiter() for _ in range(8)))
        elapsed = time.monotonic() - started
        done.set()
        await tick_task
        return most_inside, ticks, elapsed

    most_inside, ticks, elapsed = asyncio.run(main())
    assert most_inside == 1
    # The loop kept ticking every ~10 ms while eight waiters took turns.
    assert ticks >= elapsed / 0.01 * 0.5


def test_async_non_blocking_attempt_returns_none_when_held():
    held = Lock("async-held").try_acquire()

    async def attempt():
        async with Lock("async-held").acquire_async(blocking=False) as lease:
            return lease

    assert asyncio.run(attempt()) is None
    held.release()


def test_schema_keeps_one_index_and_a_token_sequence(db):
    indexes = db.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = 'django_pglock_joblock'"
    ).fetchall()
    assert [i[0] for i in indexes] == ["django_pglock_joblock_pkey"]
    assert db.execute("SELECT to_regclass('django_pglock_token_seq')").fetchone()[0] is not None


def test_every_lock_statement_commits_durably(db):
    """Grants, heartbeats and releases all commit with the server's synchronous_commit:
    a heartbeat the holder counts its deadline from, and a release it was told about,
    must survive a server crash (tests/test_faults.py crashes one to show it)."""
    lease = Lock("durable").try_acquire()
    conn = get_connection("default")
    server_default = db.execute("SHOW synchronous_commit").fetchone()[0]
    assert server_default != "off"
    assert conn.durable_commit == server_default
    assert conn.execute("SHOW synchronous_commit", {}) == [(server_default,)]
    lease.release()


def test_a_server_or_role_without_synchronous_commit_still_commits_locally(db):
    from django_pglock import sql

    db.execute("SET synchronous_commit = off")
    db.execute("SET default_transaction_isolation = 'serializable'")
    db.execute("SET idle_session_timeout = '1s'")
    params = {"statement_timeout": "30s", "lock_timeout": "5s"}
    row = db.execute(sql.SESSION_SETUP, params).fetchone()
    assert row[0] == "local"
    assert db.execute("SHOW synchronous_commit").fetchone()[0] == "local"
    assert db.execute("SHOW default_transaction_isolation").fetchone()[0] == "read committed"
    assert db.execute("SHOW idle_session_timeout").fetchone()[0] == "0"
    db.execute("RESET synchronous_commit")
    db.execute("RESET default_transaction_isolation")


def test_lock_options_default_to_the_settings_read_lazily():
    from django.test import override_settings

    lock = Lock("defaults")
    assert (lock.using, lock.heartbeat_interval, lock.alert_after, lock.stale_after) == (
        "default",
        10.0,
        30.0,
        600.0,
    )
    assert (lock.poll_interval, lock.advisory) == (0.5, True)
    with override_settings(DJANGO_PGLOCK={"STALE_AFTER": 900.0, "ADVISORY": False}):
        assert lock.stale_after == 900.0 and lock.advisory is False
        lease = lock.try_acquire()
        assert lease.stale_after == 900.0 and lease.advisory is False
        lease.release()
    assert Lock("explicit", stale_after=120.0).stale_after == 120.0


def test_a_process_that_exits_without_releasing_frees_its_locks(db, child_env):
    """A table-only lease would otherwise block the name until stale_after."""
    import subprocess
    import sys

    code = (
        "import django; django.setup()\n"
        "from django_pglock import Lock\n"
        "lease = Lock('forgotten', advisory=False).try_acquire()\n"
        "print(lease.token, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 0
    assert row(db, "forgotten") is None


def test_a_transaction_pooler_is_detected_and_the_advisory_path_switched_off(db, caplog):
    """Behind a transaction-mode pooler, statements run on changing server processes: the
    connection notices, and rows stop declaring the advisory path (table path only)."""
    conn = get_connection("default")
    first = Lock("pooled-1").try_acquire()
    assert first.advisory and row(db, "pooled-1")[5] is True
    real_pid, conn.backend_pid = conn.backend_pid, -1  # as if the next statement moved
    try:
        second = Lock("pooled-2").try_acquire()
        assert conn.pooled
        assert "transaction-mode pooler" in caplog.text
        assert row(db, "pooled-2")[5] is False  # not judged by a session that is not ours
        assert row(db, "pooled-1")[5] is False  # nor are the leases held before
        assert second._key_state is Key.NONE and first._key_state is Key.NONE
        third = Lock("pooled-3").try_acquire()
        assert third.advisory is False and row(db, "pooled-3")[5] is False
    finally:
        conn.backend_pid, conn.pooled, conn._pooler_announced = real_pid, False, False
    for lease in (first, second, third):
        lease.release()


def test_metrics_hook_sees_latency_reclaims_alerts_and_losses(db):
    calls: dict[str, list] = {}

    class Metrics:  # any subset of the hook methods
        def heartbeat_latency(self, seconds):
            calls.setdefault("heartbeat_latency", []).append(seconds)

        def stale_reclaimed(self, name):
            calls.setdefault("stale_reclaimed", []).append(name)

        def alert(self, name, age):
            calls.setdefault("alert", []).append((name, age))

        def lost(self, name):
            calls.setdefault("lost", []).append(name)

    metrics = Metrics()
    fast = {"heartbeat_interval": 0.1, "alert_after": 0.3, "stale_after": 1.5}
    lease = Lock("metrics-beat", metrics=metrics, **fast).try_acquire()
    time.sleep(0.45)
    lease.release()
    assert len(calls["heartbeat_latency"]) >= 2
    assert all(0 < seconds < 1 for seconds in calls["heartbeat_latency"])

    # A dead holder's stale row, written as another process would have left it.
    db.execute(
        "INSERT INTO django_pglock_joblock (name, token, holder, host, pid, backend_pid,"
        " description, acquired_at, last_heartbeat, heartbeat_interval, alert_after,"
        " stale_after, advisory) VALUES ('metrics-stale', nextval('django_pglock_token_seq'),"
        " 'gone:1:x', 'gone', 1, 1, '', now() - interval '1 hour', now() - interval '1 hour',"
        " 10, 30, 600, false)"
    )
    Lock("metrics-stale", metrics=metrics).try_acquire().release()
    assert calls["stale_reclaimed"] == ["metrics-stale"]

    # Heartbeats that cannot land: the holder's own alert, then its loss.
    lease = Lock("metrics-lost", metrics=metrics, **fast).try_acquire()
    with psycopg.connect(db.info.dsn, autocommit=False) as blocker:
        blocker.execute(
            "SELECT 1 FROM django_pglock_joblock WHERE name = 'metrics-lost' FOR UPDATE"
        )
        deadline = time.monotonic() + 5
        while "lost" not in calls and time.monotonic() < deadline:
            time.sleep(0.02)
        blocker.rollback()
    assert calls["lost"] == ["metrics-lost"]
    assert [name for name, _ in calls["alert"]] == ["metrics-lost"]
    assert calls["alert"][0][1] > 0.3
    with pytest.raises(LockNotHeld):
        lease.__exit__(None, None, None)


def test_metrics_hook_from_settings_follows_settings_changes():
    """``DJANGO_PGLOCK["METRICS"]`` is called for every lock, and a settings change (as
    ``override_settings`` makes) switches it on and off at once."""
    from django.test import override_settings

    from tests.testapp import RecordingMetrics

    RecordingMetrics.calls.clear()
    lock = Lock("metrics-setting")
    lock.try_acquire().release()  # no hook configured yet
    assert RecordingMetrics.calls == []
    with override_settings(DJANGO_PGLOCK={"METRICS": "tests.testapp.RecordingMetrics"}):
        lease = lock.try_acquire()
        assert Lock("metrics-setting").try_acquire() is None
        lease.release()
        assert RecordingMetrics.calls == [
            ("acquired", "metrics-setting"),
            ("contended", "metrics-setting"),
            ("released", "metrics-setting"),
        ]
    RecordingMetrics.calls.clear()
    lock.try_acquire().release()
    assert RecordingMetrics.calls == []
