"""``manage.py pglock_prune --older-than 30d``: forget old run history and schedule claims."""

from __future__ import annotations

import re
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock import sql
from django_pglock.connection import get_connection
from django_pglock.management.cli import database_option, reports_database_errors

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(text: str) -> float:
    """``"30d"`` → seconds; units s, m, h, d, w."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise CommandError(
            f"--older-than {text!r} is not an age; use a number and a unit, such as 30d, "
            "12h or 90m (units: s, m, h, d, w).",
            returncode=2,
        )
    return float(match.group(1)) * UNITS[match.group(2)]


class Command(BaseCommand):
    help = (
        "Delete run history (JobRun) and schedule claims older than --older-than. Kept "
        "whatever their age: runs still going on, and the latest slot claimed by each job "
        "(it may still be the current slot, which would otherwise start again)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, help="Age such as 30d, 12h or 90m.")
        parser.add_argument("--database", default=None, help="Database alias (default: setting).")

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        age = parse_age(options["older_than"])
        alias = database_option(options["database"])
        conn = get_connection(alias)
        runs = conn.execute(sql.PRUNE_RUNS, {"age": age})
        claims = conn.execute(sql.PRUNE_CLAIMS, {"age": age})
        self.stdout.write(
            f"Deleted {len(runs)} run(s) and {len(claims)} schedule claim(s) older than "
            f"{options['older_than'].strip()}."
        )
