"""Leader election in-process: ``with lock.leadership() as lease:`` (and its async form).

A term of leadership is one grant of the lock. It moves through :class:`Term`, and
``Leadership._advance`` is the one place where it changes: ``WAITING`` until elected,
``LEADING`` while the lease is held, then ``DEMOTED`` (the lease was lost: a missed
heartbeat deadline, a forced release, the lock's session ended) or ``RESIGNED`` (the
block was left and the lease released). Demotion sets :attr:`Leadership.demoted` and
calls ``on_demotion(lease)`` once, from the thread that saw the loss (the heartbeat
thread or its watchdog, as ``Lease.on_lost``). Neither can stop the body: the body must
stop leading when demoted, by looking at ``lease.lost`` or ``demoted`` between steps, or
by fencing its writes with ``lease.guard()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .exceptions import LockNotAcquired, LockNotHeld
from .waiting import describe_holder

if TYPE_CHECKING:
    from .acquisition import Acquisition
    from .aio import AsyncAcquisition
    from .lease import Lease

__all__ = ["AsyncLeadership", "Leadership", "Term"]

logger = logging.getLogger("django_pglock")

Callback = Callable[["Lease"], Any]


class Term(enum.Enum):
    """Where a term of leadership is."""

    WAITING = "waiting"  # not elected yet
    LEADING = "leading"  # elected: the lease is held
    DEMOTED = "demoted"  # the lease was lost (found while leading, or when leaving)
    RESIGNED = "resigned"  # left without being demoted (or never elected): released


#: The only changes a term may make.
TRANSITIONS: dict[Term, frozenset[Term]] = {
    Term.WAITING: frozenset({Term.LEADING, Term.RESIGNED}),
    Term.LEADING: frozenset({Term.DEMOTED, Term.RESIGNED}),
    Term.DEMOTED: frozenset(),
    Term.RESIGNED: frozenset(),
}


class _TermMixin:
    """The state of a term and its demotion, shared by the sync and async shells."""

    lease: Lease | None

    def _start(self, name: str, timeout: float | None, on_demotion: Callback | None) -> None:
        if on_demotion is not None and not callable(on_demotion):
            raise ValueError(
                f"on_demotion={on_demotion!r} is not callable; pass a function taking the "
                "lease (for example an Event's set wrapped in a lambda), or None."
            )
        self.name = name
        self.timeout = timeout
        self.on_demotion = on_demotion
        self.state = Term.WAITING
        self.lease = None
        #: Set once the term ended by demotion (never by leaving the block normally).
        self.demoted = threading.Event()
        self._state_lock = threading.Lock()
        self._entered = False

    def _advance(self, to: Term) -> bool:
        """Move to ``to`` if :data:`TRANSITIONS` allows it; ``False`` (no change) if not."""
        with self._state_lock:
            if to not in TRANSITIONS[self.state]:
                return False
            self.state = to
        if to is Term.DEMOTED:
            self.demoted.set()
            self._demoted_hook()
        return True

    def _demoted_hook(self) -> None:
        """Called once on demotion, after ``demoted`` is set (the async shell wakes its loop)."""

    def _enter_once(self) -> None:
        if self._entered:
            raise RuntimeError(
                f"This leadership of {self.name!r} was entered already; call "
                "lock.leadership() again for a new term."
            )
        self._entered = True

    def _elected(self, lease: Lease | None, holder: dict[str, Any] | None) -> Lease:
        """Lead with ``lease``, or raise :class:`LockNotAcquired` if the wait timed out."""
        if lease is None:
            self._advance(Term.RESIGNED)
            raise LockNotAcquired(
                f"Not elected leader of {self.name!r} within timeout={self.timeout!r} s: it "
                f"is held by {describe_holder(holder)}. Wait again, or pass a longer timeout."
            )
        self.lease = lease
        self._advance(Term.LEADING)
        lease.on_lost(self._lost)  # called at once if already lost
        return lease

    def _lost(self, lease: Lease) -> None:
        if self._advance(Term.DEMOTED) and self.on_demotion is not None:
            self.on_demotion(lease)  # its exception is logged by Lease._announce_lost

    def _ended(self, raised: bool, exc: BaseException | None) -> bool:
        """After the release: the term's end; whether to suppress ``exc``.

        A loss found only by the release (the row was gone) is a demotion too. Leaving
        a demoted term returns quietly, also with the ``LockNotHeld`` that ``check()``
        or ``guard()`` raised in the body because of it; any other exception propagates.
        """
        lease = self.lease
        if lease is not None and lease._lost_reason is not None and self.state is Term.LEADING:
            try:
                self._lost(lease)
            except Exception:
                logger.exception("django_pglock: on_demotion callback for %r raised", self.name)
        if self.state is not Term.DEMOTED:
            self._advance(Term.RESIGNED)
            if raised:  # a forked child leaving its parent's term: it never led
                raise LockNotHeld(f"Lock {self.name!r} was lost.")
            return False
        return isinstance(exc, LockNotHeld)

    @property
    def reason(self) -> str | None:
        """Why the term ended by demotion (``None`` unless demoted)."""
        if self.state is not Term.DEMOTED or self.lease is None:
            return None
        return self.lease._lost_reason


class Leadership(_TermMixin):
    """What ``Lock.leadership()`` returns: blocks until elected, yields the Lease.

    Leaving the block releases the lock (a standby is elected at once). A term that
    ended by demotion leaves quietly: ``demoted`` is set and ``reason`` says why.
    """

    def __init__(self, acquisition: Acquisition, on_demotion: Callback | None) -> None:
        self._acquisition = acquisition
        self._start(acquisition._lock.name, acquisition._waiter.timeout, on_demotion)

    def __repr__(self) -> str:
        return f"<Leadership {self.name!r} {self.state.value}>"

    def __enter__(self) -> Lease:
        self._enter_once()
        try:
            lease = self._acquisition.__enter__()
        except BaseException:
            self._advance(Term.RESIGNED)
            raise
        return self._elected(lease, self._acquisition.holder)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        raised = False
        try:
            self._acquisition.__exit__(exc_type, exc, tb)
        except LockNotHeld:  # lost while the block ran without error
            raised = True
        return self._ended(raised, exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until demoted or ``timeout`` s have passed; whether demoted.

        ``while not leadership.wait(10): tick()`` runs ``tick`` every 10 s while leading.
        """
        return self.demoted.wait(timeout)


class AsyncLeadership(_TermMixin):
    """What ``Lock.leadership_async()`` returns: ``async with`` waits until elected,
    never blocking the event loop, and yields the Lease; ``await wait()`` returns on
    demotion. Otherwise as :class:`Leadership`."""

    def __init__(self, acquisition: AsyncAcquisition, on_demotion: Callback | None) -> None:
        self._acquisition = acquisition
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_demoted: asyncio.Event | None = None
        self._start(acquisition._lock.name, acquisition._waiter.timeout, on_demotion)

    def __repr__(self) -> str:
        return f"<AsyncLeadership {self.name!r} {self.state.value}>"

    def _demoted_hook(self) -> None:
        loop, event = self._loop, self._async_demoted
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(event.set)

    async def __aenter__(self) -> Lease:
        self._enter_once()
        self._loop = asyncio.get_running_loop()
        self._async_demoted = asyncio.Event()
        try:
            lease = await self._acquisition.__aenter__()
        except BaseException:
            self._advance(Term.RESIGNED)
            raise
        # The holder the last attempt saw, without a statement in the event loop.
        return self._elected(lease, self._acquisition._waiter.holder)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        raised = False
        try:
            await self._acquisition.__aexit__(exc_type, exc, tb)
        except LockNotHeld:
            raised = True
        return self._ended(raised, exc)

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until demoted or ``timeout`` s have passed; whether demoted."""
        event = self._async_demoted
        if event is None or self.demoted.is_set():
            return self.demoted.is_set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return self.demoted.is_set()
