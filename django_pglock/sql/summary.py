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
* Inserts and updates are merged by row triggers: a lock statement writes one run, and
  a statement that writes none (a refused acquire) costs nothing. Deletes are recounted
  by a statement trigger, the jobs of the deleted rows in name order.

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
    IF cardinality(jobs) = 0 THEN
        RETURN;  -- a statement that deleted nothing
    END IF;
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


# A new or changed run, merged into its job's row. (Row by row: a statement of one row,
# as every lock statement is, costs one plain upsert, and one that wrote no row nothing.)
_MERGE_RUN = f"""
    INSERT INTO {_SUMMARY} AS s ({_COLUMNS}) VALUES (
        NEW.name, true,
        CASE WHEN is_last THEN NEW.id END, CASE WHEN is_last THEN NEW.outcome END,
        CASE WHEN is_last THEN NEW.started_at END, CASE WHEN is_last THEN NEW.finished_at END,
        CASE WHEN is_last THEN NEW.duration END, CASE WHEN is_last THEN NEW.host END,
        CASE WHEN is_ok THEN NEW.id END, CASE WHEN is_ok THEN NEW.started_at END,
        CASE WHEN is_ok THEN coalesce(NEW.finished_at, NEW.started_at) END,
        CASE WHEN is_bad THEN NEW.id END, CASE WHEN is_bad THEN NEW.started_at END,
        CASE WHEN is_bad THEN coalesce(NEW.finished_at, NEW.started_at) END,
        NULL, NULL)
    ON CONFLICT (name) DO UPDATE SET
        has_runs = true,
        {_take("last", ("id", "outcome", "started_at", "finished_at", "duration", "host"))},
        {_take("success", ("id", "started_at", "at"))},
        {_take("failure", ("id", "started_at", "at"))}
    WHERE NOT s.has_runs OR {_newer("last")} OR {_newer("success")} OR {_newer("failure")}"""

# Row triggers for inserts and updates, statement triggers (the deleted rows in a
# transition table, their jobs recounted in name order) for deletes and truncation.
SUMMARISE_RUNS = f"""
CREATE OR REPLACE FUNCTION django_pglock_summarise_runs() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    is_last boolean;
    is_ok boolean;
    is_bad boolean;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT name FROM {_SUMMARY}));
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM django_pglock_resummarise(ARRAY(SELECT DISTINCT name FROM old_runs));
        RETURN NULL;
    ELSIF TG_OP = 'UPDATE' AND (
            OLD.name <> NEW.name OR OLD.id <> NEW.id OR OLD.started_at <> NEW.started_at
            OR (OLD.outcome <> 'skipped' AND NEW.outcome = 'skipped')
            OR (OLD.outcome = 'succeeded' AND NEW.outcome <> 'succeeded')
            OR (OLD.outcome IN ('failed', 'lost') AND NEW.outcome NOT IN ('failed', 'lost'))) THEN
        -- The run may have been its job's answer to a question it no longer answers.
        PERFORM django_pglock_resummarise(ARRAY[OLD.name]);
    END IF;
    is_last := NEW.outcome <> 'skipped';
    is_ok := NEW.outcome = 'succeeded';
    is_bad := NEW.outcome IN ('failed', 'lost');
    {_MERGE_RUN};
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
        PERFORM django_pglock_resummarise(ARRAY[OLD.name, NEW.name]);
    ELSE
        INSERT INTO {_SUMMARY} AS s (name, has_runs, claim_slot, claim_schedule)
        VALUES (NEW.name, false, NEW.slot, NEW.schedule)
        ON CONFLICT (name) DO UPDATE SET
            claim_slot = excluded.claim_slot, claim_schedule = excluded.claim_schedule
        WHERE s.claim_slot IS NULL OR excluded.claim_slot >= s.claim_slot;
    END IF;
    RETURN NULL;
END $$
"""

# An update fires only when it changes what a summary holds (a claim's holder, say, or a
# run's exit code, does not).
_RUN_CHANGED = (
    "(OLD.name, OLD.id, OLD.outcome, OLD.started_at, OLD.finished_at, OLD.duration, OLD.host)"
    " IS DISTINCT FROM "
    "(NEW.name, NEW.id, NEW.outcome, NEW.started_at, NEW.finished_at, NEW.duration, NEW.host)"
)
_CLAIM_CHANGED = (
    "(OLD.name, OLD.slot, OLD.schedule) IS DISTINCT FROM (NEW.name, NEW.slot, NEW.schedule)"
)


def _triggers(table: str, function: str, rows: str, changed: str) -> list[str]:
    prefix, call = f"{table}_summary", f"EXECUTE FUNCTION {function}()"
    return [
        f"CREATE OR REPLACE TRIGGER {prefix}_insert AFTER INSERT ON {table} FOR EACH ROW {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_update AFTER UPDATE ON {table} FOR EACH ROW "
        f"WHEN ({changed}) {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_delete AFTER DELETE ON {table} "
        f"REFERENCING OLD TABLE AS old_{rows} FOR EACH STATEMENT {call}",
        f"CREATE OR REPLACE TRIGGER {prefix}_truncate AFTER TRUNCATE ON {table} "
        f"FOR EACH STATEMENT {call}",
    ]


#: Create (or replace) the functions and triggers that keep the summaries, one statement
#: each.
INSTALL = [
    RESUMMARISE,
    SUMMARISE_RUNS,
    SUMMARISE_CLAIMS,
    *_triggers(_RUNS, "django_pglock_summarise_runs", "runs", _RUN_CHANGED),
    *_triggers(_CLAIMS, "django_pglock_summarise_claims", "claims", _CLAIM_CHANGED),
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
