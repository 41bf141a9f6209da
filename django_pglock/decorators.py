"""``@singleton_job``: run a function, a management command or a coroutine on one machine."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, overload

from .conf import check_seconds, get_setting
from .context import running_under
from .exceptions import LockNotHeld
from .inherit import InheritedLease, offered, parent_grant
from .jobtypes import F, MaySkip, NeverSkips, P, R
from .lock import Lease, Lock, validate_name
from .runs import SkipReason, record_skipped, record_skipped_under
from .schedule import ScheduleSlot
from .waiting import describe_holder

__all__ = ["singleton_job"]

logger = logging.getLogger("django_pglock")


_COMMANDS_PACKAGE = ".management.commands."


def _default_name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", "") or ""
    if _COMMANDS_PACKAGE in f".{module}." and func.__qualname__.endswith(".handle"):
        return module.rsplit(".", 1)[-1]  # a management command: its command name
    return f"{module}.{func.__qualname__}"


class _SingletonJob:
    """The configured decorator; see :func:`singleton_job`."""

    def __init__(
        self,
        name: str | None,
        key: Callable[..., str] | None,
        blocking: bool,
        timeout: float | None,
        schedule: str | None,
        record: bool | None,
        lock_options: dict[str, Any],
    ) -> None:
        if name is not None:
            validate_name(name)
        if name is not None and key is not None:
            raise ValueError(
                f"singleton_job got both a name ({name!r}) and key=; pass one: the name for one "
                "lock, or key= to compute a lock name from each call's arguments."
            )
        if key is not None and not callable(key):
            raise ValueError(f"key={key!r} is not callable; pass a function returning a lock name.")
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking={blocking!r} must be True or False.")
        if timeout is not None and not blocking:
            raise ValueError(
                f"timeout={timeout!r} was given with blocking=False; drop the timeout or pass "
                "blocking=True."
            )
        # Validate arguments now, so a bad decorator fails at import time.
        Lock(name or "validation", **lock_options)
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        if schedule is not None:
            ScheduleSlot(schedule, name or "validation", using=lock_options.get("using"))
        if record is not None and not isinstance(record, bool):
            raise ValueError(f"record={record!r} must be True, False or None (from settings).")
        self.record = record
        self.schedule = schedule
        self.name = name
        self.key = key
        self.blocking = blocking
        self.timeout = timeout
        self.lock_options = lock_options

    def __call__(self, func: F) -> F:
        if hasattr(func, "enqueue") and callable(getattr(func, "func", None)):
            raise ValueError(
                f"singleton_job got the task {func!r}; put @task above @singleton_job, so "
                "that the body runs under the lock when a worker executes the task."
            )
        if not callable(func):
            raise ValueError(f"singleton_job can only decorate a callable, not {func!r}.")
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise ValueError(
                f"singleton_job cannot wrap the generator function {func.__qualname__!r}: the "
                "lock would be released before its body runs. Wrap a function that consumes it."
            )
        default = self.name or _default_name(func)
        is_command = func.__qualname__.endswith(".handle") and self.name is None

        def lock_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Lock:
            if self.key is not None:
                lock_name = self.key(*args, **kwargs)
            elif is_command and args and _is_command(args[0]):
                lock_name = type(args[0]).__module__.rsplit(".", 1)[-1]
            else:
                lock_name = default
            record = self.record if self.record is not None else get_setting("RECORD_RUNS")
            return Lock(lock_name, record=bool(record), **self.lock_options)

        def report(args: tuple[Any, ...], why: str) -> None:
            if args and _is_command(args[0]):
                # One line on stderr; the command still exits 0.
                command = type(args[0]).__module__.rsplit(".", 1)[-1]
                args[0].stderr.write(f"Skipped {command}: {why}.")
                logger.debug("django_pglock: skipped %s: %s", command, why)
            else:
                logger.info("django_pglock: skipped %s: %s.", func.__qualname__, why)

        def skipped(lock: Lock, args: tuple[Any, ...], holder: dict[str, Any] | None) -> None:
            # Not granted: held elsewhere (one attempt), or held until the wait ran out.
            report(args, f"lock {lock.name!r} is held by {describe_holder(holder)}")
            record_skipped(lock, SkipReason.TIMED_OUT if self.blocking else SkipReason.HELD)

        def first_in_slot(lock: Lock, lease: Lease | InheritedLease, args: tuple[Any, ...]) -> bool:
            """Claim the schedule slot. Under locked_run's grant, a claim by that holder
            counts as ours, and the slot it passed is ours; a skip finishes its run."""
            if self.schedule is None:
                return True
            slot = ScheduleSlot(self.schedule, lock.name, using=lock.using)
            if isinstance(lease, InheritedLease):
                claimed = slot.claim(lease.holder, lease.slot)
            else:
                claimed = slot.claim()
            if claimed:
                return True
            report(args, f"schedule slot {slot.slot_label} of {lock.name!r} already started")
            if isinstance(lease, InheritedLease):
                record_skipped_under(lease, SkipReason.SLOT_TAKEN)
            else:
                record_skipped(lock, SkipReason.SLOT_TAKEN, lease)
            return False

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                lock = lock_for(args, kwargs)
                if offered(lock.name):  # locked_run's job: maybe under its grant
                    inherited = await asyncio.to_thread(parent_grant, lock)
                    if inherited is not None:
                        if not await asyncio.to_thread(first_in_slot, lock, inherited, args):
                            return None
                        with running_under(inherited):
                            return await func(*args, **kwargs)
                acquisition = lock.acquire_async(self.blocking, self.timeout)
                async with acquisition as lease:
                    if lease is None:
                        # Naming the holder and recording the skip may query: off the loop.
                        await asyncio.to_thread(lambda: skipped(lock, args, acquisition.holder))
                        return None
                    if not await asyncio.to_thread(first_in_slot, lock, lease, args):
                        return None
                    with running_under(lease):
                        return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        def run(*args: Any, **kwargs: Any) -> Any:
            lock = lock_for(args, kwargs)
            inherited = parent_grant(lock) if offered(lock.name) else None
            if inherited is not None:  # locked_run's job, under its grant
                if not first_in_slot(lock, inherited, args):
                    return None
                with running_under(inherited):
                    return func(*args, **kwargs)
            acquisition = lock.acquire(self.blocking, self.timeout)
            with acquisition as lease:
                if lease is None:
                    skipped(lock, args, acquisition.holder)
                    return None
                if not first_in_slot(lock, lease, args):
                    return None
                with running_under(lease):
                    return func(*args, **kwargs)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return run(*args, **kwargs)
            except LockNotHeld as exc:
                if args and _is_command(args[0]):
                    from .exits import end_command  # Django's management, only if needed

                    end_command(exc)  # one line on stderr, exit status 75
                raise

        return wrapper  # type: ignore[return-value]


def _is_command(obj: object) -> bool:
    from django.core.management.base import BaseCommand

    return isinstance(obj, BaseCommand)


@overload
def singleton_job(
    name: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...


@overload
def singleton_job(name: Callable[P, R]) -> Callable[P, R | None]: ...


@overload
def singleton_job(
    name: str | None = None,
    *,
    key: Callable[..., str] | None = None,
    blocking: Literal[True],
    timeout: None = None,
    schedule: None = None,
    record: bool | None = None,
    **lock_options: Any,
) -> NeverSkips: ...


@overload
def singleton_job(
    name: str | None = None,
    *,
    key: Callable[..., str] | None = None,
    blocking: bool = False,
    timeout: float | None = None,
    schedule: str | None = None,
    record: bool | None = None,
    **lock_options: Any,
) -> MaySkip: ...


def singleton_job(
    name: Any = None,
    *,
    key: Callable[..., str] | None = None,
    blocking: bool = False,
    timeout: float | None = None,
    schedule: str | None = None,
    record: bool | None = None,
    **lock_options: Any,
) -> Any:
    """Run the decorated function on at most one machine at a time.

    ``@singleton_job`` names the lock after the function (``module.qualname``); on a
    management command's ``handle`` it is the command's name. ``@singleton_job("name")``
    names it; ``key=`` computes the name from each call's arguments. By default a call
    that finds the lock held is skipped: it returns ``None``, logs who holds the lock,
    and a management command writes one line to stderr and exits 0. ``blocking=True``
    waits instead (up to ``timeout`` seconds). ``schedule="0 3 * * *"`` also runs the
    body at most once per cron slot (computed from the database clock in the active time
    zone, to the nearest tick within ``SCHEDULE_TOLERANCE``; needs the ``schedule``
    extra), however many hosts fire it. Each run is recorded in the run history
    (``JobRun``) unless ``record=False`` or ``DJANGO_PGLOCK['RECORD_RUNS']`` is false; a
    skipped call as ``skipped``, with the reason (``held``, ``slot-taken`` or
    ``timed-out``). Other keyword arguments (``using``,
    thresholds, ``poll_interval``, ``advisory``, ``metrics``, ``description``) go to
    :class:`~django_pglock.Lock`. Works on ``async def`` functions too.

    While the body runs, :func:`~django_pglock.current_lease` returns its lease. Run as
    the job of ``locked_run`` holding the same name, the body runs under the parent's
    grant instead of skipping (see :mod:`django_pglock.inherit`). A lease lost while
    the body ran raises :class:`~django_pglock.LockNotHeld` when the call returns; a
    management command then ends with one line on stderr and exit status 75.
    """
    if callable(name) and not isinstance(name, str):
        return _SingletonJob(None, key, blocking, timeout, schedule, record, lock_options)(name)
    return _SingletonJob(name, key, blocking, timeout, schedule, record, lock_options)
