"""Job summaries, as the tests judge them (tests/test_job_summary.py and the attack files):
the summaries computed in Python from the runs and claims themselves (``expected``,
independent of the triggers), what readers see (``stored``), the stored rows alone
(``raw``) and the stale marks (``marked``).
"""

from __future__ import annotations

import contextlib
import datetime
import uuid

import psycopg
from psycopg import sql as pgsql

from django_pglock.sql import summary

UTC = datetime.timezone.utc
COLUMNS = (
    "name, has_runs, last_id, last_outcome, last_started_at, last_finished_at, last_duration,"
    " last_host, success_id, success_started_at, success_at, failure_id, failure_started_at,"
    " failure_at, claim_slot, claim_schedule"
)


def at(hour, minute=0):
    return datetime.datetime(2024, 5, 6, hour, minute, tzinfo=UTC)


def expected(db, names):
    """The summaries the history says, computed in Python (independent of the triggers)."""
    runs = db.execute(
        "SELECT id, name, outcome, started_at, finished_at, duration, host"
        " FROM django_pglock_jobrun WHERE name = ANY(%s)",
        [list(names)],
    ).fetchall()
    claims = db.execute(
        "SELECT name, slot, schedule FROM django_pglock_scheduleclaim WHERE name = ANY(%s)",
        [list(names)],
    ).fetchall()
    found = {}
    for name in names:
        mine = [r for r in runs if r[1] == name]
        slots = [c for c in claims if c[0] == name]
        if not mine and not slots:
            continue

        def newest(outcomes, mine=mine):
            picked = [r for r in mine if r[2] in outcomes]
            return max(picked, key=lambda r: (r[3], r[0]), default=None)

        last = newest({"running", "succeeded", "failed", "lost"})
        ok = newest({"succeeded"})
        bad = newest({"failed", "lost"})
        claim = max(slots, key=lambda c: c[1], default=None)
        found[name] = (
            name,
            bool(mine),
            *((last[0], last[2], last[3], last[4], last[5], last[6]) if last else (None,) * 6),
            *((ok[0], ok[3], ok[4] or ok[3]) if ok else (None,) * 3),
            *((bad[0], bad[3], bad[4] or bad[3]) if bad else (None,) * 3),
            *((claim[1], claim[2]) if claim else (None,) * 2),
        )
    return found


def stored(db, names):
    """The summaries a reader sees: the stored rows, the jobs marked stale recounted."""
    rows = db.execute(
        f"SELECT {COLUMNS} FROM ({summary.READ}) s WHERE name = ANY(%s)", [list(names)]
    ).fetchall()
    return {row[0]: row for row in rows}


def raw(db, names):
    """The stored rows alone."""
    rows = db.execute(
        f"SELECT {COLUMNS} FROM django_pglock_jobsummary WHERE name = ANY(%s)", [list(names)]
    ).fetchall()
    return {row[0]: row for row in rows}


def marked(db, names):
    (count,) = db.execute(
        "SELECT count(*) FROM django_pglock_stalesummary WHERE name = ANY(%s)", [list(names)]
    ).fetchone()
    return count


def assert_summarised(db, names):
    assert stored(db, names) == expected(db, names)


def insert(db, name, outcome, started, finished=None, host="w"):
    (run_id,) = db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome) VALUES (%s, 'h', %s, 1, '', %s, %s, 1.5, %s)"
        " RETURNING id",
        [name, host, started, finished, outcome],
    ).fetchone()
    return run_id


def claim(db, name, slot, schedule="0 * * * *"):
    db.execute(
        "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at, schedule)"
        " VALUES (%s, %s, 'h', now(), %s)",
        [name, slot, schedule],
    )


@contextlib.contextmanager
def scratch_database(pg_url, env, label):
    """A database of its own, dropped afterwards: (its name, ``env`` for children using it)."""
    name = f"pglock_{label}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
        try:
            yield name, {**env, "PGLOCK_TEST_DB_NAME": name}
        finally:
            admin.execute(pgsql.SQL("DROP DATABASE {} WITH (FORCE)").format(pgsql.Identifier(name)))


def lock_table_capacity(pg_url, dbname):
    """How many transaction advisory locks fit in the server's shared lock table now."""
    capacity = 0
    with psycopg.connect(pg_url, dbname=dbname) as probe:
        for step in (8_000, 4_000, 2_000, 1_000, 500, 100):
            while True:
                try:
                    probe.execute("SAVEPOINT s")
                    probe.execute(
                        "SELECT count(pg_advisory_xact_lock(7, g))"
                        " FROM generate_series(%s::int, %s::int) g",
                        [capacity, capacity + step - 1],
                    )
                    probe.execute("RELEASE SAVEPOINT s")
                    capacity += step
                except psycopg.errors.OutOfMemory:
                    probe.execute("ROLLBACK TO SAVEPOINT s")
                    break
        probe.rollback()
    return capacity
