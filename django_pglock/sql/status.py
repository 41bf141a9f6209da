"""What a lock looks like from outside: its state and heartbeat age, and whether its
holder is gone (``abandoned``)."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import TABLE_SQL as _T
from .names import base_name_sql, slot_sql

__all__ = [
    "ABANDONED",
    "ADVISORY_ROWS",
    "HEARTBEAT_AGE_EXPRESSION",
    "HELD_EXPRESSION",
    "LIMIT_EXPRESSION",
    "STATE_EXPRESSION",
    "STATUS",
]

# Is the advisory key `key` held by any session of this database? A bigint key shows in
# pg_locks as classid (high half), objid (low half), objsubid 1.
_KEY_HELD = """EXISTS (
    SELECT 1 FROM pg_locks pl
    WHERE pl.locktype = 'advisory' AND pl.granted AND pl.objsubid = 1
      AND pl.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND pl.classid = (({key} >> 32) & 4294967295)::oid
      AND pl.objid = ({key} & 4294967295)::oid)"""

# The grants (name, token) on the advisory path, with the keys computed by the caller
# (:func:`~django_pglock.sql.advisory_key`): the candidates for ABANDONED.
ADVISORY_ROWS = f"SELECT name, token FROM {_T} WHERE advisory"

# Abandoned grants: the row declares the advisory path and nobody holds its key. A holder
# holds its key for as long as its session lives and never takes it back once that
# session ended, so the holder is gone and the next contender takes the name at once
# (the same rule as the acquire's reclaim). The key is looked at without locks first;
# only rows that look abandoned are then locked (FOR KEY SHARE: heartbeats go on, a
# release's delete is skipped, never waited for) and looked at again, so a release
# between its unlock and its commit is not mistaken for a dead holder. Their runs, which
# no one can finish any more, are closed as lost.
ABANDONED = f"""
WITH given AS (
    SELECT g.name, g.token, g.key
    FROM unnest(%(names)s::varchar[], %(tokens)s::bigint[], %(keys)s::bigint[])
        AS g(name, token, key)
), keyless AS MATERIALIZED (
    SELECT g.name, g.token, g.key FROM given g WHERE NOT {_KEY_HELD.format(key="g.key")}
), locked AS MATERIALIZED (
    SELECT j.name, j.token, k.key FROM {_T} j
    JOIN keyless k ON j.name = k.name AND j.token = k.token
    WHERE j.advisory
    FOR KEY SHARE OF j SKIP LOCKED
), gone AS MATERIALIZED (
    SELECT d.name, d.token FROM locked d WHERE NOT {_KEY_HELD.format(key="d.key")}
), run AS (
    UPDATE {_RUNS} r SET finished_at = now(), outcome = 'lost',
        duration = extract(epoch FROM now() - r.started_at)::float8
    FROM gone WHERE r.name = {base_name_sql("gone.name")} AND r.token = gone.token
      AND r.finished_at IS NULL
)
SELECT name, token FROM gone
"""

# A lock's state by the database clock against the row's own thresholds, after the
# abandoned grants (two parameters: their names and tokens); shared by STATUS
# (pglock_status) and the admin's annotations.
STATE_EXPRESSION = f"""CASE
    WHEN EXISTS (SELECT 1 FROM unnest(%s::varchar[], %s::bigint[]) AS a(name, token)
                 WHERE a.name = {_T}.name AND a.token = {_T}.token) THEN 'abandoned'
    WHEN now() - last_heartbeat > stale_after * interval '1 second' THEN 'stale'
    WHEN now() - last_heartbeat > alert_after * interval '1 second' THEN 'alert'
    ELSE 'ok' END"""
HEARTBEAT_AGE_EXPRESSION = "extract(epoch FROM now() - last_heartbeat)::float8"

# A semaphore's rows (one per slot held), for each row: how many of its lock's slots are
# held, and the limit its latest grant declared (a limit changed while holders run shows
# as the newest one).
_SAME_LOCK = f"{base_name_sql('o.name')} = {base_name_sql(f'{_T}.name')}"
HELD_EXPRESSION = f"(SELECT count(*) FROM {_T} o WHERE {_SAME_LOCK})::int"
LIMIT_EXPRESSION = f"""(SELECT o.slot_limit FROM {_T} o WHERE {_SAME_LOCK}
    ORDER BY o.token DESC LIMIT 1)"""

# Status of every lock (the parameters of STATE_EXPRESSION): one row per holder, by lock
# name and slot (a semaphore's slots are rows of their own, see names.slot_row).
STATUS = f"""
SELECT {base_name_sql("name")}, token, holder, host, pid, acquired_at, last_heartbeat,
       {HEARTBEAT_AGE_EXPRESSION} AS heartbeat_age,
       heartbeat_interval, alert_after, stale_after, advisory, description,
       {STATE_EXPRESSION} AS state,
       {slot_sql("name")} AS slot,
       first_value(slot_limit) OVER lock AS lock_limit, (count(*) OVER lock)::int AS held
FROM {_T}
-- LIMIT_EXPRESSION and HELD_EXPRESSION for every row at once (one sort, not a scan per row).
WINDOW lock AS (PARTITION BY {base_name_sql("name")} ORDER BY token DESC
                ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
ORDER BY acquired_at DESC, name
"""
