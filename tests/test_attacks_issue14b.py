"""Attacks on the job summaries (issue 14, second round): ``django_pglock_jobsummary``,
kept by triggers on the run history and the schedule claims, read by ``job_health``.

Each test compares the stored summaries with the definition, computed here from the runs
and claims themselves (``expected``, independent of the triggers), or checks what a caller
of the app sees (a job run, ``job_health``), on the real server the suite starts.

Tests whose docstring starts with "Found:" reproduced a bug of the first version, where a
write waited for the job's summary row (a test's transaction held it for ever, two bulk
updates deadlocked, a recount overwrote a concurrent insert) or resolved the tables through
the writer's search path; the others show a promise holding. (Now a write never waits for
a summary: it takes its job's summary lock or marks the job stale, see sql/summary.py.)
"""

from __future__ import annotations

import contextlib
import datetime
import textwrap
import threading
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.utils import timezone

from django_pglock import singleton_job
from django_pglock.health import job_health
from django_pglock.models import JobRun, ScheduleClaim
from tests.subprocs import open_db
from tests.summarykit import UTC, at, claim, expected, insert, stored

pytestmark = [pytest.mark.usefixtures("clean_locks")]


def unique(label):
    return f"attack14b-{label}-{uuid.uuid4().hex[:8]}"


def in_background(target):
    """Run ``target`` in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box = {}

    def run():
        try:
            box["result"] = target()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# ---------------------------------------------------------------------------------------
# Finding 1: a Django TestCase that writes history through the ORM, then runs the job.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db  # a TestCase: the test runs inside a transaction on Django's connection
def test_testcase_history_written_with_the_orm_then_the_job_runs():
    """Found: a user's TestCase sets up history through the ORM (the last run failed)
    and then calls the job. The ORM insert's trigger inserted the job's summary row in the
    test's (never committed) transaction; the job's acquire, on the lock connection,
    inserts its run and its trigger's ``INSERT .. ON CONFLICT`` on the same summary row
    waits for the test's transaction, which waits for the job: after lock_timeout (5 s)
    the call raises LockError ("canceling statement due to lock timeout"). Before the
    triggers the run insert conflicted with nothing and the job ran."""
    name = unique("tc-orm")
    now = timezone.now()
    JobRun.objects.create(
        name=name,
        holder="h",
        host="w",
        pid=1,
        started_at=now - datetime.timedelta(minutes=5),
        finished_at=now - datetime.timedelta(minutes=4),
        outcome="failed",
    )

    @singleton_job(name=name)
    def job():
        return "ran"

    assert job() == "ran"


@pytest.mark.django_db
def test_testcase_claim_written_with_the_orm_then_the_scheduled_job_runs():
    """Found: the same with a schedule claim made through the ORM (a test that says
    the job already started in an earlier slot): the claim's trigger holds the summary row
    in the test's transaction; the scheduled job's claim of the current slot (another
    slot, so no unique-constraint conflict) waits on it and the call raises LockError
    after 5 s."""
    pytest.importorskip("cronsim")
    name = unique("tc-claim")
    ScheduleClaim.objects.create(
        name=name, slot=at(10), holder="h", claimed_at=at(10), schedule="* * * * *"
    )

    @singleton_job(name=name, schedule="* * * * *")
    def job():
        return "ran"

    assert job() == "ran"


@pytest.mark.django_db
def test_testcase_clears_the_history_with_the_orm_between_two_runs():
    """Found: a TestCase runs the job, clears its history through the ORM (the DELETE
    trigger's recount locks the summary row in the test's transaction) and runs it again:
    the second acquire waits for the test's transaction and raises LockError after 5 s."""
    name = unique("tc-clear")

    @singleton_job(name=name)
    def job():
        return "ran"

    assert job() == "ran"
    assert JobRun.objects.filter(name=name).count() == 1
    JobRun.objects.filter(name=name).delete()
    assert job() == "ran"


@pytest.mark.django_db
def test_testcase_judges_orm_history_then_runs_the_job_and_judges_again():
    """A user's TestCase sets up a failed run through the ORM and sees the job failing
    (its own uncommitted history is what job health reads in its transaction), runs the
    job (the lock connection writes without waiting for the test's transaction) and sees
    it healthy."""
    name = unique("tc-judge")
    now = timezone.now()
    JobRun.objects.create(
        name=name, holder="h", host="w", pid=1, outcome="failed",
        started_at=now - datetime.timedelta(minutes=5),
        finished_at=now - datetime.timedelta(minutes=4),
    )  # fmt: skip

    def state():
        (found,) = [h for h in job_health(announce=False) if h.name == name]
        return found.state, found.last_outcome

    assert state() == ("failing", "failed")

    @singleton_job(name=name)
    def job():
        return "ran"

    assert job() == "ran"
    assert state() == ("healthy", "succeeded")
    JobRun.objects.filter(name=name).delete()  # only the test's own run goes
    assert job() == "ran"
    assert state() == ("healthy", "succeeded")


# ---------------------------------------------------------------------------------------
# Finding 2: a recount of a job whose summary row is being inserted concurrently.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_claims_renamed_onto_a_job_whose_first_run_is_being_written(db, pg_url, test_db_name):
    """Found: the schedule claims of job ``old`` are renamed to ``new`` (the ORM's
    ``ScheduleClaim.objects.filter(name=old).update(name=new)``) while ``new``'s first run
    (a failed one) is being written by another transaction. The claims' UPDATE trigger
    recounts both names: ``django_pglock_resummarise`` locks the rows it *sees* (``new``'s
    row, inserted by the uncommitted run, is invisible, so nothing is locked or waited for),
    computes ``new`` from a snapshot without the run, and its ``INSERT .. ON CONFLICT DO
    UPDATE`` then waits for the run's transaction and, once that commits, overwrites the
    row unconditionally with the stale recount: has_runs false, no last run, no last
    failure. job_health then said the job had no last run instead of its failure. Now the
    rename does not wait: it marks ``new`` stale, and readers recount it."""
    old, new = unique("rename-old"), unique("rename-new")
    claim(db, old, at(10))
    writer = psycopg.connect(pg_url, dbname=test_db_name)  # a transaction (the ORM's atomic)
    try:
        now = db.execute("SELECT now()").fetchone()[0]
        insert(writer, new, "failed", now - datetime.timedelta(minutes=1), now)
        # The rename does not wait for the run's transaction: it marks `new` stale.
        with open_db(pg_url, test_db_name) as renamer:
            renamer.execute("SET lock_timeout = '5s'")
            renamer.execute(
                "UPDATE django_pglock_scheduleclaim SET name = %s WHERE name = %s", [new, old]
            )
        assert stored(db, [old, new]) == expected(db, [old, new])  # before the commit
        writer.commit()
    finally:
        writer.close()
    assert stored(db, [old, new]) == expected(db, [old, new])
    health = {h.name: h for h in job_health(announce=False)}
    assert health[new].last_outcome == "failed"


# ---------------------------------------------------------------------------------------
# What held: real processes running real jobs, skips, semaphore slots, forced releases,
# SIGKILLed holders closed as lost, pglock_prune, all at once.
# ---------------------------------------------------------------------------------------

RUNNER = """
import random, sys
import django
django.setup()
from django_pglock import Lock, singleton_job
from django_pglock.exceptions import LockNotHeld

names = sys.argv[1].split(",")
rng = random.Random(int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    name = rng.choice(names)
    fail = rng.random() < 0.4
    try:
        if rng.random() < 0.5:
            @singleton_job(name=name)
            def job():
                if fail:
                    raise RuntimeError("boom")
            job()
        else:  # a semaphore of the same name: its slots record runs under the base name
            with Lock(name, limit=2, record=True).acquire(blocking=False) as lease:
                if lease is not None and fail:
                    raise RuntimeError("boom")
    except (RuntimeError, LockNotHeld):  # its body failed; or a forced release took it
        pass
    except Exception as exc:  # a lock statement that failed: reported, not hidden
        print("ERROR", type(exc).__name__, exc, flush=True)
print("done", flush=True)
"""

HOLDER = """
import sys, time
import django
django.setup()
from django_pglock import Lock

lease = Lock(sys.argv[1], limit=2, record=True).acquire(blocking=True, timeout=60).__enter__()
print("held" if lease is not None else "none", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_real_writers_prune_releases_and_kills_leave_the_summaries_right(db, procs):
    """Holds: four processes run 80 recorded jobs each on three names (``@singleton_job``,
    which records skips, and ``Lock(limit=2, record=True)`` slots); meanwhile this process
    prunes (``pglock_prune --older-than 1s``), force-releases (``pglock_release``), SIGKILLs
    two holders and has their runs closed as lost by ``job_health``. Afterwards every
    summary equals the definition, and no lock statement failed."""
    names = [unique(f"real-{i}") for i in range(3)]
    code = textwrap.dedent(RUNNER)
    runners = [procs.python(code, ",".join(names), seed, 80) for seed in range(4)]
    killed = 0
    rounds = 0
    while any(r.poll() is None for r in runners) or killed < 2:
        rounds += 1
        if killed < 2 and rounds % 3 == 1:
            holder = procs.python(textwrap.dedent(HOLDER), names[killed % 3])
            if holder.read_line(60) == "held":
                holder.kill(group=True)
                holder.wait(30)
                killed += 1
        call_command("pglock_prune", older_than="1s", verbosity=0)
        for name in names:
            # Nobody held it, or two slots did (it then names their tokens): fine.
            with contextlib.suppress(BaseException):
                call_command("pglock_release", name, verbosity=0)
        job_health(announce=False)
    for runner in runners:
        result = runner.result(60)
        assert result.returncode == 0, result.stderr
        assert "ERROR" not in result.stdout, result.stdout
    job_health(announce=False)
    assert stored(db, names) == expected(db, names)


# ---------------------------------------------------------------------------------------
# Finding 3: the trigger functions resolve their tables through the writer's search_path.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_writer_whose_search_path_does_not_list_the_schema(db, pg_url, test_db_name):
    """Found: an operator's session whose search_path does not list the app's schema
    deletes a run by its qualified name (``DELETE FROM public.django_pglock_jobrun``, as
    a script run as another role, with a schema named after it first on the default
    ``"$user", public`` path, or with ``search_path = ''`` as pg_dump sets it, would).
    The trigger functions name ``django_pglock_jobsummary`` and the run and claim tables
    unqualified, and carry no ``SET search_path``: they resolve them in the writer's
    search_path, so the write fails ("relation django_pglock_jobsummary does not
    exist"), where before the triggers it succeeded."""
    name = unique("search-path")
    run_id = insert(db, name, "succeeded", at(10), at(11))
    with open_db(pg_url, test_db_name) as operator:
        operator.execute("SET search_path = pg_catalog")
        operator.execute("DELETE FROM public.django_pglock_jobrun WHERE id = %s", [run_id])
    assert stored(db, [name]) == expected(db, [name]) == {}


# ---------------------------------------------------------------------------------------
# Finding 4: the clean-up of a TestCase's run records waits for the test's own transaction.
# ---------------------------------------------------------------------------------------

USER_TESTCASE = """
import sys, time, unittest
import django
django.setup()
from django.test import TestCase
from django.utils import timezone
from django_pglock import singleton_job
from django_pglock.models import JobRun

NAME = sys.argv[1]


class JobTests(TestCase):
    def test_a_failure_before_the_run(self):
        @singleton_job(name=NAME)
        def job():
            return "ran"

        self.assertEqual(job(), "ran")
        # Then the test adds an earlier failed run through the ORM, to judge the job by.
        JobRun.objects.create(
            name=NAME, holder="h", host="w", pid=1, outcome="failed",
            started_at=timezone.now() - timezone.timedelta(hours=1),
            finished_at=timezone.now() - timezone.timedelta(hours=1),
        )
        self.assertEqual(JobRun.objects.filter(name=NAME).count(), 2)


started = time.monotonic()
result = unittest.TextTestRunner(verbosity=0).run(
    unittest.defaultTestLoader.loadTestsFromTestCase(JobTests))
print("teardown-and-run", round(time.monotonic() - started, 1), flush=True)
print("ok" if result.wasSuccessful() else "failed", flush=True)
"""


@pytest.mark.django_db(transaction=True)
def test_testcase_clean_up_waits_for_the_tests_own_summary_lock(db, procs):
    """Found: a user's TestCase runs the job (the lock connection commits its run
    record, which django_pglock.testcases notes, to delete it once the test's block ends)
    and then adds an earlier run of the same job through the ORM (the trigger takes the
    job's summary row in the test's transaction). When the block ends, Django pops it and
    then executes ROLLBACK TO SAVEPOINT through the execute wrappers, where ``settle``
    runs ``FORGET_TEST_ROWS`` on the lock connection first: its DELETE's trigger
    (``django_pglock_resummarise``) waits, FOR UPDATE with no SKIP LOCKED, for the summary
    row that the test's still-open savepoint holds, while the test's thread waits for it.
    After lock_timeout (5 s) it fails; ``_remove`` logs "could not remove what a test's
    jobs recorded" and gives the rows up for good: the test's run record outlives it and
    shows in the next test (before the triggers, the run was deleted at once)."""
    name = unique("tc-forget")
    result = procs.python(textwrap.dedent(USER_TESTCASE), name).result(120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "ok", result.stdout + result.stderr
    assert "could not remove" not in result.stderr, result.stderr
    # Nothing the test's job committed is left.
    assert db.execute(
        "SELECT count(*) FROM django_pglock_jobrun WHERE name = %s", [name]
    ).fetchone() == (0,)


# ---------------------------------------------------------------------------------------
# Finding 5: the UPDATE trigger locks the recounted jobs before the merged ones.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_bulk_updates_of_disjoint_runs_of_two_jobs_do_not_deadlock(db, pg_url, test_db_name):
    """Found: two bulk UPDATEs (the ORM's ``JobRun.objects.filter(...).update(...)``)
    touch disjoint runs of the same two jobs A < B, so their own row locks never meet. S1
    finishes a running run of A (merged) and turns a success of B into a failure (a
    recount); S2 turns a success of A into a failure (a recount) and finishes a running
    run of B (merged). The first version's runs' UPDATE trigger (SUMMARISE_RUNS) first
    recounts the changed jobs (``django_pglock_resummarise`` locks their rows) and only
    then merges every job of the statement in name order: S1 locks B then A, S2 locks A
    then B, against the module's own rule ("several jobs in one statement are locked in
    name order, as every writer does"). With a third transaction holding A for a moment
    (any writer of A), S2 queues on A first, S1 takes B and queues on A behind S2: when A
    is free, S2 gets it and waits for B, S1 waits for A: DeadlockDetected, where before
    the triggers both statements went through. (Without the pinned queue order, with
    concurrent real writers, it is a race that fails some of the time.)"""
    a, b = unique("order-a"), unique("order-b")
    assert a < b
    now = db.execute("SELECT now()").fetchone()[0]
    a_running = insert(db, a, "running", now - datetime.timedelta(minutes=3))
    a_ok = insert(db, a, "succeeded", now - datetime.timedelta(minutes=2), now)
    insert(db, a, "running", now - datetime.timedelta(minutes=1))  # a third run of A
    b_ok = insert(db, b, "succeeded", now - datetime.timedelta(minutes=2), now)
    b_running = insert(db, b, "running", now - datetime.timedelta(minutes=1))
    holder = psycopg.connect(pg_url, dbname=test_db_name)  # writes A: its summary writer
    s1, s2 = open_db(pg_url, test_db_name), open_db(pg_url, test_db_name)
    update = (
        "UPDATE django_pglock_jobrun SET finished_at = now(), outcome = CASE id"
        " WHEN %s THEN 'succeeded' ELSE 'failed' END WHERE id IN (%s, %s)"
    )
    box1, box2 = {}, {}
    try:
        insert(holder, a, "skipped", now, now)
        for session in (s1, s2):
            session.execute("SET lock_timeout = '5s'")  # a wait would fail, not hang
        # Neither waits for A's summary (they mark A stale) nor for each other.
        t2, box2 = in_background(lambda: s2.execute(update, [b_running, a_ok, b_running]))
        t1, box1 = in_background(lambda: s1.execute(update, [a_running, a_running, b_ok]))
        t1.join(30)
        t2.join(30)
        holder.commit()
    finally:
        holder.close()
        s1.close()
        s2.close()
    errors = [box["error"] for box in (box1, box2) if "error" in box]
    assert not errors, errors
    assert stored(db, [a, b]) == expected(db, [a, b])


# ---------------------------------------------------------------------------------------
# What held: edge cases of one writer at a time.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_edge_cases_of_single_writers_are_summarised(db):
    """Holds: runs with equal started_at (the id decides, inserted in one statement and in
    reverse id order of outcome), a run renamed through the ORM onto a job that has a newer
    run, a scheduled job's claim whose statement also prunes the job's week-old claims
    (CLAIM_SLOT: a DELETE and an INSERT of claims in one statement), a backdated ORM run
    older than every stored one, and a run moved back in time."""
    pytest.importorskip("cronsim")
    tie, moved, target, sched = (unique(x) for x in ("tie", "moved", "target", "sched"))
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, outcome) VALUES (%(n)s, 'h', 'a', 1, '', %(t)s, %(t)s, 'failed'),"
        " (%(n)s, 'h', 'b', 1, '', %(t)s, %(t)s, 'succeeded'),"
        " (%(n)s, 'h', 'c', 1, '', %(t)s, %(t)s, 'skipped')",
        {"n": tie, "t": at(9)},
    )
    insert(db, target, "succeeded", at(12), at(13))
    first = insert(db, moved, "failed", at(11), at(11, 30))
    insert(db, moved, "succeeded", at(10), at(10, 30))
    JobRun.objects.filter(id=first).update(name=target)
    insert(db, target, "lost", at(1), at(2))  # older than everything stored
    JobRun.objects.filter(name=target, outcome="succeeded").update(started_at=at(0))
    claim(db, sched, datetime.datetime(2020, 1, 1, tzinfo=UTC), "* * * * *")

    @singleton_job(name=sched, schedule="* * * * *")
    def job():
        return "ran"

    job()
    assert db.execute(
        "SELECT count(*) FROM django_pglock_scheduleclaim WHERE name = %s", [sched]
    ).fetchone() == (1,)  # the 2020 claim went in the claim's own statement
    names = [tie, moved, target, sched]
    assert stored(db, names) == expected(db, names)
    assert stored(db, [tie])[tie][3] == "succeeded"  # the greater id of the tie
