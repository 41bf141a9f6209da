"""Signals sent by django_pglock.

Every signal is sent with ``sender`` set to the :class:`~django_pglock.Lock` involved
(or ``None`` for forced releases made outside a lock object) and the keyword arguments
listed beside it. Receivers run synchronously; an exception raised by a receiver is
logged and never breaks the lock.
"""

from __future__ import annotations

from django.dispatch import Signal

__all__ = [
    "job_failing",
    "job_overdue",
    "lock_acquired",
    "lock_alert",
    "lock_contended",
    "lock_force_released",
    "lock_lost",
    "lock_reclaimed",
    "lock_released",
]

#: A lease was granted. Arguments: ``lease``.
lock_acquired = Signal()
#: A lease was released cleanly. Arguments: ``lease``.
lock_released = Signal()
#: An attempt found the lock held. Arguments: ``name``, ``holder`` (a dict describing the
#: current holder, or ``None`` when it could not be read).
lock_contended = Signal()
#: A lease was granted by taking over a stale or abandoned row. Arguments: ``lease``,
#: ``previous`` (a dict describing the previous holder), ``reason`` (``"stale"`` or
#: ``"abandoned"``).
lock_reclaimed = Signal()
#: A holder has not heartbeaten for longer than its ``alert_after``. Arguments: ``name``,
#: ``holder`` (dict), ``heartbeat_age`` (seconds), ``lease`` (the local lease when the
#: holder itself noticed, else ``None``).
lock_alert = Signal()
#: A lease may have been lost. Arguments: ``lease``, ``reason`` (a short string).
lock_lost = Signal()
#: A lock was released by force. Arguments: ``name``, ``token``, ``holder`` (dict).
lock_force_released = Signal()
#: A job turned ``overdue`` (a due start did not begin within its grace); sent once per
#: episode by whichever process noticed first. Arguments: ``name``, ``health`` (a
#: :class:`~django_pglock.health.JobHealth`).
job_overdue = Signal()
#: A job turned ``failing`` (its last run failed or was lost); once per episode.
#: Arguments: ``name``, ``health``.
job_failing = Signal()
