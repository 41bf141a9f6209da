"""Every statement the lock engine sends, named and parameterised.

All statements run on the dedicated autocommit connection (see :mod:`.connection`),
except :data:`GUARD`, which runs inside the caller's own transaction. Time is always
the database's ``now()``; values are always parameters. Row locks are chosen so that
a guard (``FOR KEY SHARE``) lets heartbeats (``FOR NO KEY UPDATE``) through while it
holds off reclaims (``FOR UPDATE``) and deletes.
"""

from __future__ import annotations

import hashlib

__all__ = [
    "ACQUIRE",
    "ACQUIRE_RECORDED",
    "ADOPT_KEY",
    "CHECK",
    "CLAIM_SLOT",
    "DISABLE_ADVISORY",
    "END_ABANDONED",
    "FINISH_LOST_RUN",
    "FORCE_RELEASE",
    "GUARD",
    "HEARTBEAT",
    "HEARTBEAT_AGE_EXPRESSION",
    "HOLDER",
    "NOW",
    "PRUNE_CLAIMS",
    "PRUNE_RUNS",
    "RECORD_SKIPPED",
    "RELEASE",
    "RELEASE_GUARDED",
    "RELEASE_GUARDED_RECORDED",
    "RELEASE_RECORDED",
    "SESSION_SETUP",
    "STATE_EXPRESSION",
    "STATUS",
    "SWEEP_ORPHANS",
    "UNLOCK",
    "advisory_key",
]

TABLE = "django_pglock_joblock"
SEQUENCE = "django_pglock_token_seq"


def quote_name(name: str) -> str:
    """Quote an identifier the way Django's PostgreSQL backend does."""
    return name if name.startswith('"') and name.endswith('"') else f'"{name}"'


def advisory_key(name: str) -> int:
    """The session advisory-lock key (a signed bigint) of a lock name.

    A collision between two names only ever costs speed: a contender that cannot take
    the key treats the holder as alive and waits for ``stale_after``.
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"django_pglock").digest()
    return int.from_bytes(digest, "big", signed=True)


_T = quote_name(TABLE)
_RUNS = quote_name("django_pglock_jobrun")

# Reclaimable: no heartbeat for the row's own stale_after by the database clock; or the
# holder declared the advisory path and its key was free for us to take (`key`, below):
# a holder always holds its key while its session lives, so a free key means that
# session has ended. A key held by anyone else only ever costs speed.
_RECLAIMABLE = """(
    now() - {j}.last_heartbeat > {j}.stale_after * interval '1 second'
    OR ({j}.advisory AND (SELECT held FROM key))
)"""

# Does this session hold the key already? Advisory locks nest, so a session's own try
# would succeed again: the key is tried only when it does not. Only a row carrying this
# session's backend pid can be this session's own (another thread of this process holds
# the name), or an ended session's that had the same server process (a session-mode
# pooler hands the backend to the next client after DISCARD ALL); only then is pg_locks,
# which is not cheap, looked at.
_MINE = """CASE WHEN %(advisory)s AND EXISTS (SELECT 1 FROM cur WHERE cur.here) THEN EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.objsubid = 1 AND l.classid = ((%(key)s::bigint >> 32) & 4294967295)::oid
          AND l.objid = (%(key)s::bigint & 4294967295)::oid)
    ELSE false END"""


# Acquire in one statement. `cur` reads the current row from the snapshot (no lock);
# `key` tries the advisory key (session-level) once, unless this session holds it
# already (`prior`: then a live lease of this process owns the row). A free name is inserted with ON
# CONFLICT DO NOTHING (`fresh`): a holder who got there first wins, and the refusal
# neither locks the winner's row nor writes anything. A reclaimable row is first locked
# FOR UPDATE SKIP LOCKED (`grab`: a guarded row is skipped, never waited for), and only
# looked for when the snapshot row looked reclaimable (a one-time gate, so a refusal by a
# live holder reads the row once, from the snapshot); then it is taken over by an UPDATE
# .. WHERE <reclaimable> (`taken`), re-checked on the latest row version. A refused
# attempt gives the key back in the same statement: every outcome is one round trip.
# A refusal writes nothing, so its commit does not wait for the WAL (see SESSION_SETUP).
_COLUMNS = """name, token, holder, host, pid, backend_pid, description, acquired_at,
        last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory"""
_VALUES = f"""%(name)s, nextval('{SEQUENCE}'), %(holder)s, %(host)s, %(pid)s, pg_backend_pid(),
           %(description)s, now(),
           now(), %(heartbeat_interval)s, %(alert_after)s, %(stale_after)s, key.held"""
_TAKE_OVER = f"""token = nextval('{SEQUENCE}'), holder = %(holder)s, host = %(host)s,
        pid = %(pid)s, backend_pid = pg_backend_pid(), description = %(description)s,
        acquired_at = now(),
        last_heartbeat = now(), heartbeat_interval = %(heartbeat_interval)s,
        alert_after = %(alert_after)s, stale_after = %(stale_after)s, advisory = key.held"""
_GRANTED = "j.token, j.acquired_at, j.advisory, j.backend_pid"
# The one-time gate of the reclaim: did the snapshot row look reclaimable? In both the
# locking scan and the update, so that neither even looks at the row when it did not.
_GATE = "(SELECT c.stale OR (c.advisory AND k.held) FROM cur c, key k)"


def _acquire(record: bool) -> str:
    run = _RUN_STARTED if record else ""
    run_id = "(SELECT id FROM run)" if record else "NULL::bigint"
    return f"""
WITH cur AS (
    SELECT c.token, c.holder, c.host, c.pid, c.acquired_at, c.description,
           extract(epoch FROM now() - c.last_heartbeat)::float8 AS age, c.alert_after,
           now() - c.last_heartbeat > c.stale_after * interval '1 second' AS stale,
           c.advisory AND c.backend_pid = pg_backend_pid() AS here, c.advisory
    FROM {_T} c WHERE c.name = %(name)s
), prior AS MATERIALIZED (
    SELECT {_MINE} AS mine
), key AS MATERIALIZED (
    SELECT CASE WHEN %(advisory)s AND NOT prior.mine THEN pg_try_advisory_lock(%(key)s)
                ELSE false END AS held
    FROM prior
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
       CASE WHEN ins.token IS NULL AND key.held THEN pg_advisory_unlock(%(key)s) END,
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

# Heartbeat every lease of this process on one alias in one statement, scoped by
# (name, token). Rows locked by someone else right now (a reclaim or delete in flight)
# are skipped, not waited for; the caller tells them apart from vanished rows by
# `present`, which reads the snapshot taken before the update.
HEARTBEAT = f"""
WITH mine AS (
    SELECT m.name, m.token FROM unnest(%(names)s::varchar[], %(tokens)s::bigint[]) AS m(name, token)
), locked AS (
    SELECT h.name FROM {_T} h JOIN mine ON h.name = mine.name AND h.token = mine.token
    FOR NO KEY UPDATE OF h SKIP LOCKED
), beat AS (
    UPDATE {_T} AS j SET last_heartbeat = now()
    FROM locked WHERE j.name = locked.name
    RETURNING j.token
)
SELECT mine.token, beat.token IS NOT NULL AS beaten, s.token IS NOT NULL AS present,
       pg_backend_pid()
FROM mine
LEFT JOIN beat ON beat.token = mine.token
LEFT JOIN {_T} s ON s.name = mine.name AND s.token = mine.token
"""


# Release: delete our row (scoped by token) and give the advisory key back, in one
# statement. A lease that was guarded skips a row still locked by the guarded
# transaction (FOR UPDATE SKIP LOCKED) instead of waiting for it: then nothing changes,
# `present` says so, and the caller retries once that transaction has ended. Nothing
# but a guard holds our row for long, so an unguarded release deletes directly.
def _release(guarded: bool, record: bool) -> str:
    if guarded:
        target = f"""target AS MATERIALIZED (
    SELECT t.name FROM {_T} t WHERE t.name = %(name)s AND t.token = %(token)s
    FOR UPDATE SKIP LOCKED
), del AS (
    DELETE FROM {_T} AS j USING target WHERE j.name = target.name AND j.token = %(token)s
    RETURNING j.token
), still AS (
    SELECT 1 FROM {_T} s WHERE s.name = %(name)s AND s.token = %(token)s
)"""
        present = "EXISTS (SELECT 1 FROM still)"
        settled = "(EXISTS (SELECT 1 FROM del) OR NOT EXISTS (SELECT 1 FROM still))"
    else:
        target = f"""del AS (
    DELETE FROM {_T} WHERE name = %(name)s AND token = %(token)s RETURNING token
)"""
        present, settled = "false", "true"
    # With run history: finish the JobRun row once the release is settled. A run whose
    # row was already gone was lost, whatever its body did; a run already finished (by
    # an earlier attempt whose answer never arrived) is left as it is.
    run = (
        f""", run AS (
    UPDATE {_RUNS} SET finished_at = now(),
        duration = extract(epoch FROM now() - started_at)::float8,
        outcome = CASE WHEN EXISTS (SELECT 1 FROM del) THEN %(outcome)s ELSE 'lost' END,
        exit_code = %(exit_code)s
    WHERE id = %(run_id)s AND finished_at IS NULL AND {settled}
)"""
        if record
        else ""
    )
    return f"""
WITH {target}{run}
SELECT EXISTS (SELECT 1 FROM del) AS deleted, {present} AS present,
       CASE WHEN %(advisory)s AND {settled} THEN pg_advisory_unlock(%(key)s) END
"""


RELEASE = _release(guarded=False, record=False)
RELEASE_GUARDED = _release(guarded=True, record=False)
RELEASE_RECORDED = _release(guarded=False, record=True)
RELEASE_GUARDED_RECORDED = _release(guarded=True, record=True)

# A skipped run of a recorded job: one finished row.
RECORD_SKIPPED = f"""
INSERT INTO {_RUNS} (name, holder, host, pid, description, started_at, finished_at, duration,
                     outcome)
VALUES (%(name)s, %(holder)s, %(host)s, %(pid)s, %(description)s, now(), now(), 0, 'skipped')
"""

# Pruning: run history and schedule claims older than the cutoff (database clock).
PRUNE_RUNS = f"""
DELETE FROM {_RUNS} r
WHERE coalesce(r.finished_at, r.started_at) < now() - %(age)s * interval '1 second'
  AND NOT (r.finished_at IS NULL
           AND EXISTS (SELECT 1 FROM {_T} j WHERE j.name = r.name AND j.token = r.token))
RETURNING 1
"""

# The run of a holder that lost its grant to a takeover or a forced release (it may be
# dead and never finish its own run): finished, as lost.
FINISH_LOST_RUN = f"""
UPDATE {_RUNS} SET finished_at = now(), outcome = 'lost',
    duration = extract(epoch FROM now() - started_at)::float8
WHERE name = %(name)s AND token = %(token)s AND finished_at IS NULL
"""
PRUNE_CLAIMS = f"""
DELETE FROM {quote_name("django_pglock_scheduleclaim")}
WHERE claimed_at < now() - %(age)s * interval '1 second'
RETURNING 1
"""

# A lease granted while its advisory key was busy (a concurrent contender held it for
# the length of its own statement) takes the key afterwards: when it gets it, the row
# declares the advisory path, so a crash of the holder frees the name at once again. A
# row locked right now (a reclaim in flight) is skipped; the key is then given back.
ADOPT_KEY = f"""
WITH got AS MATERIALIZED (
    SELECT pg_try_advisory_lock(%(key)s) AS held
), target AS MATERIALIZED (
    SELECT t.name FROM {_T} t
    WHERE t.name = %(name)s AND t.token = %(token)s AND (SELECT held FROM got)
    FOR NO KEY UPDATE SKIP LOCKED
), marked AS (
    UPDATE {_T} AS j SET advisory = true, backend_pid = pg_backend_pid()
    FROM target WHERE j.name = target.name AND j.token = %(token)s
    RETURNING j.token
)
SELECT EXISTS (SELECT 1 FROM marked),
       CASE WHEN got.held AND NOT EXISTS (SELECT 1 FROM marked)
            THEN pg_advisory_unlock(%(key)s) END
FROM got
"""

# Rows of this process (its holder id) that no lease of it owns: grants whose caller never
# heard of them (an exception raised by a signal handler between the server and the
# registry). Run only after such an interruption, by the heartbeat thread, holding the
# connection so that no grant is between its statement and its registration meanwhile.
# Their runs are finished as lost; the caller gives back the keys this session holds.
SWEEP_ORPHANS = f"""
WITH gone AS (
    DELETE FROM {_T}
    WHERE holder = %(holder)s AND NOT (token = ANY(%(tokens)s::bigint[]))
    RETURNING name, token, advisory, backend_pid
), run AS (
    UPDATE {_RUNS} r SET finished_at = now(), outcome = 'lost',
        duration = extract(epoch FROM now() - r.started_at)::float8
    FROM gone WHERE r.name = gone.name AND r.token = gone.token AND r.finished_at IS NULL
)
SELECT name, token, advisory AND backend_pid = pg_backend_pid() FROM gone
"""

# Behind a transaction-mode pooler: stop declaring the advisory path on our rows, so
# that no contender judges them by a session that is not really ours.
DISABLE_ADVISORY = f"UPDATE {_T} SET advisory = false WHERE token = ANY(%(tokens)s::bigint[])"

# Who holds a name now (after a refusal whose snapshot predates the holder's commit).
HOLDER = f"""
SELECT token, holder, host, pid, acquired_at, description,
       extract(epoch FROM now() - last_heartbeat)::float8, alert_after
FROM {_T} WHERE name = %(name)s
"""

# Is the row still ours? A plain snapshot read.
CHECK = f"SELECT EXISTS (SELECT 1 FROM {_T} WHERE name = %(name)s AND token = %(token)s)"

# Run in the caller's transaction: KEY SHARE blocks reclaims (FOR UPDATE) and deletes
# until that transaction ends, and does not block the holder's heartbeats.
GUARD = f"SELECT token FROM {_T} WHERE name = %(name)s AND token = %(token)s FOR KEY SHARE"

# Give back one hold of an advisory key after learning a lease is lost.
UNLOCK = "SELECT pg_advisory_unlock(%(key)s)"

# Forced release: delete the row, optionally only if it still carries the given token.
# Waits for any guarded transaction, so fenced writes commit before the row goes.
FORCE_RELEASE = f"""
WITH released AS (
    DELETE FROM {_T}
    WHERE name = %(name)s AND (%(token)s::bigint IS NULL OR token = %(token)s::bigint)
    RETURNING name, token, holder, host, pid, acquired_at
), run AS (
    UPDATE {_RUNS} r SET finished_at = now(), outcome = 'lost',
        duration = extract(epoch FROM now() - r.started_at)::float8
    FROM released WHERE r.name = released.name AND r.token = released.token
      AND r.finished_at IS NULL
)
SELECT name, token, holder, host, pid, acquired_at FROM released
"""

# A lock's state, judged by the database clock against the row's own thresholds; shared
# by STATUS (pglock_status) and the admin's annotations.
STATE_EXPRESSION = """CASE
    WHEN now() - last_heartbeat > stale_after * interval '1 second' THEN 'stale'
    WHEN now() - last_heartbeat > alert_after * interval '1 second' THEN 'alert'
    ELSE 'ok' END"""
HEARTBEAT_AGE_EXPRESSION = "extract(epoch FROM now() - last_heartbeat)::float8"

# Status of every lock.
STATUS = f"""
SELECT name, token, holder, host, pid, acquired_at, last_heartbeat,
       {HEARTBEAT_AGE_EXPRESSION} AS heartbeat_age,
       heartbeat_interval, alert_after, stale_after, advisory, description,
       {STATE_EXPRESSION} AS state
FROM {_T}
ORDER BY acquired_at DESC, name
"""

# Once per new dedicated connection: bound every statement and every lock wait, so the
# connection that carries all heartbeats is never stuck behind someone else's lock; plan
# each prepared statement once (its plan does not depend on the values); pin the
# isolation level the statements are written for (a role or database default of
# repeatable read would turn refusals into serialization errors, and an
# idle_session_timeout would end the session, and its advisory keys, between heartbeats);
# and make every commit
# durable: a grant, a heartbeat the holder counts its deadline from, and a release the
# caller was told about must all survive a server crash. The server's own
# synchronous_commit is kept (with a synchronous standby, commits wait for it too),
# except that 'off' becomes 'local'.
SESSION_SETUP = """
SELECT set_config('synchronous_commit',
                  CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local'
                       ELSE current_setting('synchronous_commit') END, false),
       set_config('statement_timeout', %(statement_timeout)s, false),
       set_config('lock_timeout', %(lock_timeout)s, false),
       set_config('plan_cache_mode', 'force_generic_plan', false),
       set_config('default_transaction_isolation', 'read committed', false),
       pg_backend_pid(),
       (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()),
       set_config('idle_session_timeout', '0', false)
"""

# A session given up because it did not answer (a stopped server process): end it on the
# server, so that a statement it still holds can never commit a grant nobody receives.
# Matched by start time too, so that a reused process id is never hit.
END_ABANDONED = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE pid = %(pid)s AND backend_start = %(started)s
"""

# Claim one schedule slot: the first host to insert (name, slot) starts the job; the
# unique constraint decides. Claims of that job older than a week are pruned on the way.
CLAIM_SLOT = f"""
WITH pruned AS (
    DELETE FROM {quote_name("django_pglock_scheduleclaim")}
    WHERE name = %(name)s AND slot < %(slot)s - interval '7 days'
)
INSERT INTO {quote_name("django_pglock_scheduleclaim")} (name, slot, holder, claimed_at)
VALUES (%(name)s, %(slot)s, %(holder)s, now())
ON CONFLICT (name, slot) DO NOTHING
RETURNING id
"""

# The database clock, for computing schedule slots.
NOW = "SELECT now()"
