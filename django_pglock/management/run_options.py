"""The command line of ``manage.py locked_run``: its options and their values."""

from __future__ import annotations

import argparse

from django.core.management.base import CommandParser

__all__ = ["add_arguments", "seconds"]


def seconds(text: str) -> float:
    """A ``--timeout``-style value: zero or more seconds, finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value < 0 or value != value or value in (float("inf"),):
        raise argparse.ArgumentTypeError(f"{text!r} must be zero or more seconds")
    return value


def add_arguments(parser: CommandParser) -> None:
    """The options of ``manage.py locked_run`` (see its help and the README)."""
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="<command> [args…]")
    parser.add_argument("--name", help="Lock name (default: the command's name).")
    parser.add_argument(
        "--limit",
        type=int,
        default=1,
        help="Run at most N at once (a semaphore of N slots; default 1: one at a time).",
    )
    parser.add_argument(
        "--shell",
        action="store_true",
        help="Run an arbitrary program: locked_run --shell -- <argv…>.",
    )
    parser.add_argument(
        "--wait", action="store_true", help="Wait for the lock instead of skipping."
    )
    parser.add_argument(
        "--timeout", type=seconds, default=None, help="With --wait: give up after N s."
    )
    parser.add_argument("--heartbeat-interval", type=seconds, default=None)
    parser.add_argument("--alert-after", type=seconds, default=None)
    parser.add_argument("--stale-after", type=seconds, default=None)
    parser.add_argument("--poll-interval", type=seconds, default=None)
    parser.add_argument(
        "--jitter",
        type=seconds,
        default=0.0,
        help="Sleep a random 0..N s before trying, to spread a thundering herd.",
    )
    parser.add_argument(
        "--on-lost",
        choices=("terminate", "continue"),
        default="terminate",
        help="When the lease is lost: terminate the child (default) or let it run.",
    )
    parser.add_argument(
        "--kill-grace",
        type=seconds,
        default=10.0,
        help="Seconds between SIGTERM and SIGKILL whenever the job's process group is "
        "stopped: on SIGTERM/SIGINT/SIGHUP to locked_run, for leftovers of a child that "
        "exited, and on lease loss (there cut short, so that the job is dead before "
        "another instance may take the lock).",
    )
    parser.add_argument("--database", default=None, help="Database alias for the lock.")
    parser.add_argument(
        "--skip-exit-code",
        type=int,
        default=0,
        help="Exit status when skipped because the lock is held (default 0).",
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="Do not record this run in the run history (JobRun).",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        help='Cron expression (e.g. "0 3 * * *"): run at most once per schedule slot, '
        "judged by the database clock. Needs the [schedule] extra (cronsim).",
    )
