"""Who is told of what happens to a lock session: its end, and the notifications it
receives. Filled by :mod:`.heartbeat` and :mod:`.wakeups`, called by :mod:`.connection`
(from whichever thread found out)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from .sql import CHANNEL

if TYPE_CHECKING:
    from .connection import LockConnection

__all__ = ["notified", "on_notify", "on_session_end", "read_idle", "tell_session_ended"]

logger = logging.getLogger("django_pglock")

#: Called with (connection, generation) when a session ends: its advisory keys are gone.
SessionListener = Callable[["LockConnection", int], None]
_session_listeners: list[SessionListener] = []


def on_session_end(listener: SessionListener) -> None:
    """Call ``listener(conn, generation)`` whenever a lock session is found ended."""
    if listener not in _session_listeners:
        _session_listeners.append(listener)


#: Called with (connection, payload) for each notification a lock session receives on
#: sql.CHANNEL, whichever thread reads it (the one running a statement, or the
#: wake-ups thread reading an idle session): see :mod:`.wakeups`.
NotifyListener = Callable[["LockConnection", str], None]
_notify_listener: list[NotifyListener] = []


def on_notify(listener: NotifyListener) -> None:
    """Call ``listener(conn, payload)`` for each notification on ``sql.CHANNEL``."""
    _notify_listener[:] = [listener]


def notified(conn: LockConnection, notification: psycopg.Notify) -> None:
    if notification.channel != CHANNEL:
        return
    for listener in _notify_listener:
        try:
            listener(conn, notification.payload)
        except Exception:  # pragma: no cover - a listener bug must not break a statement
            logger.exception("django_pglock: notify listener raised")


def tell_session_ended(conn: LockConnection, generation: int) -> None:
    for listener in list(_session_listeners):
        try:
            listener(conn, generation)
        except Exception:  # pragma: no cover - a listener bug must not break the caller
            logger.exception("django_pglock: session-end listener raised")


def read_idle(session: LockConnection) -> bool:
    """Read what ``session`` received while idle (notifications, which psycopg hands to
    :func:`notified`), without waiting: ``False`` when another thread holds the
    connection (its statement reads them), or the session was found ended."""
    if not session.lock.acquire(blocking=False):
        return False
    ended = None
    try:
        conn = session._conn
        if conn is None or conn.closed:
            return False
        pgconn = conn.pgconn
        try:
            pgconn.consume_input()
            while notification := pgconn.notifies():
                if pgconn.notify_handler is not None:  # pragma: no branch - psycopg's
                    pgconn.notify_handler(notification)
            return True
        except psycopg.Error:  # the server closed the session
            ended = session._discard()
            return False
    finally:
        session.lock.release()
        if ended is not None:
            tell_session_ended(session, ended)
