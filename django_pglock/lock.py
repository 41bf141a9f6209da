"""``Lock`` and ``Lease``: the lock state machine (synchronous; the async API wraps it)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from . import heartbeat, signals, sql
from .aio import AsyncAcquisition
from .conf import (
    Thresholds,
    check_seconds,
    generation,
    get_setting,
    setting_label,
    validate_thresholds,
)
from .connection import LockConnection, get_connection, validate_alias
from .events import call_metrics, configured_metrics, send
from .exceptions import LockError, LockNotAcquired, LockNotHeld
from .identity import current, default_description, redact

__all__ = ["Lease", "Lock", "validate_name"]

logger = logging.getLogger("django_pglock")

MAX_NAME_LENGTH = 255


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a lock, else raise ``ValueError`` saying why."""
    if not isinstance(name, str):
        raise ValueError(f"Lock name {name!r} is a {type(name).__name__}; pass a string.")
    if not name:
        raise ValueError("Lock name '' is empty; pass a non-empty string such as 'nightly-report'.")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"Lock name {name[:40]!r}... is {len(name)} characters long; "
            f"the limit is {MAX_NAME_LENGTH}."
        )
    if "\x00" in name:
        raise ValueError(f"Lock name {name!r} contains a NUL character; remove it.")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"Lock name {name!r} cannot be stored as UTF-8 (it holds a lone surrogate); "
            "pass a name made of valid text."
        ) from None
    return name


#: How soon a lease granted without its advisory key tries to take it again (doubling up
#: to its heartbeat interval, at most _LAST_KEY_RETRY).
_FIRST_KEY_RETRY = 0.05
_LAST_KEY_RETRY = 1.0


def _safety_margin(thresholds: Thresholds) -> float:
    """How long before ``stale_after`` the holder gives up on an unconfirmed lease."""
    return min(thresholds.heartbeat_interval, thresholds.stale_after * 0.1)


class Lease:
    """A granted lock: the right to run until released or lost.

    Attributes: ``name``, ``token`` (the fencing token of this grant), ``holder`` (this
    process's holder id), ``acquired_at`` (database time), ``using`` (database alias).
    A lease is also a context manager: leaving it releases the lock, and raises
    :class:`LockNotHeld` if the lease was lost while the block ran without error.
    """

    # State every lease starts with; an instance attribute replaces it when it changes.
    _lost_reason: str | None = None
    _alerting = False
    _guarded = False  # guard() was called: release must not wait for the row
    _releasing = False  # release() was called
    _pending = False  # the delete waits for a guarded transaction to end
    _done = False  # released, or given up after loss
    _outcome = "succeeded"
    # Granted while the key was busy: the heartbeat thread takes it when it can.
    _wants_key = False
    _key_retry_at = 0.0
    _key_retry_delay = _FIRST_KEY_RETRY
    #: Exit status of the wrapped program, recorded in the run history (locked_run).
    exit_code: int | None = None

    def __init__(
        self,
        lock: Lock,
        conn: LockConnection,
        token: int,
        acquired_at: datetime.datetime,
        advisory: bool,
        sent: float,
        thresholds: Thresholds,
        run_id: int | None = None,
        *,
        holder: str | None = None,
        key: int | None = None,
    ) -> None:
        self.name = lock.name
        self.token = token
        self.holder = current().holder if holder is None else holder
        self.acquired_at = acquired_at
        self.using = conn.alias
        self.heartbeat_interval = thresholds.heartbeat_interval
        self.alert_after = thresholds.alert_after
        self.stale_after = thresholds.stale_after
        self.advisory = advisory
        self._key_held = advisory  # this session holds the advisory key for the lease
        self._lock = lock
        self._conn = conn
        self._key = lock._resolved().key if key is None else key
        self._generation = conn.generation
        self._pid = conn.pid
        self._margin = _safety_margin(thresholds)
        self._confirmed_at = sent
        self._deadline = sent + thresholds.stale_after - self._margin
        self._started = sent
        self._state_lock = threading.RLock()
        self._release_lock = threading.Lock()
        self._on_lost: list[Callable[[Lease], None]] = []
        self._run_id = run_id  # the JobRun row of a recorded run

    def __repr__(self) -> str:
        state = "lost" if self._lost_reason else "released" if self._done else "held"
        return f"<Lease {self.name!r} token={self.token} {state}>"

    # -- public API -------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        """``True`` once the lease may have been lost (it never becomes ``False`` again)."""
        if os.getpid() != self._pid:
            return True
        if self._lost_reason is None and not self._done and time.monotonic() > self._deadline:
            self._mark_lost("no heartbeat was confirmed before the local deadline")
        return self._lost_reason is not None

    def check(self) -> None:
        """Raise :class:`LockNotHeld` unless the lease is held, asking the database."""
        self._require_held()
        rows = self._conn.execute(sql.CHECK, {"name": self.name, "token": self.token})
        self._check_session(self._conn)
        if not rows[0][0]:
            self._mark_lost("its row is gone or belongs to another holder", row_gone=True)
        self._require_held()

    def guard(self) -> None:
        """Fence the caller's transaction: call inside ``transaction.atomic(using=...)``.

        Locks the lease's row in that transaction so that no reclaim or forced release
        can happen before it ends; raises :class:`LockNotHeld` if the lease is gone.
        Heartbeats go on meanwhile, and releasing the lease inside the transaction does
        not deadlock: the row is deleted as soon as the transaction ends.
        """
        self._require_held()
        connection = connections[self.using]
        if not connection.in_atomic_block:
            raise LockError(
                f"lease.guard() for lock {self.name!r} ran outside a transaction; call it inside "
                f"transaction.atomic(using={self.using!r}) so the fence lasts until commit."
            )
        self._guarded = True
        with connection.cursor() as cursor:
            cursor.execute(sql.GUARD, {"name": self.name, "token": self.token})
            row = cursor.fetchone()
        if row is None:
            self._mark_lost("its row is gone or belongs to another holder", row_gone=True)
        self._require_held()

    def beat(self) -> None:
        """Heartbeat now (the heartbeat thread does this on its own every interval)."""
        self._require_held()
        heartbeat.beat(self._conn, [self])
        self._check_session(self._conn)
        self._require_held()

    def release(self) -> None:
        """Release the lock: delete its row (scoped by token) and drop the advisory key.

        Safe to call more than once. In a forked child it does nothing: the lease
        belongs to the parent.
        """
        if os.getpid() != self._pid:
            return
        with self._state_lock:
            if self._done or self._releasing:
                return
            self._releasing = True
        self._finish_release()
        if not self._done:  # the row is locked by a guarded transaction: finish later
            self._pending = True
            heartbeat.registry().add(self)

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Call ``callback(lease)`` (from the heartbeat thread) when the lease is lost."""
        self._on_lost.append(callback)
        if self._lost_reason is not None:
            callback(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = self.lost
        if lost:
            self._outcome = "lost"
        elif exc_type is not None:
            self._outcome = "failed"
        try:
            self.release()
        except LockError as error:
            logger.warning("django_pglock: releasing %r failed: %s", self.name, error)
        # A row found gone at release was lost while the block ran, too.
        lost = lost or self._lost_reason is not None
        if lost and exc_type is None:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) was lost while the block ran: "
                f"{self._lost_reason or 'it belongs to the parent process'}."
            )

    # -- internals used by the heartbeat thread ---------------------------------------

    def _require_held(self) -> None:
        if os.getpid() != self._pid:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) belongs to process {self._pid}; "
                "a forked child inherits no lease. Acquire the lock in the child instead."
            )
        if self.lost:
            raise LockNotHeld(
                f"Lock {self.name!r} (token {self.token}) was lost: {self._lost_reason}."
            )
        if self._done or self._releasing:
            raise LockNotHeld(f"Lock {self.name!r} (token {self.token}) was released.")

    def _confirm(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) updated the row."""
        with self._state_lock:
            if sent > self._confirmed_at:
                self._confirmed_at = sent
                self._deadline = sent + self.stale_after - self._margin
            self._alerting = False

    def _watch(self, now: float) -> float:
        """Enforce the local deadline and raise alerts; return when to look again."""
        if self._lost_reason is not None or self._done:
            return now + 60.0
        if now > self._deadline:
            self._mark_lost("no heartbeat was confirmed before the local deadline")
            return now + 60.0
        age = now - self._confirmed_at
        with self._state_lock:
            alert = age > self.alert_after and not self._alerting
            self._alerting = self._alerting or alert
        if alert:
            holder = {"holder": self.holder, "host": current().host, "pid": self._pid}
            send(
                signals.lock_alert,
                self._lock,
                name=self.name,
                holder=holder,
                heartbeat_age=age,
                lease=self,
            )
            call_metrics(self._lock._hooks(), "alert", self.name, age)
        next_alert = self._confirmed_at + self.alert_after if not self._alerting else self._deadline
        return min(self._deadline, next_alert) + 0.001

    def _check_session(self, conn: LockConnection) -> None:
        """An advisory lease dies with the session that took the key."""
        if (
            self._key_held
            and self._lost_reason is None
            and not self._done
            and (not conn.is_open() or conn.generation != self._generation)
        ):
            self._mark_lost("its database session ended, so a contender may take over at once")

    def _mark_lost(self, reason: str, *, row_gone: bool = False) -> None:
        with self._state_lock:
            if self._lost_reason is not None or self._done:
                return
            if row_gone and self._releasing:
                return  # the release in progress saw the row go, and settles the outcome
            self._lost_reason = reason
            callbacks = list(self._on_lost)
        if row_gone:
            # Someone else owns the name now: give the advisory key back at once.
            self._give_back_key()
        if not self._pending and not self._key_held:
            heartbeat.registry().discard(self)
        # Otherwise the row may still be ours (a missed deadline): the heartbeat thread
        # keeps the key, and so the holder's precedence, until the row is seen gone.
        logger.warning("django_pglock: lock %r (token %s) lost: %s", self.name, self.token, reason)
        send(signals.lock_lost, self._lock, lease=self, reason=reason)
        call_metrics(self._lock._hooks(), "lost", self.name)
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("django_pglock: on_lost callback for %r raised", self.name)

    def _recheck_lost(self) -> None:
        """For a lease lost by its deadline: once its row is gone, give the key back."""
        rows = self._conn.execute(sql.CHECK, {"name": self.name, "token": self.token})
        if not rows[0][0] or not self._key_held:
            self._give_back_key()
            heartbeat.registry().discard(self)

    def _claim_key(self) -> bool:
        """Take the duty to unlock the advisory key; true at most once per lease."""
        with self._state_lock:
            held = self._key_held and self._conn.is_open()
            held = held and self._conn.generation == self._generation
            self._key_held = False
            return held

    def _adopt_key(self, conn: LockConnection, now: float) -> None:
        """Try once to take the advisory key this lease was granted without.

        A contender held the key for the length of its own statement when this lease
        was granted; once this session holds it and the row says so, a crash of this
        process frees the name at once, as for any other advisory lease.
        """
        with self._release_lock:  # a release cannot claim the key meanwhile
            with self._state_lock:
                usable = not (self._done or self._lost_reason is not None or conn.pooled)
                if not usable or conn.generation != self._generation:
                    self._wants_key = False
                    return
            with conn.lock:
                rows = conn.execute(
                    sql.ADOPT_KEY, {"name": self.name, "token": self.token, "key": self._key}
                )
                generation = conn.generation
            adopted = bool(rows[0][0])
            with self._state_lock:
                if not adopted:
                    self._key_retry_at = now + self._key_retry_delay
                    self._key_retry_delay = min(
                        self._key_retry_delay * 2, self.heartbeat_interval, _LAST_KEY_RETRY
                    )
                    return
                self._wants_key = False
                if self._lost_reason is None:
                    self._key_held = True
                    self.advisory = True
                    self._generation = generation
                    return
        # Lost while the key was being taken: nobody else will give it back.
        with contextlib.suppress(LockError):
            conn.execute(sql.UNLOCK, {"key": self._key})

    def _give_back_key(self) -> None:
        if self._claim_key():
            # If the session is gone, the key went with it.
            with contextlib.suppress(LockError):
                self._conn.execute(sql.UNLOCK, {"key": self._key})

    def _finish_release(self) -> None:
        """Try the token-scoped delete; leave ``_done`` unset if a guard holds the row."""
        with self._release_lock:
            if not self._done:
                self._try_delete()

    def _try_delete(self) -> None:
        unlock = self._claim_key()
        params = {"name": self.name, "token": self.token, "advisory": unlock, "key": self._key}
        if self._run_id is None:
            statement = sql.RELEASE_GUARDED if self._guarded else sql.RELEASE
        else:
            statement = sql.RELEASE_GUARDED_RECORDED if self._guarded else sql.RELEASE_RECORDED
            params.update(run_id=self._run_id, outcome=self._outcome, exit_code=self.exit_code)
        rows = self._conn.execute(statement, params)
        deleted, present, _ = rows[0]
        if present and not deleted:
            self._key_held = unlock  # nothing was unlocked: keep the duty for the retry
            return  # locked by a guarded transaction; the heartbeat thread retries
        if not deleted:
            self._mark_lost("its row was gone at release")
        with self._state_lock:
            self._pending = False
            self._done = True
            was_lost = self._lost_reason is not None
        heartbeat.registry().discard(self)
        if deleted and not was_lost:
            send(signals.lock_released, self._lock, lease=self)
            call_metrics(
                self._lock._hooks(), "released", self.name, time.monotonic() - self._started
            )


class _Waiter:
    """The waiting policy shared by the sync and async shells."""

    def __init__(self, blocking: bool, timeout: float | None, poll_interval: float) -> None:
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
            if not blocking:
                raise ValueError(
                    f"timeout={timeout!r} was given with blocking=False; drop the timeout "
                    "or pass blocking=True."
                )
        self.blocking = blocking
        self.attempts = 0
        self.holder: dict[str, Any] | None = None  # the holder seen by the last attempt
        self.lock: Lock | None = None  # whose attempts these are
        self.poll_interval = poll_interval
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout

    def current_holder(self) -> dict[str, Any] | None:
        """The holder seen by the last refused attempt; read now if it committed after
        that attempt's snapshot (one more statement, only in that race)."""
        if self.holder is None and self.attempts and self.lock is not None:
            lock = self.lock
            found = get_connection(lock._alias()).execute(sql.HOLDER, {"name": lock.name})
            if found:
                fields = ("token", "holder", "host", "pid", "acquired_at", "description")
                self.holder = dict(zip((*fields, "heartbeat_age"), found[0][:7], strict=True))
        return self.holder

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next attempt, or ``None`` to give up."""
        if not self.blocking:
            return None
        delay = self.poll_interval * random.uniform(0.5, 1.0)
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return None
            delay = min(delay, remaining)
        return delay


T = TypeVar("T")


class _Option(Generic[T]):
    """A ``Lock`` option: its constructor argument, else the ``DJANGO_PGLOCK`` setting."""

    def __init__(self, argument: str, kind: Callable[[Any], T], doc: str) -> None:
        self.argument = argument
        self.kind = kind
        self.__doc__ = f"{doc} The argument, else the setting, read at each use."

    @overload
    def __get__(self, lock: None, owner: type[Lock]) -> _Option[T]: ...

    @overload
    def __get__(self, lock: Lock, owner: type[Lock]) -> T: ...

    def __get__(self, lock: Lock | None, owner: type[Lock]) -> _Option[T] | T:
        if lock is None:
            return self
        return self.kind(lock._option(self.argument)[0])


class _Resolved:
    """A lock's options resolved against the settings of one generation (see ``conf``)."""

    __slots__ = ("advisory", "alias", "generation", "key", "name", "poll", "thresholds")

    def __init__(self, lock: Lock) -> None:
        self.generation = generation()
        self.name = lock.name
        self.alias = validate_alias(lock._option("database")[0])
        self.thresholds = lock._resolve_thresholds()
        self.poll = check_seconds(*reversed(lock._option("poll_interval")))
        wanted, label = lock._option("advisory")
        if not isinstance(wanted, bool):
            raise ImproperlyConfigured(f"{label} = {wanted!r} must be True or False.")
        self.advisory = wanted
        self.key = sql.advisory_key(lock.name)


class Lock:
    """A named lock, held by at most one process at a time across all machines.

    ``Lock("nightly-report")`` costs nothing until it is acquired. Arguments left as
    ``None`` come from the ``DJANGO_PGLOCK`` setting at acquire time. Bad names and
    thresholds raise ``ValueError`` here; an unknown or non-PostgreSQL database alias
    raises ``ImproperlyConfigured``.
    """

    def __init__(
        self,
        name: str,
        *,
        using: str | None = None,
        heartbeat_interval: float | None = None,
        alert_after: float | None = None,
        stale_after: float | None = None,
        poll_interval: float | None = None,
        advisory: bool | None = None,
        metrics: Any = None,
        description: str | None = None,
        record: bool = False,
    ) -> None:
        self.name = validate_name(name)
        for label, value in (
            ("heartbeat_interval", heartbeat_interval),
            ("alert_after", alert_after),
            ("stale_after", stale_after),
            ("poll_interval", poll_interval),
        ):
            if value is not None:
                check_seconds(label, value)
        if advisory is not None and not isinstance(advisory, bool):
            raise ValueError(f"advisory={advisory!r} must be True, False or None (from settings).")
        if using is not None and settings.configured:
            validate_alias(using)
        if description is not None and not isinstance(description, str):
            raise ValueError(f"description={description!r} must be a string.")
        # Arguments as given; None means "from DJANGO_PGLOCK", resolved at each use.
        self._arguments: dict[str, Any] = {
            "database": using,
            "heartbeat_interval": heartbeat_interval,
            "alert_after": alert_after,
            "stale_after": stale_after,
            "poll_interval": poll_interval,
            "advisory": advisory,
        }
        if not isinstance(record, bool):
            raise ValueError(f"record={record!r} must be True or False.")
        self._cached: _Resolved | None = None
        self._cached_params: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.metrics = metrics
        self.record = record
        self.description = None if description is None else redact(description)
        if heartbeat_interval is not None and alert_after is not None and stale_after is not None:
            validate_thresholds(heartbeat_interval, alert_after, stale_after)
        elif settings.configured and (heartbeat_interval, alert_after, stale_after) != (None,) * 3:
            self._resolve_thresholds()  # partial arguments must fit the current settings

    def __repr__(self) -> str:
        return f"<Lock {self.name!r}>"

    # -- configuration, resolved at acquire time so override_settings works ------------

    using = _Option[str]("database", str, "The database alias.")
    heartbeat_interval = _Option[float]("heartbeat_interval", float, "Seconds between heartbeats.")
    alert_after = _Option[float]("alert_after", float, "Seconds without heartbeat before alert.")
    stale_after = _Option[float]("stale_after", float, "Seconds without heartbeat before reclaim.")
    poll_interval = _Option[float]("poll_interval", float, "Seconds between blocking attempts.")
    advisory = _Option[bool]("advisory", bool, "Whether the advisory path is wanted.")

    def _resolved(self) -> _Resolved:
        """The options as they stand now; resolved again only after a settings change."""
        cached = self._cached
        if cached is None or cached.generation != generation() or cached.name is not self.name:
            cached = self._cached = _Resolved(self)
        return cached

    def _alias(self) -> str:
        return self._resolved().alias

    def _option(self, argument: str) -> tuple[Any, str]:
        """An argument's value and label, falling back to the setting of that name."""
        value = self._arguments[argument]
        if value is not None:
            return value, "using" if argument == "database" else argument
        key = argument.upper()
        return get_setting(key), setting_label(key)

    def _resolve_thresholds(self) -> Thresholds:
        (hb, hb_label), (alert, alert_label), (stale, stale_label) = (
            self._option(attribute)
            for attribute in ("heartbeat_interval", "alert_after", "stale_after")
        )
        return validate_thresholds(hb, alert, stale, (hb_label, alert_label, stale_label))

    def _thresholds(self) -> Thresholds:
        return self._resolved().thresholds

    def _poll_interval(self) -> float:
        return self._resolved().poll

    def _record_skipped(self) -> None:
        """Add a ``skipped`` run to the history (for a recorded job that did not run)."""
        identity = current()
        get_connection(self._alias()).execute(
            sql.RECORD_SKIPPED,
            {
                "name": self.name,
                "holder": identity.holder,
                "host": identity.host,
                "pid": identity.pid,
                "description": self._description(),
            },
        )

    def _description(self) -> str:
        return self.description if self.description is not None else default_description()

    def _hooks(self) -> tuple[Any, ...]:
        """The metrics hooks to call: this lock's ``metrics`` and the configured one."""
        try:
            configured = configured_metrics()
        except Exception:
            logger.exception("django_pglock: DJANGO_PGLOCK['METRICS'] could not be loaded")
            configured = None
        if configured is None:
            return () if self.metrics is None else (self.metrics,)
        return (configured,) if self.metrics is None else (self.metrics, configured)

    # -- acquiring -----------------------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> _Acquisition:
        """Context manager yielding a :class:`Lease`, or ``None`` if not acquired.

        ``blocking=False`` makes one attempt; ``blocking=True`` retries every
        ``poll_interval`` (jittered) until acquired or ``timeout`` seconds have passed
        (``None``: no limit). Leaving the block releases the lock.
        """
        waiter = self._waiter(blocking, timeout)
        return _Acquisition(self, waiter)

    def try_acquire(self) -> Lease | None:
        """One attempt: a :class:`Lease` (call ``release()`` when done), or ``None``."""
        started = time.monotonic()
        lease, _ = self._attempt(first=True, want_holder=False)
        if lease is not None:
            self._granted(lease, started)
        return lease

    def acquire_or_raise(
        self, timeout: float | None = None, *, blocking: bool | None = None
    ) -> Lease:
        """A :class:`Lease`, or :class:`LockNotAcquired` naming the current holder.

        With no ``timeout`` this makes one attempt; with ``timeout`` it waits up to that
        many seconds; ``blocking=True`` with no timeout waits as long as it takes.
        """
        waiter = self._waiter(timeout is not None if blocking is None else blocking, timeout)
        lease = self._acquire(waiter)
        if lease is None:
            raise LockNotAcquired(
                f"Lock {self.name!r} is held by another process; try again later."
            )
        return lease

    def _waiter(self, blocking: bool, timeout: float | None) -> _Waiter:
        if not isinstance(blocking, bool):
            raise ValueError(f"blocking={blocking!r} must be True or False.")
        waiter = _Waiter(blocking, timeout, self._poll_interval())
        waiter.lock = self
        return waiter

    def acquire_async(
        self, blocking: bool = True, timeout: float | None = None
    ) -> AsyncAcquisition:
        """Async context manager: ``async with lock.acquire_async() as lease`` (or ``None``).

        Same semantics as :meth:`acquire`; waiting never blocks the event loop.
        """
        return AsyncAcquisition(self, self._waiter(blocking, timeout))

    def _acquire(self, waiter: _Waiter) -> Lease | None:
        """The synchronous shell: attempt, sleep, attempt again."""
        while True:
            lease = self._attempt_once(waiter)
            if lease is not None:
                return lease
            delay = waiter.next_delay()
            if delay is None:
                return None
            time.sleep(delay)

    def _attempt_once(self, waiter: _Waiter) -> Lease | None:
        """One attempt on behalf of ``waiter``; signals and metrics for its outcome."""
        lease, waiter.holder = self._attempt(first=waiter.attempts == 0)
        waiter.attempts += 1
        if lease is not None:
            self._granted(lease, waiter.started)
        return lease

    def _granted(self, lease: Lease, started: float) -> None:
        send(signals.lock_acquired, self, lease=lease)
        hooks = self._hooks()
        if hooks:
            call_metrics(hooks, "acquired", self.name, time.monotonic() - started)

    def _params(self, resolved: _Resolved, conn: LockConnection, advisory: bool) -> dict[str, Any]:
        """The acquire statement's parameters: the same for every attempt until the
        settings, the session, the process or the description change."""
        identity = current()
        description = self._description()
        key = (resolved, conn.durable_commit, advisory, identity, description)
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
            "durable": conn.durable_commit,
        }
        self._cached_params = (key, params)
        return params

    def _attempt(
        self, *, first: bool = True, want_holder: bool = True
    ) -> tuple[Lease | None, dict[str, Any] | None]:
        """One acquire statement: ``(lease, previous holder)`` or ``(None, current holder)``.

        With ``want_holder=False`` the current holder of a refused attempt is only
        described when a signal receiver or an alert needs it.
        """
        resolved = self._resolved()
        thresholds = resolved.thresholds
        conn = get_connection(resolved.alias)
        use_advisory = resolved.advisory and not conn.pooled
        params = self._params(resolved, conn, use_advisory)
        sent = time.monotonic()
        rows = conn.execute(sql.ACQUIRE_RECORDED if self.record else sql.ACQUIRE, params)
        (
            token,
            acquired_at,
            advisory,
            backend_pid,
            prev_token,
            prev_holder,
            prev_host,
            prev_pid,
            prev_acquired_at,
            prev_description,
            prev_age,
            prev_alert_after,
            prev_stale,
            _unlocked,
            run_id,
        ) = rows[0]
        alerting = prev_token is not None and prev_age > prev_alert_after
        previous = None
        if prev_token is not None and (
            want_holder
            or token is not None
            or alerting
            or (first and signals.lock_contended.receivers)
        ):
            previous = {
                "token": prev_token,
                "holder": prev_holder,
                "host": prev_host,
                "pid": prev_pid,
                "acquired_at": prev_acquired_at,
                "description": prev_description,
                "heartbeat_age": prev_age,
            }
        if token is None:
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
                    heartbeat_age=prev_age,
                    lease=None,
                )
                call_metrics(self._hooks(), "alert", self.name, prev_age)
            return None, previous
        lease = Lease(
            self,
            conn,
            token,
            acquired_at,
            bool(advisory),
            sent,
            thresholds,
            run_id,
            holder=params["holder"],
            key=resolved.key,
        )
        # The key was busy (a concurrent contender's statement held it): take it later.
        lease._wants_key = use_advisory and not advisory
        if conn.note_backend_pid(int(backend_pid)):
            # Every lease of this process on the alias leaves the advisory path at once.
            heartbeat.leave_advisory_path(conn, [*heartbeat.registry().leases(conn.alias), lease])
        elif lease.advisory and conn.pooled:
            heartbeat.leave_advisory_path(conn, [lease])
        if previous is not None:
            # The previous holder may be dead: finish its run, if it recorded one.
            conn.execute(sql.FINISH_LOST_RUN, {"name": self.name, "token": prev_token})
            reason = "stale" if prev_stale else "abandoned"
            send(signals.lock_reclaimed, self, lease=lease, previous=previous, reason=reason)
            call_metrics(self._hooks(), "stale_reclaimed", self.name)
        heartbeat.registry().add(lease)
        return lease, previous


class _Acquisition(AbstractContextManager["Lease | None"]):
    """What ``Lock.acquire()`` returns: acquires on enter, releases on exit."""

    def __init__(self, lock: Lock, waiter: _Waiter) -> None:
        self._lock = lock
        self._waiter = waiter
        self.lease: Lease | None = None

    @property
    def holder(self) -> dict[str, Any] | None:
        """The holder that made the last attempt fail (``None`` if none is known)."""
        return self._waiter.current_holder()

    def __enter__(self) -> Lease | None:
        self.lease = self._lock._acquire(self._waiter)
        return self.lease

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.lease is not None:
            self.lease.__exit__(exc_type, exc, tb)
