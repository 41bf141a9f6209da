"""A lock's name and options: validation, and resolution against the settings."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from django.core.exceptions import ImproperlyConfigured

from . import sql
from .conf import check_seconds, generation, kind_of
from .connection import validate_alias
from .redaction import describe

if TYPE_CHECKING:
    from .lock import Lock

__all__ = [
    "MAX_LIMIT",
    "MAX_NAME_LENGTH",
    "MAX_SEMAPHORE_NAME_LENGTH",
    "Option",
    "Resolved",
    "validate_description",
    "validate_limit",
    "validate_name",
]

MAX_NAME_LENGTH = 255
#: The largest ``limit`` of a semaphore.
MAX_LIMIT = 1000
#: The longest name of a semaphore (``limit`` > 1): room is kept in the 255-character
#: column for the separator and the slot number of slots above the first ("\x1f1000").
MAX_SEMAPHORE_NAME_LENGTH = MAX_NAME_LENGTH - 1 - len(str(MAX_LIMIT))


def validate_name(name: object) -> str:
    """Return ``name`` if it can name a lock, else raise ``ValueError`` saying why.

    A name is a non-empty string of at most 255 characters, storable as UTF-8 (no NUL,
    no lone surrogate, no other control character), neither blank nor with leading or
    trailing whitespace.
    """
    if not isinstance(name, str):
        raise ValueError(f"Lock name {name!r} is {kind_of(name)}; pass a string.")
    if not name:
        raise ValueError("Lock name '' is empty; pass a non-empty string such as 'nightly-report'.")
    if not name.strip():
        raise ValueError(
            f"Lock name {name!r} is blank (only whitespace); pass a name such as 'nightly-report'."
        )
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
    if name != name.strip():
        raise ValueError(
            f"Lock name {name!r} has leading or trailing whitespace; pass {name.strip()!r}."
        )
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:
        # "\x1f" separates a semaphore's name from its slot numbers (sql.slot_row).
        raise ValueError(
            f"Lock name {name!r} contains the control character {control!r}; lock names "
            "cannot contain control characters (tabs, newlines, \\x00-\\x1f, \\x7f-\\x9f): "
            "remove it."
        )
    return name


def validate_limit(limit: object, name: str) -> int:
    """Return ``limit`` if lock ``name`` can have that many holders at once, else raise
    ``ValueError`` saying why: an ``int`` from 1 to ``MAX_LIMIT`` (1000), and a name of at
    most ``MAX_SEMAPHORE_NAME_LENGTH`` (250) characters when it is above 1."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise ValueError(
            f"limit={limit!r} is {kind_of(limit)}; pass a whole number of holders from 1 "
            f"to {MAX_LIMIT}, such as limit=3."
        )
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"limit={limit} is out of range; pass a number of holders from 1 to {MAX_LIMIT} "
            "(1: a plain lock)."
        )
    if limit > 1 and len(name) > MAX_SEMAPHORE_NAME_LENGTH:
        raise ValueError(
            f"Lock name {name[:40]!r}... is {len(name)} characters long; a semaphore's "
            f"(limit={limit}) can be at most {MAX_SEMAPHORE_NAME_LENGTH}, to leave room for "
            "its slot numbers. Pass a shorter name."
        )
    return limit


def validate_description(description: object) -> str:
    """``description`` as stored: redacted, cut to ``MAX_DESCRIPTION_LENGTH`` (2000) characters.

    Raises ``ValueError`` for anything but a string and for what PostgreSQL text cannot
    hold (NUL, a lone surrogate); the message quotes the description redacted.
    """
    text = description if isinstance(description, str) else repr(description)
    quoted = repr(describe(text)) if isinstance(description, str) else describe(text)
    if len(quoted) > 80:
        quoted = quoted[:80] + "..."
    if not isinstance(description, str):
        raise ValueError(f"description={quoted} must be a string, not {kind_of(description)}.")
    if "\x00" in description:
        raise ValueError(
            f"description={quoted} contains a NUL character, which PostgreSQL text cannot "
            "hold; remove it."
        )
    try:
        description.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"description={quoted} cannot be stored as UTF-8 (it holds a lone surrogate); "
            "pass valid text (django_pglock.redaction.displayable() shows undecodable bytes "
            "as \\xff)."
        ) from None
    return describe(description)


T = TypeVar("T")


class Option(Generic[T]):
    """A ``Lock`` option: its constructor argument, else the ``DJANGO_PGLOCK`` setting."""

    def __init__(self, argument: str, kind: Callable[[Any], T], doc: str) -> None:
        self.argument = argument
        self.kind = kind
        self.__doc__ = f"{doc} The argument, else the setting, read at each use."

    @overload
    def __get__(self, lock: None, owner: type[Lock]) -> Option[T]: ...

    @overload
    def __get__(self, lock: Lock, owner: type[Lock]) -> T: ...

    def __get__(self, lock: Lock | None, owner: type[Lock]) -> Option[T] | T:
        if lock is None:
            return self
        return self.kind(lock._option(self.argument)[0])


class Resolved:
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
