"""Job health: each job's last runs, latest schedule claim and current holder, in one
statement. Jobs are the declared ones, the scheduled ones (their claims) and every name
with run history."""

from __future__ import annotations

from .names import TABLE_SQL as _T
from .names import base_name_sql, quote_name
from .summary import READ as _SUMMARIES

__all__ = ["EPISODE_CLOSE", "EPISODE_OPEN", "HEALTH_BOUNDS", "JOB_HEALTH"]

# Job health runs on Django's own connection, in a transaction bounded like the lock
# statements: a run table locked by a migration or VACUUM FULL makes a probe fail in
# seconds (503), never hang a web worker.
HEALTH_BOUNDS = "SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '30s'"

_EPISODES = quote_name("django_pglock_jobepisode")

# One row per job from its summary (django_pglock_jobsummary, kept by triggers where runs and
# claims are written: see sql/summary.py), so the history is never probed here, however
# long, but for the jobs marked stale (usually none), recounted. Times travel as
# timestamptz, fetched in binary (see health_reads.read_rows): psycopg turns those into
# datetimes in C, cheaper than any conversion in Python.
JOB_HEALTH = f"""
WITH summaries AS MATERIALIZED ({_SUMMARIES}
), episodes AS (
    SELECT e.name, array_agg(e.kind ORDER BY e.kind) AS kinds FROM {_EPISODES} e GROUP BY e.name
), held AS (
    -- Each lock's holder. A semaphore's slots are rows of their own: its live holder that
    -- has held longest (one whose session is gone, in `gone`, or that is stale only when
    -- no other holds a slot), so a dead or stale slot never hides a live run.
    SELECT DISTINCT ON (1) {base_name_sql("h.name")} AS job, h.*,
           (h.name, h.token) IN (SELECT * FROM unnest(
               %(gone_names)s::varchar[], %(gone_tokens)s::bigint[])) AS gone
    FROM {_T} h
    ORDER BY 1, gone, now() - h.last_heartbeat > h.stale_after * interval '1 second',
             h.acquired_at
), jobs AS (
    -- Names with history, scheduled names (their latest claim has an expression), the
    -- declared ones, and those with an open episode (an episode outlives its history:
    -- judged, it closes).
    SELECT name FROM summaries WHERE has_runs OR claim_schedule <> ''
    UNION SELECT unnest(%(declared)s::varchar[])
    UNION SELECT name FROM episodes
)
SELECT j.name, now(),
       s.last_outcome, s.last_started_at, s.last_finished_at, s.last_duration, s.last_host,
       s.success_at, s.failure_at, s.claim_slot, s.claim_schedule,
       held.token, held.host, held.pid, held.acquired_at,
       extract(epoch FROM now() - held.acquired_at)::float8,
       CASE WHEN held.name IS NULL THEN NULL
            WHEN now() - held.last_heartbeat > held.stale_after * interval '1 second'
                THEN 'stale'
            WHEN now() - held.last_heartbeat > held.alert_after * interval '1 second'
                THEN 'alert'
            ELSE 'ok' END,
       held.advisory,
       coalesce(episodes.kinds, ARRAY[]::varchar[]), held.name, held.gone
FROM jobs j
LEFT JOIN summaries s ON s.name = j.name
LEFT JOIN episodes ON episodes.name = j.name
LEFT JOIN held ON held.job = j.name
ORDER BY j.name
"""

# A health episode opens once (the first process to notice it inserts the row and
# announces it) and closes when the job is healthy again.
EPISODE_OPEN = f"""
INSERT INTO {_EPISODES} (name, kind, since) VALUES (%(name)s, %(kind)s, now())
ON CONFLICT (name, kind) DO NOTHING
RETURNING id
"""
EPISODE_CLOSE = f"""
DELETE FROM {_EPISODES} WHERE name = %(name)s AND NOT (kind = ANY(%(open)s::varchar[]))
"""
