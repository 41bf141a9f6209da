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
* with ``ADVISORY`` left on, the library must notice the pooler (different server
  backends answering one session) and still exclude.

Session mode keeps one server connection per client: everything works, including the
crash-fast takeover (``DISCARD ALL``, pgbouncer's reset query, drops advisory locks).

Without ``pgbouncer`` installed these tests skip, unless ``CI`` is set: then they fail.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import pytest

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
    worker_env,
)

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
    for worker in started:
        worker.ready()
    for worker in started:
        worker.send("go")
    done = {}
    for worker in started:
        line = worker.expect("DONE", timeout=seconds + 30, skip=("GRANTED", "LEFT", "FAIL"))
        done[worker.pid] = dict(word.split("=") for word in line.split()[1:])
        assert worker.popen.wait(15) == 0, worker.stderr_text
        worker.drain()
    return started, done


def stderr_of(workers):
    return "".join(worker.stderr_text for worker in workers)


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
