"""Attacks on the job summaries (issue 14, fourth round): ``django_pglock_jobsummary`` and
the stale marks, kept by triggers on the run history and the schedule claims
(``sql/summary.py``: the writer of an existing summary holds its row lock, a summary is
created under a transaction advisory try-lock, everybody else marks the job stale), read
by ``job_health``.

Tests whose docstring starts with "Found:" reproduced a break of a promise by the version
before (the summaries were models; a transaction took one advisory lock per summary it
created, up to 1,000); the others show a promise holding. The reference (``expected``) is the
definition computed in Python from the runs and claims; ``stored`` is what readers see
(``summary.READ``), both from tests/summarykit.py.
"""

from __future__ import annotations

import datetime
import itertools
import json
import random
import threading
import time
import uuid

import psycopg
import pytest
from django.core.management import call_command
from psycopg import errors

from django_pglock import singleton_job
from django_pglock.health import job_health
from tests.summarykit import at, claim, expected, insert, lock_table_capacity, marked, raw, stored

pytestmark = [pytest.mark.usefixtures("clean_locks")]

UTC = datetime.timezone.utc


def unique(label):
    return f"attack14d-{label}-{uuid.uuid4().hex[:8]}"


def forget(conn, names):
    """Delete the runs, claims and marks of ``names`` (the triggers remove the summaries)."""
    conn.execute("DELETE FROM django_pglock_jobrun WHERE name = ANY(%s)", [list(names)])
    conn.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = ANY(%s)", [list(names)])
    conn.execute("DELETE FROM django_pglock_stalesummary WHERE name = ANY(%s)", [list(names)])
    conn.execute("DELETE FROM django_pglock_jobsummary WHERE name = ANY(%s)", [list(names)])


# ---------------------------------------------------------------------------------------
# Finding: the summaries and the marks travel in Django fixtures (dumpdata / loaddata).
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_summaries_are_no_models_fixtures_and_the_orm_cannot_write_them(tmp_path):
    """Found: the summaries and the marks were Django models, so ``dumpdata``/``loaddata``
    carried them (a loaded summary overwrote the one the triggers kept; a loaded mark moved
    another job's mark away), and a test's own ORM writes to them (a faked summary,
    clearing every model) made the job's lock statements wait. They are plain tables now:
    no model of the app names them, and a dump of the app holds none of their rows."""
    from django.apps import apps

    name = unique("dump")

    @singleton_job(name=name)
    def job():
        return "ran"

    assert job() == "ran"
    models = list(apps.get_app_config("django_pglock").get_models())
    tables = {model._meta.db_table for model in models}
    assert not tables & {"django_pglock_jobsummary", "django_pglock_stalesummary"}
    out = tmp_path / "dump.json"
    call_command("dumpdata", "django_pglock", output=str(out), verbosity=0)
    dumped = {item["model"] for item in json.loads(out.read_text())}
    assert dumped <= {
        f"django_pglock.{model._meta.model_name}"
        for model in apps.get_app_config("django_pglock").get_models()
    }
    assert "django_pglock.jobrun" in dumped


# ---------------------------------------------------------------------------------------
# Finding: one creation lock per summary filled the server's shared lock table.
# ---------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_open_transactions_that_created_summaries_fill_the_servers_lock_table(
    db, pg_url, test_db_name
):
    """Found: the cap of 1,000 summaries created per transaction (sql/summary.py,
    _CREATED_MAX, each creation a pg_try_advisory_xact_lock held to the end of the
    transaction) bounds one transaction, not the server. A handful of transactions that
    each recorded the first runs of 1,000 new job names and are still open (parallel
    imports of tenants' history; Django's parallel test runner, whose test databases share
    one server, with TestCase classes whose setUpTestData writes runs of many names and
    holds them for the whole class) fill the server's shared lock table
    (max_locks_per_transaction x backends: about 9 such transactions on a default server,
    max_connections = 100; the number is measured here on this suite's server). Then the
    next of those writes fails with "out of shared memory", and so does every lock
    statement on the server (here a job that ran a moment before, on its open lock
    connection, raises LockError "out of shared memory"; a new connection to the server
    fails at start-up with FATAL "out of shared memory"). Before the summaries, inserting
    runs took no lock-table slot per row. Now a creator takes one of 16 creation locks: a
    transaction holds at most 16 slots, and every write here goes through."""
    capacity = lock_table_capacity(pg_url, test_db_name)
    per_transaction = 1_000
    count = capacity // per_transaction + 2
    prefix = unique("tenants")
    job_name = unique("job")
    holders, failures = [], []

    @singleton_job(name=job_name)
    def job():
        return "ran"

    try:
        assert job() == "ran"  # the lock connection is open, the job has its summary
        full = False
        for i in range(count):
            holder = psycopg.connect(pg_url, dbname=test_db_name)
            holders.append(holder)
            # 1,000 names in one statement; when they no longer fit, one name a statement
            # (each in a savepoint) until even one does not: the table is then full.
            first, size = 0, per_transaction
            while first < per_transaction and not full:
                holder.execute("SAVEPOINT s")
                try:
                    holder.execute(
                        "INSERT INTO django_pglock_jobrun (name, holder, host, pid,"
                        " description, started_at, finished_at, duration, outcome)"
                        " SELECT %s || '-' || %s || '-' || g, 'h', 'w', 1, '', now(), now(),"
                        " 1, 'succeeded' FROM generate_series(%s::int, %s::int) g",
                        [prefix, i, first, first + size - 1],
                    )
                    holder.execute("RELEASE SAVEPOINT s")
                    first += size
                except errors.OutOfMemory as exc:
                    holder.execute("ROLLBACK TO SAVEPOINT s")
                    if size == 1:
                        full = True
                        failures.append(f"writer {i}: {str(exc).splitlines()[0]}")
                    size = 1
            if full:
                break
        try:
            result = job()
        except Exception as exc:
            result = repr(exc)
        assert (failures, result) == ([], "ran"), (
            f"capacity {capacity} locks; {count} open transactions of {per_transaction}"
            f" new jobs each; the job: {result}"
        )
    finally:
        for holder in holders:
            holder.rollback()
            holder.close()
        forget(db, [job_name])


# ---------------------------------------------------------------------------------------
# What held: a summary row locked by somebody else.
# ---------------------------------------------------------------------------------------


def mark_stale(db, pg_url, test_db_name, name, hour):
    """Leave ``name`` marked stale: a write while another transaction holds its summary."""
    with psycopg.connect(pg_url, dbname=test_db_name) as holder:
        insert(holder, name, "skipped", at(hour), at(hour))
        insert(db, name, "failed", at(hour, 10), at(hour, 20))
        holder.rollback()
    assert marked(db, [name]) == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "strength", ["FOR UPDATE", "FOR NO KEY UPDATE", "FOR SHARE", "FOR KEY SHARE"]
)
def test_a_summary_row_locked_by_a_reader_never_holds_up_the_job(
    db, pg_url, test_db_name, strength
):
    """Holds: a transaction holds a job's summary row with a row lock of any strength
    (a project's own SQL, say):
    the job runs twice, one of its calls nested in the other (so that it is skipped),
    without waiting; the writes mark the job; job health recounts it and says what the
    history says; once the transaction ends, the next write settles the job."""
    name = unique("row-locked")
    insert(db, name, "failed", at(1), at(1, 30))

    @singleton_job(name=name)
    def job():
        return inner()

    @singleton_job(name=name)
    def inner():
        return "inner ran"

    try:
        with psycopg.connect(pg_url, dbname=test_db_name) as reader:
            reader.execute(
                f"SELECT * FROM django_pglock_jobsummary WHERE name = %s {strength}", [name]
            )
            began = time.monotonic()
            assert job() is None  # the nested call was skipped: the lock was held
            assert time.monotonic() - began < 2
            assert marked(db, [name]) >= 2
            assert stored(db, [name]) == expected(db, [name])
            health = {h.name: h for h in job_health(announce=False)}[name]
            assert health.last_outcome == "succeeded" and health.state == "healthy"
            reader.rollback()
        insert(db, name, "skipped", at(0), at(0))
        assert marked(db, [name]) == 0
        assert raw(db, [name]) == expected(db, [name])
    finally:
        forget(db, [name])


# ---------------------------------------------------------------------------------------
# What held: random interleavings, with the recount's DELETE and INSERT pulled apart.
# ---------------------------------------------------------------------------------------

JITTER = """
CREATE OR REPLACE FUNCTION attack14d_jitter() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(random() * 0.004);
    RETURN NULL;
END $$
"""
JITTERED = [
    ("django_pglock_jobsummary", "AFTER DELETE", "OLD"),
    ("django_pglock_jobsummary", "AFTER INSERT", "NEW"),
    ("django_pglock_stalesummary", "AFTER INSERT", "NEW"),
    ("django_pglock_stalesummary", "AFTER DELETE", "OLD"),
]


class Writer:
    """One connection writing runs and claims of ``names`` at random, in transactions of
    one to four statements (some in savepoints rolled back, some in REPEATABLE READ,
    some held open a while, a fifth rolled back). It updates and deletes only the runs
    and claims it committed itself, so it never waits for another writer's row: any wait
    (lock_timeout) is a wait for a summary."""

    OUTCOMES = ("running", "succeeded", "failed", "lost", "skipped")

    def __init__(self, dsn, names, seed, slots):
        self.conn = psycopg.connect(dsn)
        self.conn.execute("SET lock_timeout = '3s'")
        self.conn.execute("SET statement_timeout = '10s'")
        self.conn.commit()
        self.names, self.rng, self.slots = names, random.Random(seed), slots
        self.runs, self.claims = set(), set()  # committed, mine
        self.transactions = 0
        self.errors = []

    def started(self):
        return at(1) + datetime.timedelta(minutes=self.rng.randrange(40))

    def op(self, runs, claims):
        rng, c = self.rng, self.conn
        kind = rng.choice(
            ["insert"] * 4 + ["update"] * 3 + ["delete", "rename", "claim", "unclaim"]
        )
        if kind == "insert" or (kind in ("update", "delete", "rename") and not runs):
            outcome = rng.choice(self.OUTCOMES)
            started = self.started()
            finished = None if outcome == "running" else started + datetime.timedelta(minutes=1)
            runs.add(insert(c, rng.choice(self.names), outcome, started, finished))
        elif kind == "update":
            run = rng.choice(sorted(runs))
            if rng.random() < 0.3:
                c.execute(
                    "UPDATE django_pglock_jobrun SET started_at = %s WHERE id = %s",
                    [self.started(), run],
                )
            else:
                c.execute(
                    "UPDATE django_pglock_jobrun SET outcome = %s,"
                    " finished_at = started_at + interval '2 minutes' WHERE id = %s",
                    [rng.choice(self.OUTCOMES), run],
                )
        elif kind == "delete":
            name = rng.choice(self.names)
            gone = c.execute(
                "DELETE FROM django_pglock_jobrun WHERE id = ANY(%s) AND (name = %s OR"
                " random() < 0.2) RETURNING id",
                [sorted(runs), name],
            ).fetchall()
            runs.difference_update(r for (r,) in gone)
        elif kind == "rename":
            c.execute(
                "UPDATE django_pglock_jobrun SET name = %s WHERE id = %s",
                [rng.choice(self.names), rng.choice(sorted(runs))],
            )
        elif kind == "claim":
            slot = at(0) + datetime.timedelta(seconds=next(self.slots))
            name = rng.choice(self.names)
            claim(c, name, slot, rng.choice(["0 * * * *", "*/5 * * * *", ""]))
            claims.add((name, slot))
        elif claims:
            name, slot = rng.choice(sorted(claims))
            c.execute(
                "DELETE FROM django_pglock_scheduleclaim WHERE name = %s AND slot = %s",
                [name, slot],
            )
            claims.discard((name, slot))

    def transaction(self):
        rng, c = self.rng, self.conn
        if rng.random() < 0.15:
            c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        else:
            c.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        runs, claims = set(self.runs), set(self.claims)
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.25:
                c.execute("SAVEPOINT s")
                before = (set(runs), set(claims))
                self.op(runs, claims)
                if rng.random() < 0.5:
                    c.execute("ROLLBACK TO SAVEPOINT s")
                    runs, claims = before
                else:
                    c.execute("RELEASE SAVEPOINT s")
            else:
                self.op(runs, claims)
            time.sleep(rng.random() * 0.01)
        if rng.random() < 0.05:
            time.sleep(0.3)  # a transaction held open a while (a test's, say)
        if rng.random() < 0.2:
            c.rollback()
        else:
            c.commit()
            self.runs, self.claims = runs, claims
        self.transactions += 1

    def run(self, until, minimum=40, cap=120.0):
        """Write until ``until`` and at least ``minimum`` transactions (a busy machine is
        slower, not shorter), never past ``cap`` seconds from now."""
        deadline = time.monotonic() + cap
        try:
            while (time.monotonic() < until or self.transactions < minimum) and (
                time.monotonic() < deadline
            ):
                self.transaction()
        except Exception as exc:
            self.errors.append(repr(exc))
            self.conn.rollback()
        finally:
            self.conn.close()


@pytest.mark.django_db(transaction=True)
def test_random_interleavings_never_wait_and_readers_see_the_history(db, pg_url, test_db_name):
    """Holds: three connections write, rewrite, rename and delete runs and claims of three
    jobs at random for eight seconds (savepoints rolled back, REPEATABLE READ writers,
    transactions held open, rollbacks), with a random pause inserted after every row
    the summary functions delete or insert (a recount's DELETE and INSERT pulled apart,
    a mark inserted or removed late), while a fourth connection reads, again and again,
    in one REPEATABLE READ snapshot, both what readers see and the history. No write ever
    waits (lock_timeout 3 s), every read agrees with the history of its own snapshot,
    and the next write of each job settles it."""
    names = [unique(f"race-{i}") for i in range(3)]
    dsn = psycopg.conninfo.make_conninfo(pg_url, dbname=test_db_name)
    pattern = "attack14d-race-%"
    triggers = []
    db.execute(JITTER)
    for i, (table, when, row) in enumerate(JITTERED):
        trigger = f"attack14d_jitter_{i}"
        db.execute(
            f"CREATE TRIGGER {trigger} {when} ON {table} FOR EACH ROW"
            f" WHEN ({row}.name LIKE '{pattern}') EXECUTE FUNCTION attack14d_jitter()"
        )
        triggers.append((trigger, table))
    slots = itertools.count()  # claims' slots, unique across the writers
    disagreements, reads = [], 0
    try:
        writers = [Writer(dsn, names, seed, slots) for seed in range(3)]
        until = time.monotonic() + 8
        threads = [threading.Thread(target=w.run, args=(until,)) for w in writers]
        for thread in threads:
            thread.start()
        with psycopg.connect(dsn) as reader:
            reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            while time.monotonic() < until or (
                reads < 50 and any(thread.is_alive() for thread in threads)
            ):
                seen, want = stored(reader, names), expected(reader, names)
                reader.commit()
                reads += 1
                if seen != want:
                    disagreements.append((seen, want))
                time.sleep(0.01)
        for thread in threads:
            thread.join(150)
        assert [w.errors for w in writers] == [[], [], []]
        assert not disagreements, disagreements[:2]
        assert reads > 50 and sum(w.transactions for w in writers) > 100
        assert stored(db, names) == expected(db, names)
        for name in names:  # the next write settles each job
            insert(db, name, "skipped", at(0), at(0))
        assert marked(db, names) == 0
        assert raw(db, names) == expected(db, names)
    finally:
        for trigger, table in triggers:
            db.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {table}")
        db.execute("DROP FUNCTION IF EXISTS attack14d_jitter()")
        forget(db, names)
