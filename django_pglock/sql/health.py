"""Job health: each job's last runs, latest schedule claim and current holder, in one
statement. Jobs are the declared ones, the scheduled ones (their claims) and every name
with run history."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import TABLE_SQL as _T
from .names import quote_name

__all__ = ["EPISODE_CLOSE", "EPISODE_OPEN", "HEALTH_BOUNDS", "JOB_HEALTH"]

# Job health runs on Django's own connection, in a transaction bounded like the lock
# statements: a run table locked by a migration or VACUUM FULL makes a probe fail in
# seconds (503), never hang a web worker.
HEALTH_BOUNDS = "SET LOCAL lock_timeout = '5s'; SET LOCAL statement_timeout = '30s'"

_CLAIMS = quote_name("django_pglock_scheduleclaim")
_EPISODES = quote_name("django_pglock_jobepisode")

# Times travel as seconds since the epoch: turning a thousand rows of timestamps into
# datetimes from their text form costs more than the statement itself.
_EPOCH = "extract(epoch FROM {})::float8"

# The distinct names of the run history by a loose index scan (one index probe per name,
# on django_pglock_run_name_idx), not a scan of every row. Each job's last run, last
# success and last failure come from the same index or its two partial ones.
JOB_HEALTH = f"""
WITH RECURSIVE run_names AS (
    (SELECT name FROM {_RUNS} ORDER BY name LIMIT 1)
    UNION ALL
    SELECT (SELECT r.name FROM {_RUNS} r WHERE r.name > n.name ORDER BY r.name LIMIT 1)
    FROM run_names n WHERE n.name IS NOT NULL
), claim AS (
    SELECT DISTINCT ON (c.name) c.name, c.slot, c.schedule FROM {_CLAIMS} c
    ORDER BY c.name, c.slot DESC
), episodes AS (
    SELECT e.name, array_agg(e.kind ORDER BY e.kind) AS kinds FROM {_EPISODES} e GROUP BY e.name
), jobs AS (
    SELECT name FROM run_names WHERE name IS NOT NULL
    UNION SELECT unnest(%(declared)s::varchar[])
    UNION SELECT name FROM claim WHERE schedule <> ''
    UNION SELECT name FROM episodes  -- an episode outlives its history: judged, it closes
)
SELECT j.name, {_EPOCH.format("now()")},
       last.outcome, {_EPOCH.format("last.started_at")}, {_EPOCH.format("last.finished_at")},
       last.duration, last.host,
       {_EPOCH.format("ok.started_at")}, {_EPOCH.format("ok.finished_at")},
       {_EPOCH.format("bad.at")}, bad.outcome,
       {_EPOCH.format("claim.slot")}, claim.schedule,
       held.token, held.host, held.pid, {_EPOCH.format("held.acquired_at")},
       extract(epoch FROM now() - held.acquired_at)::float8,
       CASE WHEN held.name IS NULL THEN NULL
            WHEN now() - held.last_heartbeat > held.stale_after * interval '1 second'
                THEN 'stale'
            WHEN now() - held.last_heartbeat > held.alert_after * interval '1 second'
                THEN 'alert'
            ELSE 'ok' END,
       held.advisory,
       coalesce(episodes.kinds, ARRAY[]::varchar[])
FROM jobs j
LEFT JOIN LATERAL (
    SELECT r.outcome, r.started_at, r.finished_at, r.duration, r.host FROM {_RUNS} r
    WHERE r.name = j.name AND r.outcome <> 'skipped' ORDER BY r.started_at DESC LIMIT 1
) last ON true
LEFT JOIN LATERAL (
    SELECT r.started_at, r.finished_at FROM {_RUNS} r
    WHERE r.name = j.name AND r.outcome = 'succeeded' ORDER BY r.started_at DESC LIMIT 1
) ok ON true
LEFT JOIN LATERAL (
    SELECT coalesce(r.finished_at, r.started_at) AS at, r.outcome FROM {_RUNS} r
    WHERE r.name = j.name AND r.outcome IN ('failed', 'lost') ORDER BY r.started_at DESC LIMIT 1
) bad ON true
LEFT JOIN claim ON claim.name = j.name
LEFT JOIN episodes ON episodes.name = j.name
LEFT JOIN {_T} held ON held.name = j.name
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
