"""Each job's summary row (``django_pglock_jobsummary``), kept by triggers on the run history
and the schedule claims: what job health reads instead of probing the history per job.

A job's summary holds its last run that ran its body, its last success, its last failure
(each by start, then id, as job health orders them), whether it has any run at all, and
its latest schedule claim. Every writer of runs and claims (the lock statements, a version
of this app from before the table, the ORM, ``pglock_prune``, a test's clean-up) goes
through the same triggers, so the summary is always what the history says.

How the triggers keep it right under concurrency:

* A new or changed run or claim is *merged*: ``INSERT .. ON CONFLICT DO UPDATE`` takes a
  value only when it is at least as new as the one stored, compared under the row's lock
  against its latest version. Concurrent writers of one job therefore serialise on its row
  and the newest wins, whatever order they commit in.
* A run that stops answering a question (deleted, its start or name changed, or a running
  run finished as skipped) is *recomputed*: ``resummarise`` first locks the jobs' rows in
  name order (so a writer that got there first commits before the recount) and then
  recounts from the history with fresh snapshots (a PL/pgSQL function takes one per
  statement). A writer that comes later merges its own row on top.
* Several jobs in one statement are locked in name order, as every writer does.

The statements below are the current version; ``migrations/0008_job_summary`` installs
them. Changing them takes a new migration (and the old text frozen into 0008).
"""

from __future__ import annotations

__all__ = ["BACKFILL", "INSTALL", "INSTALLED", "TRIGGERS", "UNINSTALL"]

_SUMMARY = "django_pglock_jobsummary"
_RUNS = "django_pglock_jobrun"
_CLAIMS = "django_pglock_scheduleclaim"

# A job's newest run of a kind (its last run, last success, last failure), by the order
# job health uses: start, then id. {where} picks the kind.
_NEWEST = f"""(SELECT r.id, r.outcome, r.started_at, r.finished_at, r.duration, r.host
        FROM {_RUNS} r WHERE r.name = j.name AND {{where}}
        ORDER BY r.started_at DESC, r.id DESC LIMIT 1)"""
_LAST = "r.outcome <> 'skipped'"
_OK = "r.outcome = 'succeeded'"
_BAD = "r.outcome IN ('failed', 'lost')"

_COLUMNS = """name, has_runs, last_id, last_outcome, last_started_at, last_finished_at,
        last_duration, last_host, success_id, success_started_at, success_at, failure_id,
        failure_started_at, failure_at, claim_slot, claim_schedule"""

RESUMMARISE = f"""
CREATE OR REPLACE FUNCTION django_pglock_resummarise(jobs varchar[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    -- Writers of these jobs that hold their rows commit first; each statement below then
    -- reads the history with a fresh snapshot.
    PERFORM 1 FROM {_SUMMARY} WHERE name = ANY(jobs) ORDER BY name FOR UPDATE;
    DELETE FROM {_SUMMARY} s WHERE s.name = ANY(jobs)
        AND NOT EXISTS (SELECT 1 FROM {_RUNS} r WHERE r.name = s.name)
        AND NOT EXISTS (SELECT 1 FROM {_CLAIMS} c WHERE c.name = s.name);
    INSERT INTO {_SUMMARY} AS s ({_COLUMNS})
    SELECT j.name, j.has_runs, l.id, l.outcome, l.started_at, l.finished_at, l.duration,
           l.host, ok.id, ok.started_at, coalesce(ok.finished_at, ok.started_at),
           bad.id, bad.started_at, coalesce(bad.finished_at, bad.started_at),
           c.slot, c.schedule
    FROM (SELECT u.name, EXISTS (SELECT 1 FROM {_RUNS} r WHERE r.name = u.name) AS has_runs
          FROM (SELECT DISTINCT name FROM unnest(jobs) AS n(name)) u) j
    LEFT JOIN LATERAL {_NEWEST.format(where=_LAST)} l ON true
    LEFT JOIN LATERAL {_NEWEST.format(where=_OK)} ok ON true
    LEFT JOIN LATERAL {_NEWEST.format(where=_BAD)} bad ON true
    LEFT JOIN LATERAL (SELECT c.slot, c.schedule FROM {_CLAIMS} c WHERE c.name = j.name
                       ORDER BY c.slot DESC LIMIT 1) c ON true
    WHERE j.has_runs OR c.slot IS NOT NULL
    ORDER BY j.name
    ON CONFLICT (name) DO UPDATE SET
        has_runs = excluded.has_runs, last_id = excluded.last_id,
        last_outcome = excluded.last_outcome, last_started_at = excluded.last_started_at,
        last_finished_at = excluded.last_finished_at, last_duration = excluded.last_duration,
        last_host = excluded.last_host, success_id = excluded.success_id,
        success_started_at = excluded.success_started_at, success_at = excluded.success_at,
        failure_id = excluded.failure_id, failure_started_at = excluded.failure_started_at,
        failure_at = excluded.failure_at, claim_slot = excluded.claim_slot,
        claim_schedule = excluded.claim_schedule;
END $$
"""


def _newer(group: str) -> str:
    """The merge's test: the incoming run of ``group`` (last, success, failure) is at
    least as new as the stored one (the same run counts: its values may have changed)."""
    return (
        f"(excluded.{group}_id IS NOT NULL AND (s.{group}_id IS NULL OR "
        f"(excluded.{group}_started_at, excluded.{group}_id) >= "
        f"(s.{group}_started_at, s.{group}_id)))"
    )


def _take(group: str, columns: tuple[str, ...]) -> str:
    test = _newer(group)
    return ",\n        ".join(
        f"{group}_{c} = CASE WHEN {test} THEN excluded.{group}_{c} ELSE s.{group}_{c} END"
        for c in columns
    )


# Every run kind's newest row in the statement's new rows, per job, merged into the jobs'
# rows in name order.
_MERGE_RUNS = f"""
    WITH l AS (
        SELECT DISTINCT ON (name) * FROM new_runs WHERE outcome <> 'skipped'
        ORDER BY name, started_at DESC, id DESC
    ), ok AS (
        SELECT DISTINCT ON (name) * FROM new_runs WHERE outcome = 'succeeded'
        ORDER BY name, started_at DESC, id DESC
    ), bad AS (
        SELECT DISTINCT ON (name) * FROM new_runs WHERE outcome IN ('failed', 'lost')
        ORDER BY name, started_at DESC, id DESC
    )
    INSERT INTO {_SUMMARY} AS s ({_COLUMNS})
    SELECT j.name, true, l.id, l.outcome, l.started_at, l.finished_at, l.duration, l.host,
           ok.id, ok.started_at, coalesce(ok.finished_at, ok.started_at),
           bad.id, bad.started_at, coalesce(bad.finished_at, bad.started_at), NULL, NULL
    FROM (SELECT DISTINCT name FROM new_runs) j
    LEFT JOIN l ON l.name = j.name LEFT JOIN ok ON ok.name = j.name
    LEFT JOIN bad ON bad.name = j.name
    ORDER BY j.name
    ON CONFLICT (name) DO UPDATE SET
        has_runs = true,
        {_take("last", ("id", "outcome", "started_at", "finished_at", "duration", "host"))},
        {_take("success", ("id", "started_at", "at"))},
        {_take("failure", ("id", "started_at", "at"))}
    WHERE NOT s.has_runs OR {_newer("last")} OR {_newer("success")} OR {_newer("failure")}"""

# The jobs whose stored answer an update may have taken away: a run that answered a
# question (last run, success, failure) and no longer does, or that moved.
_CHANGED_RUNS = """
        SELECT o.name FROM old_runs o JOIN new_runs n ON n.id = o.id
        WHERE o.name <> n.name OR o.started_at IS DISTINCT FROM n.started_at
           OR (o.outcome <> 'skipped' AND n.outcome = 'skipped')
           OR (o.outcome = 'succeeded' AND n.outcome <> 'succeeded')
           OR (o.outcome IN ('failed', 'lost') AND n.outcome NOT IN ('failed', 'lost'))"""

SUMMARISE_RUNS = f"""
CREATE OR REPLACE FUNCTION django_pglock_summarise_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    changed varchar[];
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT name FROM {_SUMMARY}));
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT DISTINCT name FROM old_runs));
        RETURN NULL;
    ELSIF TG_OP = 'UPDATE' THEN
        changed := ARRAY(SELECT DISTINCT name FROM ({_CHANGED_RUNS}) c);
        IF cardinality(changed) > 0 THEN
            PERFORM django_pglock_resummarise(changed);
        END IF;
    END IF;
    {_MERGE_RUNS};
    RETURN NULL;
END $$
"""

SUMMARISE_CLAIMS = f"""
CREATE OR REPLACE FUNCTION django_pglock_summarise_claims() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT name FROM {_SUMMARY}));
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT DISTINCT name FROM old_claims));
    ELSIF TG_OP = 'UPDATE' THEN
        -- (A claim whose slot or schedule changed: both of its jobs are recounted.)
        PERFORM django_pglock_resummarise(ARRAY(
            SELECT DISTINCT unnest(ARRAY[o.name, n.name])
            FROM old_claims o JOIN new_claims n ON n.id = o.id
            WHERE o.name <> n.name OR o.slot <> n.slot OR o.schedule <> n.schedule));
    ELSE
        INSERT INTO {_SUMMARY} AS s (name, has_runs, claim_slot, claim_schedule)
        SELECT DISTINCT ON (name) name, false, slot, schedule FROM new_claims
        ORDER BY name, slot DESC
        ON CONFLICT (name) DO UPDATE SET
            claim_slot = excluded.claim_slot, claim_schedule = excluded.claim_schedule
        WHERE s.claim_slot IS NULL OR excluded.claim_slot >= s.claim_slot;
    END IF;
    RETURN NULL;
END $$
"""


def _triggers(table: str, function: str, rows: str) -> list[str]:
    """One trigger per event (a trigger with transition tables has one event)."""
    prefix, call = f"{table}_summary", f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
    return [
        f"CREATE OR REPLACE TRIGGER {prefix}_insert AFTER INSERT ON {table} "
        f"REFERENCING NEW TABLE AS new_{rows} {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_update AFTER UPDATE ON {table} "
        f"REFERENCING OLD TABLE AS old_{rows} NEW TABLE AS new_{rows} {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_delete AFTER DELETE ON {table} "
        f"REFERENCING OLD TABLE AS old_{rows} {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_truncate AFTER TRUNCATE ON {table} {call}",
    ]


#: Create (or replace) the functions and triggers that keep the summaries, one statement
#: each.
INSTALL = [
    RESUMMARISE,
    SUMMARISE_RUNS,
    SUMMARISE_CLAIMS,
    *_triggers(_RUNS, "django_pglock_summarise_runs", "runs"),
    *_triggers(_CLAIMS, "django_pglock_summarise_claims", "claims"),
]

#: Summarise every job with history or claims (the names of the history by a loose index
#: scan on django_pglock_run_name_idx: one probe per job, not a read of every run).
BACKFILL = f"""
WITH RECURSIVE names AS (
    (SELECT name FROM {_RUNS} ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.name FROM {_RUNS} r WHERE r.name > n.name ORDER BY r.name LIMIT 1)
    FROM names n WHERE n.name IS NOT NULL
)
SELECT django_pglock_resummarise(ARRAY(
    SELECT name FROM names WHERE name IS NOT NULL
    UNION SELECT DISTINCT name FROM {_CLAIMS}))
"""

#: Remove the triggers and functions (the table goes with its model).
UNINSTALL = [
    f"DROP TRIGGER IF EXISTS {table}_summary_{event} ON {table}"
    for table in (_RUNS, _CLAIMS)
    for event in ("insert", "update", "delete", "truncate")
] + [
    "DROP FUNCTION IF EXISTS django_pglock_summarise_runs()",
    "DROP FUNCTION IF EXISTS django_pglock_summarise_claims()",
    "DROP FUNCTION IF EXISTS django_pglock_resummarise(varchar[])",
]

_TRIGGERS = [
    f"'{table}_summary_{event}'"
    for table in (_RUNS, _CLAIMS)
    for event in ("insert", "update", "delete", "truncate")
]

#: How many triggers keep the summaries.
TRIGGERS = len(_TRIGGERS)

#: How many of the triggers exist (``TRIGGERS`` when installed), on the tables the session's
#: search path finds.
INSTALLED = f"""
SELECT count(*) FROM pg_trigger
WHERE tgrelid IN (to_regclass('{_RUNS}'), to_regclass('{_CLAIMS}'))
  AND tgname IN ({", ".join(_TRIGGERS)})
"""
