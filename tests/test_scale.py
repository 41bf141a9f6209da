"""One process holding 1,000 locks: one connection, one heartbeat statement per interval.

A worker process (``python -m tests.worker hold-many 1000``) holds 1,000 locks with a
0.5 s heartbeat interval. Over a 3 s window the test checks, from the server's side:

* the worker uses exactly one session on the test database, and every lock row names it;
* the heartbeat is one statement per interval for all 1,000 rows, counted two independent
  ways: by ``pg_stat_statements`` (``calls`` and ``rows`` of the heartbeat statement), and
  by reading the table every few milliseconds: every read finds all 1,000 rows carrying
  one and the same ``last_heartbeat`` (one statement updated them all: ``now()`` is its
  transaction's start time), and each heartbeat leaves a new such value. The second way
  needs no extension, so the test still runs, and still counts statements, against a
  server without ``pg_stat_statements``;
* no row's heartbeat age, by the database clock, reaches twice the interval.

(Sampling ``query_start`` in ``pg_stat_activity`` would not do: with the extended query
protocol one execution can report activity, with a new ``query_start``, at Bind and again
at Execute; one run saw two of them 1 ms apart for a single call.)
"""

from __future__ import annotations

import itertools
import math
import time
import uuid

import psycopg
import pytest

from django_pglock import Lock
from django_pglock.connection import get_connection

LOCK_TABLE = "django_pglock_joblock"
COUNT = 1000
INTERVAL = 0.5
WINDOW = 3.0
SAMPLE_EVERY = 0.01
HEARTBEAT_TEXT = "SET last_heartbeat = now()"

pytestmark = pytest.mark.django_db(transaction=True)


def client_sessions(conn, dbname):
    """``{backend pid: application_name}`` of the client sessions on ``dbname``."""
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity"
        " WHERE datname = %s AND backend_type = 'client backend'",
        [dbname],
    ).fetchall()
    return dict(rows)


def table_state(conn):
    """(rows, distinct holders, distinct backend pids, distinct heartbeat times)."""
    return conn.execute(
        f"SELECT count(*), count(DISTINCT holder), count(DISTINCT backend_pid),"
        f" count(DISTINCT last_heartbeat) FROM {LOCK_TABLE}"
    ).fetchone()


def start_statement_counts(conn):
    """Reset pg_stat_statements; ``False`` if the server does not have it loaded."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset()")
    except psycopg.Error:
        return False
    return True


def heartbeat_statement_counts(conn):
    """(calls, rows) of the heartbeat statement on this database since the reset."""
    row = conn.execute(
        "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(rows), 0)::bigint"
        " FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND query LIKE %s",
        [f"%{HEARTBEAT_TEXT}%"],
    ).fetchone()
    return int(row[0]), int(row[1])


@pytest.mark.slow
def test_thousand_locks_one_connection_one_heartbeat_statement(
    run_child, pg_url, test_db_name, clean_locks
):
    prefix = f"scale-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as obs:
        before = client_sessions(obs, test_db_name)
        worker = run_child(
            "hold-many", COUNT, "--name", prefix,
            "--heartbeat-interval", INTERVAL, "--alert-after", 2, "--stale-after", 10,
        )  # fmt: skip
        worker.expect("ACQUIRED_ALL", timeout=120)

        # Every row names one holder and one server session.
        rows, holders, backend_pids, _ = table_state(obs)
        assert (rows, holders, backend_pids) == (COUNT, 1, 1)
        (backend_pid,) = obs.execute(f"SELECT DISTINCT backend_pid FROM {LOCK_TABLE}").fetchone()
        assert obs.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [backend_pid]
        ).fetchone() == (1,)

        # The worker opened exactly one session on the test database: the lock connection.
        new = {pid: app for pid, app in client_sessions(obs, test_db_name).items()
               if pid not in before}  # fmt: skip
        assert new == {backend_pid: "django_pglock"}

        # Wait for the first heartbeat that covers every row, then count over the window.
        deadline = time.monotonic() + 5 * INTERVAL
        while table_state(obs)[3] != 1:
            assert time.monotonic() < deadline, "no heartbeat covered all rows"
            time.sleep(SAMPLE_EVERY)

        have_statements = start_statement_counts(obs)
        (window_start,) = obs.execute("SELECT clock_timestamp()").fetchone()
        seen_beats = set()
        max_age = 0.0
        reads = 0
        end = time.monotonic() + WINDOW
        while time.monotonic() < end:
            rows, holders, backend_pids, heartbeats, age, beat = obs.execute(
                f"SELECT count(*), count(DISTINCT holder), count(DISTINCT backend_pid),"
                f" count(DISTINCT last_heartbeat),"
                f" extract(epoch FROM max(now() - last_heartbeat))::float8, max(last_heartbeat)"
                f" FROM {LOCK_TABLE}"
            ).fetchone()
            reads += 1
            assert (rows, holders, backend_pids) == (COUNT, 1, 1)
            # One statement updates all rows: they always share one last_heartbeat.
            assert heartbeats == 1, f"{heartbeats} distinct last_heartbeat values"
            seen_beats.add(beat)
            max_age = max(max_age, age)
            time.sleep(SAMPLE_EVERY)
        (window_end,) = obs.execute("SELECT clock_timestamp()").fetchone()
        if have_statements:
            calls, statement_rows = heartbeat_statement_counts(obs)

        sampled = sorted(b for b in seen_beats if window_start <= b <= window_end)
        low, high = math.floor(WINDOW / INTERVAL) - 1, math.ceil(WINDOW / INTERVAL) + 1
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(sampled)]
        report = (
            f"sampled heartbeats={len(sampled)} gaps={[round(g, 3) for g in gaps]} "
            f"max age={max_age:.3f}s over {reads} reads"
        )
        if have_statements:
            report += f"; pg_stat_statements calls={calls} rows={statement_rows}"
        print(report)

        assert low <= len(sampled) <= high, report
        assert all(0.8 * INTERVAL <= g <= 2 * INTERVAL for g in gaps), report
        assert max_age < 2 * INTERVAL, report
        if have_statements:
            assert low <= calls <= high, report
            assert statement_rows == calls * COUNT, report
            # Both ways of counting saw the same statements (give or take one at an edge).
            assert abs(calls - len(sampled)) <= 1, report

        # Still one session after all that heartbeating: nothing reconnected.
        new_after = {pid: app for pid, app in client_sessions(obs, test_db_name).items()
                     if pid not in before}  # fmt: skip
        assert new_after == {backend_pid: "django_pglock"}

        worker.send("release")
        worker.expect("RELEASED", timeout=60)
        assert worker.finish() == 0
        assert table_state(obs)[0] == 0


def test_lock_statements_are_prepared_on_the_dedicated_connection(clean_locks):
    """The acquire and release statements are parsed and planned once per session.

    ``connection.py`` means to prepare them ("Prepared statements save planning on every
    acquire") and passes ``prepare=True`` to every ``execute``, but it opens the
    connection with ``prepare_threshold=None``, which in psycopg disables prepared
    statements altogether: ``prepare=True`` is then ignored and PostgreSQL re-parses and
    re-plans the large acquire statement on every attempt. In
    ``benchmarks/bench_cycle.py`` that is most of the cost of a refused attempt (about
    720 us as shipped, about 280 us with preparing honoured, against 43 us for the floor).
    """
    conn = get_connection("default")
    conn.close()  # a fresh session, opened under the settings of this test
    lock = Lock(f"prepared-{uuid.uuid4().hex[:8]}")
    for _ in range(3):
        lease = lock.try_acquire()
        assert lease is not None
        lease.release()
    prepared = [
        statement
        for (statement,) in conn.execute("SELECT statement FROM pg_prepared_statements", {})
    ]
    assert any(
        "ON CONFLICT (name) DO NOTHING" in s and "FOR UPDATE SKIP LOCKED" in s for s in prepared
    ), prepared
    assert any("WITH del AS" in s for s in prepared), prepared
