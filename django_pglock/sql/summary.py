"""Each job's summary row (``django_pglock_jobsummary``), kept by triggers on the run history
and the schedule claims: what job health reads instead of probing the history per job.

A job's summary holds its last run that ran its body, its last success, its last failure
(each the newest by start, then id), whether it has any run at all, and its latest schedule
claim: exactly what :data:`COUNT` computes from the history. Every writer of runs and claims
(the lock statements, a version of this app from before the table, the ORM, ``pglock_prune``,
a test's clean-up) goes through the same triggers.

No writer ever waits for a summary. A write first tries to become its job's summary
writer for the rest of its transaction: by locking the job's summary row (``FOR UPDATE
SKIP LOCKED``: no slot of the server's shared lock table), or, for a job without one yet,
by a transaction advisory lock that every creator of a summary holds until it commits
(``pg_try_advisory_xact_lock``, one of 16 per database: a transaction takes at most 16).

* The writer removes the job's stale marks (their writers have committed) and then
  recounts the job from the history, when there were marks or its own change may have
  taken an answer away (a deleted run, a run moved or renamed, a success turned failure, a
  run finished as skipped); otherwise it merges its own row (a value is taken when it is
  at least as new as the stored one).
* Any other write of the job (while another transaction writes its summary, such as a
  test's, which never commits; or in a REPEATABLE READ or SERIALIZABLE transaction, which
  could not write a row changed since its snapshot) inserts a stale mark
  (``django_pglock_stalesummary``) instead, committed with its change. Readers recount a
  job with a mark from the history they see, so their answer is always what the history
  says; the job's next writer recounts it and clears the marks (``pglock_prune`` settles
  every marked job).

A recount runs after the marks are removed, with a fresh snapshot (a PL/pgSQL function takes
one per statement), so it sees every change whose mark it removed; a change committed later
left its own mark. The functions carry the search path they were created with, so a
writer whose own path does not list the app's schema writes the same tables.

The tables, the triggers and the backfill are in :mod:`.summary_schema`; migration 0008
installs them with the functions below. Changing any takes a new migration (and the old
text frozen into 0008).
"""

from __future__ import annotations

__all__ = ["COUNT", "READ", "SETTLE", "SETTLE_STALE", "SUMMARISE_CLAIMS", "SUMMARISE_RUNS"]

_SUMMARY = "django_pglock_jobsummary"
_STALE = "django_pglock_stalesummary"
_RUNS = "django_pglock_jobrun"
_CLAIMS = "django_pglock_scheduleclaim"
# The advisory lock a job's summary is created under: ("pglk", one of 16 buckets of the
# name's hashtext). A transaction that creates many summaries takes at most 16 slots of the
# server's shared lock table; two new jobs of one bucket created at once: one is marked.
# (An acquire's gate, sql/acquire.py, uses the same two-key space, with the halves of a
# name's 64-bit key: it meets these 16 locks only if that key is one of them.)
_LOCK_KEY = 0x70676C6B
_BUCKETS = 16

_COLUMNS = (
    "name, has_runs, last_id, last_outcome, last_started_at, last_finished_at, last_duration, "
    "last_host, success_id, success_started_at, success_at, failure_id, failure_started_at, "
    "failure_at, claim_slot, claim_schedule"
)

# A job's newest run of a kind (its last run, success, failure): by start, then id.
_NEWEST = f"""(SELECT r.id, r.outcome, r.started_at, r.finished_at, r.duration, r.host
        FROM {_RUNS} r WHERE r.name = job AND {{where}}
        ORDER BY r.started_at DESC, r.id DESC LIMIT 1)"""

#: A job's summary as its history says, in the columns of ``_COLUMNS`` (no row when it
#: has neither runs nor claims).
COUNT = f"""
CREATE OR REPLACE FUNCTION django_pglock_count_job(job varchar)
RETURNS SETOF {_SUMMARY} LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
    SELECT job, j.has_runs, l.id, l.outcome, l.started_at, l.finished_at, l.duration, l.host,
           ok.id, ok.started_at, coalesce(ok.finished_at, ok.started_at),
           bad.id, bad.started_at, coalesce(bad.finished_at, bad.started_at),
           c.slot, c.schedule
    FROM (SELECT EXISTS (SELECT 1 FROM {_RUNS} r WHERE r.name = job) AS has_runs) j
    LEFT JOIN LATERAL {_NEWEST.format(where="r.outcome <> 'skipped'")} l ON true
    LEFT JOIN LATERAL {_NEWEST.format(where="r.outcome = 'succeeded'")} ok ON true
    LEFT JOIN LATERAL {_NEWEST.format(where="r.outcome IN ('failed', 'lost')")} bad ON true
    LEFT JOIN LATERAL (SELECT c.slot, c.schedule FROM {_CLAIMS} c WHERE c.name = job
                       ORDER BY c.slot DESC LIMIT 1) c ON true
    WHERE j.has_runs OR c.slot IS NOT NULL
$$
"""

# Become the job's summary writer, or mark the job stale (unless ``mark`` is false: a
# settling pass with no change of its own). True when the caller is to merge its own row;
# false when there is nothing more to do (marked, or recounted).
SETTLE = f"""
CREATE OR REPLACE FUNCTION django_pglock_settle_job(
    job varchar, recount boolean, mark boolean DEFAULT true)
RETURNS boolean LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    writer boolean := false;
    marks integer;
BEGIN
    -- A snapshot transaction (REPEATABLE READ, SERIALIZABLE) could not write a summary
    -- changed since its snapshot: it marks the job instead.
    IF current_setting('transaction_isolation') IN ('read committed', 'read uncommitted') THEN
        -- The writer of an existing summary holds its row lock (no lock-table slot).
        PERFORM 1 FROM {_SUMMARY} WHERE name = job FOR UPDATE SKIP LOCKED;
        writer := FOUND;
        IF NOT writer AND NOT EXISTS (SELECT 1 FROM {_SUMMARY} WHERE name = job) THEN
            -- A job without a summary: its creator holds the creation lock until it
            -- commits, so that nobody waits for its uncommitted row.
            IF pg_try_advisory_xact_lock({_LOCK_KEY}, hashtext(job) & {_BUCKETS - 1}) THEN
                -- (A creator that committed meanwhile: its row, which may be locked.)
                PERFORM 1 FROM {_SUMMARY} WHERE name = job FOR UPDATE SKIP LOCKED;
                writer := FOUND OR NOT EXISTS (SELECT 1 FROM {_SUMMARY} WHERE name = job);
            END IF;
        END IF;
    END IF;
    IF NOT writer THEN  -- another transaction writes it
        IF mark THEN
            INSERT INTO {_STALE} (name) VALUES (job);
        END IF;
        RETURN false;
    END IF;
    DELETE FROM {_STALE} WHERE name = job;
    GET DIAGNOSTICS marks = ROW_COUNT;
    IF recount OR marks > 0 THEN
        DELETE FROM {_SUMMARY} WHERE name = job;
        INSERT INTO {_SUMMARY} ({_COLUMNS})
        SELECT {_COLUMNS} FROM django_pglock_count_job(job);
        RETURN false;
    END IF;
    RETURN true;
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


# A new or changed run, merged into its job's row by the job's summary writer.
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

# Row triggers for inserts and updates (a lock statement writes one run; a statement that
# writes none, such as a refused acquire, costs nothing), statement triggers for deletes and
# truncation (the jobs of the deleted rows in name order).
SUMMARISE_RUNS = f"""
CREATE OR REPLACE FUNCTION django_pglock_summarise_runs() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    taken boolean;
    is_last boolean;
    is_ok boolean;
    is_bad boolean;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM django_pglock_settle_job(name, true)
        FROM (SELECT name FROM {_SUMMARY} UNION SELECT name FROM {_STALE} ORDER BY 1) j;
        RETURN NULL;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM django_pglock_settle_job(name, true)
        FROM (SELECT DISTINCT name FROM old_runs ORDER BY 1) j;
        RETURN NULL;
    ELSIF TG_OP = 'UPDATE' AND OLD.name <> NEW.name THEN
        PERFORM django_pglock_settle_job(OLD.name, true);
    END IF;
    -- The run may have been its job's answer to a question it no longer answers: recount.
    taken := django_pglock_settle_job(NEW.name, TG_OP = 'UPDATE' AND (
        OLD.name <> NEW.name OR OLD.id <> NEW.id OR OLD.started_at <> NEW.started_at
        OR (OLD.outcome <> 'skipped' AND NEW.outcome = 'skipped')
        OR (OLD.outcome = 'succeeded' AND NEW.outcome <> 'succeeded')
        OR (OLD.outcome IN ('failed', 'lost') AND NEW.outcome NOT IN ('failed', 'lost'))));
    IF taken THEN
        is_last := NEW.outcome <> 'skipped';
        is_ok := NEW.outcome = 'succeeded';
        is_bad := NEW.outcome IN ('failed', 'lost');
        {_MERGE_RUN};
    END IF;
    RETURN NULL;
END $$
"""

SUMMARISE_CLAIMS = f"""
CREATE OR REPLACE FUNCTION django_pglock_summarise_claims() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM django_pglock_settle_job(name, true)
        FROM (SELECT name FROM {_SUMMARY} UNION SELECT name FROM {_STALE} ORDER BY 1) j;
    ELSIF TG_OP = 'DELETE' THEN
        PERFORM django_pglock_settle_job(name, true)
        FROM (SELECT DISTINCT name FROM old_claims ORDER BY 1) j;
    ELSIF TG_OP = 'UPDATE' THEN
        PERFORM django_pglock_settle_job(OLD.name, true);
        PERFORM django_pglock_settle_job(NEW.name, true);
    ELSIF django_pglock_settle_job(NEW.name, false) THEN
        INSERT INTO {_SUMMARY} AS s (name, has_runs, claim_slot, claim_schedule)
        VALUES (NEW.name, false, NEW.slot, NEW.schedule)
        ON CONFLICT (name) DO UPDATE SET
            claim_slot = excluded.claim_slot, claim_schedule = excluded.claim_schedule
        WHERE s.claim_slot IS NULL OR excluded.claim_slot >= s.claim_slot;
    END IF;
    RETURN NULL;
END $$
"""

#: The effective summaries a reader sees: the stored ones, and a recount of the jobs
#: marked stale (usually none).
READ = f"""
    SELECT s.* FROM {_SUMMARY} s
    WHERE NOT EXISTS (SELECT 1 FROM {_STALE} m WHERE m.name = s.name)
    UNION ALL
    SELECT c.* FROM (SELECT DISTINCT name FROM {_STALE}) m,
         LATERAL django_pglock_count_job(m.name) c"""

#: Settle up to %(batch)s jobs marked stale, by name after %(after)s: each is recounted
#: and its marks removed, unless another transaction writes its summary now. Returns how
#: many were picked and the last name (where the next batch starts). (``pglock_prune``.)
SETTLE_STALE = f"""
SELECT count(django_pglock_settle_job(name, true, false)), max(name) FROM (
    SELECT DISTINCT name FROM {_STALE} WHERE name > %(after)s ORDER BY name LIMIT %(batch)s
) j
"""
