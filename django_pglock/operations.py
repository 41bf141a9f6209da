"""Operator actions shared by the admin and the management commands.

Both run on Django's own connection for the alias (not the dedicated lock connection),
so a forced release that waits for a guarded transaction never stalls this process's
heartbeats.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.db import connections

from . import signals, sql
from .conf import get_setting
from .connection import validate_alias
from .events import call_metrics, configured_metrics, send
from .lock import validate_name

__all__ = ["LockStatus", "abandoned_grants", "force_release", "lock_status"]


@dataclass(frozen=True)
class LockStatus:
    """One held lock as the database sees it now."""

    name: str
    token: int
    holder: str
    host: str
    pid: int
    acquired_at: datetime.datetime
    last_heartbeat: datetime.datetime
    heartbeat_age: float
    heartbeat_interval: float
    alert_after: float
    stale_after: float
    advisory: bool
    description: str
    state: str  # "ok", "alert", "stale" or "abandoned"
    slot: int = 1  # which of a semaphore's slots (1 for a plain lock)
    limit: int = 1  # the limit of the lock's latest grant (1: a plain lock)
    held: int = 1  # how many of the lock's slots are held

    @property
    def semaphore(self) -> bool:
        """Whether the row is a semaphore's (a limit above 1, or a slot above 1)."""
        return self.limit > 1 or self.slot > 1 or self.held > 1

    @property
    def held_label(self) -> str:
        """``"2 of 3 held"``."""
        return f"{self.held} of {self.limit} held"

    def as_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["acquired_at"] = self.acquired_at.isoformat()
        data["last_heartbeat"] = self.last_heartbeat.isoformat()
        data["held_label"] = self.held_label
        return data


def abandoned_grants(using: str) -> tuple[list[str], list[int]]:
    """The grants whose holder is gone: names and tokens, for ``sql.STATE_EXPRESSION``.

    A row on the advisory path whose key nobody holds belongs to a session that has
    ended: the next contender takes the name at once. Runs of such grants are closed as
    ``lost`` on the way (nobody can finish them any more).
    """
    with connections[using].cursor() as cursor:
        cursor.execute(sql.ADVISORY_ROWS)
        candidates = cursor.fetchall()
        if not candidates:
            return [], []
        names = [name for name, _token in candidates]
        cursor.execute(
            sql.ABANDONED,
            {
                "names": names,
                "tokens": [token for _name, token in candidates],
                "keys": [sql.advisory_key(name) for name in names],
            },
        )
        gone = cursor.fetchall()
    return [name for name, _token in gone], [token for _name, token in gone]


def lock_status(using: str | None = None) -> list[LockStatus]:
    """Every held lock with its heartbeat age and state, judged by the database clock.

    ``state`` is ``ok``, ``alert`` (no heartbeat for ``alert_after``), ``stale`` (none
    for ``stale_after``: the next contender reclaims it) or ``abandoned`` (the holder's
    session has ended: the next contender takes it at once; nothing to alert about).
    """
    alias = validate_alias(using if using is not None else get_setting("DATABASE"))
    abandoned = abandoned_grants(alias)
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.STATUS, abandoned)
        rows = [LockStatus(*row) for row in cursor.fetchall()]
    hooks = (configured_metrics(),)
    for row in rows:
        if row.state in ("alert", "stale"):  # whoever meets a lock in alert raises it
            holder = {"holder": row.holder, "host": row.host, "pid": row.pid, "token": row.token}
            send(
                signals.lock_alert,
                None,
                name=row.name,
                holder=holder,
                heartbeat_age=row.heartbeat_age,
                lease=None,
            )
            call_metrics(hooks, "alert", row.name, row.heartbeat_age)
    return rows


def force_release(
    name: str, token: int | None = None, using: str | None = None
) -> dict[str, Any] | None:
    """Delete the row of ``name`` (only if it carries ``token``, when given).

    Returns the released holder (name, token, holder, host, pid, acquired_at, slot), or
    ``None`` when nothing matched. A semaphore's holders are one per slot: without a
    ``token`` only a lone holder is released, and with several ``ValueError`` names
    their tokens and nothing changes. Waits for a guarded transaction on that row to end.
    The old holder's next heartbeat, ``check()`` and ``guard()`` fail.
    """
    validate_name(name)
    if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 1):
        raise ValueError(f"token={token!r} is not a fencing token; pass a positive integer.")
    alias = validate_alias(using if using is not None else get_setting("DATABASE"))
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.FORCE_RELEASE, {"name": name, "token": token})
        row = cursor.fetchone()
    held = row[6] or []
    if len(held) > 1:  # a semaphore's holders: which one is for the caller to say
        tokens = ", ".join(str(t) for t in held)
        raise ValueError(
            f"Lock {name!r} is a semaphore with {len(held)} holders (tokens {tokens}); "
            "nothing was released. Pass the token of the one to release (--token N)."
        )
    if row[1] is None:
        return None
    fields = ("name", "token", "holder", "host", "pid", "acquired_at")
    released = dict(zip(fields, row[:6], strict=True))
    released["name"], released["slot"] = sql.slot_of(released["name"])
    send(signals.lock_force_released, None, name=name, token=released["token"], holder=released)
    return released
