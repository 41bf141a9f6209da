"""Instant handoff: the waiters of a name wake as soon as it is freed.

The statements that free a name (a release, a forced release, the orphan sweep) notify
on :data:`~django_pglock.sql.CHANNEL` at commit, with :func:`~django_pglock.sql.wake_key`
of the name as payload. A process with blocking waiters listens on its lock session for
that alias; psycopg hands each notification over while any statement's answer is read
on that session (heartbeats, other locks), and this module's thread reads the idle
session otherwise. Either way the notification wakes the waiters of that name in this
process, and each retries at once.

Polling stays the safety net, at the waiter's ``poll_interval``: a crashed holder sends
nothing (its freed advisory key is found by the next poll), a notification sent before
the session listened is never delivered (so a session that starts listening is polled
once at once), and behind a transaction-mode pooler, or with ``ADVISORY`` off (as it is
set behind one), nothing listens at all. A waiting process sends no statement between
polls; the thread only reads. Once the last waiter has been gone for :data:`LINGER`
seconds, the session stops listening (one statement), so a process that waited once is
not woken by every release in the database for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
import time

from . import sql
from .conf import get_setting
from .connection import LockConnection, get_connection
from .exceptions import LockError
from .sessionevents import on_notify, on_session_end, read_idle

__all__ = ["LINGER", "LISTENING", "OFF", "STARTED", "Wake", "Wakeups", "wakeups"]

logger = logging.getLogger("django_pglock")

#: Seconds a session keeps listening after the last waiter of its process left.
LINGER = 30.0
#: A readable session whose connection another thread holds: that statement reads the
#: notifications; looked at again after this many seconds (it may have just finished).
BUSY_RETRY = 0.005

#: What :meth:`Wakeups.ensure_listening` found.
OFF = "off"  # nothing listens: waiting polls
LISTENING = "listening"  # the current session listens already
STARTED = "started"  # it listens from now on: a release just before was not heard


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Wake:
    """One waiter's wake-up call: set from any thread, awaited by a thread or a task."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def set(self) -> None:
        self._event.set()  # before the futures are taken: see wait_async
        with self._lock:
            futures, self._futures = self._futures, []
        for loop, future in futures:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` s; ``True`` if woken. A wake-up is consumed here, so one
        that arrives during the next attempt makes the next wait return at once."""
        woken = self._event.wait(timeout)
        self._event.clear()
        return woken

    async def wait_async(self, timeout: float) -> bool:
        """:meth:`wait` for a task: the event loop is never blocked."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        entry = (loop, future)
        with self._lock:
            self._futures.append(entry)
        try:
            if not self._event.is_set():  # set() after this sees the future
                await asyncio.wait({future}, timeout=timeout)
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._futures.remove(entry)
            future.cancel()
        woken = self._event.is_set()
        self._event.clear()
        return woken


class Wakeups:
    """The waiters of this process by (alias, wake key), and the thread that listens."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._waiting: dict[tuple[str, str], set[Wake]] = {}
        # alias -> the generation of the session that listens (changed only by
        # _set_listening and _stop_listening); a session that ended takes it with it.
        self._listening: dict[str, int] = {}
        self._last_waiter = 0.0  # when the last waiter left
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def subscribe(self, alias: str, name: str) -> Wake:
        """A wake-up for a waiter of ``name`` on ``alias``, until :meth:`unsubscribe`."""
        wake = Wake()
        with self._lock:
            self._waiting.setdefault((alias, sql.wake_key(name)), set()).add(wake)
        return wake

    def unsubscribe(self, alias: str, name: str, wake: Wake) -> None:
        key = (alias, sql.wake_key(name))
        with self._lock:
            wakes = self._waiting.get(key)
            if wakes is not None:
                wakes.discard(wake)
                if not wakes:
                    del self._waiting[key]
            if not self._waiting:
                self._last_waiter = time.monotonic()

    def ensure_listening(self, conn: LockConnection, deadline: float | None = None) -> str:
        """Make ``conn``'s current session listen: :data:`LISTENING` if it did already,
        :data:`STARTED` if it does from now on (the caller tries once more at once: a
        release committed before was not heard), :data:`OFF` if it cannot (a pooler,
        ``ADVISORY`` off, the statement failed): the caller polls."""
        if conn.pooled or get_setting("ADVISORY") is False:
            return OFF
        with self._lock:
            if self._listening.get(conn.alias) == conn.generation and conn.is_open():
                return LISTENING
        try:
            conn.ensure_open(deadline)
            generation = conn.generation
            # Only on that session: listening on a newer one that nobody re-polled
            # would hide a release committed in between.
            conn.execute(sql.LISTEN, {}, session=generation, deadline=deadline)
        except LockError as exc:
            logger.debug("django_pglock: LISTEN on %r failed, polling: %s", conn.alias, exc)
            return OFF
        if conn.pooled:  # found out by that very statement  # pragma: no cover - a race
            return OFF
        self._set_listening(conn.alias, generation)
        return STARTED

    def _set_listening(self, alias: str, generation: int) -> None:
        with self._lock:
            self._listening[alias] = generation
            self._ensure_thread()
        self._poke()

    def _stop_listening(self, alias: str, generation: int) -> None:
        """The session ``generation`` of ``alias`` no longer listens: every waiter on
        that alias tries at once (what the session would have heard is lost), and the
        next session listens again. Under one lock with the change, so that no waiter
        can take the session for a listening one in between."""
        with self._lock:
            if self._listening.get(alias) != generation:
                return
            del self._listening[alias]
            wakes = [w for (a, _), ws in self._waiting.items() if a == alias for w in ws]
        self._poke()
        for wake in wakes:
            wake.set()

    def dispatch(self, conn: LockConnection, payload: str) -> None:
        """A notification read on ``conn``'s session: wake that name's waiters."""
        with self._lock:
            wakes = list(self._waiting.get((conn.alias, payload), ()))
        for wake in wakes:
            wake.set()

    def session_ended(self, conn: LockConnection, generation: int) -> None:
        """A lock session ended (a restart, a failover, a lost network)."""
        self._stop_listening(conn.alias, generation)

    # -- the thread that reads idle sessions ----------------------------------------------

    def _ensure_thread(self) -> None:
        """Start the thread (caller holds ``_lock``)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="django_pglock-wakeups", daemon=True
            )
            self._thread.start()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while os.getpid() == self.pid:  # pragma: no branch - a forked child has no thread
            try:
                if not self._step():
                    return
            except Exception:  # pragma: no cover - a bug must not kill the thread
                logger.exception("django_pglock: wake-ups iteration failed")
                time.sleep(1.0)

    def _step(self) -> bool:
        """Wait for notifications once; ``False`` when nothing listens any more."""
        with self._lock:
            listening = dict(self._listening)
            waiting = bool(self._waiting)
            linger = self._last_waiter + LINGER - time.monotonic()
            if not listening:
                self._thread = None  # a listen from now on starts a new one
                return False
        conns: dict[int, LockConnection] = {}
        for alias, generation in listening.items():
            conn = get_connection(alias)
            fd = conn.fileno()
            if conn.generation != generation or fd is None:
                self._stop_listening(alias, generation)  # its session ended meanwhile
            elif waiting or linger > 0 or not self._unlisten(conn, generation):
                conns[fd] = conn
        # Looked at again every second at least: a session may end, and its socket
        # close, between two looks (the session-end hook pokes the pipe as well).
        timeout = 1.0 if waiting or linger <= 0 else min(1.0, linger)
        try:
            ready, _, _ = select.select([self._wake_r, *conns], [], [], timeout)
        except (OSError, ValueError):  # a socket closed meanwhile: look again
            time.sleep(BUSY_RETRY)
            return True
        for fd in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError, OSError):
                    while os.read(self._wake_r, 512):  # pragma: no branch - write end open
                        pass
            elif not read_idle(conns[fd]) and conns[fd].is_open():
                time.sleep(BUSY_RETRY)  # another thread's statement reads them
        return True

    def _unlisten(self, conn: LockConnection, generation: int) -> bool:
        """Stop listening (no waiter for LINGER s): ``True`` once it has. Tried again
        a second later if it fails, and the session is read meanwhile: one left unread
        would hold the server's notification queue back."""
        try:
            conn.execute(sql.UNLISTEN, {}, session=generation, wait=1.0)
        except LockError as exc:
            logger.debug("django_pglock: UNLISTEN on %r failed: %s", conn.alias, exc)
            if conn.generation == generation and conn.is_open():
                return False
        self._stop_listening(conn.alias, generation)
        return True


_wakeups: Wakeups | None = None
_wakeups_lock = threading.Lock()


def wakeups() -> Wakeups:
    """The wake-ups of the calling process (a fresh one in a forked child)."""
    global _wakeups
    held = _wakeups
    if held is not None and held.pid == os.getpid():
        return held
    with _wakeups_lock:
        if _wakeups is None or _wakeups.pid != os.getpid():
            _wakeups = Wakeups()
        return _wakeups


def _notified(conn: LockConnection, payload: str) -> None:
    held = _wakeups
    if held is not None and held.pid == os.getpid():
        held.dispatch(conn, payload)


def _session_ended(conn: LockConnection, generation: int) -> None:
    held = _wakeups
    if held is not None and held.pid == os.getpid():
        held.session_ended(conn, generation)


def _forget_after_fork() -> None:
    global _wakeups, _wakeups_lock
    _wakeups = None
    _wakeups_lock = threading.Lock()


on_notify(_notified)
on_session_end(_session_ended)
os.register_at_fork(after_in_child=_forget_after_fork)
