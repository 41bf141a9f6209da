"""The one heartbeat thread per process (and its I/O-free watchdog).

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
import select
import selectors
import threading
import time
from typing import TYPE_CHECKING

from .beats import RETRY_INTERVAL, beat, sweep_orphans
from .connection import LockConnection, get_connection, on_session_end
from .exceptions import LockError
from .states import Key, State

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["RETRY_INTERVAL", "Registry", "current_registry", "registry"]

logger = logging.getLogger("django_pglock")


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
        # Deadlines and alerts are also watched by a thread that does no I/O, so a
        # heartbeat stuck on an unresponsive server cannot delay lock_lost.
        self._watchdog: threading.Thread | None = None
        self._watchdog_wake = threading.Event()
        self._watchdog_next = 0.0  # when the watchdog looks next; 0.0 while it looks
        self._next_wake = 0.0
        self.closing = False  # the interpreter is exiting
        self._idle_wait = 10.0  # how long to sleep with no lease: the last lease's pace
        self._watched: set[tuple[str, int]] = set()  # sessions whose sockets are watched

    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive from now on (its acquire counts as its first heartbeat)."""
        now = time.monotonic()
        with self._lock:
            held = self._leases.setdefault(lease.using, {})
            if not held:
                self._last_beat[lease.using] = now
            held[lease.token] = lease
            self._idle_wait = min(lease.heartbeat_interval, lease.alert_after)
            releasing = lease.state is State.RELEASING
            self._ensure_threads()
            # Wake the watchdog only if this lease needs it sooner than it planned to.
            first_due = min(lease._deadline, lease._confirmed_at + lease.alert_after)
            planned = self._watchdog_next
            if not planned or first_due < planned:
                self._watchdog_wake.set()
            # Wake the thread only if it must look sooner than it planned to, or must
            # start watching this connection's socket.
            conn = lease._conn
            watched = (conn.alias, conn.generation) in self._watched
            soon = releasing or lease._key_state is Key.WANTED or not watched
            soon = soon or now + self._idle_wait < self._next_wake
        if soon:
            self.wake()

    def _ensure_threads(self) -> None:
        """Start the heartbeat thread and its watchdog (caller holds ``_lock``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="django_pglock-heartbeat", daemon=True
            )
            self._thread.start()
            self._watchdog = threading.Thread(
                target=self._run_watchdog, name="django_pglock-watchdog", daemon=True
            )
            self._watchdog.start()

    def sweep_soon(self, alias: str) -> None:
        """An interrupted statement on ``alias`` may have left a grant nobody owns: have
        the heartbeat thread look for it now (see ``_sweep``)."""
        with self._lock:
            self._leases.setdefault(alias, {})
            self._ensure_threads()
        self.wake()

    def discard(self, lease: Lease) -> None:
        """Stop heartbeating ``lease`` (the thread notices at its next wake-up)."""
        with self._lock:
            self._leases.get(lease.using, {}).pop(lease.token, None)

    def aliases(self) -> list[str]:
        """The database aliases this process has held (or swept) leases on."""
        with self._lock:
            return list(self._leases)

    def leases(self, alias: str | None = None) -> list[Lease]:
        with self._lock:
            if alias is not None:
                return list(self._leases.get(alias, {}).values())
            return [lease for held in self._leases.values() for lease in held.values()]

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while os.getpid() == self.pid:  # pragma: no branch - a forked child has no such thread
            try:
                timeout = self._tick()
            except Exception:  # pragma: no cover - a bug must not kill the heartbeat
                logger.exception("django_pglock: heartbeat iteration failed")
                timeout = RETRY_INTERVAL
            self._next_wake = time.monotonic() + timeout
            try:
                self._wait(timeout)
            except Exception:  # pragma: no cover - a bug must not kill the heartbeat
                logger.exception("django_pglock: heartbeat wait failed")
                time.sleep(RETRY_INTERVAL)

    def _run_watchdog(self) -> None:
        while os.getpid() == self.pid:  # pragma: no branch - a forked child has no such thread
            self._watchdog_next = 0.0  # a lease added meanwhile wakes us again
            now = time.monotonic()
            wake_at = now + 1.0
            for lease in self.leases():
                wake_at = min(wake_at, lease._watch(now))
            self._watchdog_next = wake_at
            self._watchdog_wake.wait(max(0.01, wake_at - time.monotonic()))
            self._watchdog_wake.clear()

    def _tick(self) -> float:
        now = time.monotonic()
        wake_at = now + self._idle_wait
        with self._lock:
            by_alias = {alias: list(held.values()) for alias, held in self._leases.items()}
        for alias, leases in by_alias.items():
            conn = get_connection(alias)
            live, watched = [], []
            for lease in leases:
                lease._check_session(conn)
                wake_at = min(wake_at, lease._watch(now))
                state = lease.state
                if state is State.RELEASING:
                    wake_at = min(wake_at, lease._retry_release(now))
                    continue
                if lease._key_state is Key.WANTED:
                    if now >= lease._key_retry_at:
                        try:
                            lease._adopt_key(conn, now)
                        except LockError as exc:
                            logger.debug(
                                "django_pglock: taking %r's key failed: %s", lease.name, exc
                            )
                            lease._key_retry_at = now + RETRY_INTERVAL
                    wake_at = min(wake_at, lease._key_retry_at)
                if state is State.HELD:
                    live.append(lease)
                elif state is State.LOST:
                    watched.append(lease)  # lost by its deadline: still holds its key
            if conn.orphans_possible:
                wake_at = min(wake_at, sweep_orphans(conn, self.leases(conn.alias), now))
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
                self._last_beat[alias] = now  # keep the cadence: count from the start
                due = now + interval
            wake_at = min(wake_at, due)
        return max(0.0, wake_at - time.monotonic())

    def session_ended(self, conn: LockConnection, generation: int) -> None:
        """A lock session ended: the leases whose key it held learn at once."""
        for lease in self.leases(conn.alias):
            lease._session_closed(generation)

    def _wait(self, timeout: float) -> None:
        """Sleep until ``timeout``, a wake-up, or the server closing a lock connection."""
        conns = {}
        for alias, held in list(self._leases.items()):
            conn = get_connection(alias)
            fd = conn.fileno()
            if fd is not None and held:
                conns[fd] = conn
        self._watched = {(conn.alias, conn.generation) for conn in conns.values()}
        for conn in _hung_up(self._wake_r, conns, timeout):
            if not conn.probe() and not self.closing:
                logger.warning(
                    "django_pglock: the lock connection for %r was closed by the server",
                    conn.alias,
                )
        try:
            while os.read(self._wake_r, 512):  # pragma: no branch - its write end stays open
                pass
        except (BlockingIOError, OSError):
            pass


def _hung_up(
    wake_fd: int, conns: dict[int, LockConnection], timeout: float
) -> list[LockConnection]:
    """Wait on the wake-up pipe and the lock sockets; return connections the peer closed.

    On Linux, epoll's EPOLLRDHUP reports only the server closing the session, not the
    replies to statements other threads are running, so the wait is not disturbed by
    ordinary traffic. Elsewhere a readable idle socket is probed instead.
    """
    if hasattr(select, "epoll"):
        with select.epoll() as poller:
            poller.register(wake_fd, select.EPOLLIN)
            for fd in list(conns):
                try:
                    poller.register(fd, select.EPOLLRDHUP)
                except OSError:  # closed by another thread meanwhile: nothing to watch
                    del conns[fd]
            events = poller.poll(timeout)
        return [conns[fd] for fd, _ in events if fd in conns]
    with selectors.DefaultSelector() as selector:  # pragma: no cover - not Linux
        selector.register(wake_fd, selectors.EVENT_READ, None)
        for fd, conn in conns.items():
            selector.register(fd, selectors.EVENT_READ, conn)
        ready = [key.data for key, _ in selector.select(timeout) if key.data is not None]
        if ready:
            time.sleep(0.001)  # maybe another thread's reply: let it be read first
        return [conn for conn in ready if conn.readable_while_idle()]


_registry: Registry | None = None
_registry_lock = threading.Lock()


def _session_ended(conn: LockConnection, generation: int) -> None:
    held = _registry
    if held is not None and held.pid == os.getpid():
        held.session_ended(conn, generation)


on_session_end(_session_ended)


def current_registry() -> Registry | None:
    """The registry of the calling process if it has one (``None`` in a forked child)."""
    held = _registry
    return held if held is not None and held.pid == os.getpid() else None


def registry() -> Registry:
    """The registry of the calling process (a fresh, empty one in a forked child)."""
    global _registry
    held = _registry
    if held is not None and held.pid == os.getpid():
        return held
    with _registry_lock:
        if _registry is None or _registry.pid != os.getpid():
            from . import exiting  # it needs this module: imported once a lease exists

            exiting.register()
            _registry = Registry()
        return _registry


def _forget_after_fork() -> None:
    global _registry, _registry_lock
    _registry = None
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
