"""The lock table's names, and the advisory key of a lock name."""

from __future__ import annotations

import hashlib

__all__ = [
    "CHANNEL",
    "LISTEN",
    "RUNS",
    "SEQUENCE",
    "SLOT_SEPARATOR",
    "TABLE",
    "UNLISTEN",
    "advisory_key",
    "base_name_sql",
    "notify",
    "quote_name",
    "slot_of",
    "slot_row",
    "slot_sql",
    "wake_key",
]

TABLE = "django_pglock_joblock"
SEQUENCE = "django_pglock_token_seq"


def quote_name(name: str) -> str:
    """Quote an identifier the way Django's PostgreSQL backend does."""
    return name if name.startswith('"') and name.endswith('"') else f'"{name}"'


def advisory_key(name: str) -> int:
    """The session advisory-lock key (a signed bigint) of a lock name.

    A collision between two names only ever costs speed: a contender that cannot take
    the key treats the holder as alive and waits for ``stale_after``.
    """
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=b"django_pglock").digest()
    return int.from_bytes(digest, "big", signed=True)


#: Between a semaphore's name and the number of a slot above the first in that slot's
#: row name (``"exports\x1f2"``). Lock names cannot contain it (no control character).
SLOT_SEPARATOR = "\x1f"


def slot_row(name: str, slot: int) -> str:
    """The row name of slot ``slot`` (1..N) of lock ``name``: the name itself for slot 1,
    so that a plain lock is slot 1 of a semaphore of the same name."""
    return name if slot == 1 else f"{name}{SLOT_SEPARATOR}{slot}"


def slot_of(row: str) -> tuple[str, int]:
    """``(name, slot)`` of a row name: the one place, with :func:`base_name_sql`, that
    reads a row name back."""
    name, separator, number = row.partition(SLOT_SEPARATOR)
    return (name, int(number)) if separator and number.isdigit() else (name, 1)


def base_name_sql(column: str) -> str:
    """SQL for the lock name of the row name in ``column`` (:func:`slot_of` in SQL)."""
    return f"split_part({column}, E'\\x1f', 1)"


def slot_sql(column: str) -> str:
    """SQL for the slot of the row name in ``column`` (1 for a plain lock's row)."""
    return f"coalesce(nullif(split_part({column}, E'\\x1f', 2), '')::int, 1)"


#: The channel every lock statement that frees a name notifies on (one per database, as a
#: lock's scope is).
CHANNEL = "django_pglock"
LISTEN = f'LISTEN "{CHANNEL}"'
UNLISTEN = f'UNLISTEN "{CHANNEL}"'


def wake_key(name: str) -> str:
    """The payload of the notification that a lock name was freed: its SHA-256 in hex,
    as :func:`notify` computes it on the server. Any role that can connect may listen on
    any channel: a digest keeps the names themselves off the channel. The one place
    that says which name's waiters a freed row wakes (see :func:`notify`)."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def notify(name: str) -> str:
    """The SQL expression that wakes the waiters of the name ``name`` (an SQL expression
    naming the freed row's name): ``pg_notify`` on :data:`CHANNEL` with :func:`wake_key`
    of it. Delivered when the statement's transaction commits, never before."""
    digest = f"encode(sha256(convert_to({base_name_sql(name)}, 'UTF8')), 'hex')"
    return f"pg_notify('{CHANNEL}', {digest})"


TABLE_SQL = quote_name(TABLE)
RUNS = quote_name("django_pglock_jobrun")
