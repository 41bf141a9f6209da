"""What the heartbeat thread sends for the leases of one alias: the heartbeat of all of
them in one statement, the move off the advisory path when a pooler shows up, and the
sweep for grants nobody owns after an interrupted or lost statement."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from . import sql
from .connection import LockConnection
from .events import call_metrics
from .exceptions import LockError
from .states import Key, State

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["RETRY_INTERVAL", "beat", "leave_advisory_path", "sweep_orphans"]

logger = logging.getLogger("django_pglock")

#: How soon a failed heartbeat or a release waiting for a guarded transaction is retried.
RETRY_INTERVAL = 0.1


def beat(conn: LockConnection, leases: list[Lease]) -> None:
    """Heartbeat ``leases`` (all on ``conn``) in one statement and apply the outcome.

    A lease holding its advisory key is confirmed only by a statement on the session that
    holds the key: if that session ended, the lease is lost, never confirmed on a new
    one. Raises ``LockError`` when the statement cannot run; the leases' local deadlines
    then decide whether they are lost.
    """
    for lease in leases:
        lease._check_session(conn)
    leases = [lease for lease in leases if lease.state is State.HELD]
    if not leases:
        return
    keyed = [lease for lease in leases if lease._key_state is Key.HELD]
    session = keyed[0]._generation if keyed else None
    sent = time.monotonic()
    rows = conn.execute(
        sql.HEARTBEAT,
        {"names": [lease._row for lease in leases], "tokens": [lease.token for lease in leases]},
        session=session,
    )
    latency = time.monotonic() - sent
    by_token = {lease.token: lease for lease in leases}
    if rows and conn.note_backend_pid(int(rows[0][3])):
        leave_advisory_path(conn, leases)
    # One latency per statement, to each distinct metrics hook of these leases.
    hooks = {id(hook): hook for lease in leases for hook in lease._lock._hooks() if hook}
    call_metrics(tuple(hooks.values()), "heartbeat_latency", latency)
    for token, beaten, present, _ in rows:
        lease = by_token[token]
        if beaten:
            lease._confirm(sent)
        elif not present:
            lease._mark_lost("its row is gone or belongs to another holder", row_gone=True)


def leave_advisory_path(conn: LockConnection, leases: list[Lease]) -> None:
    """A pooler was detected: no row of ours may be judged by its session any longer."""
    holding = [lease for lease in leases if lease._key_state is Key.HELD]
    if holding:
        conn.execute(sql.DISABLE_ADVISORY, {"tokens": [lease.token for lease in holding]})
        for lease in holding:
            lease._give_back_key()


def sweep_orphans(conn: LockConnection, leases: list[Lease], now: float) -> float:
    """Release rows of this process that no lease owns (``sql.SWEEP_ORPHANS``), after
    an interrupted statement; return when to look again."""
    from .identity import current
    from .lease import unreleased_tokens

    try:
        with conn.lock:  # no grant is between its statement and its lease meanwhile
            tokens = unreleased_tokens()
            params = {"holder": current().holder, "tokens": tokens}
            rows = conn.execute(sql.SWEEP_ORPHANS, params)
            # Cleared only once it ran: until then, the exit sweep knows it must run
            # (it waits for this one, holding the same lock).
            conn.orphans_possible = False
            keys = {lease._key for lease in leases}
            for name, token, keyed in rows:
                logger.warning(
                    "django_pglock: released lock %r (token %s): granted to this process "
                    "while an exception interrupted the grant, so nobody held it",
                    name,
                    token,
                )
                key = sql.advisory_key(name)
                if keyed and key not in keys:
                    unlock = {"key": key, "name": name, "token": None}
                    conn.execute(sql.UNLOCK, unlock, session=conn.generation)
    except LockError as exc:
        conn.orphans_possible = True
        logger.debug("django_pglock: sweeping orphaned grants failed: %s", exc)
        return now + RETRY_INTERVAL
    return now + 60.0
