"""Acquire: one atomic statement per attempt, with or without a run record.

This is a plain lock's (``limit=1``); a semaphore's is in :mod:`.semaphore`.
"""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import SEQUENCE
from .names import TABLE_SQL as _T

__all__ = ["ACQUIRE", "ACQUIRE_RECORDED"]

# Reclaimable: no heartbeat for the row's own stale_after by the database clock; or the
# holder declared the advisory path and its key was free for us to take (`key`, below):
# a holder always holds its key while its session lives, so a free key means that
# session has ended. A key held by anyone else only ever costs speed.
_RECLAIMABLE = """(
    now() - {j}.last_heartbeat > {j}.stale_after * interval '1 second'
    OR ({j}.advisory AND (SELECT held FROM key))
)"""

# Does this session hold the key already? Advisory locks nest, so a session's own try
# would succeed again: the key is tried only when it does not, and a session holds a key
# at most once, for the one lease whose row says so. pg_locks, which is not cheap, is
# looked at only when the session may hold it: when the row carries this session's
# backend pid (another thread of this process holds the name, or an ended session's that
# had the same server process: a session-mode pooler hands the backend to the next client
# after DISCARD ALL), or when a lease of this process holds the key (`maybe_held`: its
# row was deleted by a forced release that it has not noticed yet).
_MINE = """CASE WHEN %(advisory)s AND (%(maybe_held)s OR EXISTS (SELECT 1 FROM cur WHERE cur.here))
    THEN EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.objsubid = 1 AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
          AND l.objid = (%(key)s::bigint & 4294967295)::oid)
    ELSE false END"""


# Acquire in one statement. `cur` reads the current row from the snapshot (no lock);
# `key` tries the advisory key (session-level) once, unless this session holds it
# already (`prior`: then a live lease of this process owns the row). A free name is
# inserted with ON CONFLICT DO NOTHING (`fresh`): a holder who got there first wins, and the refusal
# neither locks the winner's row nor writes anything. A reclaimable row is first locked
# FOR UPDATE SKIP LOCKED (`grab`: a guarded row is skipped, never waited for), and only
# looked for when the snapshot row looked reclaimable (a one-time gate, so a refusal by a
# live holder reads the row once, from the snapshot); then it is taken over by an UPDATE
# .. WHERE <reclaimable> (`taken`), re-checked on the latest row version. A refused
# attempt gives the key back in the same statement: every outcome is one round trip.
# A refusal writes nothing, so its commit does not wait for the WAL (see SESSION_SETUP).
_COLUMNS = """name, token, holder, host, pid, backend_pid, description, acquired_at,
        last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory, slot_limit"""
_VALUES = f"""%(name)s, nextval('{SEQUENCE}'), %(holder)s, %(host)s, %(pid)s, pg_backend_pid(),
           %(description)s, now(),
           now(), %(heartbeat_interval)s, %(alert_after)s, %(stale_after)s, key.held, 1"""
_TAKE_OVER = f"""token = nextval('{SEQUENCE}'), holder = %(holder)s, host = %(host)s,
        pid = %(pid)s, backend_pid = pg_backend_pid(), description = %(description)s,
        acquired_at = now(),
        last_heartbeat = now(), heartbeat_interval = %(heartbeat_interval)s,
        alert_after = %(alert_after)s, stale_after = %(stale_after)s, advisory = key.held,
        slot_limit = 1"""
_GRANTED = "j.token, j.acquired_at, j.advisory, j.backend_pid"
# The one-time gate of the reclaim: did the snapshot row look reclaimable? In both the
# locking scan and the update, so that neither even looks at the row when it did not.
_GATE = "(SELECT c.stale OR (c.advisory AND k.held) FROM cur c, key k)"


# Tokens follow grants: every grant takes its token while it holds the name's gate, a
# transaction-level advisory lock (the two-int4 key space, apart from the session keys'
# bigint one) held until the grant commits. Without it a fresh insert whose statement
# paused between nextval and its insert could land after a later token's whole grant and
# release, and the name's tokens would go down. A second attempt on the name waits for the
# first's statement to end (never longer: the gate is taken before anything else).
_GATE_LOCK = """pg_advisory_xact_lock(
        (%(key)s::bigint >> 32)::int4, ((%(key)s::bigint << 32) >> 32)::int4)"""


def _acquire(record: bool) -> str:
    run = _RUN_STARTED if record else ""
    run_id = "(SELECT id FROM run)" if record else "NULL::bigint"
    return f"""
WITH gate AS MATERIALIZED (
    SELECT {_GATE_LOCK}
), cur AS (
    SELECT c.token, c.holder, c.host, c.pid, c.acquired_at, c.description,
           extract(epoch FROM now() - c.last_heartbeat)::float8 AS age, c.alert_after,
           now() - c.last_heartbeat > c.stale_after * interval '1 second' AS stale,
           c.advisory AND c.backend_pid = pg_backend_pid() AS here, c.advisory
    FROM {_T} c WHERE c.name = %(name)s
), prior AS MATERIALIZED (
    SELECT {_MINE} AS mine, EXISTS (SELECT 1 FROM cur WHERE cur.here) AS here FROM gate
), tried AS MATERIALIZED (
    SELECT CASE WHEN %(advisory)s AND NOT prior.mine THEN pg_try_advisory_lock(%(key)s)
                ELSE false END AS took,
           prior.mine AND NOT prior.here AS kept
    FROM prior
), key AS MATERIALIZED (
    -- held: this session holds the key after this statement, whether this statement
    -- took it or it was kept from a lease whose row is gone (the new row takes over that
    -- hold; the old lease's release sees the new row and leaves the key alone).
    SELECT took OR kept AS held, took FROM tried
), fresh AS (
    INSERT INTO {_T} AS j ({_COLUMNS})
    SELECT {_VALUES} FROM key WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (name) DO NOTHING
    RETURNING {_GRANTED}
), taken AS (
    UPDATE {_T} AS j SET {_TAKE_OVER}
    FROM key, (
        SELECT g.name FROM {_T} g
        WHERE {_GATE} AND g.name = %(name)s AND {_RECLAIMABLE.format(j="g")}
        FOR UPDATE SKIP LOCKED
    ) AS grab
    WHERE {_GATE} AND j.name = %(name)s AND j.name = grab.name
      AND {_RECLAIMABLE.format(j="j")}
    RETURNING {_GRANTED}
), ins AS (
    SELECT * FROM fresh UNION ALL SELECT * FROM taken
){run}
SELECT ins.token, ins.acquired_at, ins.advisory, ins.backend_pid,
       cur.token, cur.holder, cur.host, cur.pid, cur.acquired_at, cur.description,
       cur.age, cur.alert_after, cur.stale,
       CASE WHEN ins.token IS NULL AND key.took THEN pg_advisory_unlock(%(key)s) END,
       {run_id}
FROM key LEFT JOIN ins ON true LEFT JOIN cur ON true
"""


# With run history: the grant also starts a JobRun row, in the same statement.
_RUN_STARTED = f""", run AS (
    INSERT INTO {_RUNS} (name, token, holder, host, pid, description, started_at, outcome)
    SELECT %(name)s, ins.token, %(holder)s, %(host)s, %(pid)s, %(description)s, now(), 'running'
    FROM ins
    RETURNING id
)"""

ACQUIRE = _acquire(record=False)
ACQUIRE_RECORDED = _acquire(record=True)
