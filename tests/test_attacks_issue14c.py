"""Attacks on the job summaries (issue 14, third round): ``django_pglock_jobsummary`` and
the stale marks, kept by triggers on the run history and the schedule claims under one
transaction advisory try-lock per job (``sql/summary.py``), read by ``job_health``.

Tests whose docstring starts with "Found:" reproduced a break of a promise by the version
that took one advisory lock per job for every write (a transaction touching tens of
thousands of jobs ran out of the server's shared lock table; a REPEATABLE READ writer got
serialisation failures): now the summary's writer holds its row lock, advisory locks are
taken only to create a summary (at most 1,000 per transaction), and a snapshot
transaction marks instead of writing. The others show a promise holding. The reference
(``expected``) is the definition computed in Python from the runs and claims; ``stored`` is
what readers see (``summary.READ``), both from tests/summarykit.py.
"""

from __future__ import annotations

import datetime
import sys
import textwrap
import uuid

import psycopg
import pytest
from django.db import transaction
from psycopg import errors

from django_pglock import singleton_job
from django_pglock.health import job_health
from django_pglock.models import JobRun
from tests.summarykit import (
    at,
    claim,
    expected,
    insert,
    lock_table_capacity,
    scratch_database,
    stored,
)

pytestmark = [pytest.mark.usefixtures("clean_locks")]

UTC = datetime.timezone.utc


def unique(label):
    return f"attack14c-{label}-{uuid.uuid4().hex[:8]}"


def marks(conn, names):
    (count,) = conn.execute(
        "SELECT count(*) FROM django_pglock_stalesummary WHERE name = ANY(%s)", [list(names)]
    ).fetchone()
    return count


def insert_many_jobs(conn, prefix, jobs, runs_per_job=1, chunk=2_000):
    """One finished run (or several) for each of ``jobs`` job names ``prefix + i``, written
    ``chunk`` names per statement (each statement settles its own jobs and commits)."""
    for start in range(0, jobs, chunk):
        conn.execute(
            "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
            " finished_at, duration, outcome)"
            " SELECT %s || g, 'h', 'w', 1, '', now() - interval '2 days' - r * interval '1 hour',"
            " now() - interval '2 days' - r * interval '1 hour', 1, 'succeeded'"
            " FROM generate_series(%s::int, %s::int) g, generate_series(1, %s::int) r",
            [prefix, start, min(start + chunk, jobs) - 1, runs_per_job],
        )


def delete_many_jobs(conn, prefix, jobs, chunk=2_000):
    for start in range(0, jobs, chunk):
        conn.execute(
            "DELETE FROM django_pglock_jobrun WHERE name = ANY(ARRAY("
            " SELECT %s || g FROM generate_series(%s::int, %s::int) g))",
            [prefix, start, min(start + chunk, jobs) - 1],
        )


# ---------------------------------------------------------------------------------------
# Finding 1: one advisory lock per job, held to the end of the writing transaction.
# ---------------------------------------------------------------------------------------

MANY_JOBS = 40_000


@pytest.mark.django_db(transaction=True)
def test_deleting_the_runs_of_many_jobs_in_one_transaction(db):
    """Found: a project with a recorded lock per tenant or per object (the admin's
    JobNameFilter says it: "a project with a lock per tenant has thousands") deletes the
    old history of 40,000 job names through the ORM (``JobRun.objects.filter(...).delete()``,
    one DELETE statement, as the admin's "delete selected" or a project's own clean-up
    would). The DELETE's statement trigger calls ``django_pglock_settle_job`` for every
    job of the deleted rows, and each call takes ``pg_try_advisory_xact_lock`` on that
    job, held until the transaction ends: 40,000 entries in the server's shared lock
    table (sized max_locks_per_transaction x the number of backends: about 24,500 measured
    on this suite's server, max_connections = 200; in proportion about 14,000 with the
    default max_connections = 100). The
    statement fails with "out of shared memory" (HINT: increase max_locks_per_transaction)
    and nothing is deleted. Before the triggers the same DELETE took no lock per row.
    While such a statement fills the shared lock table, every other session that needs a
    lock-table entry fails too (a lock statement's gate lock, any summary try-lock)."""
    prefix = unique("many") + "-"
    insert_many_jobs(db, prefix, MANY_JOBS)
    try:
        with transaction.atomic():
            deleted, _ = JobRun.objects.filter(name__startswith=prefix).delete()
        assert deleted == MANY_JOBS
    finally:
        delete_many_jobs(db, prefix, MANY_JOBS)
    assert db.execute(
        "SELECT count(*) FROM django_pglock_jobsummary WHERE name LIKE %s", [prefix + "%"]
    ).fetchone() == (0,)


@pytest.mark.django_db(transaction=True)
def test_pglock_prune_batch_while_another_transaction_holds_summary_locks(db, pg_url, test_db_name):
    """Found: ``pglock_prune`` deletes in batches of 10,000 runs (BATCH_SIZE), one
    statement each: a batch whose runs belong to 10,000 different jobs takes 10,000
    summary locks at once. Here another transaction (a second clean-up, an admin bulk
    delete, a fixture load: any write that touched a few thousand jobs and has not yet
    committed) holds summary locks of its own jobs; together they exceed the shared lock
    table and the prune batch fails with "out of shared memory". The locks the other
    transaction holds are sized from this server's capacity (measured first), so that the
    prune's 10,000 no longer fit, as they would not on its own on a default server
    (max_connections = 100)."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    capacity = lock_table_capacity(pg_url, test_db_name)
    prune_jobs = 10_000
    other_jobs = max(capacity - prune_jobs + 2_000, 1)
    prefix, other = unique("prune") + "-", unique("other") + "-"
    insert_many_jobs(db, prefix, prune_jobs, runs_per_job=2)  # the older run of each goes
    insert_many_jobs(db, other, other_jobs)
    holder = psycopg.connect(pg_url, dbname=test_db_name)
    try:
        # The other transaction: it rewrote the runs of its jobs, not yet committed.
        for start in range(0, other_jobs, 2_000):
            holder.execute(
                "UPDATE django_pglock_jobrun SET host = 'moved' WHERE name = ANY(ARRAY("
                " SELECT %s || g FROM generate_series(%s::int, %s::int) g))",
                [other, start, min(start + 2_000, other_jobs) - 1],
            )
        try:
            call_command("pglock_prune", older_than="1d", verbosity=0)
        except CommandError as exc:
            pytest.fail(
                f"pglock_prune failed (this server's lock table took {capacity} locks; the"
                f" other transaction held {other_jobs}): {exc}"
            )
    finally:
        holder.rollback()
        holder.close()
        delete_many_jobs(db, prefix, prune_jobs)
        delete_many_jobs(db, other, other_jobs)


MIGRATE_MANY_JOBS = """
import django
django.setup()
from django.core.management import call_command
from django.db import connection

call_command("migrate", "django_pglock", "0007", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, outcome) SELECT 'tenant-' || g, 'h', 'w', 1, '', now(), now(),"
        " 'succeeded' FROM generate_series(1, %s) g", [int(__import__("sys").argv[1])])
call_command("migrate", "django_pglock", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute("SELECT count(*) FROM django_pglock_jobsummary")
    print("summaries", cursor.fetchone()[0])
"""


@pytest.fixture
def scratch(pg_url, procs):
    with scratch_database(pg_url, procs.env, "attack14c") as made:
        yield made


@pytest.mark.django_db(transaction=True)
def test_migrating_a_history_of_many_jobs_to_0008(scratch, procs):
    """Found: an existing installation upgrades (``migrate``) with a run history of
    40,000 job names (a lock per tenant, recorded). Migration 0008's backfill calls
    ``django_pglock_settle_job(name, true)`` for every job in the migration's one
    transaction, each taking the job's transaction advisory lock until the migration
    commits: the migration fails with "out of shared memory" and the upgrade cannot be
    applied (on a server with the default max_connections = 100, about 14,000 jobs would
    do). The same backfill runs in ``unmigrated.complete`` after ``migrate`` of a
    database built without migrations."""
    _, env = scratch
    result = procs.start(
        sys.executable, "-c", textwrap.dedent(MIGRATE_MANY_JOBS), str(MANY_JOBS), env=env
    ).result(timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == f"summaries {MANY_JOBS}"


# ---------------------------------------------------------------------------------------
# Finding 2: writers in REPEATABLE READ or SERIALIZABLE.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "level",
    [psycopg.IsolationLevel.REPEATABLE_READ, psycopg.IsolationLevel.SERIALIZABLE],
    ids=["repeatable-read", "serializable"],
)
def test_a_repeatable_read_writer_after_the_job_ran(db, pg_url, test_db_name, level):
    """Found: a transaction in REPEATABLE READ or SERIALIZABLE (Django's
    ``OPTIONS["isolation_level"]``, or a role or database default, which the lock session
    itself is protected from, see test_boundaries) records a run of a job through the ORM
    (a project's import of runs, a test's set-up). Meanwhile the job ran once, on its lock
    connection. The transaction's insert of a *new* run row then fails with "could not
    serialize access due to concurrent update": its trigger takes the job's (now free)
    summary lock and upserts the summary row, which the job's run updated after the
    transaction's snapshot. Before the triggers, inserting a new run never conflicted with
    another transaction's insert of another run. The same holds for job_health on a
    Django connection in REPEATABLE READ: its ABANDONED update closes a lost run and fails
    when the job's summary changed since the transaction's first statement."""
    name = unique("rr")
    insert(db, name, "succeeded", at(1), at(2))

    @singleton_job(name=name)
    def job():
        return "ran"

    with psycopg.connect(pg_url, dbname=test_db_name) as writer:
        writer.isolation_level = level
        writer.execute("SELECT count(*) FROM django_pglock_jobrun WHERE name = %s", [name])
        assert job() == "ran"  # committed on the lock connection, after the snapshot
        try:
            insert(writer, name, "failed", at(3), at(4))
            writer.commit()
        except errors.SerializationFailure as exc:
            pytest.fail(f"the run's insert failed: {exc}")
    assert stored(db, [name]) == expected(db, [name])


# ---------------------------------------------------------------------------------------
# What held.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_savepoints_rolled_back_around_holders_and_marks(db, pg_url, test_db_name):
    """Holds: a transaction's savepoint takes the job's summary lock (its write merged,
    the job's stale marks deleted) and is rolled back: PostgreSQL releases a transaction
    advisory lock taken in an aborted subtransaction, and the mark deletions come back
    with it; a write in the outer transaction afterwards takes the lock again and
    recounts. Meanwhile autocommit writers mark or merge. A non-holder's mark inserted in
    a savepoint that is rolled back goes with its run. At every step what a reader sees
    is what the history says; at the end no mark is left and the stored row is exact."""
    name = unique("savepoint")
    insert(db, name, "succeeded", at(1), at(1, 30))
    with (
        psycopg.connect(pg_url, dbname=test_db_name) as t,
        psycopg.connect(pg_url, dbname=test_db_name) as blocker,
    ):
        # A blocker holds the lock; an autocommit write marks the job.
        insert(blocker, name, "skipped", at(2), at(2))
        insert(db, name, "failed", at(3), at(3, 30))
        assert marks(db, [name]) == 1
        blocker.rollback()
        # T: a savepoint writes (takes the lock, deletes the mark, recounts), rolled back.
        t.execute("SAVEPOINT a")
        insert(t, name, "succeeded", at(4), at(4, 30))
        assert marks(t, [name]) == 0
        t.execute("ROLLBACK TO SAVEPOINT a")
        assert marks(t, [name]) == 1
        assert stored(db, [name]) == expected(db, [name])
        # The lock is free again: an autocommit write takes it, recounts and clears.
        insert(db, name, "lost", at(5), at(5, 30))
        assert marks(db, [name]) == 0
        # T again, in a savepoint released into the transaction: T is the holder now.
        t.execute("SAVEPOINT b")
        insert(t, name, "running", at(6))
        t.execute("RELEASE SAVEPOINT b")
        # A non-holder's write in a savepoint marks; rolled back, the mark goes with it.
        with db.transaction():
            db.execute("SAVEPOINT c")
            insert(db, name, "succeeded", at(7), at(7, 30))
            assert marks(db, [name]) == 1
            db.execute("ROLLBACK TO SAVEPOINT c")
            claim(db, name, at(8))  # a claim in the same transaction: marked
        assert marks(db, [name]) == 1
        assert stored(db, [name]) == expected(db, [name])
        t.commit()
        assert stored(db, [name]) == expected(db, [name])
    insert(db, name, "skipped", at(9), at(9))
    assert marks(db, [name]) == 0
    assert stored(db, [name]) == expected(db, [name])
    assert db.execute(
        "SELECT count(*) FROM django_pglock_jobsummary WHERE name = %s", [name]
    ).fetchone() == (1,)


@pytest.mark.django_db(transaction=True)
def test_two_names_with_one_hashtext_share_a_lock_and_stay_right(db, pg_url, test_db_name):
    """Holds: two job names whose ``hashtext`` is the same (found here by a search among
    generated names) share the advisory lock a summary is created under. While a
    transaction creates one's summary (and stays open), the first writes of the other mark
    it instead; readers recount it; the open transaction commits; a later write of each
    settles both, with no mark left."""
    (a, b) = db.execute(
        "SELECT min(n), max(n) FROM (SELECT 'attack14c-hash-' || g AS n"
        " FROM generate_series(1, 300000) g) s GROUP BY hashtext(n)"
        " HAVING count(*) = 2 LIMIT 1"
    ).fetchone()
    db.execute("DELETE FROM django_pglock_jobrun WHERE name IN (%s, %s)", [a, b])
    db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name IN (%s, %s)", [a, b])
    assert db.execute("SELECT hashtext(%s) = hashtext(%s)", [a, b]).fetchone() == (True,)
    try:
        with psycopg.connect(pg_url, dbname=test_db_name) as holder:
            insert(holder, a, "failed", at(2), at(2, 30))  # creates a's: holds the lock
            insert(db, b, "succeeded", at(1), at(1, 30))  # b has no summary yet
            insert(db, b, "failed", at(3), at(3, 30))
            claim(db, b, at(4))
            db.execute("DELETE FROM django_pglock_jobrun WHERE name = %s AND outcome = "
                       "'succeeded'", [b])  # fmt: skip
            assert marks(db, [b]) == 4
            assert stored(db, [a, b]) == expected(db, [a, b])
            health = {h.name: h for h in job_health(announce=False)}
            assert health[b].last_outcome == "failed" and health[b].last_success_at is None
            holder.commit()
        assert stored(db, [a, b]) == expected(db, [a, b])
        insert(db, a, "skipped", at(5), at(5))
        insert(db, b, "skipped", at(5), at(5))
        assert marks(db, [a, b]) == 0
        assert stored(db, [a, b]) == expected(db, [a, b])
    finally:
        db.execute("DELETE FROM django_pglock_jobrun WHERE name IN (%s, %s)", [a, b])
        db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name IN (%s, %s)", [a, b])


@pytest.mark.django_db(transaction=True)
def test_merge_statements_and_a_repeatable_read_reader(db, pg_url, test_db_name):
    """Holds: runs inserted, updated and deleted by SQL ``MERGE`` (row and statement
    triggers with transition tables fire for its actions), and a reader in REPEATABLE
    READ: its answer stays the one of its snapshot while writers and a holder that
    commits later change the job, and is what the history says in that snapshot."""
    name = unique("merge")
    first = insert(db, name, "succeeded", at(1), at(1, 30))
    second = insert(db, name, "failed", at(2), at(2, 30))
    db.execute(
        "MERGE INTO django_pglock_jobrun r USING (VALUES (%s::bigint, 'lost'),"
        " (%s::bigint, 'x')) AS s(id, outcome) ON r.id = s.id"
        " WHEN MATCHED AND s.outcome = 'x' THEN DELETE"
        " WHEN MATCHED THEN UPDATE SET outcome = s.outcome",
        [first, second],
    )
    assert stored(db, [name]) == expected(db, [name])
    assert stored(db, [name])[name][8] is None  # no success left
    with (
        psycopg.connect(pg_url, dbname=test_db_name) as reader,
        psycopg.connect(pg_url, dbname=test_db_name) as holder,
    ):
        reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        before = stored(reader, [name])
        assert before == expected(reader, [name])
        insert(holder, name, "succeeded", at(3), at(3, 30))  # holds, uncommitted
        insert(db, name, "failed", at(4), at(4, 30))  # marked
        assert stored(reader, [name]) == before == expected(reader, [name])
        holder.commit()
        assert stored(reader, [name]) == before
        reader.commit()
        assert stored(reader, [name]) == expected(reader, [name])
        assert stored(reader, [name])[name][3] == "failed"
