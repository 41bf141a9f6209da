"""``manage.py pglock_status``: who holds what, and does it look alive."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock.management.cli import database_option, reports_database_errors
from django_pglock.operations import lock_status


class Command(BaseCommand):
    help = (
        "List held locks with holder, heartbeat age (by the database clock) and state "
        "(ok / alert / stale, judged by each row's own thresholds; abandoned when the "
        "holder's session has ended and the next contender takes the lock at once)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        parser.add_argument(
            "--check",
            action="store_true",
            help="Exit with status 1 when any lock is in alert or stale (for monitors); "
            "an abandoned lock (holder gone) does not fail the check.",
        )
        parser.add_argument("--database", default=None, help="Database alias (default: setting).")

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        rows = lock_status(using=database_option(options["database"]))
        if options["json"]:
            self.stdout.write(json.dumps([row.as_dict() for row in rows], indent=2))
        elif not rows:
            self.stdout.write("No locks are held.")
        else:
            header = ("NAME", "STATE", "HEARTBEAT AGE", "HOLDER", "ACQUIRED", "TOKEN", "RUNS")
            table = [header] + [
                (
                    row.name,
                    row.state.upper() if row.state != "ok" else "ok",
                    f"{row.heartbeat_age:.1f}s",
                    f"{row.host}:{row.pid}",
                    row.acquired_at.isoformat(timespec="seconds"),
                    str(row.token),
                    row.description[:60],
                )
                for row in rows
            ]
            widths = [max(len(line[i]) for line in table) for i in range(len(header))]
            for line in table:
                self.stdout.write(
                    "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                )
            if any(row.state == "abandoned" for row in rows):
                self.stdout.write(
                    "ABANDONED: the holder's session has ended (its process died or lost the "
                    "lock); the next contender takes the lock at once. Nothing to do."
                )
        unhealthy = [row for row in rows if row.state in ("alert", "stale")]
        if options["check"] and unhealthy:
            names = ", ".join(f"{row.name!r} ({row.state})" for row in unhealthy)
            raise CommandError(f"{len(unhealthy)} lock(s) need attention: {names}.", returncode=1)
