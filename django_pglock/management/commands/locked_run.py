"""``manage.py locked_run [options] <command> [args…]``: a command under a lock.

The command runs as a child process, so that it can be terminated when the lease is
lost. ``--shell -- <argv…>`` wraps any program instead of a management command.
"""

from __future__ import annotations

import datetime
import os
import random
import select
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management import get_commands
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_pglock.conf import get_setting
from django_pglock.exceptions import LockNotHeld
from django_pglock.inherit import lend
from django_pglock.lock import Lease, Lock, validate_name
from django_pglock.management.cli import database_option, reports_database_errors
from django_pglock.management.run_options import add_arguments
from django_pglock.management.wakeup import Wakeup
from django_pglock.redaction import redact_argv
from django_pglock.runs import SkipReason, record_skipped
from django_pglock.schedule import ScheduleSlot
from django_pglock.supervisor import GuardedJob, JobNotStarted
from django_pglock.waiting import describe_holder

EXIT_USAGE = 2
EXIT_LOST = 75  # EX_TEMPFAIL: the lease was lost and the child was terminated
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Command(BaseCommand):
    help = (
        "Run a management command (or, with --shell, any program) under a lock, so that it "
        "runs on one machine at a time. Exit status: the child's own; 0 when skipped "
        "because the lock is held (see --skip-exit-code); 2 for usage or configuration "
        "errors; 75 when the lease was lost and the child was terminated."
    )
    requires_system_checks: list[str] = []  # the child runs its own checks

    def add_arguments(self, parser: CommandParser) -> None:
        add_arguments(parser)

    @reports_database_errors
    def handle(self, *args: Any, **options: Any) -> None:
        argv = list(options["argv"])
        if argv and argv[0] == "--":
            argv = argv[1:]
        if not argv:
            raise CommandError(
                "Name the command to run: locked_run <command> [args…], or "
                "locked_run --shell -- <program> [args…].",
                returncode=EXIT_USAGE,
            )
        if options["timeout"] is not None and not options["wait"]:
            raise CommandError(
                f"--timeout {options['timeout']:g} needs --wait: without --wait, locked_run "
                "makes one attempt and skips at once when the lock is held. Add --wait, or "
                "drop --timeout.",
                returncode=EXIT_USAGE,
            )
        child_argv, default_name = self._child_argv(argv, options["shell"])
        alias = database_option(options["database"])
        lock_options = {
            "using": alias,
            "heartbeat_interval": options["heartbeat_interval"],
            "alert_after": options["alert_after"],
            "stale_after": options["stale_after"],
            "poll_interval": options["poll_interval"],
            "description": "locked_run " + redact_argv(argv),
        }
        record = not options["no_record"] and get_setting("RECORD_RUNS") is True
        try:
            name = self._lock_name(options["name"], default_name)
            slot = None
            if options["schedule"] is not None:
                slot = ScheduleSlot(options["schedule"], name, using=alias)
            lock = Lock(name, record=record, limit=options["limit"], **lock_options)
            lock._thresholds()  # settings and arguments together must be in order
            acquisition = lock.acquire(blocking=options["wait"], timeout=options["timeout"])
        except (ValueError, ImproperlyConfigured) as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None

        if options["jitter"]:
            time.sleep(random.uniform(0, options["jitter"]))
        shown = redact_argv(argv)
        self.terminated = False
        code = options["skip_exit_code"]
        started = time.monotonic()
        try:
            with acquisition as lease:
                if lease is None:
                    who = describe_holder(acquisition.holder)
                    if options["wait"]:
                        waited = time.monotonic() - started
                        self.stderr.write(
                            f"Gave up on {shown!r} after waiting {waited:.1f} s (--timeout "
                            f"{options['timeout']:g}): lock {name!r} is still held by {who}."
                        )
                    else:
                        self.stderr.write(f"Skipped {shown!r}: lock {name!r} is held by {who}.")
                    reason = SkipReason.TIMED_OUT if options["wait"] else SkipReason.HELD
                    record_skipped(lock, reason)
                elif slot is not None and not slot.claim():
                    self.stderr.write(
                        f"Skipped {shown!r}: schedule slot {slot.slot_label} of {name!r} "
                        "has already started elsewhere."
                    )
                    record_skipped(lock, SkipReason.SLOT_TAKEN, lease)
                else:
                    claimed = None if slot is None else slot.slot
                    code = self._supervise(lease, child_argv, options, claimed)
                    lease.exit_code = code
                    if code != 0:
                        lease._outcome = "lost" if self.terminated else "failed"
        except LockNotHeld as exc:
            if not self.terminated:  # --on-lost continue let the child finish
                self.stderr.write(f"{exc} The command's own exit status is kept.")
        sys.exit(code)

    def _child_argv(self, argv: list[str], shell: bool) -> tuple[list[str], str]:
        if shell:
            return argv, Path(argv[0]).name
        command = argv[0]
        if command not in get_commands():
            raise CommandError(
                f"Unknown command: {command!r}. Run 'manage.py help' for the list, or use "
                "--shell -- <program> to wrap a program that is not a management command.",
                returncode=EXIT_USAGE,
            )
        if command == "locked_run":
            raise CommandError("locked_run cannot wrap itself.", returncode=EXIT_USAGE)
        entry = sys.argv[0]
        if entry.endswith("manage.py") and os.path.isfile(entry):
            return [sys.executable, entry, *argv], command
        return [sys.executable, "-m", "django", *argv], command

    @staticmethod
    def _lock_name(given: str | None, default: str) -> str:
        """``--name`` if given (an empty or blank one is refused), else ``default``."""
        try:
            return validate_name(default if given is None else given)
        except ValueError as exc:
            fix = "" if given is not None else " Name the lock with --name."
            raise CommandError(f"{exc}{fix}", returncode=EXIT_USAGE) from None

    def _supervise(
        self,
        lease: Lease,
        child_argv: list[str],
        options: dict[str, Any],
        slot: datetime.datetime | None = None,
    ) -> int:
        """Run the job (the child and its process group) through a guardian; its exit status.

        The job is lent the grant, and the schedule ``slot`` claimed for it (see
        :mod:`django_pglock.inherit`).

        Nothing here waits on the database: once the lease is lost, only the job's
        process group is waited for.
        """
        grace = options["kill_grace"]
        wakeup = Wakeup()  # the lease's loss wakes the loop in _watch()
        lease.on_lost(lambda _lease: wakeup.poke())
        env = dict(os.environ)
        lend(env, lease.name, lease.token, slot)
        if not options["shell"]:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        # Signals ignored where locked_run runs (nohup) are neither forwarded nor
        # un-ignored for the job.
        ignored = [sig for sig in FORWARDED_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN]
        job: GuardedJob | None = None
        early: list[int] = []

        def forward(signum: int, frame: FrameType | None) -> None:
            # To the job's process group, once; SIGKILL follows after the kill grace.
            if job is None:
                early.append(signum)
            else:
                job.forward(signum, grace)

        previous = {
            sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS if sig not in ignored
        }
        try:
            hold = _lock_socket(lease)
            try:
                expire = lease._held_until() if options["on_lost"] == "terminate" else None
                job = GuardedJob(
                    child_argv, env, grace=grace, hold_fd=hold, ignored=ignored, expire_at=expire
                )
            except (JobNotStarted, OSError) as exc:
                raise CommandError(
                    f"Could not start {child_argv[0]!r}: {exc.strerror}.", returncode=EXIT_USAGE
                ) from None
            finally:
                if hold is not None:
                    os.close(hold)
            for signum in early:
                job.forward(signum, grace)
            self._watch(job, lease, wakeup, options)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            wakeup.close()
        assert job is not None
        if job.guardian_failed:
            self.stderr.write(
                f"The guardian of {child_argv[0]!r} died; its process group was killed."
            )
        if self.terminated:
            return EXIT_LOST
        code = job.exit_code
        if code is None:
            return 128 + signal.SIGKILL
        return 128 - code if code < 0 else code

    def _watch(
        self, job: GuardedJob, lease: Lease, wakeup: Wakeup, options: dict[str, Any]
    ) -> None:
        """Wait until the job's process group is gone, acting on the lease's loss."""
        terminate = options["on_lost"] == "terminate"
        handled = False
        expires = 0.0
        while job.poll(0) and not job.gone:
            # lease.lost also turns true at the local deadline, even while the
            # heartbeat thread is stuck on an unresponsive server.
            if not handled and lease.lost:
                handled = True
                if terminate:
                    self._stop_on_loss(job, lease, options["kill_grace"])
                else:
                    self.stderr.write(
                        f"Lock {lease.name!r} was lost; the command goes on (--on-lost continue)."
                    )
            elif not handled and terminate and lease._held_until() != expires:
                expires = lease._held_until()
                job.expire_at(expires)
            select.select([job.fileno(), wakeup.fileno()], [], [], 0.25)
            wakeup.drain()
        job.wait_gone()
        if job.expired and not handled:  # this process was too slow to see its own loss
            self.stderr.write(
                f"Lock {lease.name!r} was lost (no heartbeat was confirmed in time); "
                "the command was killed."
            )
            self.terminated = True

    def _stop_on_loss(self, job: GuardedJob, lease: Lease, grace: float) -> None:
        """SIGTERM the job's group; SIGKILL it by the lease's kill deadline at the latest."""
        if job.exit_code is None:
            self.stderr.write(f"Lock {lease.name!r} was lost; terminating the command.")
            self.terminated = True
        deadline = lease.kill_deadline  # set before the loss shows
        now = time.monotonic()
        if deadline is None:  # pragma: no cover - Lease._advance sets it before a loss shows
            deadline = now  # not known: assume the worst
        kill_after = grace
        if deadline - now < grace:
            kill_after = max(0.0, deadline - now)
            when = (
                "at once"
                if kill_after == 0
                else f"in {kill_after:.1f}s (stale_after after its last confirmed heartbeat)"
            )
            self.stderr.write(
                f"Lock {lease.name!r}: another instance may take the lock {when}, so the "
                f"kill grace is cut from {grace:g}s to {kill_after:.1f}s."
            )
        if kill_after > 0:
            job.forward(signal.SIGTERM, kill_after)
        else:
            job.kill()


def _lock_socket(lease: Lease) -> int | None:
    """A duplicate of the lease's connection socket, for the guardian to hold (or None)."""
    fd = lease._session_fileno()
    if fd is None:
        return None
    try:
        return os.dup(fd)
    except OSError:
        return None
