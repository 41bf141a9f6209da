"""The job summaries' tables, the triggers that call :mod:`.summary`'s functions, the
backfill, and their removal: what migration 0008 (and :mod:`django_pglock.unmigrated`)
runs."""

from __future__ import annotations

from .summary import (
    _CLAIMS,
    _COLUMNS,
    _RUNS,
    _STALE,
    _SUMMARY,
    COUNT,
    SETTLE,
    SUMMARISE_CLAIMS,
    SUMMARISE_RUNS,
)

__all__ = ["BACKFILL", "INSTALL", "INSTALLED", "TABLES", "TRIGGERS", "UNINSTALL"]

#: The tables: a job's summary (the columns of ``_COLUMNS``, in that order), and its stale
#: marks. Not Django models: only the triggers write them (no fixture, no ORM clean-up).
TABLES = [
    f"""CREATE TABLE IF NOT EXISTS {_SUMMARY} (
    name varchar(255) PRIMARY KEY,
    has_runs boolean NOT NULL,
    last_id bigint, last_outcome varchar(16), last_started_at timestamptz,
    last_finished_at timestamptz, last_duration double precision, last_host varchar(255),
    success_id bigint, success_started_at timestamptz, success_at timestamptz,
    failure_id bigint, failure_started_at timestamptz, failure_at timestamptz,
    claim_slot timestamptz, claim_schedule varchar(255))""",
    f"CREATE TABLE IF NOT EXISTS {_STALE} (name varchar(255) NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {_STALE}_name ON {_STALE} (name)",
]


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
    COUNT,
    SETTLE,
    SUMMARISE_RUNS,
    SUMMARISE_CLAIMS,
    *_triggers(_RUNS, "django_pglock_summarise_runs", "runs", _RUN_CHANGED),
    *_triggers(_CLAIMS, "django_pglock_summarise_claims", "claims", _CLAIM_CHANGED),
]

#: Summarise every job with history or claims, from scratch (the names of the history by a
#: loose index scan on django_pglock_run_name_idx: one probe per job, not a read of every
#: run). Run where the triggers were just created, in the same transaction: that holds off
#: every writer of runs and claims, so nobody else writes a summary meanwhile, and no
#: per-job lock is needed.
BACKFILL = [
    f"DELETE FROM {_STALE}",
    f"DELETE FROM {_SUMMARY}",
    f"""
WITH RECURSIVE names AS (
    (SELECT name FROM {_RUNS} ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.name FROM {_RUNS} r WHERE r.name > n.name ORDER BY r.name LIMIT 1)
    FROM names n WHERE n.name IS NOT NULL
)
INSERT INTO {_SUMMARY} ({_COLUMNS})
SELECT c.* FROM (SELECT name FROM names WHERE name IS NOT NULL
                 UNION SELECT name FROM {_CLAIMS}) j,
     LATERAL django_pglock_count_job(j.name) c
""",
]

_EVENTS = ("insert", "update", "delete", "truncate")
_TRIGGERS = [f"{table}_summary_{event}" for table in (_RUNS, _CLAIMS) for event in _EVENTS]

#: Remove the triggers, the functions and the tables.
UNINSTALL = [
    *(f"DROP TRIGGER IF EXISTS {name} ON {name.split('_summary_')[0]}" for name in _TRIGGERS),
    "DROP FUNCTION IF EXISTS django_pglock_summarise_runs()",
    "DROP FUNCTION IF EXISTS django_pglock_summarise_claims()",
    "DROP FUNCTION IF EXISTS django_pglock_settle_job(varchar, boolean, boolean)",
    "DROP FUNCTION IF EXISTS django_pglock_count_job(varchar)",
    f"DROP TABLE IF EXISTS {_STALE}",
    f"DROP TABLE IF EXISTS {_SUMMARY}",
]

#: How many triggers keep the summaries.
TRIGGERS = len(_TRIGGERS)

#: How many of the triggers exist (``TRIGGERS`` when installed), on the tables the session's
#: search path finds.
INSTALLED = f"""
SELECT count(*) FROM pg_trigger
WHERE tgrelid IN (to_regclass('{_RUNS}'), to_regclass('{_CLAIMS}'))
  AND tgname IN ({", ".join(f"'{name}'" for name in _TRIGGERS)})
"""
