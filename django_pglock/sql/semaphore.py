"""Acquire one slot of a semaphore (``Lock(name, limit=N)``, N > 1): one statement.

A semaphore of N is N slots, each an ordinary lock row with its own name
(:func:`~.names.slot_row`), token, heartbeat and advisory key; slot 1's row is the lock's
own name, so a plain lock of that name is slot 1. The statement is the plain acquire
(:mod:`.acquire`) run against the slot it chooses:

* ``gate``: the name's gate (the plain lock's, on the name itself): every grant of every
  slot of the name takes its token while holding it, so all acquirers of one semaphore,
  plain locks of the name included, serialise, and each slot's tokens go up.
* ``cur``: slots 1..N (row names and keys from the caller) with their rows, from the
  snapshot. ``mine``: the slot's key is held by this session already (a lease of this
  process holds it, passed in ``held``, or the row says this server process holds it and
  pg_locks agrees): advisory locks nest, so trying it would succeed; such a slot is
  skipped, which is always safe.
* ``walk``: the slots in order, a RECURSIVE CTE that PostgreSQL evaluates one step at a
  time, so it stops at the first slot chosen. On the advisory path each candidate's key
  is tried (the key taken is the arbiter, live, not the snapshot): a slot is chosen when
  its key was taken (a free slot, or one whose advisory holder's session has ended), or
  when its row is stale; when none is, the first slot without a row is, on the table
  path (``chosen``). On the table path the first slot absent or stale is chosen.
* ``fresh`` / ``taken``: the plain acquire's insert (ON CONFLICT DO NOTHING) or reclaim
  (FOR UPDATE SKIP LOCKED, then an UPDATE re-checked on the latest row version) of the
  chosen slot's row. A key taken for a slot that was not granted is given back.

The snapshot is taken before the gate is waited for, so a slot may look free and have
been granted meanwhile: then nothing is granted and ``retry`` says so; the caller tries
once more with a new statement, rather than refuse while slots are free.
"""

from __future__ import annotations

from .acquire import _GATE_LOCK, _RUN_STARTED
from .names import SEQUENCE
from .names import TABLE_SQL as _T

__all__ = ["SEMAPHORE", "SEMAPHORE_RECORDED", "UNLOCK_STRAY_SLOTS"]


_HELD_HERE = """EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.objsubid = 1 AND l.classid = ((s.key >> 32) & 4294967295)::oid
          AND l.objid = (s.key & 4294967295)::oid)"""

_COLUMNS = """name, token, holder, host, pid, backend_pid, description, acquired_at,
        last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory, slot_limit"""
_VALUES = f"""t.row_name, nextval('{SEQUENCE}'), %(holder)s, %(host)s, %(pid)s,
           pg_backend_pid(), %(description)s, now(), now(), %(heartbeat_interval)s,
           %(alert_after)s, %(stale_after)s, t.took, %(limit)s"""
_TAKE_OVER = f"""token = nextval('{SEQUENCE}'), holder = %(holder)s, host = %(host)s,
        pid = %(pid)s, backend_pid = pg_backend_pid(), description = %(description)s,
        acquired_at = now(),
        last_heartbeat = now(), heartbeat_interval = %(heartbeat_interval)s,
        alert_after = %(alert_after)s, stale_after = %(stale_after)s, advisory = t.took,
        slot_limit = %(limit)s"""
_RECLAIMABLE = """(now() - {j}.last_heartbeat > {j}.stale_after * interval '1 second'
        OR ({j}.advisory AND t.took))"""
_GRANTED = "j.token, j.acquired_at, j.advisory, j.backend_pid"


def _semaphore(record: bool) -> str:
    run = _RUN_STARTED if record else ""
    run_id = "(SELECT id FROM run)" if record else "NULL::bigint"
    return f"""
WITH RECURSIVE gate AS MATERIALIZED (
    SELECT {_GATE_LOCK}
), cur AS MATERIALIZED (
    SELECT s.slot::int AS slot, s.row_name, s.key, c.name IS NOT NULL AS present,
           c.token, c.holder, c.host, c.pid, c.acquired_at, c.description,
           extract(epoch FROM now() - c.last_heartbeat)::float8 AS age, c.alert_after,
           coalesce(now() - c.last_heartbeat > c.stale_after * interval '1 second', false)
               AS stale,
           coalesce(c.advisory, false) AS advisory,
           %(advisory)s AND (s.key = ANY(%(held)s::bigint[]) OR CASE
               WHEN c.advisory AND c.backend_pid = pg_backend_pid() THEN {_HELD_HERE}
               ELSE false END) AS mine
    FROM gate, unnest(%(rows)s::varchar[], %(keys)s::bigint[]) WITH ORDINALITY
        AS s(row_name, key, slot)
    LEFT JOIN {_T} c ON c.name = s.row_name
), walk (slot, took, pick) AS (
    SELECT 0, false, false
    UNION ALL
    SELECT c.slot,
           CASE WHEN %(advisory)s AND NOT c.mine AND (NOT c.present OR c.advisory OR c.stale)
                THEN pg_try_advisory_lock(c.key) ELSE false END,
           NOT c.mine AND (c.stale OR (NOT %(advisory)s AND NOT c.present))
    FROM walk w JOIN cur c ON c.slot = w.slot + 1
    WHERE NOT (w.took OR w.pick)
), chosen AS MATERIALIZED (
    -- An aggregate reads the whole walk: every step runs, and at most the last one took.
    -- No key taken and no stale slot: the first slot without a row, granted on the table
    -- path as the plain acquire grants a free name whose key it cannot take (an old
    -- holder that has not yet heard of a forced release holds it, in another process or
    -- in this one; or a grant after this snapshot does, and then its row makes the
    -- insert do nothing).
    SELECT coalesce(max(slot) FILTER (WHERE took OR pick),
                    (SELECT min(c.slot) FROM cur c WHERE NOT c.present))
               AS slot,
           bool_or(took) AS took
    FROM walk
), target AS MATERIALIZED (
    SELECT c.slot, c.row_name, c.key, c.present, ch.took FROM chosen ch JOIN cur c
    ON c.slot = ch.slot
), fresh AS (
    INSERT INTO {_T} AS j ({_COLUMNS})
    SELECT {_VALUES} FROM target t WHERE NOT t.present
    ON CONFLICT (name) DO NOTHING
    RETURNING {_GRANTED}
), taken AS (
    UPDATE {_T} AS j SET {_TAKE_OVER}
    FROM target t, (
        SELECT g.name FROM {_T} g, target t
        WHERE t.present AND g.name = t.row_name AND {_RECLAIMABLE.format(j="g")}
        FOR UPDATE OF g SKIP LOCKED
    ) AS grab
    WHERE t.present AND j.name = t.row_name AND j.name = grab.name
      AND {_RECLAIMABLE.format(j="j")}
    RETURNING {_GRANTED}
), ins AS (
    SELECT * FROM fresh UNION ALL SELECT * FROM taken
){run}, shown AS (
    -- The holder to tell of: the one taken over, or else the one longest without a beat.
    SELECT c.* FROM cur c
    WHERE c.present AND (NOT EXISTS (SELECT 1 FROM ins) OR c.slot = (SELECT slot FROM target))
    ORDER BY c.age DESC LIMIT 1
)
SELECT ins.token, ins.acquired_at, ins.advisory, ins.backend_pid,
       p.token, p.holder, p.host, p.pid, p.acquired_at, p.description,
       p.age, p.alert_after, p.stale,
       CASE WHEN ins.token IS NULL AND t.took THEN pg_advisory_unlock(t.key) END,
       {run_id}, t.slot, t.row_name, t.slot IS NOT NULL AND ins.token IS NULL AS retry
FROM (SELECT 1) AS one LEFT JOIN target t ON true LEFT JOIN ins ON true
LEFT JOIN shown p ON true
"""


SEMAPHORE = _semaphore(record=False)
SEMAPHORE_RECORDED = _semaphore(record=True)


# After a semaphore's attempt failed or was interrupted: give back the slots' keys it may
# have taken (a session-level lock outlives the rolled-back statement). Not a key a lease
# of this process holds (`held`), nor one a row says this session holds.
UNLOCK_STRAY_SLOTS = f"""
SELECT pg_advisory_unlock(s.key)
FROM unnest(%(rows)s::varchar[], %(keys)s::bigint[]) AS s(row_name, key)
WHERE NOT (s.key = ANY(%(held)s::bigint[])) AND {_HELD_HERE}
  AND NOT EXISTS (
    SELECT 1 FROM {_T} o
    WHERE o.name = s.row_name AND o.advisory AND o.backend_pid = pg_backend_pid())
"""
