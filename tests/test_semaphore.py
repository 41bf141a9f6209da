"""Semaphores (``Lock(name, limit=N)``), in one process, against a real PostgreSQL.

The process-level tests (8 processes, a SIGKILLed holder) are in test_semaphore_procs.py.
"""

from __future__ import annotations

import pytest

from django_pglock import Lock, LockNotAcquired, LockNotHeld, sql
from django_pglock.operations import force_release

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def rows(db, name):
    """(slot, token, slot_limit, advisory) of every row of lock ``name``, by slot."""
    found = db.execute(
        "SELECT name, token, slot_limit, advisory FROM django_pglock_joblock"
        f" WHERE {sql.base_name_sql('name')} = %s",
        [name],
    ).fetchall()
    return sorted((sql.slot_of(row)[1], token, limit, adv) for row, token, limit, adv in found)


@pytest.mark.parametrize("advisory", [True, False])
def test_at_most_limit_holders_each_in_its_own_slot(db, advisory):
    lock = Lock("sem-basic", limit=3, advisory=advisory)
    leases = [lock.try_acquire() for _ in range(3)]
    assert all(lease is not None for lease in leases)
    assert [lease.slot for lease in leases] == [1, 2, 3]
    assert {lease.name for lease in leases} == {"sem-basic"}
    assert {lease.limit for lease in leases} == {3}
    assert lock.try_acquire() is None  # a fourth is refused
    assert [(s, t, n, a) for s, t, n, a in rows(db, "sem-basic")] == [
        (lease.slot, lease.token, 3, advisory) for lease in leases
    ]
    leases[1].release()
    again = lock.try_acquire()
    assert again is not None and again.slot == 2 and again.token > leases[1].token
    for lease in (leases[0], leases[2], again):
        lease.check()
        lease.beat()
        lease.release()
    assert rows(db, "sem-basic") == []


def test_plain_lock_is_slot_one(db):
    """``Lock(x)`` and ``Lock(x, limit=1)`` exclude each other; a plain lock holds slot 1
    of a semaphore of the same name, and so counts against it."""
    plain = Lock("sem-plain").try_acquire()
    assert plain is not None and plain.slot == 1 and plain.limit == 1
    assert Lock("sem-plain", limit=1).try_acquire() is None
    sem = Lock("sem-plain", limit=2)
    second = sem.try_acquire()
    assert second is not None and second.slot == 2
    assert sem.try_acquire() is None
    plain.release()
    assert Lock("sem-plain").try_acquire() is not None  # slot 1 is free again


def test_lowering_and_raising_the_limit(db):
    """Slots are 1..N of the acquirer's own limit: after lowering N, holders above it keep
    their slots and nobody new gets in while 1..N are held; raising N admits at once."""
    wide = Lock("sem-change", limit=4)
    held = [wide.try_acquire() for _ in range(4)]
    assert [lease.slot for lease in held] == [1, 2, 3, 4]
    narrow = Lock("sem-change", limit=2)
    held[0].release()
    first = narrow.try_acquire()
    assert first is not None and first.slot == 1
    assert narrow.try_acquire() is None  # 4 held (slots 1-4), more than 2: none admitted
    held[3].release()
    assert narrow.try_acquire() is None  # slots 1 and 2 are held: still none admitted
    assert [s for s, *_ in rows(db, "sem-change")] == [1, 2, 3]
    wider = Lock("sem-change", limit=5)
    fourth = wider.try_acquire()
    fifth = wider.try_acquire()
    assert (fourth.slot, fifth.slot) == (4, 5)  # raised: admitted at once
    assert wider.try_acquire() is None


def test_release_of_one_slot_leaves_the_others(db):
    lock = Lock("sem-force", limit=2)
    a, b = lock.try_acquire(), lock.try_acquire()
    released = force_release("sem-force", token=b.token)
    assert released is not None and released["token"] == b.token
    with pytest.raises(LockNotHeld):
        b.check()
    a.check()
    assert [s for s, *_ in rows(db, "sem-force")] == [1]


def test_acquire_or_raise_on_a_full_semaphore_says_it_is_full(db):
    lock = Lock("sem-full", limit=2)
    held = [lock.acquire_or_raise(), lock.acquire_or_raise()]
    with pytest.raises(LockNotAcquired, match=r"Lock 'sem-full' is full \(2 of 2 held\)"):
        lock.acquire_or_raise()
    for lease in held:
        lease.release()


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (0, "limit=0 is out of range"),
        (-1, "limit=-1 is out of range"),
        (1001, "limit=1001 is out of range"),
        (True, "limit=True is a bool"),
        (2.0, "limit=2.0 is a float"),
        ("3", "limit='3' is a str"),
        (None, "limit=None is"),
    ],
)
def test_bad_limit(db, limit, message):
    with pytest.raises(ValueError, match="limit=") as info:
        Lock("sem-bad", limit=limit)
    assert message in str(info.value)
    assert "1 to 1000" in str(info.value)


def test_semaphore_name_leaves_room_for_slots():
    Lock("x" * 255)  # a plain lock keeps the whole column
    Lock("x" * 250, limit=1000)
    with pytest.raises(ValueError, match="at most 250"):
        Lock("x" * 251, limit=2)


@pytest.mark.parametrize("bad", ["a\x1fb", "tab\there", "line\nbreak", "del\x7f", "c1\x85in"])
def test_names_cannot_hold_control_characters(bad):
    with pytest.raises(ValueError, match="control character"):
        Lock(bad)


def test_force_release_without_token_refuses_several_holders(db):
    lock = Lock("sem-force-all", limit=3)
    a, b = lock.try_acquire(), lock.try_acquire()
    with pytest.raises(ValueError, match=rf"2 holders \(tokens {a.token}, {b.token}\)"):
        force_release("sem-force-all")
    assert [s for s, *_ in rows(db, "sem-force-all")] == [1, 2]  # nothing changed
    b.release()
    released = force_release("sem-force-all")  # a lone holder: released
    assert released["token"] == a.token and released["slot"] == 1


def test_status_and_json_show_held_of_limit(db):
    import json

    from django.core.management import call_command

    from django_pglock.operations import lock_status

    lock = Lock("sem-status", limit=3)
    a, b = lock.try_acquire(), lock.try_acquire()
    status = [row for row in lock_status() if row.name == "sem-status"]
    assert sorted((row.slot, row.token) for row in status) == [(1, a.token), (2, b.token)]
    assert {(row.held, row.limit, row.held_label) for row in status} == {(2, 3, "2 of 3 held")}
    out = io_of(call_command, "pglock_status")
    assert "SEMAPHORE: sem-status: 2 of 3 held." in out
    assert "sem-status [slot 2]" in out and str(b.token) in out
    data = json.loads(io_of(call_command, "pglock_status", "--json"))
    mine = sorted(
        (d["slot"], d["token"], d["held_label"]) for d in data if d["name"] == "sem-status"
    )
    assert mine == [(1, a.token, "2 of 3 held"), (2, b.token, "2 of 3 held")]


def io_of(call, *args):
    import io

    out = io.StringIO()
    call(*args, stdout=out)
    return out.getvalue()
