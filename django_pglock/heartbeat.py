"""The one heartbeat thread per process.

Every lease of the process registers here. Per database alias the thread sends one
statement per interval for all of them, whatever their number; it watches each idle
lock connection's socket so that a session ended by the server is noticed at once;
it enforces each lease's local monotonic deadline and raises alerts from the holder's
own missed heartbeats; and it finishes releases that had to wait for a guarded
transaction to end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
import time
from typing import TYPE_CHECKING

from . import sql
from .connection import LockConnection, get_connection
from .exceptions import LockError

if TYPE_CHECKING:
    from .lock import Lease

__all__ = ["beat", "registry"]

logger = logging.getLogger("django_pglock")

#: How soon a failed heartbeat or a release waiting for a guarded transaction is retried.
RETRY_INTERVAL = 0.1


def beat(conn: LockConnection, leases: list[Lease]) -> None:
    """Heartbeat ``leases`` (all on ``conn``) in one statement and apply the outcome.

    Raises ``LockError`` when the statement cannot run; the leases' local deadlines then
    decide whether they are lost.
    """
    if not leases:
        return
    sent = time.monotonic()
    rows = conn.execute(
        sql.HEARTBEAT,
        {"names": [lease.name for lease in leases], "tokens": [lease.token for lease in leases]},
    )
    latency = time.monotonic() - sent
    by_token = {lease.token: lease for lease in leases}
    for token, beaten, present, backend_pid in rows:
        conn.note_backend_pid(int(backend_pid))
        lease = by_token[token]
        lease._record_latency(latency)
        if beaten:
            lease._confirm(sent)
        elif not present:
            lease._mark_lost("its row is gone or belongs to another holder", row_gone=True)


class Registry:
    """The leases of this process, and the thread that keeps them alive."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._leases: dict[str, dict[int, Lease]] = {}
        self._last_beat: dict[str, float] = {}
        self._failing: set[str] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._next_wake = 0.0

    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive from now on (its acquire counts as its first heartbeat)."""
        now = time.monotonic()
        with self._lock:
            new_alias = lease.using not in self._leases
            self._leases.setdefault(lease.using, {})[lease.token] = lease
            self._last_beat.setdefault(lease.using, now)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="django_pglock-heartbeat", daemon=True
                )
                self._thread.start()
            # Wake the thread only if it must look sooner than it planned to.
            soon = lease._pending or new_alias
            soon = soon or now + min(lease.heartbeat_interval, lease.alert_after) < self._next_wake
        if soon:
            self.wake()

    def discard(self, lease: Lease) -> None:
        """Stop heartbeating ``lease`` (the thread notices at its next wake-up)."""
        with self._lock:
            held = self._leases.get(lease.using)
            if held is not None:
                held.pop(lease.token, None)
                if not held:
                    del self._leases[lease.using]
                    self._last_beat.pop(lease.using, None)

    def leases(self, alias: str | None = None) -> list[Lease]:
        with self._lock:
            if alias is not None:
                return list(self._leases.get(alias, {}).values())
            return [lease for held in self._leases.values() for lease in held.values()]

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while os.getpid() == self.pid:
            try:
                timeout = self._tick()
            except Exception:  # pragma: no cover - a bug must not kill the heartbeat
                logger.exception("django_pglock: heartbeat iteration failed")
                timeout = RETRY_INTERVAL
            self._next_wake = time.monotonic() + timeout
            self._wait(timeout)

    def _tick(self) -> float:
        now = time.monotonic()
        wake_at = now + 60.0
        with self._lock:
            by_alias = {alias: list(held.values()) for alias, held in self._leases.items()}
        for alias, leases in by_alias.items():
            conn = get_connection(alias)
            live, watched = [], []
            for lease in leases:
                lease._check_session(conn)
                wake_at = min(wake_at, lease._watch(now))
                if lease._pending:
                    try:
                        lease._finish_release()
                    except LockError as exc:
                        logger.warning("django_pglock: releasing %r failed: %s", lease.name, exc)
                    wake_at = min(wake_at, now + RETRY_INTERVAL)
                if not lease._lost_reason and not lease._done:
                    live.append(lease)
                elif lease._lost_reason and not lease._done:
                    watched.append(lease)  # lost by its deadline: still holds its key
            if not live and not watched:
                continue
            interval = min(lease.heartbeat_interval for lease in live or watched)
            if alias in self._failing:
                interval = min(interval, max(RETRY_INTERVAL, interval / 4))
            due = self._last_beat.get(alias, 0.0) + interval
            if now >= due:
                try:
                    beat(conn, live)
                    for lease in watched:
                        lease._recheck_lost()
                    self._failing.discard(alias)
                except LockError as exc:
                    if alias not in self._failing:
                        logger.warning("django_pglock: heartbeat on %r failed: %s", alias, exc)
                    self._failing.add(alias)
                    for lease in live:
                        lease._check_session(conn)
                self._last_beat[alias] = time.monotonic()
                due = self._last_beat[alias] + interval
            wake_at = min(wake_at, due)
        return max(0.0, wake_at - time.monotonic())

    def _wait(self, timeout: float) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ, None)
            for alias in list(self._leases):
                conn = get_connection(alias)
                fd = conn.fileno()
                if fd is not None:
                    selector.register(fd, selectors.EVENT_READ, conn)
            for key, _ in selector.select(timeout):
                if key.data is None:
                    try:
                        while os.read(self._wake_r, 512):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                else:
                    conn = key.data
                    if not conn.probe_if_readable():
                        logger.warning(
                            "django_pglock: the lock connection for %r was closed by the server",
                            conn.alias,
                        )
                        for lease in self.leases(conn.alias):
                            lease._check_session(conn)
                    else:
                        # Readable because another thread's statement was in flight:
                        # give it a moment instead of spinning on the same event.
                        time.sleep(0.001)


_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    """The registry of the calling process (a fresh, empty one in a forked child)."""
    global _registry
    with _registry_lock:
        if _registry is None or _registry.pid != os.getpid():
            _registry = Registry()
        return _registry


def _forget_after_fork() -> None:
    global _registry, _registry_lock
    _registry = None
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
