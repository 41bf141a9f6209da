"""``manage.py pglock_release <name> [--token N]``: forced release."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock.management.cli import database_option, reports_database_errors
from django_pglock.operations import force_release


class Command(BaseCommand):
    help = (
        "Force-release a lock. The old holder's next heartbeat, check() and guard() fail. "
        "With --token, only that grant is released (safe against a lock changing hands)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The lock name.")
        parser.add_argument("--token", type=int, default=None, help="Release only this grant.")
        parser.add_argument("--database", default=None, help="Database alias (default: setting).")

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        name, token = options["name"], options["token"]
        alias = database_option(options["database"])
        try:
            released = force_release(name, token=token, using=alias)
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from None
        if released is None:
            which = f" with token {token}" if token is not None else ""
            raise CommandError(f"No lock {name!r}{which} is held; nothing was released.")
        self.stdout.write(
            f"Released {name!r} (token {released['token']}, held by {released['holder']} "
            f"since {released['acquired_at'].isoformat(timespec='seconds')})."
        )
