"""``pglock_prune`` on a large history: bounded batches, counts only, progress on a terminal.

The tables are filled with ``generate_series`` on the real server; the batch size is made
small so that 50,000 rows take many batches. What must stay (a run still going on, the
latest schedule claim of each job, recent rows) stays.
"""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import call_command

from django_pglock import Lock, sql
from django_pglock.management.commands import pglock_prune
from tests.subprocs import open_db

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

OLD_RUNS = 50_000
OLD_NAMES = 100  # the old runs belong to this many jobs
RECENT_RUNS = 50
JOBS = 5  # schedule claims: 5 jobs with 5,000 old slots each
SLOTS = 5_000
BATCH = 1_000


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Recording:
    """The lock connection, noting how many rows each statement sent back."""

    def __init__(self, conn):
        self.conn = conn
        self.calls = []

    def execute(self, query, params, **options):
        rows = self.conn.execute(query, params, **options)
        self.calls.append((query, len(rows), rows))
        return rows


@pytest.fixture
def sql_db(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        conn.execute("DELETE FROM django_pglock_jobrun")
        conn.execute("DELETE FROM django_pglock_scheduleclaim")
        yield conn
        conn.execute("DELETE FROM django_pglock_jobrun")
        conn.execute("DELETE FROM django_pglock_scheduleclaim")


@pytest.fixture
def big_history(sql_db):
    """50,000 runs finished two days ago, 50 recent ones, one old run still going on
    (its lock held), and 25,000 schedule claims made two days ago for 5 jobs."""
    sql_db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome)"
        " SELECT 'prune-old-' || (i %% %s), 'h', 'host', 1, '', now() - interval '2 days',"
        " now() - interval '2 days' + interval '1 second', 1, 'succeeded'"
        " FROM generate_series(1, %s) i",
        [OLD_NAMES, OLD_RUNS],
    )
    sql_db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome)"
        " SELECT 'prune-recent', 'h', 'host', 1, '', now(), now(), 0, 'succeeded'"
        " FROM generate_series(1, %s)",
        [RECENT_RUNS],
    )
    name = f"prune-running-{uuid.uuid4().hex[:8]}"
    lease = Lock(name, record=True).try_acquire()
    assert lease is not None
    sql_db.execute(
        "UPDATE django_pglock_jobrun SET started_at = now() - interval '3 days' WHERE name = %s",
        [name],
    )
    sql_db.execute(
        "INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at)"
        " SELECT 'prune-job-' || j, now() - interval '3 days' + s * interval '1 second', 'h',"
        " now() - interval '2 days'"
        " FROM generate_series(1, %s) j, generate_series(1, %s) s",
        [JOBS, SLOTS],
    )
    yield name
    lease.release()


def recording(monkeypatch):
    """Make pglock_prune's lock connection a Recording (returned) and its batches small."""
    monkeypatch.setattr(pglock_prune, "BATCH_SIZE", BATCH, raising=False)
    recorder = {}
    real = pglock_prune.get_connection

    def get_connection(alias):
        recorder["conn"] = Recording(real(alias))
        return recorder["conn"]

    monkeypatch.setattr(pglock_prune, "get_connection", get_connection)
    return recorder


def test_prune_deletes_50000_rows_in_bounded_batches_and_keeps_what_must_stay(
    big_history, sql_db, monkeypatch
):
    recorder = recording(monkeypatch)
    out, err = io.StringIO(), io.StringIO()
    call_command("pglock_prune", "--older-than", "1d", stdout=out, stderr=err)

    kept_claims = JOBS
    kept_runs = OLD_NAMES  # each old job's latest success stays, whatever its age
    assert out.getvalue().strip() == (
        f"Deleted {OLD_RUNS - kept_runs} run(s) and {JOBS * SLOTS - kept_claims} schedule claim(s) "
        "older than 1d."
    )
    assert err.getvalue() == ""  # not a terminal: no progress lines

    # Bounded: every statement sent back one row of counts, none deleted more than a batch,
    # and it took as many statements as the batch size implies.
    calls = recorder["conn"].calls
    assert all(count == 1 for _, count, _ in calls), [count for _, count, _ in calls]
    runs = [rows[0] for query, _, rows in calls if query == sql.PRUNE_RUNS]
    claims = [rows[0] for query, _, rows in calls if query == sql.PRUNE_CLAIMS]
    assert all(gone <= BATCH for gone, _, _ in runs + claims)
    assert len(runs) == (OLD_RUNS - kept_runs) // BATCH + 1
    assert len(claims) == (JOBS * SLOTS - kept_claims) // BATCH + 1

    # Kept: the recent runs, the old run still going on, each old job's latest success
    # (job health is judged by it), the latest claim of each job.
    remaining = sql_db.execute(
        "SELECT name, count(*) FROM django_pglock_jobrun GROUP BY name ORDER BY name"
    ).fetchall()
    old_jobs = [(f"prune-old-{i}", 1) for i in range(OLD_NAMES)]
    assert remaining == sorted([("prune-recent", RECENT_RUNS), (big_history, 1), *old_jobs])
    latest = sql_db.execute(
        "SELECT c.name FROM django_pglock_scheduleclaim c WHERE c.slot ="
        " (SELECT max(slot) FROM django_pglock_scheduleclaim n WHERE n.name = c.name)"
    ).fetchall()
    assert len(latest) == JOBS
    (claims_left,) = sql_db.execute("SELECT count(*) FROM django_pglock_scheduleclaim").fetchone()
    assert claims_left == JOBS


def test_prune_reports_progress_on_a_terminal(big_history, monkeypatch):
    recording(monkeypatch)
    err = Terminal()
    call_command("pglock_prune", "--older-than", "1d", stdout=io.StringIO(), stderr=err)
    progress = err.getvalue()
    assert f"Deleting old run(s): {BATCH} so far..." in progress
    assert f"Deleting old run(s): {OLD_RUNS - BATCH} so far..." in progress
    assert f"Deleting old run(s): {OLD_RUNS - OLD_NAMES} done." in progress
    assert f"Deleting old schedule claim(s): {JOBS * SLOTS - JOBS} done." in progress


def test_prune_with_nothing_to_delete_reports_no_progress(sql_db, monkeypatch):
    recording(monkeypatch)
    err = Terminal()
    out = io.StringIO()
    call_command("pglock_prune", "--older-than", "1d", stdout=out, stderr=err)
    assert "Deleted 0 run(s) and 0 schedule claim(s)" in out.getvalue()
    assert err.getvalue() == ""
