"""The lock table's names, and the advisory key of a lock name."""

from __future__ import annotations

import hashlib

__all__ = ["RUNS", "SEQUENCE", "TABLE", "advisory_key", "quote_name"]

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


TABLE_SQL = quote_name(TABLE)
RUNS = quote_name("django_pglock_jobrun")
