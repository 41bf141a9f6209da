"""Sending signals and calling metrics hooks without ever breaking the lock."""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal
from django.utils.module_loading import import_string

from .conf import generation, get_setting

__all__ = ["call_metrics", "configured_metrics", "send"]

logger = logging.getLogger("django_pglock")

METRICS_METHODS = (
    "acquired",
    "released",
    "contended",
    "skipped",
    "stale_reclaimed",
    "alert",
    "lost",
    "heartbeat_latency",
)

_metrics_cache: dict[str, Any] = {}
_current: tuple[int, Any] = (-1, None)  # (settings generation, its metrics instance)


def configured_metrics() -> Any | None:
    """The instance of ``DJANGO_PGLOCK['METRICS']``, or ``None`` when it is not set."""
    global _current
    now = generation()
    if _current[0] == now:
        return _current[1]
    path = get_setting("METRICS")
    if not path:
        instance = None
    else:
        if path not in _metrics_cache:
            _metrics_cache[path] = import_string(path)()
        instance = _metrics_cache[path]
    _current = (now, instance)
    return instance


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal``; a receiver that raises does not stop the others.

    Django's ``send_robust`` logs such an exception itself (logger ``django.dispatch``,
    with its traceback), so it is not logged again here: one failing receiver, one record.
    """
    if not signal.receivers:
        return
    signal.send_robust(sender=sender, **kwargs)


def call_metrics(hooks: tuple[Any, ...], method: str, *args: Any) -> None:
    """Call ``method`` on every hook object that has it; exceptions are logged."""
    for hook in hooks:
        func = getattr(hook, method, None) if hook is not None else None
        if func is None:
            continue
        try:
            func(*args)
        except Exception:
            logger.exception("django_pglock: metrics hook %r.%s raised", hook, method)
