"""What operators and the run history use: forced release, holder, skipped and lost runs,
pruning and schedule slots."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import TABLE_SQL as _T
from .names import base_name_sql, notify, quote_name

_CLAIMS = quote_name("django_pglock_scheduleclaim")

__all__ = [
    "CLAIM_SLOT",
    "CLAIM_SLOT_UNDER",
    "FINISH_LOST_RUN",
    "FINISH_SKIPPED_INHERITED_RUN",
    "FINISH_SKIPPED_RUN",
    "FORCE_RELEASE",
    "HOLDER",
    "NOW",
    "PRUNE_CLAIMS",
    "PRUNE_RUNS",
    "RECORD_SKIPPED",
    "SLOT_CLAIMED_BY",
]

# A skipped call of a recorded job that was not granted the lock: one finished row, with
# the reason (held, timed-out).
RECORD_SKIPPED = f"""
INSERT INTO {_RUNS} (name, holder, host, pid, description, started_at, finished_at, duration,
                     outcome, reason)
VALUES (%(name)s, %(holder)s, %(host)s, %(pid)s, %(description)s, now(), now(), 0, 'skipped',
        %(reason)s)
RETURNING id
"""

# A granted call that did not run its body (its schedule slot had already started): the
# run its grant started ends as skipped, with the reason. The release statement leaves a
# finished run as it is.
FINISH_SKIPPED_RUN = f"""
UPDATE {_RUNS} SET finished_at = now(), outcome = 'skipped', reason = %(reason)s,
    duration = extract(epoch FROM now() - started_at)::float8
WHERE id = %(run_id)s AND finished_at IS NULL
"""

# The same for a job under its parent's grant (locked_run's job, which knows the grant's
# name and token, not the run's id): the run the parent's grant started ends as skipped.
FINISH_SKIPPED_INHERITED_RUN = f"""
UPDATE {_RUNS} SET finished_at = now(), outcome = 'skipped', reason = %(reason)s,
    duration = extract(epoch FROM now() - started_at)::float8
WHERE name = %(name)s AND token = %(token)s AND finished_at IS NULL
"""

# Pruning, in batches (see pglock_prune): up to %(batch)s rows after id %(after)s, in id
# order, that are older than the cutoff (taken once from the database clock). Returns how
# many it deleted, how many it picked and the last id picked (where the next batch starts);
# fewer picked than the batch size means done. Nothing else comes back to the client.
# Runs: kept whatever their age, a run still going on, and each job's latest run of each
# outcome (its last success and last failure are what job health is judged by).
PRUNE_RUNS = f"""
WITH batch AS (
    SELECT r.id FROM {_RUNS} r
    WHERE r.id > %(after)s
      AND coalesce(r.finished_at, r.started_at) < %(cutoff)s
      AND NOT (r.finished_at IS NULL
               AND EXISTS (SELECT 1 FROM {_T} j
                           WHERE j.token = r.token AND {base_name_sql("j.name")} = r.name))
      AND EXISTS (SELECT 1 FROM {_RUNS} n
                  WHERE n.name = r.name AND n.outcome = r.outcome
                    AND (n.started_at, n.id) > (r.started_at, r.id))
    ORDER BY r.id
    LIMIT %(batch)s
), gone AS (
    DELETE FROM {_RUNS} r USING batch WHERE r.id = batch.id RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM batch), (SELECT max(id) FROM batch)
"""

# The run of a holder that lost its grant to a takeover or a forced release (it may be
# dead and never finish its own run): finished, as lost.
FINISH_LOST_RUN = f"""
UPDATE {_RUNS} SET finished_at = now(), outcome = 'lost',
    duration = extract(epoch FROM now() - started_at)::float8
WHERE name = %(name)s AND token = %(token)s AND finished_at IS NULL
"""
# Schedule claims older than the cutoff, except the latest slot claimed for each job: that
# one may still be the current slot, and without it the slot would start again. Batched
# like PRUNE_RUNS.
PRUNE_CLAIMS = f"""
WITH batch AS (
    SELECT c.id FROM {_CLAIMS} c
    WHERE c.id > %(after)s
      AND c.claimed_at < %(cutoff)s
      AND EXISTS (SELECT 1 FROM {_CLAIMS} n WHERE n.name = c.name AND n.slot > c.slot)
    ORDER BY c.id
    LIMIT %(batch)s
), gone AS (
    DELETE FROM {_CLAIMS} c USING batch WHERE c.id = batch.id RETURNING 1
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM batch), (SELECT max(id) FROM batch)
"""

# Who holds a name now (after a refusal whose snapshot predates the holder's commit).
HOLDER = f"""
SELECT token, holder, host, pid, acquired_at, description,
       extract(epoch FROM now() - last_heartbeat)::float8, alert_after
FROM {_T} WHERE name = %(name)s
"""

# Forced release: delete the row, optionally only if it still carries the given token.
# Waits for any guarded transaction, so fenced writes commit before the row goes. A
# semaphore's holders are all rows of the name (every slot): without a token only a lone
# holder is released; `held` tells how many there were (the caller names their tokens).
FORCE_RELEASE = f"""
WITH found AS MATERIALIZED (
    SELECT name, token FROM {_T}
    WHERE (name = %(name)s OR {base_name_sql("name")} = %(name)s)
      AND (%(token)s::bigint IS NULL OR token = %(token)s::bigint)
), released AS (
    DELETE FROM {_T} AS j USING found f
    WHERE j.name = f.name AND j.token = f.token AND (SELECT count(*) FROM found) = 1
    RETURNING j.name, j.token, j.holder, j.host, j.pid, j.acquired_at, {notify("j.name")}
), run AS (
    UPDATE {_RUNS} r SET finished_at = now(), outcome = 'lost',
        duration = extract(epoch FROM now() - r.started_at)::float8
    FROM released WHERE r.name = {base_name_sql("released.name")} AND r.token = released.token
      AND r.finished_at IS NULL
)
SELECT r.name, r.token, r.holder, r.host, r.pid, r.acquired_at,
       (SELECT array_agg(token ORDER BY token) FROM found)
FROM (SELECT 1) AS one LEFT JOIN released r ON true
"""

# Claim one schedule slot: the first host to insert (name, slot) starts the job; the
# unique constraint decides. The claim carries the cron expression: job health reads
# when the next start is due from a job's latest claim. Claims of that job older than
# a week are pruned on the way.
CLAIM_SLOT = f"""
WITH pruned AS (
    DELETE FROM {quote_name("django_pglock_scheduleclaim")}
    WHERE name = %(name)s AND slot < %(slot)s - interval '7 days'
)
INSERT INTO {quote_name("django_pglock_scheduleclaim")} (name, slot, holder, claimed_at, schedule)
VALUES (%(name)s, %(slot)s, %(holder)s, now(), %(schedule)s)
ON CONFLICT (name, slot) DO NOTHING
RETURNING id
"""

# The same claim for a job running under its parent's grant (locked_run --schedule may have
# claimed the slot already): a slot the parent's holder claimed counts as this run's. The
# no-op update returns the parent's row in the same statement; anyone else's claim wins.
CLAIM_SLOT_UNDER = f"""
WITH pruned AS (
    DELETE FROM {quote_name("django_pglock_scheduleclaim")}
    WHERE name = %(name)s AND slot < %(slot)s - interval '7 days'
)
INSERT INTO {quote_name("django_pglock_scheduleclaim")} AS c (name, slot, holder, claimed_at,
    schedule)
VALUES (%(name)s, %(slot)s, %(holder)s, now(), %(schedule)s)
ON CONFLICT (name, slot) DO UPDATE SET holder = c.holder WHERE c.holder = %(parent)s
RETURNING id
"""

# The slot locked_run --schedule claimed and passed to its job (DJANGO_PGLOCK_SLOT): the job
# runs in it only if that very claim is the parent holder's.
SLOT_CLAIMED_BY = f"""
SELECT id FROM {_CLAIMS} WHERE name = %(name)s AND slot = %(slot)s AND holder = %(parent)s
"""

# The database clock, for computing schedule slots.
NOW = "SELECT now()"
