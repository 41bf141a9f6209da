"""A grant its caller never received (a cancelled ``acquire_async``, an interrupted
``acquire``) is released, and its run is recorded as ``failed``: its body never ran, so it
never shows as a success ("Last successful run")."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid

import pytest

from django_pglock import Lock, signals
from django_pglock.aio import _Handoff
from tests.subprocs import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def unique(label):
    return f"{label}-{uuid.uuid4().hex[:8]}"


def runs(db, name):
    """(token, outcome) of every run of ``name``, once none is running and the lock is free
    (a grant given up is released by the heartbeat thread, soon after)."""

    def settled():
        held = db.execute("SELECT 1 FROM django_pglock_joblock WHERE name = %s", [name])
        running = db.execute(
            "SELECT 1 FROM django_pglock_jobrun WHERE name = %s AND finished_at IS NULL", [name]
        )
        return held.fetchone() is None and running.fetchone() is None

    wait_until(settled, 30, f"the runs of {name!r} never settled")
    return db.execute(
        "SELECT token, outcome FROM django_pglock_jobrun WHERE name = %s ORDER BY id", [name]
    ).fetchall()


@contextlib.contextmanager
def on_acquired(name, receiver):
    """Call ``receiver(lease)`` from ``lock_acquired`` for grants of ``name`` (it runs in
    the thread that made the attempt, before the grant is handed over)."""

    def receive(sender, lease, **kwargs):
        if lease.name == name:
            receiver(lease)

    signals.lock_acquired.connect(receive, weak=False)
    try:
        yield
    finally:
        signals.lock_acquired.disconnect(receive)


def test_cancelled_async_acquires_are_never_recorded_as_succeeded(db):
    """The issue's scenario: 30 ``task.cancel()`` during ``acquire_async(record=True)``.

    A third of the cancellations land while the acquire statement's thread still runs
    (deterministically: the ``lock_acquired`` receiver waits for the task to end), a third
    as the grant is handed over, a third from the loop at a varying moment (the body may
    then run: that run, and only that kind, is a success).
    """
    name = unique("cancelled")
    lock = Lock(name, record=True)
    bodies = []  # tokens whose body ran
    current = {}

    def cancel_from_the_thread(lease):
        task, loop, mode = current["task"], current["loop"], current["mode"]
        if mode == "during":
            ended = threading.Event()
            loop.call_soon_threadsafe(lambda: task.add_done_callback(lambda _: ended.set()))
            loop.call_soon_threadsafe(task.cancel)
            assert ended.wait(30), "the cancelled task never ended"
        elif mode == "handover":
            loop.call_soon_threadsafe(task.cancel)

    async def one():
        async with lock.acquire_async(blocking=True, timeout=30) as lease:
            bodies.append(lease.token)

    async def main():
        current["loop"] = asyncio.get_running_loop()
        for i in range(30):
            current["mode"] = ("during", "handover", "loop")[i % 3]
            task = current["task"] = asyncio.create_task(one())
            if current["mode"] == "loop":
                for _ in range(i % 5):
                    await asyncio.sleep(0)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    with on_acquired(name, cancel_from_the_thread):
        asyncio.run(main())

    recorded = runs(db, name)
    # Every cancellation from the thread came after a grant (one from the loop may come
    # before the task even started its acquire).
    assert len(recorded) >= 20
    succeeded = [token for token, outcome in recorded if outcome == "succeeded"]
    assert set(succeeded) <= set(bodies), (
        f"runs recorded as succeeded whose body never ran: {set(succeeded) - set(bodies)}"
    )
    assert {outcome for _, outcome in recorded} <= {"succeeded", "failed"}
    # At least every cancellation that landed while the statement ran was one.
    assert sum(outcome == "failed" for _, outcome in recorded) >= 10


def test_a_grant_handed_over_after_its_task_was_cancelled_is_failed(db):
    """The hand-over's other order: the grant reached the hand-over first, then the task
    was cancelled before it took it (``_Handoff.abandon`` finds the lease)."""
    name = unique("handover")
    lock = Lock(name, record=True)
    handoff = _Handoff()
    lease = handoff.run(lambda: lock._attempt_once(lock._waiter(False, None)))
    assert lease is not None
    handoff.abandon()
    assert runs(db, name) == [(lease.token, "failed")]


def test_a_grant_cancelled_while_its_statement_ran_is_failed(db):
    name = unique("abandoned-first")
    lock = Lock(name, record=True)
    handoff = _Handoff()
    handoff.abandon()
    granted = []

    def attempt():
        lease = lock._attempt_once(lock._waiter(False, None))
        granted.append(lease)
        return lease

    assert handoff.run(attempt) is None
    assert granted[0] is not None
    assert runs(db, name) == [(granted[0].token, "failed")]


class Interrupt(BaseException):
    """Like KeyboardInterrupt: not caught by signal dispatch."""


def test_an_interrupted_sync_acquire_is_failed(db):
    """A receiver interrupted after the grant (a signal handler's exception): nobody gets
    the lease, it is released, and its run is not a success."""
    name = unique("interrupted")
    lock = Lock(name, record=True)

    def interrupt(lease):
        raise Interrupt

    with on_acquired(name, interrupt), pytest.raises(Interrupt), lock.acquire(blocking=False):
        pytest.fail("the body ran")
    [(_, outcome)] = runs(db, name)
    assert outcome == "failed"
