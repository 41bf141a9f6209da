"""One acquire statement and what follows from its outcome (the core of ``Lock``).

A grant becomes a registered :class:`~django_pglock.lease.Lease`; a refusal sends the
contention signals. A grant that its caller will never receive (the statement or what
follows it was interrupted by a signal handler's exception) is handed to the heartbeat
thread to be released, and an advisory key a failed statement took is given back.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from . import beats, heartbeat, signals, sql, testcases
from .connection import LockConnection, get_connection
from .events import call_metrics, send
from .exceptions import DatabaseUnavailable, LockError
from .identity import current
from .keys import key_shared, keys_held
from .lease import Lease
from .states import Key

if TYPE_CHECKING:
    from .options import Resolved

__all__ = ["AttemptMixin"]


class AttemptMixin:
    """The attempt half of :class:`~django_pglock.lock.Lock`."""

    name: str
    limit: int
    record: bool
    _cached_params: tuple[tuple[Any, ...], dict[str, Any]] | None

    def _resolved(self) -> Resolved:  # pragma: no cover - defined by Lock
        raise NotImplementedError

    def _description(self) -> str:  # pragma: no cover - defined by Lock
        raise NotImplementedError

    def _hooks(self) -> tuple[Any, ...]:  # pragma: no cover - defined by Lock
        raise NotImplementedError

    def _params(self, resolved: Resolved, conn: LockConnection, advisory: bool) -> dict[str, Any]:
        """The acquire statement's parameters: the same for every attempt until the
        settings, the session, the process or the description change."""
        identity = current()
        description = self._description()
        key = (resolved, advisory, identity, description)
        cached = self._cached_params
        if cached is not None and cached[0] == key:
            return cached[1]
        thresholds = resolved.thresholds
        params = {
            "name": self.name,
            "holder": identity.holder,
            "host": identity.host,
            "pid": identity.pid,
            "description": description,
            "heartbeat_interval": thresholds.heartbeat_interval,
            "alert_after": thresholds.alert_after,
            "stale_after": thresholds.stale_after,
            "advisory": advisory,
            "key": resolved.key,
        }
        if self.limit > 1:  # a semaphore: its slots' rows and keys (sql.semaphore)
            rows = [sql.slot_row(self.name, slot) for slot in range(1, self.limit + 1)]
            params.update(rows=rows, keys=[sql.advisory_key(row) for row in rows])
            params["limit"] = self.limit
        self._cached_params = (key, params)
        return params

    def _attempt(
        self,
        *,
        first: bool = True,
        want_holder: bool = True,
        sync: bool = False,
        deadline: float | None = None,
    ) -> tuple[Lease | None, dict[str, Any] | None]:
        """One acquire statement: ``(lease, previous holder)`` or ``(None, current holder)``.

        With ``want_holder=False`` the current holder of a refused attempt is only
        described when a signal receiver or an alert needs it. ``deadline``
        (``time.monotonic()``, a blocking acquire's bound): waiting for the connection,
        opening a session and each statement end by then, with ``DatabaseUnavailable``;
        a statement cut off gives its session up, as one with no answer does.
        """
        resolved = self._resolved()
        testcases.settle()  # what ended TestCase transactions left goes first
        conn = get_connection(resolved.alias)
        if resolved.advisory:
            conn.ensure_open(deadline)  # a pooler is looked for when the session opens
        use_advisory = resolved.advisory and not conn.pooled
        params = self._params(resolved, conn, use_advisory)
        sent = time.monotonic()

        def failed(rows: list[tuple[Any, ...]], alive: bool) -> None:
            # The statement failed or was interrupted (a signal handler raised). If it
            # granted anyway, nobody will use the grant: release it from the heartbeat
            # thread. Otherwise a key it took outlives it: give that back.
            if rows and rows[0][0] is not None:
                self._lease(rows[0], conn, resolved, params, sent, use_advisory)._abandon()
            elif alive and use_advisory:
                self._drop_stray_key(conn, resolved.key, params)

        semaphore = self.limit > 1
        if semaphore:
            statement = sql.SEMAPHORE_RECORDED if self.record else sql.SEMAPHORE
        else:
            statement = sql.ACQUIRE_RECORDED if self.record else sql.ACQUIRE
        lease = None
        # The grant is registered before the connection is let go, so the heartbeat
        # thread's sweep for orphaned rows never takes a grant being handed over.
        if not conn.lock.acquire(timeout=_left(deadline)):
            raise DatabaseUnavailable(
                f"The lock connection for database alias {conn.alias!r} stayed busy with "
                "another thread's statement until this acquire's timeout."
            )
        try:
            try:
                # A lease of this process may hold the key already (its row deleted by a
                # forced release it has not noticed): then the statement looks, and never
                # takes the key twice.
                if semaphore:
                    # The slots whose keys leases of this process hold are skipped.
                    held = sorted(keys_held(conn)) if use_advisory else []
                    sent_params = {**params, "held": held}
                else:
                    kept = use_advisory and key_shared(conn, resolved.key)
                    sent_params = {**params, "maybe_held": kept}
                rows = conn.execute(statement, sent_params, after_failure=failed, deadline=deadline)
                if semaphore and rows[0][0] is None and rows[0][17]:
                    # The slot chosen from the snapshot was granted meanwhile (see
                    # sql.semaphore): once more, with a new snapshot.
                    rows = conn.execute(
                        statement, sent_params, after_failure=failed, deadline=deadline
                    )
                if rows[0][0] is not None:
                    lease = self._lease(rows[0], conn, resolved, params, sent, use_advisory)
            finally:
                conn.lock.release()
            if lease is None:
                return None, self._refused(rows[0], first, want_holder)
            return lease, self._took(lease, rows[0], conn, deadline)
        except BaseException:
            if lease is not None:
                lease._abandon()
            else:  # a grant may have been lost between the server and here
                conn.orphans_possible = True
                heartbeat.registry().sweep_soon(conn.alias)
            raise

    def _drop_stray_key(self, conn: LockConnection, key: int, params: dict[str, Any]) -> None:
        """A failed or interrupted attempt may have taken the key before it ended (a
        session-level lock outlives the rolled-back statement): give it back, unless a
        lease of this process holds it on this session (then the attempt never took it).
        A semaphore's attempt may have taken any of its slots' keys. Runs while the
        statement's caller still holds the connection."""
        if not conn.is_open():
            return  # the keys went with the session
        with contextlib.suppress(LockError):
            if self.limit > 1:
                unlock = {"rows": params["rows"], "keys": params["keys"]}
                unlock["held"] = sorted(keys_held(conn))
                conn.execute(sql.UNLOCK_STRAY_SLOTS, unlock, session=conn.generation)
            elif not key_shared(conn, key):  # else a lease of this process holds it
                unlock = {"key": key, "name": self.name, "token": None}
                conn.execute(sql.UNLOCK, unlock, session=conn.generation)

    def _lease(
        self,
        row: tuple[Any, ...],
        conn: LockConnection,
        resolved: Resolved,
        params: dict[str, Any],
        sent: float,
        use_advisory: bool,
    ) -> Lease:
        token, acquired_at, advisory = row[0], row[1], bool(row[2])
        slot, row_name, key = 1, self.name, resolved.key
        if self.limit > 1:
            slot, row_name = int(row[15]), row[16]
            key = params["keys"][slot - 1]
        lease = Lease(
            self,  # type: ignore[arg-type]
            conn,
            token,
            acquired_at,
            advisory,
            sent,
            resolved.thresholds,
            row[14],
            holder=params["holder"],
            key=key,
            slot=slot,
            row=row_name,
        )
        if use_advisory and not advisory:
            # The key was busy (a concurrent contender's statement held it): take it later.
            lease._set_key(Key.WANTED)
        heartbeat.registry().add(lease)
        testcases.note(conn.alias, lease=lease)  # inside a TestCase: undone when it ends
        return lease

    def _refused(
        self, row: tuple[Any, ...], first: bool, want_holder: bool
    ) -> dict[str, Any] | None:
        """A refused attempt: signals and alerts; the current holder, when wanted."""
        wanted = want_holder or (first and bool(signals.lock_contended.receivers))
        previous, alerting = self._previous(row, wanted)
        if first:
            send(signals.lock_contended, self, name=self.name, holder=previous)
            hooks = self._hooks()
            if hooks:
                call_metrics(hooks, "contended", self.name)
        if alerting:
            send(
                signals.lock_alert,
                self,
                name=self.name,
                holder=previous,
                heartbeat_age=row[10],
                lease=None,
            )
            call_metrics(self._hooks(), "alert", self.name, row[10])
        return previous

    def _previous(self, row: tuple[Any, ...], wanted: bool) -> tuple[dict[str, Any] | None, bool]:
        """The holder an attempt saw (``None`` if none, or if nobody needs it described)
        and whether it was in alert."""
        prev_token, prev_age, prev_alert_after = row[4], row[10], row[11]
        alerting = prev_token is not None and prev_age > prev_alert_after
        if prev_token is None:
            return None, False
        if not (wanted or row[0] is not None or alerting):
            return None, alerting
        fields = ("token", "holder", "host", "pid", "acquired_at", "description", "heartbeat_age")
        return dict(zip(fields, row[4:11], strict=True)), alerting

    def _took(
        self, lease: Lease, row: tuple[Any, ...], conn: LockConnection, deadline: float | None
    ) -> dict[str, Any] | None:
        """After a grant: leave the advisory path if a pooler showed itself, and finish
        a reclaimed holder's run. Returns the previous holder, if the grant took over."""
        if conn.note_backend_pid(int(row[3])):
            # Every lease of this process on the alias leaves the advisory path at once.
            beats.leave_advisory_path(conn, heartbeat.registry().leases(conn.alias))
        elif lease.advisory and conn.pooled:
            beats.leave_advisory_path(conn, [lease])
        previous, _ = self._previous(row, True)
        if previous is not None:
            # The previous holder may be dead: finish its run, if it recorded one.
            finish = {"name": self.name, "token": previous["token"]}
            conn.execute(sql.FINISH_LOST_RUN, finish, deadline=deadline)
            reason = "stale" if row[12] else "abandoned"
            send(signals.lock_reclaimed, self, lease=lease, previous=previous, reason=reason)
            call_metrics(self._hooks(), "stale_reclaimed", self.name)
        return previous


def _left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (``-1``, no limit, for ``None``), as ``Lock.acquire``
    takes them."""
    return -1 if deadline is None else max(0.0, deadline - time.monotonic())
