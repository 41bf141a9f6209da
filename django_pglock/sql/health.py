"""Job health: each job's last runs, latest schedule claim and current holder, in one
statement. Jobs are the declared ones, the scheduled ones (their claims) and every name
with run history."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import TABLE_SQL as _T
from .names import base_name_sql, quote_name

__all__ = ["EPISODE_CLOSE", "EPISODE_OPEN", "HEALTH_BOUNDS", "JOB_HEALTH"]

# Job health runs on Django's own connection, in a transaction bounded like the lock
# statements: a run table locked by a migration or VACUUM FULL makes a probe fail in
# seconds (503), never hang a web worker.
HEALTH_BOUNDS = "SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '30s'"

_CLAIMS = quote_name("django_pglock_scheduleclaim")
_EPISODES = quote_name("django_pglock_jobepisode")

# Times travel as timestamptz, fetched in binary (see health_reads.read_rows): psycopg turns those
# into datetimes in C, cheaper than any conversion in Python.
_RUN = "r.name, r.outcome, r.started_at, r.finished_at, r.duration, r.host"

# The distinct names of the run history by a loose index scan on django_pglock_run_name_idx
# (one probe per name, not a scan of every row), each probe bringing that name's newest run.
# A job's last run is that one unless it was skipped (then one more probe, on the same
# index). Its last success is the last run when that run succeeded (health.py reads it
# there; the column is NULL), else one probe on the partial index run_ok_idx; its last
# failure likewise, on run_bad_idx. A `WHERE` on the outer row alone is a one-time filter:
# a probe that is not needed does not run. Columns that are NULL cost nothing to fetch.
JOB_HEALTH = f"""
WITH RECURSIVE newest AS (
    (SELECT {_RUN} FROM {_RUNS} r ORDER BY r.name, r.started_at DESC LIMIT 1)
    UNION ALL
    SELECT next.* FROM newest n JOIN LATERAL (
        SELECT {_RUN} FROM {_RUNS} r
        WHERE r.name > n.name ORDER BY r.name, r.started_at DESC LIMIT 1
    ) next ON true
), claim AS (
    SELECT DISTINCT ON (c.name) c.name, c.slot, c.schedule FROM {_CLAIMS} c
    ORDER BY c.name, c.slot DESC
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
    SELECT name FROM newest
    UNION SELECT unnest(%(declared)s::varchar[])
    UNION SELECT name FROM claim WHERE schedule <> ''
    UNION SELECT name FROM episodes  -- an episode outlives its history: judged, it closes
)
SELECT j.name, now(),
       last.outcome, last.started_at, last.finished_at, last.duration, last.host,
       ok.at, bad.at, claim.slot, claim.schedule,
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
LEFT JOIN newest n ON n.name = j.name
LEFT JOIN LATERAL (
    SELECT n.outcome, n.started_at, n.finished_at, n.duration, n.host
    WHERE n.outcome <> 'skipped'
    UNION ALL
    (SELECT r.outcome, r.started_at, r.finished_at, r.duration, r.host FROM {_RUNS} r
     WHERE n.outcome = 'skipped' AND r.name = j.name AND r.outcome <> 'skipped'
     ORDER BY r.started_at DESC LIMIT 1)
) last ON true
LEFT JOIN LATERAL (
    SELECT coalesce(r.finished_at, r.started_at) AS at FROM {_RUNS} r
    WHERE last.outcome <> 'succeeded' AND r.name = j.name AND r.outcome = 'succeeded'
    ORDER BY r.started_at DESC LIMIT 1
) ok ON true
LEFT JOIN LATERAL (
    SELECT coalesce(r.finished_at, r.started_at) AS at FROM {_RUNS} r
    WHERE last.outcome NOT IN ('failed', 'lost') AND r.name = j.name
      AND r.outcome IN ('failed', 'lost')
    ORDER BY r.started_at DESC LIMIT 1
) bad ON true
LEFT JOIN claim ON claim.name = j.name
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
