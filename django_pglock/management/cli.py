"""What the management commands share: ``--database`` in command-line terms, and a
database they cannot use reported in one line.

A command that cannot reach or use the lock database writes one line to stderr naming
the alias and the cause, and exits with status 2 (configuration); ``--traceback`` shows
the traceback. Passwords never appear: libpq's messages name host, port and user only,
and the line is redacted on top.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import DatabaseError, connections

from django_pglock.conf import get_setting, validate_alias
from django_pglock.exceptions import LockError, LockNotAcquired, LockNotHeld
from django_pglock.failures import first_line
from django_pglock.identity import redact

__all__ = ["EXIT_CONFIG", "database_option", "reports_database_errors"]

EXIT_CONFIG = 2

Handle = TypeVar("Handle", bound=Callable[..., Any])


def database_option(value: str | None) -> str:
    """The lock alias for ``--database VALUE`` (default: the setting), checked.

    Raises :class:`CommandError` (exit 2) in command-line terms when it names no
    PostgreSQL alias.
    """
    if value is None:
        try:
            return validate_alias(get_setting("DATABASE"))
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_CONFIG) from None
    known = ", ".join(connections.settings) or "none"
    if value not in connections.settings:
        raise CommandError(
            f"--database {value}: no such database alias in settings.DATABASES (known: "
            f"{known}). Pass one of them, or leave --database out to use "
            "DJANGO_PGLOCK['DATABASE'].",
            returncode=EXIT_CONFIG,
        )
    vendor = connections[value].vendor
    if vendor != "postgresql":
        raise CommandError(
            f"--database {value}: that alias uses the {vendor!r} backend; the locks live "
            "on PostgreSQL. Pass a PostgreSQL alias.",
            returncode=EXIT_CONFIG,
        )
    return value


def _missing_table(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.errors.UndefinedTable):
            return True
        seen = seen.__cause__
    return False


def describe_database_error(exc: BaseException, alias: str) -> str:
    """One line for ``exc``: the alias, the cause (redacted) and what to do."""
    if isinstance(exc, LockError):  # already names the alias and what to check
        return redact(first_line(exc).rstrip(".")) + "."
    if _missing_table(exc):
        hint = f"Run 'manage.py migrate django_pglock --database {alias}'."
    else:
        hint = f"Check DATABASES[{alias!r}] and that the server is up."
    return f"Database alias {alias!r} cannot be used: {redact(first_line(exc).rstrip('.'))}. {hint}"


def reports_database_errors(handle: Handle) -> Handle:
    """Decorate a command's ``handle``: a database it cannot use ends it with one line
    on stderr and exit status 2, instead of a traceback."""

    @functools.wraps(handle)
    def wrapper(self: Any, *args: Any, **options: Any) -> Any:
        try:
            return handle(self, *args, **options)
        except (LockNotHeld, LockNotAcquired):
            raise
        except (LockError, DatabaseError, psycopg.Error) as exc:
            alias = options.get("database") or get_setting("DATABASE")
            message = describe_database_error(exc, str(alias))
            raise CommandError(message, returncode=EXIT_CONFIG) from exc

    return wrapper  # type: ignore[return-value]
