"""A lock client for the failover tests: ``python -m tests.failover_worker <command>``.

It uses only the public API of django_pglock, reaches the database through
``DATABASE_URL`` (a multi-host DSN, see tests/standby.py) and records its grants in the
shared ``--log`` file in the format of tests/chaos_worker.py (``ENTER`` / ``EXIT`` /
``LOST <pid> <token> <time.time()> <time.monotonic()> <name>``, one ``O_APPEND`` write
each), which ``faultkit.read_log`` reads. ``EXIT`` is written before a release, and as
soon as the holder sees ``lease.lost`` (a careful job stops working then).

Commands (stdout is a line protocol, one flushed line per message):

``hold``
    Take ``--name`` (or, with ``--count N``, ``<name>-0`` .. ``<name>-<N-1>``) in one
    attempt each: ``GRANTED <token> <name>`` per grant, then ``READY``; ``REFUSED <name>``
    and exit 1 if one is taken. A lease found lost prints ``LOST_DETECTED <token>
    <time.time()>``. Lines: ``release`` releases every lease in turn, printing
    ``RELEASED <token> <time.time()>`` once ``release()`` returned, or ``RELEASE_FAILED
    <token> <exception class>``, then ``RELEASED_ALL``; ``check`` prints ``OK <token>`` or
    ``LOST <token>`` per lease (``lease.check()``); ``guard`` runs ``lease.guard()`` for the
    first lease in a ``transaction.atomic()`` on Django's own connection: ``GUARDED
    <token>`` or ``GUARD_FAILED <exception class>``; ``close_old`` calls Django's
    ``close_old_connections()`` (``CLOSED``). EOF releases what is left and exits 0.
``wait``
    One blocking ``acquire(timeout=--timeout)``: prints ``READY``, ``CONTENDED`` once the
    first attempt was refused, then ``GRANTED <token> <time.time()> <seconds waited>`` or
    ``TIMEOUT``. Holds until a ``release`` line or EOF (``RELEASED``). A ``LockError``
    escaping the wait prints ``ERROR LockError: <message>`` and exits 3.
Options: thresholds, ``--poll-interval``, ``--advisory on|off``, and ``--record`` (the
lock keeps a run history).

``try``
    Prints ``READY``; each ``go`` line makes one non-blocking attempt and prints ``TRIED
    ACQUIRED <token> <seconds>`` (then releases it), ``TRIED REFUSED - <seconds>`` or
    ``TRIED <exception class> - <seconds>`` with the exception's message on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from tests.chaos_worker import JobLog, say

EXIT_ERROR = 3
CHECK_EVERY = 0.005


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.failover_worker")
    parser.add_argument("command", choices=["hold", "wait", "try"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--count", type=int, default=0, help="hold: N names <name>-<i>")
    parser.add_argument("--log", default=None)
    parser.add_argument("--timeout", type=float, default=120.0, help="wait: the bound")
    parser.add_argument("--heartbeat-interval", type=float, default=None)
    parser.add_argument("--alert-after", type=float, default=None)
    parser.add_argument("--stale-after", type=float, default=None)
    parser.add_argument("--poll-interval", type=float, default=None)
    parser.add_argument("--advisory", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--record", action="store_true", help="keep a run history")
    return parser.parse_args(argv)


def make_lock(args: argparse.Namespace, name: str) -> Any:
    from django_pglock import Lock

    options: dict[str, Any] = {}
    for option in ("heartbeat_interval", "alert_after", "stale_after", "poll_interval"):
        value = getattr(args, option)
        if value is not None:
            options[option] = value
    if args.advisory != "auto":
        options["advisory"] = args.advisory == "on"
    return Lock(name, record=args.record, **options)


def lines() -> Any:
    for raw in sys.stdin:
        if raw.strip():
            yield raw.strip()


class Holding:
    """The leases of ``hold``; a watcher thread reports each loss once, as it happens."""

    def __init__(self, log: JobLog) -> None:
        self.log = log
        self.leases: list[Any] = []
        self.left: set[int] = set()  # tokens whose EXIT is written
        self.guard = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._watch, name="lost-watch", daemon=True).start()

    def _exit(self, lease: Any, lost: bool) -> bool:
        with self.guard:
            if lease.token in self.left:
                return False
            self.left.add(lease.token)
            self.log.write("EXIT", lease.token, lease.name)
            if lost:
                self.log.write("LOST", lease.token, lease.name)
            return True

    def _watch(self) -> None:
        while not self.stop.wait(CHECK_EVERY):
            for lease in list(self.leases):
                if lease.lost and self._exit(lease, lost=True):
                    say("LOST_DETECTED", lease.token, f"{time.time():.6f}")

    def release_all(self) -> None:
        from django_pglock import LockError

        for lease in self.leases:
            self._exit(lease, lost=False)
            try:
                lease.release()
            except LockError as exc:
                say("RELEASE_FAILED", lease.token, type(exc).__name__)
            else:
                say("RELEASED", lease.token, f"{time.time():.6f}")
        self.leases = []
        say("RELEASED_ALL")


def guard(lease: Any) -> tuple[object, ...]:
    """``lease.guard()`` in a transaction of its own on Django's connection."""
    from django.db import DatabaseError, transaction

    from django_pglock import LockError

    try:
        with transaction.atomic(using=lease.using):
            lease.guard()
    except (DatabaseError, LockError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return ("GUARD_FAILED", type(exc).__name__)
    return ("GUARDED", lease.token)


def cmd_hold(args: argparse.Namespace) -> int:
    from django_pglock import LockNotHeld

    names = [f"{args.name}-{i}" for i in range(args.count)] if args.count else [args.name]
    holding = Holding(JobLog(args.log))
    for name in names:
        lease = make_lock(args, name).try_acquire()
        if lease is None:
            say("REFUSED", name)
            holding.release_all()
            return 1
        holding.log.write("ENTER", lease.token, name)
        holding.leases.append(lease)
        say("GRANTED", lease.token, name)
    say("READY")
    for line in lines():
        if line == "release":
            holding.release_all()
        elif line == "guard":
            say(*guard(holding.leases[0]))
        elif line == "close_old":
            from django.db import close_old_connections

            close_old_connections()
            say("CLOSED")
        elif line == "check":
            for lease in holding.leases:
                try:
                    lease.check()
                except LockNotHeld:
                    say("LOST", lease.token)
                else:
                    say("OK", lease.token)
        else:
            say("ERROR", f"UnknownCommand: {line!r}")
    holding.release_all()
    holding.stop.set()
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from django_pglock import LockError, signals

    lock = make_lock(args, args.name)
    log = JobLog(args.log)

    def contended(sender: Any, **kwargs: Any) -> None:
        if sender is lock:
            say("CONTENDED")

    signals.lock_contended.connect(contended, weak=False)
    say("READY")
    started = time.monotonic()
    try:
        with lock.acquire(blocking=True, timeout=args.timeout) as lease:
            if lease is None:
                say("TIMEOUT")
                return 0
            log.write("ENTER", lease.token, args.name)
            waited = time.monotonic() - started
            say("GRANTED", lease.token, f"{time.time():.6f}", f"{waited:.3f}")
            for line in lines():
                if line == "release":
                    break
                say("ERROR", f"UnknownCommand: {line!r}")
            log.write("EXIT", lease.token, args.name)
        say("RELEASED")
    except LockError as exc:
        say("ERROR", f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR
    return 0


def cmd_try(args: argparse.Namespace) -> int:
    lock = make_lock(args, args.name)
    log = JobLog(args.log)
    say("READY")
    for line in lines():
        if line != "go":
            say("ERROR", f"UnknownCommand: {line!r}")
            continue
        started = time.monotonic()
        try:
            lease = lock.try_acquire()
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            say("TRIED", type(exc).__name__, "-", f"{time.monotonic() - started:.3f}")
            continue
        elapsed = f"{time.monotonic() - started:.3f}"
        if lease is None:
            say("TRIED", "REFUSED", "-", elapsed)
            continue
        log.write("ENTER", lease.token, args.name)
        log.write("EXIT", lease.token, args.name)
        lease.release()
        say("TRIED", "ACQUIRED", lease.token, elapsed)
    return 0


HANDLERS = {"hold": cmd_hold, "wait": cmd_wait, "try": cmd_try}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.fault_settings")
        import django

        django.setup()
        return HANDLERS[args.command](args)
    except Exception as exc:
        say("ERROR", f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
