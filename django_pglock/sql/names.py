"""The lock table's names, and the advisory key of a lock name."""

from __future__ import annotations

import hashlib

__all__ = [
    "CHANNEL",
    "LISTEN",
    "RUNS",
    "SEQUENCE",
    "TABLE",
    "UNLISTEN",
    "advisory_key",
    "notify",
    "quote_name",
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
    digest = f"encode(sha256(convert_to({name}, 'UTF8')), 'hex')"
    return f"pg_notify('{CHANNEL}', {digest})"


TABLE_SQL = quote_name(TABLE)
RUNS = quote_name("django_pglock_jobrun")
