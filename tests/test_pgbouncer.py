"""django_pglock behind PgBouncer (Debian's ``pgbouncer``), in transaction and session mode.

PgBouncer runs on 127.0.0.1 in front of the fault tests' own TCP server
(``faultkit.PgBouncer``; as root it runs as the ``embedded_postgres`` user, since pgbouncer
refuses to run as root). Workers are ``python -m tests.chaos_worker`` processes whose
``DATABASE_URL`` points at the pooler; the invariant is judged from their own
``O_APPEND`` log, as in tests/test_faults.py.

Transaction mode hands each transaction to whichever server connection is free, so
session state (advisory locks, prepared statements, SET) does not follow the client:

* with ``DJANGO_PGLOCK = {"ADVISORY": False}`` the table path alone must exclude, and a
  crashed holder is taken over after ``stale_after`` (by the database clock);
* with ``ADVISORY`` left on, the library must notice the pooler and still exclude; a
  client alone keeps getting the same server connection (PgBouncer reuses the one
  released last), so the lock connection looks for the pooler when it opens
  (``django_pglock.pooler``), before its first grant could take a key that PgBouncer
  would free by retiring that server connection (``server_lifetime``).

Session mode keeps one server connection per client: everything works, including the
crash-fast takeover (``DISCARD ALL``, pgbouncer's reset query, drops advisory locks), also
when the next client is handed the dead holder's own server process.

Without ``pgbouncer`` installed these tests skip, unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import psycopg
import pytest

from django_pglock import pooler
from django_pglock.sql import advisory_key
from tests import faultkit
from tests.faultkit import (  # noqa: F401  (fixtures "log", "procs")
    SMALL,
    STALE,
    Db,
    Procs,
    assert_exclusive,
    grants,
    log_fixture,
    measure,
    procs_fixture,
    read_log,
    wait_until,
    worker_env,
)
from tests.procs import go_together

pytestmark = pytest.mark.slow

TABLE_ONLY = {"ADVISORY": False}
POOLER_WARNING = "transaction-mode pooler"  # in every wording of the detection warning


def unique(label):
    return f"bouncer-{label}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server():
    return faultkit.shared_server()


@pytest.fixture(scope="module")
def transaction_pool(server):
    bouncer = faultkit.PgBouncer(server, "transaction", pool_size=2)
    yield bouncer
    bouncer.close()


@pytest.fixture(scope="module")
def session_pool(server):
    bouncer = faultkit.PgBouncer(server, "session", pool_size=8)
    yield bouncer
    bouncer.close()


@pytest.fixture
def bouncers(server):
    """Dedicated pgbouncers: ``bouncers(mode, **options)``; closed at teardown."""
    started = []

    def start(pool_mode, **options):
        bouncer = faultkit.PgBouncer(server, pool_mode, **options)
        started.append(bouncer)
        return bouncer

    yield start
    for bouncer in started:
        bouncer.close()


@pytest.fixture
def db(server):
    server.ensure_running()
    session = Db(server.url())  # direct, not through the pooler
    yield session
    session.close()


def start_job(procs, env, name, log, *extra, hold="inf", poll=0.1):
    args = ["job", "--name", name, "--log", log, *SMALL, "--hold-for", hold]
    worker = procs.worker(env, *args, "--poll-interval", poll, *extra)
    worker.ready()
    return worker


def granted(proc, timeout=20.0):
    return int(proc.expect("GRANTED", timeout, skip=("FAIL", "LEFT")).split()[1])


def contend(procs, env, name, log, workers=3, seconds=5, extra=()):
    """``workers`` processes contending for ``name`` for ``seconds``; returns their DONE."""
    args = ["job", "--name", name, "--log", log, *SMALL, "--seconds", seconds, "--wait-go"]
    args += ["--poll-interval", "0.05", "--hold-for", "0.02", "--pause", "0.03", *extra]
    started = [procs.worker(env, *args) for _ in range(workers)]
    go_together(started)
    done = {}
    for worker in started:
        line = worker.expect("DONE", timeout=seconds + 30, skip=("GRANTED", "LEFT", "FAIL"))
        done[worker.pid] = dict(word.split("=") for word in line.split()[1:])
        assert worker.wait(15) == 0, worker.stderr_text
        worker.drain()
    return started, done


def stderr_of(workers):
    return "".join(worker.stderr_text for worker in workers)


def pooler_warnings(worker):
    return [line for line in worker.stderr_text.splitlines() if POOLER_WARNING in line]


def key_holders(db, name):
    """Server processes holding the advisory key of ``name`` (any session, any client)."""
    key = advisory_key(name) & 0xFFFF_FFFF_FFFF_FFFF  # pg_locks shows it as two oids
    rows = db.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1",
        [key >> 32, key & 0xFFFF_FFFF],
    ).fetchall()
    return sorted(pid for (pid,) in rows)


def backend_alive(db, backend_pid):
    query = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
    return db.execute(query, [backend_pid]).fetchone()[0] == 1


def db_now(db):
    return db.execute("SELECT clock_timestamp()").fetchone()[0]


def acquire_attempted_since(db, since, backends=None):
    """Server processes that started an acquire statement after ``since`` (DB clock).

    An acquire starts with its name's gate (``pg_advisory_xact_lock``): pg_stat_activity
    keeps only the first kilobyte of a statement (``track_activity_query_size``)."""
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE query LIKE '%%pg_advisory_xact_lock%%'"
        " AND query NOT LIKE '%%pg_stat_activity%%' AND query_start > %s",
        [since],
    ).fetchall()
    return {pid for (pid,) in rows if backends is None or pid in backends}


def grant_within(worker, seconds):
    """The token of ``worker``'s next GRANTED line within ``seconds``, else ``None``."""
    line = worker.line_within("GRANTED", seconds)
    return None if line is None else int(line.split()[1])


def warm(bouncer, servers):
    """Make ``bouncer`` open ``servers`` server connections (left idle in its pool)."""
    clients = [psycopg.connect(bouncer.url(), connect_timeout=10) for _ in range(servers)]
    try:
        for client in clients:  # each in a transaction: each holds a server of its own
            client.execute("SELECT pg_backend_pid()")
        pids = {client.execute("SELECT pg_backend_pid()").fetchone()[0] for client in clients}
        assert len(pids) == servers, pids
        for client in clients:
            client.rollback()  # a server left in a transaction would be closed, not pooled
    finally:
        for client in clients:
            client.close()


# -- manage.py check ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("port", "pglock", "no_ssc", "warned"),
    [
        (6432, None, False, True),  # PgBouncer's default port
        (5432, None, True, True),  # DISABLE_SERVER_SIDE_CURSORS, Django's advice for poolers
        (6432, TABLE_ONLY, True, False),  # the advice taken: no warning
        (5432, None, False, False),
    ],
)
def test_check_warns_about_a_pooler_while_advisory_is_on(port, pglock, no_ssc, warned):
    extra = {"PGLOCK_FAULT_NO_SSC": "1"} if no_ssc else {}
    env = worker_env(f"postgresql://postgres@127.0.0.1:{port}/faults", pglock=pglock, **extra)
    result = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=faultkit.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert ("django_pglock.W001" in output) == warned, output


# -- transaction mode -------------------------------------------------------------------------


def test_transaction_mode_table_only_excludes_three_contenders(transaction_pool, db, procs, log):
    name = unique("tx-table")
    env = worker_env(transaction_pool.url(), pglock=TABLE_ONLY)
    workers, done = contend(procs, env, name, log)
    all_grants = grants(read_log(log))
    assert_exclusive(all_grants)
    per_worker = sorted(int(d["grants"]) for d in done.values())
    measure("pgbouncer transaction, ADVISORY False: grants in 5 s", len(all_grants), unit="")
    print(f"[measure] pgbouncer transaction, ADVISORY False: grants per process {per_worker}")
    assert all(n >= 1 for n in per_worker), per_worker
    assert all(d["failures"] == "0" and d["lost"] == "0" for d in done.values()), done
    # (The pooler warning is judged by its own test below.)
    bad = [
        line for line in faultkit.alarming_stderr(stderr_of(workers)) if POOLER_WARNING not in line
    ]
    assert not bad, "\n".join(bad[:20])
    assert db.row(name) is None


def test_transaction_mode_table_only_does_not_warn_to_set_what_is_set(
    transaction_pool, db, procs, log
):
    """With ADVISORY already False, "Set DJANGO_PGLOCK['ADVISORY'] = False" is noise."""
    name = unique("tx-table-warning")
    env = worker_env(transaction_pool.url(), pglock=TABLE_ONLY)
    workers, _ = contend(procs, env, name, log, seconds=2)
    warned = [w.pid for w in workers if POOLER_WARNING in w.stderr_text]
    assert not warned, (
        f"processes {warned} with DJANGO_PGLOCK['ADVISORY'] = False were told to set "
        f"DJANGO_PGLOCK['ADVISORY'] = False:\n{workers[0].stderr_text[-600:]}"
    )


def test_transaction_mode_table_only_crashed_holder_is_taken_over_after_stale(
    transaction_pool, db, procs, log
):
    name = unique("tx-crash")
    env = worker_env(transaction_pool.url(), pglock=TABLE_ONLY)
    holder = start_job(procs, env, name, log)
    token = granted(holder)
    contender = start_job(procs, env, name, log)
    time.sleep(0.6)
    assert db.row(name)["advisory"] is False
    assert contender.lines.empty()

    holder.signal(signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    time.sleep(0.3)
    last_heartbeat = db.row(name)["last_heartbeat"]
    new_token = granted(contender, timeout=STALE + 5)
    takeover = time.monotonic() - killed_at
    silent = db.seconds_between(db.row(name)["acquired_at"], last_heartbeat)
    measure("pgbouncer transaction, ADVISORY False: takeover after SIGKILL", takeover)
    measure("pgbouncer transaction, ADVISORY False: DB time from last heartbeat", silent)
    assert new_token > token
    assert STALE <= silent < STALE + 1.0
    contender.finish()
    assert_exclusive(grants(read_log(log), ends={holder.pid: killed_wall}))


def contend_and_judge(procs, env, name, log, label):
    """Three contenders; print what was seen; assert exclusion, no failure, no crash."""
    workers, done = contend(procs, env, name, log)
    all_grants = grants(read_log(log))
    detected = sum(POOLER_WARNING in worker.stderr_text for worker in workers)
    failures = sum(int(d["failures"]) for d in done.values())
    other = [
        line for line in faultkit.alarming_stderr(stderr_of(workers)) if POOLER_WARNING not in line
    ]
    print(
        f"[measure] {label}: {len(all_grants)} grants, {failures} failed attempts, "
        f"pooler detected by {detected}/{len(workers)} processes"
    )
    assert_exclusive(all_grants)
    assert failures == 0 and not other, (
        f"{failures} attempts failed behind the pooler; stderr:\n" + "\n".join(other[:20])
    )
    return detected


def test_transaction_mode_with_default_settings(transaction_pool, db, procs, log):
    """ADVISORY left True, DATABASES left alone: detect the pooler and keep working.

    The lock connection prepares every statement unless ADVISORY is False in the settings
    or OPTIONS has prepare_threshold; behind a transaction pooler another client's
    "_pg3_0" already exists on the server connection (or ours is missing on the next one).
    """
    name = unique("tx-default")
    contend_and_judge(procs, worker_env(transaction_pool.url()), name, log, "tx, defaults")


@pytest.mark.parametrize("pglock", [None, TABLE_ONLY], ids=["defaults", "advisory-off"])
def test_transaction_mode_a_blocking_waiter_is_granted_by_its_poll(
    transaction_pool, db, procs, log, pglock
):
    """Behind a transaction pooler notifications cannot reach a waiter (its LISTEN would
    hold on to whichever server connection ran it): waiting polls, and a waiter is granted
    within its poll interval of the release, never later, and never beside the holder."""
    name = unique("tx-wait")
    env = worker_env(transaction_pool.url(), pglock=pglock)
    holder = start_job(procs, env, name, log, "--once", hold="2", poll=0.2)
    first = granted(holder)
    waiter = start_job(procs, env, name, log, "--once", hold="0", poll=1.0)
    holder.expect("LEFT", timeout=30)
    released_at = time.monotonic()
    second = granted(waiter, timeout=30)
    waited = time.monotonic() - released_at
    print(f"[measure] pgbouncer transaction, waiter granted {waited:.2f} s after the release")
    assert second > first
    assert waited < 10.0, f"the waiter was granted {waited:.1f} s after the release (poll 1 s)"
    assert_exclusive(grants(read_log(log)))
    bad = [
        line
        for line in faultkit.alarming_stderr(stderr_of([holder, waiter]))
        if POOLER_WARNING not in line
    ]
    assert not bad, "\n".join(bad[:20])


def test_transaction_mode_per_lock_advisory_false_with_default_settings(
    transaction_pool, db, procs, log
):
    """``Lock(..., advisory=False)`` (what --advisory off passes) behind the pooler.

    The settings still say ADVISORY True, so the connection prepares its statements; the
    pooler makes them come and go, the library notices, runs them unprepared and warns
    once per process that the setting should be False. Nothing else may go wrong.
    """
    name = unique("tx-perlock")
    env = worker_env(transaction_pool.url())
    workers, done = contend(procs, env, name, log, seconds=3, extra=("--advisory", "off"))
    crashed = [d for d in done.values() if d["failures"] != "0"]
    warned = [
        line for line in faultkit.alarming_stderr(stderr_of(workers)) if POOLER_WARNING in line
    ]
    assert len(warned) <= len(workers), warned  # at most once per process
    bad = [
        line for line in faultkit.alarming_stderr(stderr_of(workers)) if POOLER_WARNING not in line
    ]
    print(f"[measure] tx, Lock(advisory=False): {len(bad)} alarming stderr lines")
    assert_exclusive(grants(read_log(log)))
    assert not crashed and not bad, "\n".join(bad[:20])


def test_transaction_mode_advisory_on_without_prepared_statements_detects_the_pooler(
    transaction_pool, db, procs, log
):
    """ADVISORY left True, OPTIONS prepare_threshold=None: detected, and still exclusive."""
    name = unique("tx-auto")
    env = worker_env(transaction_pool.url(), PGLOCK_FAULT_NO_PREPARE="1")
    detected = contend_and_judge(procs, env, name, log, "tx, ADVISORY True, no prepare")
    assert detected >= 1, "no process noticed the transaction-mode pooler"


def test_transaction_mode_advisory_key_on_a_recycled_server_connection(
    transaction_pool, db, procs, log
):
    """The pooler closes the server connection the holder's statements ran on.

    PgBouncer does that on its own (server_lifetime, server_idle_timeout, RECONNECT, a
    server-side error); here pg_terminate_backend() does it at a known moment. The holder's
    client connection to the pooler is untouched, so it holds on: nobody else may get in.
    With the recommended configuration (ADVISORY False) no session's life is trusted, so
    this holds; with the advisory path left on behind a transaction pooler, a recycled
    server connection frees the key and lets a contender in (documented in the README).
    """
    name = unique("tx-recycle")
    env = worker_env(
        transaction_pool.url(),
        PGLOCK_FAULT_NO_PREPARE="1",
        PGLOCK_FAULT_SETTINGS='{"ADVISORY": false}',
    )
    # A heartbeat every second: the holder learns of a takeover at its next heartbeat.
    slower = ("--heartbeat-interval", "1", "--alert-after", "2", "--stale-after", "6")
    holder = start_job(procs, env, name, log, *slower)
    token = granted(holder)
    time.sleep(0.5)
    row = db.row(name)
    contender = start_job(procs, env, name, log)
    time.sleep(0.5)
    assert contender.lines.empty(), contender.read_line()
    print(f"[measure] recycled server connection: holder row advisory={row['advisory']}")

    db.execute("SELECT pg_terminate_backend(%s)", [row["backend_pid"]])
    cut_at = time.time()
    time.sleep(2.0)
    events = read_log(log)
    takeover = next((e for e in events if e.kind == "ENTER" and e.pid == contender.pid), None)
    lost = next((e for e in events if e.kind == "LOST" and e.pid == holder.pid), None)
    if takeover is not None:
        measure("recycled server connection: contender took over after", takeover.wall - cut_at)
    if lost is not None:
        measure("recycled server connection: holder concluded loss after", lost.wall - cut_at)
    holder.finish()
    contender.finish()
    detected_at = [
        float(line.split("[", 1)[1].split("]", 1)[0])
        for line in holder.stderr_text.splitlines()
        if POOLER_WARNING in line
    ]
    print(
        "[measure] recycled server connection: the holder noticed the pooler "
        + (f"{detected_at[0] - cut_at:+.3f}s from the cut" if detected_at else "never")
    )
    assert_exclusive(grants(read_log(log)))
    assert token > 0


# -- finding the pooler: django_pglock.pooler on its own -------------------------------------

SECRET = "s3cret-never-logged"


@pytest.mark.parametrize(
    ("where", "found"),
    [
        ("direct", None),
        ("session", None),
        ("transaction", pooler.SHARED),
        ("transaction-round-robin", None),  # MOVED or SHARED, judged below
        ("transaction-full", None),  # the probe cannot connect: no evidence, no harm
    ],
)
def test_find_pooler(server, bouncers, caplog, where, found):
    """What the lock connection's probe concludes, and that it never logs a password."""
    if where == "direct":
        url = server.url()
    elif where == "transaction-round-robin":
        bouncer = bouncers("transaction", pool_size=4, server_round_robin=True)
        warm(bouncer, 4)
        url = bouncer.url()
    elif where == "transaction-full":  # room for the lock session only
        url = bouncers("transaction", pool_size=2, max_client_conn=1).url()
    else:
        url = bouncers(where, pool_size=2).url()
    params = {**psycopg.conninfo.conninfo_to_dict(url), "password": SECRET}  # trust ignores it
    caplog.set_level("DEBUG", logger="django_pglock")
    with psycopg.connect(autocommit=True, **params) as session:
        backend_pid = session.execute("SELECT pg_backend_pid()").fetchone()[0]
        started = time.monotonic()
        evidence = pooler.find_pooler(session, params, backend_pid, "default")
        took = time.monotonic() - started
        assert session.execute("SELECT 1").fetchone() == (1,)  # the session is left usable
    measure(f"pooler probe, {where}", took)
    if where == "transaction-round-robin":
        assert evidence in (pooler.MOVED, pooler.SHARED)
    else:
        assert evidence == found
    if where == "transaction-full":
        assert "could not connect" in caplog.text
    assert SECRET not in caplog.text
    assert all(record.levelname == "DEBUG" for record in caplog.records), caplog.text
    assert took < pooler.CONNECT_TIMEOUT + pooler.ANSWER_TIMEOUT + 1


def test_find_pooler_gives_up_on_a_full_session_pool(bouncers, caplog):
    """The probe waits for a server connection that never comes: bounded, no evidence."""
    bouncer = bouncers("session", pool_size=1)
    caplog.set_level("DEBUG", logger="django_pglock")
    with psycopg.connect(bouncer.url(), autocommit=True) as session:
        backend_pid = session.execute("SELECT pg_backend_pid()").fetchone()[0]
        params = psycopg.conninfo.conninfo_to_dict(bouncer.url())
        started = time.monotonic()
        assert pooler.find_pooler(session, params, backend_pid, "default") is None
        took = time.monotonic() - started
    measure("pooler probe, session pool of one", took)
    assert pooler.ANSWER_TIMEOUT <= took < pooler.ANSWER_TIMEOUT + 1.5
    assert "no server process within" in caplog.text
    # The abandoned probe left nothing behind: the pool serves the next client.
    with psycopg.connect(bouncer.url(), autocommit=True, connect_timeout=5) as other:
        assert other.execute("SELECT 1").fetchone() == (1,)


# -- transaction mode: the pooler found when the lock connection opens -----------------------

# Thresholds of a holder that will not heartbeat during the test (stale_after far away).
QUIET = ("--heartbeat-interval", "10", "--alert-after", "20", "--stale-after", "30")


@pytest.mark.parametrize("round_robin", [False, True], ids=["lifo", "round-robin"])
def test_transaction_mode_one_quiet_client_is_detected_when_its_connection_opens(
    bouncers, db, procs, log, round_robin
):
    """One client alone behind a transaction pooler, ADVISORY left on (the default).

    PgBouncer hands it the server connection it released last (LIFO), so its statements
    all run on one server process and never show the pooler; the lock connection has to
    find it when it opens: the holder's row is off the advisory path and the process said
    so once. With ``server_round_robin = 1`` and four idle server connections too.
    """
    bouncer = bouncers("transaction", pool_size=4, server_round_robin=round_robin)
    warm(bouncer, 4)
    name = unique("tx-quiet")
    holder = start_job(procs, worker_env(bouncer.url()), name, log)
    granted(holder)
    row = db.row(name)
    assert row["advisory"] is False, "a quiet transaction pooler was not noticed"
    assert holder.finish() == 0
    warned = pooler_warnings(holder)
    assert len(warned) == 1, holder.stderr_text
    bad = [line for line in faultkit.alarming_stderr(holder.stderr_text) if line not in warned]
    assert not bad, "\n".join(bad[:20])
    assert db.row(name) is None


def test_transaction_mode_first_grant_is_already_off_the_advisory_path(bouncers, db, procs, log):
    """Detected *before* the first grant: that grant neither says advisory nor takes the key.

    A trigger records each row as granted (insert, or a reclaim's new token), before any
    later statement of the holder could switch the row off the advisory path.
    """
    bouncer = bouncers("transaction", pool_size=2)
    name = unique("tx-first")
    record = f"pglock_test_grants_{uuid.uuid4().hex[:8]}"
    db.execute(f"CREATE TABLE {record} (name text, token bigint, advisory boolean)")
    db.execute(
        f"""CREATE FUNCTION {record}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO {record} VALUES (NEW.name, NEW.token, NEW.advisory);
            RETURN NULL;
        END $$"""
    )
    db.execute(
        f"CREATE TRIGGER {record} AFTER INSERT OR UPDATE OF token ON {faultkit.LOCK_TABLE}"
        f" FOR EACH ROW WHEN (NEW.name = '{name}') EXECUTE FUNCTION {record}()"
    )
    try:
        holder = start_job(procs, worker_env(bouncer.url()), name, log)
        token = granted(holder)
        seen = db.execute(f"SELECT token, advisory FROM {record}").fetchall()
        holding_key = key_holders(db, name)
        assert holder.finish() == 0
    finally:
        db.execute(f"DROP TRIGGER {record} ON {faultkit.LOCK_TABLE}")
        db.execute(f"DROP FUNCTION {record}()")
        db.execute(f"DROP TABLE {record}")
    assert seen == [(token, False)], f"the first grant was written as {seen}"
    assert holding_key == [], f"server processes {holding_key} hold the key behind the pooler"
    assert len(pooler_warnings(holder)) == 1, holder.stderr_text


def test_transaction_mode_retired_server_connection_lets_no_contender_in(bouncers, db, procs, log):
    """The issue's reproduction: PgBouncer retires the holder's server connection.

    Transaction mode, ADVISORY left on, one holder, ``server_lifetime = 1``: once the
    server connection its grant ran on is closed, a key taken there would be free while the
    holder runs on (it heartbeats every 10 s here). No contender may be granted while the
    holder still holds, however long the test watches (its stale_after is 30 s).
    """
    bouncer = bouncers("transaction", pool_size=2, server_lifetime=1)
    name = unique("tx-lifetime")
    env = worker_env(bouncer.url())
    holder = start_job(procs, env, name, log, *QUIET)
    token = granted(holder)
    row = db.row(name)
    retired = wait_until(lambda: not backend_alive(db, row["backend_pid"]), 20)
    assert retired, f"pgbouncer did not retire server process {row['backend_pid']}"
    since = db_now(db)
    contender = start_job(procs, env, name, log, *QUIET)
    # The contender is refused (an acquire statement ran), then for 3 s more.
    attempted = wait_until(lambda: acquire_attempted_since(db, since), 20)
    stolen = grant_within(contender, 3.0)
    print(
        f"[measure] retired server connection: holder row advisory={row['advisory']}, "
        f"contender attempted={bool(attempted)}, granted token={stolen}"
    )
    assert stolen is None, (
        f"a contender was granted token {stolen} while holder {holder.pid} (token {token}) "
        "still held: the key went with the retired server connection"
    )
    assert attempted, "the contender never tried"
    assert db.row(name)["token"] == token
    released_at = time.monotonic()
    assert holder.finish() == 0
    assert grant_within(contender, 15.0) is not None, contender.stderr_text
    measure("retired server connection: hand-over after release", time.monotonic() - released_at)
    assert contender.finish() == 0
    assert_exclusive(grants(read_log(log)))


# -- session mode -----------------------------------------------------------------------------


def test_session_mode_contention_and_crash_fast_takeover(session_pool, db, procs, log):
    name = unique("session")
    env = worker_env(session_pool.url())
    workers, done = contend(procs, env, name, log, seconds=4)
    assert all(int(d["grants"]) >= 1 and d["failures"] == "0" for d in done.values()), done
    bad = faultkit.alarming_stderr(stderr_of(workers))
    assert not bad, "\n".join(bad[:20])

    poll = 0.2
    holder = start_job(procs, env, name, log, poll=poll)
    token = granted(holder)
    assert db.row(name)["advisory"] is True, "session mode keeps the advisory path"
    contender = start_job(procs, env, name, log, poll=poll)
    time.sleep(0.5)
    assert contender.lines.empty()
    holder.signal(signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()
    new_token = granted(contender, timeout=STALE + 5)
    takeover = time.monotonic() - killed_at
    measure("pgbouncer session: takeover after SIGKILL", takeover)
    assert new_token > token
    assert takeover < poll + 1.0, f"crash-fast takeover took {takeover:.3f}s"
    contender.finish()
    assert_exclusive(grants(read_log(log), ends={holder.pid: killed_wall}))


def test_session_mode_stays_on_the_advisory_path(session_pool, db, procs, log):
    """Session mode keeps one server connection per client: never taken for a pooler."""
    name = unique("session-advisory")
    holder = start_job(procs, worker_env(session_pool.url()), name, log)
    granted(holder)
    row = db.row(name)
    assert row["advisory"] is True, holder.stderr_text
    assert key_holders(db, name) == [row["backend_pid"]]
    assert holder.finish() == 0
    assert not faultkit.alarming_stderr(holder.stderr_text), holder.stderr_text


def test_session_mode_with_a_full_pool_stays_on_the_advisory_path(bouncers, db, procs, log):
    """A session pool of one server connection: a second client has to wait for it.

    Whatever the lock connection does to look for a pooler must give up in bounded time
    and conclude nothing: the holder is granted promptly, on the advisory path.
    """
    bouncer = bouncers("session", pool_size=1)
    name = unique("session-full")
    holder = start_job(procs, worker_env(bouncer.url()), name, log)
    started = time.monotonic()
    granted(holder, timeout=30)
    measure("pgbouncer session, pool of one: READY to granted", time.monotonic() - started)
    row = db.row(name)
    assert row["advisory"] is True, holder.stderr_text
    assert time.monotonic() - started < 10
    assert holder.finish() == 0
    assert not faultkit.alarming_stderr(holder.stderr_text), holder.stderr_text


def test_session_mode_takeover_on_the_dead_holders_own_server_process(bouncers, db, procs, log):
    """SIGKILLed holder; the next client is given the very server process it used.

    PgBouncer's reset query (DISCARD ALL) released the holder's advisory key and hands
    the server connection to the next client; with a pool of one it can only be that one,
    so the contender's session has the row's ``backend_pid``. The holder is gone: the
    contender must take over at once, not after ``stale_after`` (30 s here).
    """
    bouncer = bouncers("session", pool_size=1)
    name = unique("session-same-backend")
    env = worker_env(bouncer.url())
    poll = 0.2
    holder = start_job(procs, env, name, log, *QUIET, poll=poll)
    token = granted(holder)
    row = db.row(name)
    assert row["advisory"] is True
    holder.signal(signal.SIGKILL)
    killed_at, killed_wall = time.monotonic(), time.time()

    def released():  # the holder's server connection is back in the pool, reset
        servers = {s["remote_pid"]: s for s in bouncer.show("servers")}
        held = key_holders(db, name)
        server = servers.get(row["backend_pid"])
        return server is not None and server["state"] == "idle" and not held

    assert wait_until(released, 20), f"server process {row['backend_pid']} was not released"
    contender = start_job(procs, env, name, log, *QUIET, poll=poll)
    ready_at = time.monotonic()
    new_token = grant_within(contender, 10.0)
    takeover = time.monotonic() - ready_at
    print(
        f"[measure] session, same server process: granted {new_token} {takeover:.3f}s after "
        f"the contender started ({time.monotonic() - killed_at:.3f}s after the SIGKILL)"
    )
    assert new_token is not None, (
        f"the contender on the dead holder's own server process {row['backend_pid']} was "
        "not granted within 10 s (it waits for stale_after, 30 s)"
    )
    taken = db.row(name)
    assert (taken["token"], taken["backend_pid"]) == (new_token, row["backend_pid"]), (
        "precondition: the contender was not given the dead holder's server process"
    )
    measure("pgbouncer session, same server process: contender started to granted", takeover)
    assert takeover < poll + 3.0, f"the takeover took {takeover:.3f}s (stale_after is 30 s)"
    assert new_token > token
    assert contender.finish() == 0
    assert_exclusive(grants(read_log(log), ends={holder.pid: killed_wall}))
