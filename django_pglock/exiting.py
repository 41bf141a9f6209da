"""At interpreter exit: release what the process still holds, retrying failed releases
for a few seconds (the heartbeat thread that would retry them dies with the process)."""

from __future__ import annotations

import atexit
import contextlib
import time

from .beats import RETRY_INTERVAL, sweep_orphans
from .connection import get_connection
from .exceptions import ConnectionBusy
from .heartbeat import Registry, current_registry
from .states import State

__all__ = ["EXIT_BUSY_WAIT", "EXIT_RETRIES", "EXIT_WAIT", "register", "release_all_at_exit"]

#: How long a release at interpreter exit waits for a busy lock connection at most, and
#: how long failed releases are retried at exit before the process gives up on them.
EXIT_WAIT = 1.0
EXIT_RETRIES = 5.0
EXIT_BUSY_WAIT = 0.2


def release_all_at_exit() -> None:
    """At interpreter exit, release what this process still holds.

    A lease that was never released would otherwise keep its name until its session
    ends (advisory path) or until ``stale_after`` (table path).
    """
    held = current_registry()
    if held is None:
        return
    leases = held.leases()
    for lease in leases:
        with contextlib.suppress(Exception):
            lease._release(EXIT_WAIT)  # a stuck connection must not keep the process
    # Releases that failed (now or before) get their retries here: the heartbeat thread
    # that would retry them dies with the process, and on the table path a row left
    # behind would block its name until stale_after.
    # A connection that stays busy is stuck (a statement on an unresponsive server): its
    # releases are given up at once, so that the process exits.
    deadline = time.monotonic() + EXIT_RETRIES
    pending = [lease for lease in leases if lease.state is State.RELEASING]
    busy: set[int] = set()
    while pending and time.monotonic() < deadline:
        for lease in pending:
            try:
                lease._finish_release(EXIT_BUSY_WAIT)
            except ConnectionBusy:
                busy.add(id(lease))
            except Exception:
                continue
        pending = [
            lease for lease in pending if lease.state is State.RELEASING and id(lease) not in busy
        ]
        if pending:
            time.sleep(RETRY_INTERVAL)
    _sweep_before_exit(held, deadline)
    held.closing = True  # servers stopping at exit are no news


def _sweep_before_exit(held: Registry, deadline: float) -> None:
    """A grant whose answer never arrived (a lost connection, no answer) is swept by the
    heartbeat thread, which dies with the process: sweep here, within the exit budget,
    or on the table path the grant would block its name until ``stale_after``."""
    for alias in held.aliases():
        conn = get_connection(alias)
        while conn.orphans_possible and time.monotonic() < deadline:
            if not conn.lock.acquire(timeout=EXIT_BUSY_WAIT):
                continue  # the heartbeat thread's own sweep, or a stuck statement
            try:
                if not conn.orphans_possible:  # the heartbeat thread's sweep finished it
                    break
                sweep_orphans(conn, held.leases(alias), time.monotonic())
            finally:
                conn.lock.release()
            if conn.orphans_possible:
                time.sleep(RETRY_INTERVAL)


_registered = False


def register() -> None:
    """Have :func:`release_all_at_exit` run at interpreter exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(release_all_at_exit)
        _registered = True
