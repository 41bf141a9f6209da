"""The states of a lease and of its advisory key, and the changes each may make.

``Lease._advance`` (for :class:`State`) and ``KeyMixin._set_key`` (for :class:`Key`)
are the only places where they change.
"""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "Key", "State"]


class State(enum.Enum):
    """Where a lease is in its life."""

    HELD = "held"  # granted; the heartbeat thread keeps it alive
    LOST = "lost"  # may have been lost; kept only while it still holds its advisory key
    RELEASING = "releasing"  # release asked for; the token-scoped delete has not settled
    RELEASED = "released"  # settled: our row is deleted or was found gone


#: The only changes a lease's state may make.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.HELD: frozenset({State.LOST, State.RELEASING}),
    State.LOST: frozenset({State.RELEASING}),
    State.RELEASING: frozenset({State.RELEASED}),
    State.RELEASED: frozenset(),
}


class Key(enum.Enum):
    """Whether the lock connection's session holds a lease's advisory key."""

    NONE = "none"  # it does not (table path, given back, or its session ended)
    WANTED = "wanted"  # granted while the key was busy: the heartbeat thread takes it
    HELD = "held"  # it does, and the row says so: a crash frees the name at once
