"""``manage.py pglock_status``: who holds what, and does it look alive."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock.health import PROBLEMS, JobHealth, job_health
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
        parser.add_argument(
            "--jobs",
            action="store_true",
            help="Show job health instead of locks: healthy, running, overdue, failing, "
            "too-long or abandoned, with last run, last success and next due start.",
        )
        parser.add_argument(
            "--fail-on",
            default=",".join(PROBLEMS),
            help="With --jobs --check: the job states that fail the check, comma-separated "
            f"(default: {','.join(PROBLEMS)}).",
        )

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        if options["jobs"]:
            self.show_jobs(options)
            return
        rows = lock_status(using=database_option(options["database"]))
        if options["json"]:
            self.stdout.write(json.dumps([row.as_dict() for row in rows], indent=2))
        elif not rows:
            self.stdout.write("No locks are held.")
        else:
            header = ("NAME", "STATE", "HEARTBEAT AGE", "HOLDER", "ACQUIRED", "TOKEN", "RUNS")
            _write_table(
                self,
                header,
                [
                    (
                        f"{row.name} [slot {row.slot}]" if row.semaphore else row.name,
                        row.state.upper() if row.state != "ok" else "ok",
                        f"{row.heartbeat_age:.1f}s",
                        f"{row.host}:{row.pid}",
                        row.acquired_at.isoformat(timespec="seconds"),
                        str(row.token),
                        row.description[:60],
                    )
                    for row in rows
                ],
            )
            semaphores = {row.name: row.held_label for row in rows if row.semaphore}
            for name, held in sorted(semaphores.items()):
                self.stdout.write(f"SEMAPHORE: {name}: {held}.")
            if any(row.state == "abandoned" for row in rows):
                self.stdout.write(
                    "ABANDONED: the holder's session has ended (its process died or lost the "
                    "lock); the next contender takes the lock at once. Nothing to do."
                )
        unhealthy = [row for row in rows if row.state in ("alert", "stale")]
        if options["check"] and unhealthy:
            names = ", ".join(f"{row.name!r} ({row.state})" for row in unhealthy)
            raise CommandError(f"{len(unhealthy)} lock(s) need attention: {names}.", returncode=1)

    def show_jobs(self, options: dict[str, Any]) -> None:
        fail_on = _states(options["fail_on"])
        jobs = job_health(using=database_option(options["database"]))
        if options["json"]:
            self.stdout.write(json.dumps([job.as_dict() for job in jobs], indent=2))
        elif not jobs:
            self.stdout.write("No jobs: none is declared, scheduled or has run history.")
        else:
            _table(self, jobs)
        failing = [job for job in jobs if job.state in fail_on]
        if options["check"] and failing:
            for job in failing:  # one line per problem, for cron-based monitors
                self.stderr.write(f"{job.name}: {job.state}: {job.detail}")
            raise CommandError(f"{len(failing)} job(s) need attention.", returncode=1)


def _states(text: str) -> set[str]:
    from django_pglock.health import STATES

    states = {part.strip() for part in text.split(",") if part.strip()}
    unknown = sorted(states - set(STATES))
    if unknown:
        raise CommandError(
            f"--fail-on {text!r} names unknown state(s) {', '.join(map(repr, unknown))}; "
            f"use a comma-separated list of: {', '.join(STATES)}."
        )
    return states


def _when(value: Any) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _last_run(job: JobHealth) -> str:
    if job.last_outcome is None:
        return "-"
    return f"{job.last_outcome} {_when(job.last_started_at)}"


def _write_table(
    command: BaseCommand, header: tuple[str, ...], rows: list[tuple[str, ...]]
) -> None:
    """Columns padded to their widest cell."""
    table = [header, *rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        command.stdout.write(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        )


def _table(command: BaseCommand, jobs: list[JobHealth]) -> None:
    header = ("JOB", "STATE", "LAST RUN", "LAST SUCCESS", "NEXT DUE", "HOLDER")
    _write_table(
        command,
        header,
        [
            (
                job.name,
                job.state if job.state in ("healthy", "running") else job.state.upper(),
                "-"
                if job.last_outcome is None
                else f"{job.last_outcome} {_when(job.last_started_at)}",
                _when(job.last_success_at),
                _when(job.next_due),
                "-" if job.holder is None else f"{job.holder['host']}:{job.holder['pid']}",
            )
            for job in jobs
        ],
    )
    for job in jobs:
        if job.problem:
            command.stdout.write(f"{job.state.upper()}: {job.name}: {job.detail}")
