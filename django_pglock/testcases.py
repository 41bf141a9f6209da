"""Django's ``TestCase`` and the rows the lock connection commits outside its transaction.

A ``TestCase`` (also pytest-django's ``django_db`` without ``transaction=True``) runs each
test, and each class's ``setUpTestData``, inside a transaction it rolls back; the lock
connection commits on its own, so a job's run record, schedule claim and lock row would
outlive the test and show in the next one. What a job run from the test's own thread
commits while such a transaction is open is noted here, against that transaction (the
innermost atomic block ``TestCase`` opened on the lock alias); once the block has ended,
it is removed: the run records and claims are deleted and a lease the test left held is
released (with a warning). That happens before the next query on the test's connection
(an execute wrapper, added to that connection only once something was noted), before
the next acquire or schedule claim, and before Django creates or drops a database
(:mod:`.testdb`) or the process exits.

Nothing is noted outside ``TestCase`` transactions: ``TransactionTestCase`` truncates the
tables itself, and production code never runs inside one. Jobs run by other threads or
processes commit as they always do (as the ORM does from another thread).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import connections

from . import sql
from .exceptions import LockError
from .states import State

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.transaction import Atomic

    from .lease import Lease

__all__ = ["note", "settle"]

logger = logging.getLogger("django_pglock")


@dataclass(eq=False)
class _Written:
    """What the lock connection of ``alias`` committed during one TestCase block."""

    wrapper: BaseDatabaseWrapper  # the test thread's Django connection for ``alias``
    atomic: Atomic  # the innermost block TestCase opened on it
    alias: str
    leases: list[Lease] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    claims: list[int] = field(default_factory=list)

    def ended(self) -> bool:
        return not any(block is self.atomic for block in self.wrapper.atomic_blocks)


_lock = threading.Lock()
_pending: list[_Written] = []
_at_exit = False


def note(
    alias: str,
    *,
    lease: Lease | None = None,
    run_id: int | None = None,
    claim_id: int | None = None,
) -> None:
    """Note a grant, a run record or a schedule claim just committed on ``alias``, if the
    calling thread is inside a ``TestCase`` transaction on that alias (else nothing)."""
    wrapper = connections[alias]
    if not wrapper.in_atomic_block:
        return
    atomic = next(
        (b for b in reversed(wrapper.atomic_blocks) if getattr(b, "_from_testcase", False)), None
    )
    if atomic is None:
        return
    global _at_exit
    with _lock:
        written = next((w for w in _pending if w.atomic is atomic and w.alias == alias), None)
        if written is None:
            written = _Written(wrapper, atomic, alias)
            _pending.append(written)
        if lease is not None:
            written.leases.append(lease)
        if run_id is not None:
            written.runs.append(run_id)
        if claim_id is not None:
            written.claims.append(claim_id)
        if not _at_exit:
            _at_exit = True
            atexit.register(settle, everything=True)  # a kept test database (--keepdb)
    if _settle_first not in wrapper.execute_wrappers:
        # First, so that it runs before any other wrapper, and so that the pop() that
        # ends a `with connection.execute_wrapper(...)` block removes that block's own.
        wrapper.execute_wrappers.insert(0, _settle_first)


def _settle_first(
    execute: Callable[..., Any], sql_: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """Django execute wrapper: what ended TestCase blocks left goes before any query."""
    if _pending:
        settle()
    return execute(sql_, params, many, context)


def settle(*, everything: bool = False) -> None:
    """Remove what ended ``TestCase`` blocks left (with ``everything``, what every noted
    block left). Rows a transaction still locks are tried again next time. Called
    before an acquire or a schedule claim too, holding no lock connection."""
    if not _pending:
        return
    with _lock:
        due = [written for written in _pending if everything or written.ended()]
        for written in due:
            _pending.remove(written)
    for written in due:
        left = _remove(written)
        if left is not None:
            with _lock:
                _pending.append(left)


def _remove(written: _Written) -> _Written | None:
    """Release what the test left held; delete its run records and claims. Returns what
    is left to delete (rows locked by a transaction), or ``None``."""
    from .connection import get_connection

    runs = list(written.runs)
    for lease in written.leases:
        if lease.state is State.HELD:
            logger.warning(
                "django_pglock: lock %r (token %s) was still held when the test that "
                "acquired it ended; it is released now.",
                lease.name,
                lease.token,
            )
        if lease.state in (State.HELD, State.LOST):
            try:
                lease.release()
            except LockError as exc:  # retried by the heartbeat thread
                logger.debug("django_pglock: %s", exc)
        if lease._run_id is not None:
            runs.append(lease._run_id)
    if not runs and not written.claims:
        return None
    try:
        rows = get_connection(written.alias).execute(
            sql.FORGET_TEST_ROWS, {"runs": runs, "claims": written.claims}
        )
    except LockError as exc:
        logger.warning("django_pglock: could not remove what a test's jobs recorded: %s", exc)
        return None
    runs_left, claims_left = rows[0]
    if not runs_left and not claims_left:
        return None
    return _Written(written.wrapper, written.atomic, written.alias, [], runs_left, claims_left)
