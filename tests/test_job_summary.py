"""Job summaries (issue 14, performance): one row per job, kept by triggers on the run
history and the schedule claims, read by job health instead of the history.

Every test compares the stored summaries with a reference computed here in Python from the
runs and claims themselves, after writes through the real paths (``@singleton_job``,
``pglock_prune``, the ORM, plain SQL, concurrent processes), on a real server.
"""

from __future__ import annotations

import sys
import textwrap
import uuid

import psycopg
import pytest
from django.core.management import call_command

from django_pglock import Lock, singleton_job
from django_pglock.health import job_health
from django_pglock.models import JobRun
from django_pglock.sql import summary_schema as summary
from tests.summarykit import (
    assert_summarised,
    at,
    claim,
    expected,
    insert,
    marked,
    raw,
    scratch_database,
    stored,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def unique(label):
    return f"summary-{label}-{uuid.uuid4().hex[:8]}"


def test_the_runs_of_real_jobs_are_summarised_as_they_happen(db):
    name = unique("job")

    @singleton_job(name=name)
    def job(fail=False):
        if fail:
            raise RuntimeError("failed on purpose")

    job()
    assert_summarised(db, [name])
    assert stored(db, [name])[name][3] == "succeeded"
    with pytest.raises(RuntimeError):
        job(fail=True)
    assert_summarised(db, [name])
    summary_row = stored(db, [name])[name]
    assert summary_row[3] == "failed" and summary_row[8] is not None  # the success stays
    held = Lock(name).try_acquire()
    try:
        job()  # skipped: the lock is held
    finally:
        held.release()
    assert_summarised(db, [name])
    assert stored(db, [name])[name][3] == "failed"  # a skip is no run
    job()
    assert_summarised(db, [name])
    (health,) = [h for h in job_health(announce=False) if h.name == name]
    assert health.last_outcome == "succeeded" and health.state == "healthy"


def test_a_job_with_only_skips_is_a_job_without_runs(db):
    name = unique("skips")
    insert(db, name, "skipped", at(1), at(1))
    insert(db, name, "skipped", at(2), at(2))
    assert_summarised(db, [name])
    row = stored(db, [name])[name]
    assert row[1] is True and row[2] is None
    assert name in {h.name for h in job_health(announce=False)}


def test_a_running_run_finished_as_skipped_gives_the_last_run_back(db):
    name = unique("finish-skipped")
    insert(db, name, "succeeded", at(1), at(1, 30))
    running = insert(db, name, "running", at(2))
    assert stored(db, [name])[name][2] == running
    db.execute(
        "UPDATE django_pglock_jobrun SET finished_at = now(), outcome = 'skipped',"
        " reason = 'started' WHERE id = %s",
        [running],
    )
    assert_summarised(db, [name])
    assert stored(db, [name])[name][3] == "succeeded"


def test_edits_deletes_and_renames_through_the_orm_are_summarised(db):
    name, other = unique("orm"), unique("orm-other")
    first = insert(db, name, "succeeded", at(1), at(1, 30))
    second = insert(db, name, "failed", at(2), at(2, 30))
    third = insert(db, name, "succeeded", at(3), at(3, 30))
    assert_summarised(db, [name, other])
    JobRun.objects.filter(pk=third).update(outcome="lost")  # the last success is the first
    assert_summarised(db, [name, other])
    JobRun.objects.filter(pk=third).update(started_at=at(0))  # the last run moves back
    assert_summarised(db, [name, other])
    JobRun.objects.filter(pk=second).update(name=other)  # renamed: both jobs change
    assert_summarised(db, [name, other])
    JobRun.objects.filter(pk=first).delete()
    assert_summarised(db, [name, other])
    claim(db, name, at(5))
    JobRun.objects.filter(name=name).delete()  # no runs, a claim: the row stays
    assert_summarised(db, [name, other])
    assert stored(db, [name])[name][1] is False
    db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [name])
    assert stored(db, [name]) == {}  # neither runs nor claims: gone
    JobRun.objects.filter(name=other).delete()
    assert stored(db, [name, other]) == {}


def test_runs_of_several_jobs_in_one_statement(db):
    names = sorted(unique(f"bulk-{i}") for i in range(5))
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome)"
        " SELECT n, 'h', 'w', 1, '', %s + r * interval '1 minute', NULL, NULL,"
        " (ARRAY['succeeded', 'failed', 'lost', 'skipped', 'running'])[1 + (r %% 5)]"
        " FROM unnest(%s::varchar[]) n, generate_series(1, 23) r",
        [at(1), names],
    )
    assert_summarised(db, names)
    db.execute(
        "UPDATE django_pglock_jobrun SET outcome = 'skipped' WHERE name = ANY(%s)"
        " AND outcome = 'succeeded'",
        [names],
    )
    assert_summarised(db, names)
    db.execute(
        "DELETE FROM django_pglock_jobrun WHERE name = ANY(%s) AND outcome = 'failed'", [names]
    )
    assert_summarised(db, names)


def test_prune_leaves_the_summaries_as_the_history_says(db):
    name = unique("prune")
    for hour in range(1, 20):
        outcome = ("succeeded", "failed", "skipped", "lost")[hour % 4]
        insert(db, name, outcome, at(hour), at(hour, 10))
    for hour in range(1, 6):
        claim(db, name, at(hour))
    call_command("pglock_prune", "--older-than", "1h", verbosity=0)
    (left,) = db.execute(
        "SELECT count(*) FROM django_pglock_jobrun WHERE name = %s", [name]
    ).fetchone()
    assert left == 4  # the newest of each outcome
    assert_summarised(db, [name])


def test_the_claims_give_the_latest_slot_and_its_expression(db):
    name = unique("claims")
    claim(db, name, at(1), "0 * * * *")
    claim(db, name, at(3), "*/5 * * * *")
    claim(db, name, at(2), "0 * * * *")  # older than the latest: changes nothing
    assert_summarised(db, [name])
    assert stored(db, [name])[name][14:] == (at(3), "*/5 * * * *")
    db.execute(
        "DELETE FROM django_pglock_scheduleclaim WHERE name = %s AND slot = %s", [name, at(3)]
    )
    assert_summarised(db, [name])
    db.execute(
        "UPDATE django_pglock_scheduleclaim SET schedule = '' WHERE name = %s AND slot = %s",
        [name, at(2)],
    )
    assert_summarised(db, [name])
    # A latest claim without an expression and no runs: no job to judge.
    assert name not in {h.name for h in job_health(announce=False)}


def test_a_truncated_history_leaves_only_the_claims(db):
    name, scheduled = unique("truncate"), unique("truncate-claim")
    insert(db, name, "succeeded", at(1), at(1))
    insert(db, scheduled, "failed", at(1), at(1))
    claim(db, scheduled, at(2))
    with db.transaction(force_rollback=True):
        db.execute("TRUNCATE django_pglock_jobrun")
        assert stored(db, [name]) == {}
        assert_summarised(db, [name, scheduled])
        assert stored(db, [scheduled])[scheduled][1:4] == (False, None, None)
    assert_summarised(db, [name, scheduled])


WRITER = """
import os, random, sys
import psycopg
from psycopg import errors

names = sys.argv[1].split(",")
rng = random.Random(int(sys.argv[2]))
conn = psycopg.connect(os.environ["SUMMARY_TEST_DSN"], autocommit=True)
target = int(sys.argv[3])
done = conflicts = 0
OUTCOMES = ["running", "succeeded", "failed", "lost", "skipped"]
while done < target:
    name = rng.choice(names)
    step = rng.random()
    try:
        with conn.transaction():
            if step < 0.4:
                conn.execute(
                    "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description,"
                    " started_at, outcome) VALUES (%s, 'h', %s, 1, '',"
                    " now() - %s * interval '1 second', %s)",
                    [name, f"w{os.getpid()}", rng.randint(0, 5), rng.choice(OUTCOMES)])
            elif step < 0.7:
                conn.execute(
                    "UPDATE django_pglock_jobrun SET outcome = %s, finished_at = now()"
                    " WHERE id = (SELECT id FROM django_pglock_jobrun WHERE name = %s"
                    " ORDER BY random() LIMIT 1)", [rng.choice(OUTCOMES), name])
            elif step < 0.85:  # runs of two jobs (their rows locked in id order)
                conn.execute(
                    "DELETE FROM django_pglock_jobrun WHERE id IN (SELECT id FROM"
                    " django_pglock_jobrun WHERE id IN (SELECT id FROM django_pglock_jobrun"
                    " WHERE name = ANY(%s) ORDER BY random() LIMIT 3) ORDER BY id FOR UPDATE)",
                    [rng.sample(names, 2)])
            elif step < 0.95:
                conn.execute(
                    "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at,"
                    " schedule) VALUES (%s, now() - %s * interval '1 minute', 'h', now(), %s)"
                    " ON CONFLICT DO NOTHING",
                    [name, rng.randint(0, 30), rng.choice(["", "* * * * *"])])
            else:
                conn.execute(
                    "DELETE FROM django_pglock_scheduleclaim WHERE id IN (SELECT id FROM"
                    " django_pglock_scheduleclaim WHERE name = %s ORDER BY random() LIMIT 2)",
                    [name])
            if rng.random() < 0.3:  # a second write of the same job, same transaction
                conn.execute(
                    "UPDATE django_pglock_jobrun SET outcome = 'succeeded' WHERE id IN"
                    " (SELECT id FROM django_pglock_jobrun WHERE id IN (SELECT id FROM"
                    " django_pglock_jobrun WHERE name = %s ORDER BY random() LIMIT 2)"
                    " ORDER BY id FOR UPDATE)", [name])
        done += 1
    except (errors.DeadlockDetected, errors.SerializationFailure):
        conflicts += 1  # the writes' own row locks, in random order: rolled back
print(done, conflicts, flush=True)
"""


def test_concurrent_writers_leave_every_summary_as_the_history_says(
    db, procs, pg_url, test_db_name
):
    """Six processes write, rewrite and delete runs and claims of four jobs at random (a
    statement may touch two jobs; a transaction may write one job twice), 60 transactions
    each: afterwards each summary is what the history says, exactly. (Deadlocks and
    serialisation failures roll a transaction back, and are counted, not errors.)"""
    names = [unique(f"race-{i}") for i in range(4)]
    dsn = psycopg.conninfo.make_conninfo(pg_url, dbname=test_db_name)
    env = {**procs.env, "SUMMARY_TEST_DSN": dsn}
    code = textwrap.dedent(WRITER)
    writers = [
        procs.start(sys.executable, "-c", code, ",".join(names), seed, "60", env=env)
        for seed in range(6)
    ]
    finished = 0
    for writer in writers:
        result = writer.result(timeout=120)
        assert result.returncode == 0, result.stderr
        finished += int(result.stdout.split()[0])
    assert finished == 6 * 60  # each committed its 60 transactions
    assert_summarised(db, names)
    for name in names:  # the next write of each job settles it: no mark left
        insert(db, name, "skipped", at(1), at(1))
    assert marked(db, names) == 0
    assert raw(db, names) == expected(db, names)


def test_a_write_never_waits_for_a_transaction_that_writes_the_same_job(db, pg_url, test_db_name):
    """A transaction that wrote a job's run (a test's, which never commits, say) is that
    job's summary writer until it ends: other writes of the job mark it stale instead of
    waiting, readers recount it, and the first write after the transaction clears it."""
    name = unique("no-wait")
    insert(db, name, "succeeded", at(1), at(1, 30))
    db.execute("SET lock_timeout = '2s'")  # a wait would fail here, not hang
    with psycopg.connect(pg_url, dbname=test_db_name) as other:
        insert(other, name, "failed", at(2), at(2, 30))  # uncommitted
        running = insert(db, name, "running", at(3))
        db.execute(
            "UPDATE django_pglock_jobrun SET outcome = 'succeeded', finished_at = %s WHERE id = %s",
            [at(3, 30), running],
        )
        claim(db, name, at(4))
        db.execute("DELETE FROM django_pglock_jobrun WHERE id = %s", [running])
        assert marked(db, [name]) == 4
        assert_summarised(db, [name])  # what this session sees, recounted
        other.commit()  # now its failed run counts as well
        assert_summarised(db, [name])
        assert stored(db, [name])[name][3] == "failed"
        other.rollback()
    insert(db, name, "skipped", at(5), at(5))
    assert marked(db, [name]) == 0
    assert raw(db, [name]) == expected(db, [name])


MIGRATE_BACK_AND_FORTH = """
import sys
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from django_pglock.sql import summary_schema as summary
call_command("migrate", "django_pglock", "0007", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, outcome) SELECT 'job-' || (r % 7), 'h', 'w', 1, '',"
        " now() - r * interval '1 minute', now(), (ARRAY['succeeded', 'failed', 'skipped',"
        " 'lost'])[1 + r % 4] FROM generate_series(1, 200) r")
    cursor.execute(
        "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at, schedule)"
        " VALUES ('only-claimed', now(), 'h', now(), '* * * * *')")
call_command("migrate", "django_pglock", "0008", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(summary.INSTALLED)
    print("installed", cursor.fetchone()[0])
    cursor.execute("SELECT count(*) FROM django_pglock_jobsummary")
    print("summaries", cursor.fetchone()[0])
call_command("migrate", "django_pglock", "0007", verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(summary.INSTALLED)
    print("installed", cursor.fetchone()[0])
    cursor.execute(
        "SELECT to_regprocedure('django_pglock_settle_job(varchar, boolean, boolean)'),"
        " to_regclass('django_pglock_jobsummary'), to_regclass('django_pglock_stalesummary')")
    print("left", *cursor.fetchone())
    cursor.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " outcome) VALUES ('after', 'h', 'w', 1, '', now(), 'running')")  # no trigger left
call_command("migrate", "django_pglock", verbosity=0)
"""

WITHOUT_MIGRATIONS = """
import django
from django.conf import settings

class NoMigrations:
    def __contains__(self, item):
        return True
    def __getitem__(self, item):
        return None

settings.MIGRATION_MODULES = NoMigrations()
django.setup()
from django.core.management import call_command
from django.db import connection
from django_pglock import singleton_job
from django_pglock.health import job_health
from django_pglock.sql import summary_schema as summary
call_command("migrate", run_syncdb=True, verbosity=0)
with connection.cursor() as cursor:
    cursor.execute(summary.INSTALLED)
    print("installed", cursor.fetchone()[0])
from django.db.migrations.recorder import MigrationRecorder
recorder = MigrationRecorder(connection)
print("migrations", recorder.has_table() and len(recorder.applied_migrations()))

@singleton_job(name="tested-job")
def job():
    pass

job()
print("health", [(h.name, h.last_outcome) for h in job_health(announce=False)])
"""


@pytest.fixture
def scratch(pg_url, procs):
    with scratch_database(pg_url, procs.env, "summary") as made:
        yield made


def test_the_migration_summarises_the_history_and_goes_back_cleanly(scratch, procs, pg_url):
    name, env = scratch
    result = procs.start(
        sys.executable, "-c", textwrap.dedent(MIGRATE_BACK_AND_FORTH), env=env
    ).result(timeout=180)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # 7 jobs with history and one with a claim only; then no trigger and no function left.
    assert lines == [
        f"installed {summary.TRIGGERS}",
        "summaries 8",
        "installed 0",
        "left None None None",
    ]
    with psycopg.connect(pg_url, dbname=name, autocommit=True) as conn:
        names = [row[0] for row in conn.execute("SELECT name FROM django_pglock_jobsummary")]
        assert len(names) == 9 and "after" in names  # summarised again when migrated forward
        assert_summarised(conn, names)


def test_tables_made_without_migrations_get_the_sequence_and_the_triggers(scratch, procs):
    """pytest-django's --nomigrations: the jobs of a project's own tests run and are judged."""
    _, env = scratch
    result = procs.start(sys.executable, "-c", textwrap.dedent(WITHOUT_MIGRATIONS), env=env).result(
        timeout=180
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"installed {summary.TRIGGERS}", "migrations False"]
    assert lines[2] == "health [('tested-job', 'succeeded')]"


def test_job_health_answers_while_the_history_is_locked(db, pg_url, test_db_name):
    """A migration or ``VACUUM FULL`` of the run history holds it exclusively: job health,
    which reads the summaries, still answers (reading the history it would fail after
    its 5 s lock timeout)."""
    name = unique("locked-history")
    insert(db, name, "failed", at(1), at(1, 30))
    with psycopg.connect(pg_url, dbname=test_db_name) as locker:
        locker.execute("LOCK TABLE django_pglock_jobrun IN ACCESS EXCLUSIVE MODE")
        (found,) = [h for h in job_health(announce=False) if h.name == name]
        locker.rollback()
    assert (found.state, found.last_outcome) == ("failing", "failed")


def test_a_transaction_that_creates_many_summaries_takes_few_lock_table_slots(db):
    """Creating a job's summary holds an advisory lock until the transaction ends (a slot of
    the server's shared lock table): one of 16, so a transaction that writes the first runs
    of 1,200 jobs takes at most 16 slots and creates every summary; a job marked stale
    meanwhile (its summary created elsewhere) is settled by ``pglock_prune``."""
    prefix = unique("bulk")
    names = [f"{prefix}-{i:04d}" for i in range(1_200)]
    with db.transaction():
        db.execute(
            "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description,"
            " started_at, finished_at, duration, outcome) SELECT n, 'h', 'w', 1, '', %s, %s,"
            " 1, 'failed' FROM unnest(%s::varchar[]) n",
            [at(1), at(1, 30), names],
        )
        (slots,) = db.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND pid = pg_backend_pid() AND classid = %s::oid",
            [0x70676C6B],
        ).fetchone()
    assert 1 <= slots <= 16
    assert marked(db, names) == 0
    assert raw(db, names) == expected(db, names)
    db.execute("INSERT INTO django_pglock_stalesummary (name) VALUES (%s)", [names[0]])
    call_command("pglock_prune", "--older-than", "3650d", verbosity=0)
    assert marked(db, names) == 0
    assert raw(db, names) == expected(db, names)
