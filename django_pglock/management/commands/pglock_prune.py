"""``manage.py pglock_prune --older-than 30d``: forget old run history and schedule claims."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock import sql
from django_pglock.conf import MAX_SECONDS
from django_pglock.connection import LockConnection, get_connection
from django_pglock.management.cli import database_option, reports_database_errors
from django_pglock.sql import summary

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: The oldest age that can be asked for: 100 years, well inside PostgreSQL's timestamps.
MAX_AGE_DAYS = int(MAX_SECONDS // 86400)
#: Rows deleted per statement: each statement stays far below the lock session's 30 s
#: statement timeout, and only three numbers come back per batch, whatever the table's size.
BATCH_SIZE = 10_000
#: Jobs whose stale summary one statement settles (see ``sql.summary``); a job whose
#: summary another transaction is writing stays marked.
SETTLE_BATCH = 1_000


def parse_age(text: str) -> float:
    """``"30d"`` → seconds; units s, m, h, d, w; at most ``MAX_AGE_DAYS`` days."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise CommandError(
            f"--older-than {text!r} is not an age; use a number and a unit, such as 30d, "
            "12h or 90m (units: s, m, h, d, w).",
            returncode=2,
        )
    seconds = float(match.group(1)) * UNITS[match.group(2)]
    if seconds > MAX_SECONDS:
        raise CommandError(
            f"--older-than {text!r} is too large; the maximum is {MAX_AGE_DAYS}d (100 years).",
            returncode=2,
        )
    return seconds


class Command(BaseCommand):
    help = (
        "Delete run history (JobRun) and schedule claims older than --older-than. Kept "
        "whatever their age: runs still going on, and the latest slot claimed by each job "
        "(it may still be the current slot, which would otherwise start again). Then "
        "recount the job summaries marked stale."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", required=True, help="Age such as 30d, 12h or 90m.")
        parser.add_argument("--database", default=None, help="Database alias (default: setting).")

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        age = parse_age(options["older_than"])
        alias = database_option(options["database"])
        conn = get_connection(alias)
        ((now,),) = conn.execute(sql.NOW, {})
        cutoff = now - timedelta(seconds=age)  # one cutoff for every batch
        runs = self._prune(conn, sql.PRUNE_RUNS, cutoff, "run(s)")
        claims = self._prune(conn, sql.PRUNE_CLAIMS, cutoff, "schedule claim(s)")
        self._settle(conn)
        self.stdout.write(
            f"Deleted {runs} run(s) and {claims} schedule claim(s) older than "
            f"{options['older_than'].strip()}."
        )

    def _settle(self, conn: LockConnection) -> None:
        """Recount the jobs whose summary is marked stale (see ``sql.summary``), in batches
        of ``SETTLE_BATCH`` jobs, each its own statement."""
        after = ""
        while True:
            params = {"after": after, "batch": SETTLE_BATCH}
            ((picked, last),) = conn.execute(summary.SETTLE_STALE, params)
            if picked < SETTLE_BATCH:
                return
            after = last

    def _prune(self, conn: LockConnection, statement: str, cutoff: Any, what: str) -> int:
        """Delete in batches of ``BATCH_SIZE`` rows, each its own statement (and
        transaction); on a terminal, report progress after each full batch."""
        deleted, after = 0, 0
        progress = self.stderr.isatty()
        while True:
            params = {"after": after, "cutoff": cutoff, "batch": BATCH_SIZE}
            ((gone, picked, last),) = conn.execute(statement, params)
            deleted += gone
            if picked < BATCH_SIZE:
                break
            after = last
            if progress:
                self.stderr.write(f"Deleting old {what}: {deleted} so far...", ending="\r")
                self.stderr.flush()
        if progress and deleted >= BATCH_SIZE:
            self.stderr.write(f"Deleting old {what}: {deleted} done.     ")
        return int(deleted)
