"""The holder's own statements: heartbeat, release, key adoption, checks, the guard,
the orphan sweep, and the lock session's setup."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import TABLE_SQL as _T
from .names import base_name_sql, notify

__all__ = [
    "ADOPTED",
    "ADOPT_KEY",
    "CHECK",
    "DISABLE_ADVISORY",
    "END_ABANDONED",
    "GUARD",
    "HEARTBEAT",
    "PARENT_GRANT",
    "RELEASE",
    "RELEASE_GUARDED",
    "RELEASE_GUARDED_RECORDED",
    "RELEASE_RECORDED",
    "SESSION_AS_DJANGO",
    "SESSION_SETUP",
    "SWEEP_ORPHANS",
    "UNLOCK",
]

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


# Release: delete our row (scoped by token), give the advisory key back and wake the
# name's waiters (a notification delivered at commit, computed in the delete's RETURNING
# so that it is sent exactly when a row was deleted), in one statement. A lease that was
# guarded skips a row still locked by the guarded transaction (FOR UPDATE SKIP LOCKED)
# instead of waiting for it: then nothing changes,
# `present` says so, and the caller retries once that transaction has ended. Nothing
# but a guard holds our row for long, so an unguarded release deletes directly.
def _release(guarded: bool, record: bool) -> str:
    if guarded:
        target = f"""target AS MATERIALIZED (
    SELECT t.name FROM {_T} t WHERE t.name = %(name)s AND t.token = %(token)s
    FOR UPDATE SKIP LOCKED
), del AS (
    DELETE FROM {_T} AS j USING target WHERE j.name = target.name AND j.token = %(token)s
    RETURNING j.token, {notify("j.name")}
), still AS (
    SELECT 1 FROM {_T} s WHERE s.name = %(name)s AND s.token = %(token)s
)"""
        present = "EXISTS (SELECT 1 FROM still)"
        settled = "(EXISTS (SELECT 1 FROM del) OR NOT EXISTS (SELECT 1 FROM still))"
    else:
        target = f"""del AS (
    DELETE FROM {_T} WHERE name = %(name)s AND token = %(token)s
    RETURNING token, {notify("name")}
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
    # The key is given back only when no other lease of this session may hold it now.
    # An unlock is not undone when its statement fails: after an attempt that failed
    # past its unlock, this session may have taken the name again (key and row, with a new
    # token), and a retry's blind unlock would free that new holder's key, so that any
    # contender could take over at once. So: unlock when this statement deleted our row,
    # or when no row of this name says this session holds its key.
    ours = f"""(EXISTS (SELECT 1 FROM del) OR NOT EXISTS (
        SELECT 1 FROM {_T} o
        WHERE o.name = %(name)s AND o.advisory AND o.backend_pid = pg_backend_pid()))"""
    return f"""
WITH {target}{run}
SELECT EXISTS (SELECT 1 FROM del) AS deleted, {present} AS present,
       CASE WHEN %(advisory)s AND {settled} AND {ours} THEN pg_advisory_unlock(%(key)s) END
"""


RELEASE = _release(guarded=False, record=False)
RELEASE_GUARDED = _release(guarded=True, record=False)
RELEASE_RECORDED = _release(guarded=False, record=True)
RELEASE_GUARDED_RECORDED = _release(guarded=True, record=True)

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
# Their runs are finished as lost, their waiters woken; the caller gives back the keys
# this session holds.
SWEEP_ORPHANS = f"""
WITH gone AS (
    DELETE FROM {_T}
    WHERE holder = %(holder)s AND NOT (token = ANY(%(tokens)s::bigint[]))
    RETURNING name, token, advisory, backend_pid, {notify("name")}
), run AS (
    UPDATE {_RUNS} r SET finished_at = now(), outcome = 'lost',
        duration = extract(epoch FROM now() - r.started_at)::float8
    FROM gone WHERE r.name = {base_name_sql("gone.name")} AND r.token = gone.token
      AND r.finished_at IS NULL
)
SELECT name, token, advisory AND backend_pid = pg_backend_pid() FROM gone
"""

# Behind a transaction-mode pooler: stop declaring the advisory path on our rows, so
# that no contender judges them by a session that is not really ours.
DISABLE_ADVISORY = f"UPDATE {_T} SET advisory = false WHERE token = ANY(%(tokens)s::bigint[])"

# After a key adoption whose answer was lost with its session: did it commit? (A row that
# says advisory while the session that took the key has ended lets a contender in.)
ADOPTED = f"SELECT advisory FROM {_T} WHERE name = %(name)s AND token = %(token)s"

# Is the row still ours? A plain snapshot read.
CHECK = f"SELECT EXISTS (SELECT 1 FROM {_T} WHERE name = %(name)s AND token = %(token)s)"

# The grant a locked_run passed to its job (DJANGO_PGLOCK_NAME/_TOKEN), if still current:
# a plain snapshot read; the caller checks that its holder is an ancestor on this host.
# A semaphore's grant is the row of one of its slots: any row of the name with the token.
PARENT_GRANT = f"""
SELECT holder, host, pid, acquired_at, name FROM {_T}
WHERE token = %(token)s AND (name = %(name)s OR {base_name_sql("name")} = %(name)s)
"""

# Run in the caller's transaction: KEY SHARE blocks reclaims (FOR UPDATE) and deletes
# until that transaction ends, and does not block the holder's heartbeats.
GUARD = f"SELECT token FROM {_T} WHERE name = %(name)s AND token = %(token)s FOR KEY SHARE"

# Give back the hold of an advisory key after learning a lease is lost, or after an attempt
# that may have taken it failed: unless a row of the name (other than `token`'s) says this
# session holds the key, for a newer lease of this process that took the hold over.
UNLOCK = f"""
SELECT pg_advisory_unlock(%(key)s) WHERE NOT EXISTS (
    SELECT 1 FROM {_T} o
    WHERE o.name = %(name)s AND o.advisory AND o.backend_pid = pg_backend_pid()
      AND o.token IS DISTINCT FROM %(token)s::bigint)
"""

# Once per new dedicated connection: bound every statement and every lock wait, so the
# connection that carries all heartbeats is never stuck behind someone else's lock; plan
# each prepared statement once (its plan does not depend on the values); pin the
# isolation level the statements are written for (a role or database default of
# repeatable read would turn refusals into serialization errors, and an
# idle_session_timeout would end the session, and its advisory keys, between heartbeats);
# and make every commit durable: a grant, a heartbeat the holder counts its deadline
# from, and a release the caller was told about must all survive a server crash. The server's own
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

# Once per new dedicated connection, after the setup and the end of abandoned sessions
# (which needs the login role's own rights), and only when needed: what Django's backend
# applies to each of its connections, so that the lock statements run as its ORM does:
# its time zone, and OPTIONS["assume_role"] (the role that holds the table privileges).
SESSION_AS_DJANGO = """
SELECT CASE WHEN %(time_zone)s::text IS NOT NULL
            THEN set_config('TimeZone', %(time_zone)s, false) END,
       CASE WHEN %(role)s::text IS NOT NULL THEN set_config('role', %(role)s, false) END
"""

# A session given up because it did not answer (a stopped server process): end it on the
# server, so that a statement it still holds can never commit a grant nobody receives.
# Matched by start time too, so that a reused process id is never hit.
END_ABANDONED = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE pid = %(pid)s AND backend_start = %(started)s
"""
