"""A job process for the fault-injection tests: ``python -m tests.chaos_worker <command>``.

It uses only the public API of django_pglock and records what it does from the outside:
every grant appends lines to the shared ``--log`` file (opened with ``O_APPEND``, one
``os.write`` per line, so lines of concurrent processes never mix)::

    ENTER <pid> <token> <time.time()> <time.monotonic()> <name>
    EXIT  <pid> <token> <time.time()> <time.monotonic()> <name>
    LOST  <pid> <token> <time.time()> <time.monotonic()> <name>   (lease.lost seen true)
    FAIL  <pid> 0 <time.time()> <time.monotonic()> <name>         (an attempt raised LockError)

``ENTER`` is written right after the grant, ``EXIT`` right before the lease is released,
or as soon as the job sees ``lease.lost`` (a careful job stops working then). The test
judges these intervals: never two holders of one name at once.

Commands (stdout is a line protocol, one flushed line per message):

``job``
    Print ``READY <pid>``; with ``--wait-go`` wait for a ``go`` line. Then, until
    ``--seconds`` have passed or a ``stop`` line / EOF arrives: pick a name (``--name``,
    or with ``--names N`` one of ``<name>-0`` .. ``<name>-<N-1>`` at random), acquire it
    blocking (``--poll-interval``), print ``GRANTED <token> <name>``, hold it for
    ``--hold-for`` seconds (``inf``: until lost or stopped), release, pause up to
    ``--pause`` seconds (with ``--once``: after the first grant, wait for ``stop``).
    ``--notice signal``: the job learns of a loss only from the ``lock_lost`` signal (what
    a job that never polls ``lease.lost`` relies on); ``poll`` (default): ``lease.lost``.
    Leaving the ``with`` block prints ``LEFT <token> ok|LockNotHeld``. A lost lease prints
    ``LOST_DETECTED <token>`` as soon as the job sees it. An attempt that
    raises ``LockError`` (database down) is logged as ``FAIL``, and retried after the poll
    interval. At the end: ``DONE grants=<n> lost=<n> failures=<n>``.
``prefork``
    A gunicorn-style pre-fork parent: sets up Django, takes and releases one lock, then
    takes ``<name>-parent`` and keeps holding it (so it has an open lock connection and a
    running heartbeat thread), closes Django's own connections, and forks ``--children``
    children. Each child calls a ``@singleton_job(<name>, blocking=True)`` function in a
    loop for ``--seconds``; the function logs ENTER/EXIT, and on its first grant prints
    ``CHILD_ROW <pid> <token> <backend_pid of the lock row>``. Children exit through the
    normal interpreter shutdown. The parent prints ``PARENT <pid> <lock backend_pid>``
    before forking and, after reaping the children, ``CHILDREN <exit statuses>``,
    ``PARENT_CHECK ok|<error>`` (its held lease, checked in the database), ``PARENT_AGAIN
    <token>`` (a fresh grant on its old connection) and ``PARENT_DONE``.

Logging: WARNING and above from any logger go to stderr as ``<LEVEL> <logger>: <message>``.
Under libfaketime 0.9.10 ``time.sleep`` fails with EINVAL when the monotonic clock is not
faked; it is then replaced by a ``select``-based sleep (monotonic, so unaffected).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import select
import sys
import threading
import time
from typing import Any

EXIT_ERROR = 3
CHECK_EVERY = 0.005

_print_lock = threading.Lock()


def say(*words: object) -> None:
    with _print_lock, contextlib.suppress(BrokenPipeError):
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


def _select_sleep(seconds: float) -> None:
    deadline = time.monotonic() + max(0.0, seconds)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        select.select([], [], [], remaining)


def fix_sleep_under_faketime() -> None:
    """libfaketime 0.9.10 + FAKETIME_DONT_FAKE_MONOTONIC: clock_nanosleep gives EINVAL."""
    try:
        time.sleep(0.0001)
    except OSError:
        time.sleep = _select_sleep


class JobLog:
    """The shared O_APPEND event log."""

    def __init__(self, path: str | None) -> None:
        self.fd = None if path is None else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def write(self, event: str, token: int, name: str) -> None:
        if self.fd is None:
            return
        line = f"{event} {os.getpid()} {token} {time.time():.6f} {time.monotonic():.6f} {name}\n"
        os.write(self.fd, line.encode())


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos_worker")
    parser.add_argument("command", choices=["job", "prefork"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--names", type=int, default=0, help="job: pick among N keyed names")
    parser.add_argument("--log", default=None)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--hold-for", type=float, default=0.01)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--wait-go", action="store_true")
    parser.add_argument("--once", action="store_true", help="job: one grant, then idle")
    parser.add_argument(
        "--notice",
        choices=["poll", "signal"],
        default="poll",
        help="job: learn of a loss by polling lease.lost, or only from the lock_lost signal",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=None)
    parser.add_argument("--alert-after", type=float, default=None)
    parser.add_argument("--stale-after", type=float, default=None)
    parser.add_argument("--poll-interval", type=float, default=None)
    parser.add_argument("--advisory", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--children", type=int, default=4, help="prefork: how many")
    return parser.parse_args(argv)


def lock_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for option in ("heartbeat_interval", "alert_after", "stale_after", "poll_interval"):
        value = getattr(args, option)
        if value is not None:
            options[option] = value
    if args.advisory != "auto":
        options["advisory"] = args.advisory == "on"
    return options


def read_stdin(stop: threading.Event, go: threading.Event) -> None:
    for raw in sys.stdin:
        line = raw.strip()
        if line == "go":
            go.set()
        elif line == "stop":
            break
        elif line:
            say("ERROR", f"UnknownCommand: {line!r}")
    stop.set()
    go.set()


def cmd_job(args: argparse.Namespace) -> int:
    from django_pglock import Lock, LockError, LockNotHeld, signals

    options = lock_options(args)
    log = JobLog(args.log)
    signalled: set[int] = set()  # tokens the lock_lost signal was sent for

    def on_lost(sender: Any, lease: Any, **kwargs: Any) -> None:
        signalled.add(lease.token)

    signals.lock_lost.connect(on_lost, weak=False)

    def is_lost(lease: Any) -> bool:
        if args.notice == "signal":  # never touch lease.lost: rely on the signal alone
            return lease.token in signalled
        return bool(lease.lost)

    stop, go = threading.Event(), threading.Event()
    threading.Thread(target=read_stdin, args=(stop, go), daemon=True).start()
    say("READY", os.getpid())
    if args.wait_go:
        go.wait()
    poll = args.poll_interval if args.poll_interval is not None else 0.5
    deadline = time.monotonic() + args.seconds
    grants = lost = failures = 0
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        name = args.name
        if args.names:
            name = f"{args.name}-{random.randrange(args.names)}"
        lock = Lock(name, **options)
        lease = None
        try:
            # Short slices, so that a stop line is honoured while waiting.
            with lock.acquire(blocking=True, timeout=min(remaining, 1.0)) as lease:
                if lease is None:
                    continue
                log.write("ENTER", lease.token, name)
                grants += 1
                say("GRANTED", lease.token, name)
                until = time.monotonic() + args.hold_for
                while True:
                    if is_lost(lease):
                        log.write("EXIT", lease.token, name)
                        log.write("LOST", lease.token, name)
                        say("LOST_DETECTED", lease.token)
                        break
                    if time.monotonic() >= until or stop.is_set():
                        log.write("EXIT", lease.token, name)
                        break
                    time.sleep(CHECK_EVERY)
            say("LEFT", lease.token, "ok")
        except LockNotHeld:
            lost += 1
            say("LEFT", lease.token if lease is not None else 0, "LockNotHeld")
        except LockError as exc:
            if lease is None:
                failures += 1
                log.write("FAIL", 0, name)
                say("FAIL", type(exc).__name__)
                time.sleep(poll)
            else:  # pragma: no cover - __exit__ turns release errors into warnings
                raise
        if args.once and grants:
            stop.wait()
            break
        if args.pause > 0:
            time.sleep(random.uniform(0, args.pause))
    say("DONE", f"grants={grants}", f"lost={lost}", f"failures={failures}")
    return 0


# -- prefork ---------------------------------------------------------------------------

_current: dict[str, Any] = {}


def _remember_lease(sender: Any, lease: Any, **kwargs: Any) -> None:
    _current["lease"] = lease


def _row_backend_pid(token: int) -> int | None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT backend_pid FROM django_pglock_joblock WHERE token = %s", [token])
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def _child_main(args: argparse.Namespace, job: Any) -> int:
    deadline = time.monotonic() + args.seconds
    calls = 0
    while time.monotonic() < deadline:
        job()
        calls += 1
        if args.pause > 0:
            time.sleep(random.uniform(0, args.pause))
    from django.db import connections

    connections.close_all()
    say("CHILD_DONE", os.getpid(), calls, _current.get("grants", 0))
    return 0


def cmd_prefork(args: argparse.Namespace) -> int:
    from django.db import connections

    from django_pglock import Lock, signals, singleton_job

    options = lock_options(args)
    log = JobLog(args.log)
    signals.lock_acquired.connect(_remember_lease, weak=False)

    # Took and released a lock: the lock connection stays open in this process.
    first = Lock(f"{args.name}-warmup", **options).acquire_or_raise()
    first.release()
    # And keeps holding one while it forks: the heartbeat thread is running.
    parent_lease = Lock(f"{args.name}-parent", **options).acquire_or_raise()
    parent_backend = _row_backend_pid(parent_lease.token)
    connections.close_all()  # what a pre-fork server does with Django's own connection
    say("PARENT", os.getpid(), parent_backend)

    def work() -> None:
        lease = _current["lease"]
        log.write("ENTER", lease.token, args.name)
        if "reported" not in _current:
            _current["reported"] = True
            say("CHILD_ROW", os.getpid(), lease.token, _row_backend_pid(lease.token))
        time.sleep(args.hold_for)
        log.write("EXIT", lease.token, args.name)
        _current["grants"] = _current.get("grants", 0) + 1

    job = singleton_job(args.name, blocking=True, timeout=1.0, **options)(work)

    children = []
    for _ in range(args.children):
        pid = os.fork()
        if pid == 0:
            # A worker: run, then leave through the normal interpreter shutdown (atexit,
            # garbage collection of what it inherited), as a gunicorn worker does.
            raise SystemExit(_child_main(args, job))
        children.append(pid)
    statuses = []
    for pid in children:
        _, status = os.waitpid(pid, 0)
        statuses.append(os.waitstatus_to_exitcode(status))
    say("CHILDREN", *statuses)
    try:
        parent_lease.check()
    except Exception as exc:
        say("PARENT_CHECK", f"{type(exc).__name__}:{exc}".replace(" ", "_"))
    else:
        say("PARENT_CHECK", "ok")
    parent_lease.release()
    again = Lock(f"{args.name}-parent", **options).acquire_or_raise()
    say("PARENT_AGAIN", again.token)
    again.release()
    say("PARENT_DONE")
    return 0


HANDLERS = {"job": cmd_job, "prefork": cmd_prefork}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    fix_sleep_under_faketime()
    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.fault_settings")
        import django

        django.setup()
        logging.basicConfig(
            level=logging.WARNING,
            format="%(levelname)s %(name)s [%(created).3f]: %(message)s",
            force=True,
        )
        return HANDLERS[args.command](args)
    except Exception as exc:
        say("ERROR", f"{type(exc).__name__}: {exc}")
        logging.getLogger("tests.chaos_worker").exception("worker failed")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
