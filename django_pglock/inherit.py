"""Running under the grant of the ``locked_run`` that started this process.

``locked_run nightly_report`` holds the lock ``nightly_report`` and runs the command as
its job, telling it the grant in ``DJANGO_PGLOCK_NAME`` and ``DJANGO_PGLOCK_TOKEN``. A
``@singleton_job`` of that name in the job would find the lock held by its own parent
and skip; instead it runs under the parent's grant, once the grant is proven real:

* the variables name this very lock (``DJANGO_PGLOCK_NAME`` equals the lock's name);
* the lock's row exists now with that token (so the grant is current: a reclaim, a
  forced release or a release gives the name a new token or none); for a semaphore,
  the row of one of its slots (tokens are unique: the token names the slot);
* the row's holder runs on this host and is an ancestor of this process (its pid is
  met walking up the parent pids; ``locked_run``'s guardian sits in between);
* this process is in the job's process group, the one ``locked_run`` waits for and
  stops on loss (the guardian names it in ``DJANGO_PGLOCK_JOB_PGID``): a descendant
  that left it (``setsid``, a daemon) is no longer part of the job.

Otherwise (a cron line that exports the variables, a copied environment, a process
started after the parent lost the lock, a detached descendant) the variables are
ignored and the lock is tried as usual. A process under the parent's grant never
heartbeats, releases or records a run: ``locked_run`` does, and stops its whole job if
the lease is lost. ``locked_run --schedule`` also passes the slot it claimed in
``DJANGO_PGLOCK_SLOT`` (an ISO 8601 timestamp): a ``@singleton_job(schedule=...)`` under
the grant runs in exactly that slot instead of computing one later.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
from collections.abc import Iterator
from typing import TYPE_CHECKING

from django.db import connections

from . import sql
from .connection import get_connection
from .exceptions import LockError, LockNotHeld
from .guardian import GROUP_VARIABLE
from .identity import current

if TYPE_CHECKING:
    from .lock import Lock

__all__ = [
    "GROUP_VARIABLE",
    "NAME_VARIABLE",
    "SLOT_VARIABLE",
    "TOKEN_VARIABLE",
    "InheritedLease",
    "ancestors",
    "lend",
    "offered",
    "parent_grant",
]

logger = logging.getLogger("django_pglock")

NAME_VARIABLE = "DJANGO_PGLOCK_NAME"
TOKEN_VARIABLE = "DJANGO_PGLOCK_TOKEN"
SLOT_VARIABLE = "DJANGO_PGLOCK_SLOT"
_MAX_TOKEN = 2**63 - 1
_MAX_DEPTH = 256  # parent pids walked at most (a loop in a broken /proc ends there)


class InheritedLease:
    """The grant of the ``locked_run`` that started this process, seen from its job.

    What :func:`~django_pglock.current_lease` returns inside a ``@singleton_job`` that
    runs under its parent's grant. Attributes: ``name``, ``token`` (the parent's fencing
    token), ``holder`` (the parent's holder id), ``acquired_at``, ``using``, and
    ``inherited = True``, and ``slot``: the schedule slot the parent claimed
    (``locked_run --schedule``), or ``None``. :meth:`check` and :meth:`guard` work as on a
    :class:`~django_pglock.Lease`; ``lost`` turns true once one of them found the grant
    gone (the job does not heartbeat: ``locked_run`` does, and terminates its job when
    the lease is lost). It cannot be released: the parent releases it.
    """

    inherited = True

    def __init__(
        self,
        name: str,
        token: int,
        holder: str,
        acquired_at: datetime.datetime,
        using: str,
        slot: datetime.datetime | None = None,
        row: str | None = None,
    ) -> None:
        self.name = name
        # The row of the grant: the name, or a semaphore's slot's (sql.slot_row).
        self._row = name if row is None else row
        self.token = token
        self.holder = holder
        self.acquired_at = acquired_at
        self.using = using
        self.slot = slot
        self._lost = False

    def __repr__(self) -> str:
        state = "lost" if self._lost else "inherited"
        return f"<InheritedLease {self.name!r} token={self.token} {state}>"

    @property
    def lost(self) -> bool:
        """``True`` once :meth:`check` or :meth:`guard` found the grant gone."""
        return self._lost

    def check(self) -> None:
        """Raise :class:`LockNotHeld` unless the parent's grant is still current."""
        self._require_held()
        rows = get_connection(self.using).execute(
            sql.CHECK, {"name": self._row, "token": self.token}
        )
        if not rows[0][0]:
            self._gone()

    def guard(self) -> None:
        """Fence the caller's transaction, as :meth:`Lease.guard
        <django_pglock.Lease.guard>` does: call inside ``transaction.atomic(using=...)``."""
        self._require_held()
        connection = connections[self.using]
        if not connection.in_atomic_block:
            raise LockError(
                f"lease.guard() for lock {self.name!r} ran outside a transaction; call it inside "
                f"transaction.atomic(using={self.using!r}) so the fence lasts until commit."
            )
        with connection.cursor() as cursor:
            cursor.execute(sql.GUARD, {"name": self._row, "token": self.token})
            row = cursor.fetchone()
        if row is None:
            self._gone()

    def _require_held(self) -> None:
        if self._lost:
            raise LockNotHeld(self._lost_message())

    def _gone(self) -> None:
        self._lost = True
        raise LockNotHeld(self._lost_message())

    def _lost_message(self) -> str:
        return (
            f"Lock {self.name!r} (token {self.token}, held by the parent {self.holder}) was "
            "lost: its row is gone or belongs to another holder."
        )


def offered(name: str) -> bool:
    """Whether the environment offers a parent's grant of lock ``name`` (not checked yet)."""
    return os.environ.get(NAME_VARIABLE) == name


def parent_grant(lock: Lock) -> InheritedLease | None:
    """The parent's grant of ``lock`` passed in the environment, if it is proven real
    (see the module's docstring); ``None`` otherwise, and then the lock is tried as usual."""
    name, text = lock.name, os.environ.get(TOKEN_VARIABLE)
    if not offered(name) or text is None:
        return None
    try:
        token = int(text)
    except ValueError:
        token = 0
    if not 0 < token <= _MAX_TOKEN:
        _ignored(lock.name, text, "is not a fencing token")
        return None
    alias = lock._alias()
    rows = get_connection(alias).execute(sql.PARENT_GRANT, {"name": name, "token": token})
    if not rows:
        _ignored(name, text, "is not the lock's current grant")
        return None
    holder, host, pid, acquired_at, row = rows[0]
    if host != current().host or pid not in ancestors():
        _ignored(name, text, f"belongs to {holder}, which did not start this process")
        return None
    outside = _outside_the_job()
    if outside:
        _ignored(name, text, outside)
        return None
    return InheritedLease(name, token, holder, acquired_at, alias, _lent_slot(), row)


def lend(env: dict[str, str], name: str, token: int, slot: datetime.datetime | None) -> None:
    """Put a grant in ``env``, the environment of ``locked_run``'s job: the lock's
    ``name``, its ``token`` and the schedule ``slot`` claimed for this run (if any). The
    guardian adds the job's process group (:data:`GROUP_VARIABLE`) when it starts the job."""
    env[NAME_VARIABLE] = name
    env[TOKEN_VARIABLE] = str(token)
    env.pop(GROUP_VARIABLE, None)
    if slot is None:
        env.pop(SLOT_VARIABLE, None)
    else:
        env[SLOT_VARIABLE] = slot.isoformat()


def _outside_the_job() -> str:
    """Why this process is not in the job's process group (``""`` when it is)."""
    text = os.environ.get(GROUP_VARIABLE, "")
    try:
        group = int(text)
    except ValueError:
        group = 0
    if group <= 0:
        return f"comes without the job's process group ({GROUP_VARIABLE}={text[:40]!r})"
    if os.getpgrp() != group:
        return (
            f"was lent to the process group {group} of locked_run's job, and this process "
            f"(group {os.getpgrp()}) left it (setsid, a daemon): it is not part of the job"
        )
    return ""


def _lent_slot() -> datetime.datetime | None:
    """The schedule slot the parent claimed (:data:`SLOT_VARIABLE`), if it is a timestamp
    with a UTC offset; else ``None`` (with a warning when there was a value)."""
    text = os.environ.get(SLOT_VARIABLE)
    if not text:
        return None
    try:
        slot = datetime.datetime.fromisoformat(text)
    except ValueError:
        slot = None
    if slot is None or slot.utcoffset() is None:
        logger.warning(
            "django_pglock: %s=%r is not an ISO 8601 timestamp with a UTC offset; the "
            "schedule slot is computed as usual.",
            SLOT_VARIABLE,
            text[:40],
        )
        return None
    return slot


def _ignored(name: str, text: str, why: str) -> None:
    logger.warning(
        "django_pglock: %s=%r %s; lock %r is tried as usual.", TOKEN_VARIABLE, text[:40], why, name
    )


def ancestors() -> Iterator[int]:
    """The pids of this process's parent, its parent's parent, … up to pid 1."""
    pid = os.getppid()
    for _ in range(_MAX_DEPTH):
        if pid <= 0:
            return
        yield pid
        if pid == 1:
            return
        pid = parent_of(pid)


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when unknown): from ``/proc``, else from ``ps``."""
    if not os.path.isdir("/proc/self"):  # pragma: no cover - systems without /proc
        return _parent_from_ps(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0  # gone, or not to be read


def _parent_from_ps(pid: int) -> int:
    """The parent pid of ``pid`` from ``ps`` (systems without ``/proc``); 0 when unknown."""
    try:
        found = subprocess.run(
            ["ps", "-o", "ppid=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return int(found.stdout.strip() or 0)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0
