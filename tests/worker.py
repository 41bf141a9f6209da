"""A child process for multi-process tests: ``python -m tests.worker <command> [options]``.

It talks a line protocol over stdin/stdout (one line per message, flushed at once) and uses
only the public API of django_pglock. Commands:

``hold``
    Acquire (``--blocking`` / ``--timeout``), print ``ACQUIRED <token>`` or ``REFUSED``.
    Then read commands from stdin: ``release`` -> ``RELEASED``; ``check`` -> ``OK`` or
    ``LOST <exception class>``; ``lost?`` -> ``LOST True|False``; ``exit`` -> leave the
    ``with`` block and print ``EXITED`` or ``EXIT_RAISED LockNotHeld``. EOF leaves the block
    too (exit status 0 either way). ``LOST_DETECTED`` is printed, unasked, as soon as
    ``lease.lost`` becomes true. ``fork`` -> ``os.fork()``; the child probes the inherited
    lease (``lease.lost``, ``lease.check()``, ``lease.release()``), makes one attempt of its
    own on the same name with the same options, reports on a pipe and leaves with
    ``os._exit``; the parent prints ``FORKED lost=<bool> check=<outcome> release=<outcome>
    try=<REFUSED|ACQUIRED:token|error:type> status=<child exit status>``.
``try``
    One non-blocking attempt: ``ACQUIRED <token>`` (then release) or ``REFUSED``.
``wait``
    Blocking acquire with ``--timeout``: ``ACQUIRED <token> <seconds waited>`` or
    ``TIMEOUT``; then hold until a ``release`` line (-> ``RELEASED``) or EOF.
``hold-many N``
    Acquire ``<name>-0`` .. ``<name>-<N-1>``, print ``ACQUIRED_ALL`` (or ``REFUSED <name>``),
    hold until a ``release`` line or EOF, release all, print ``RELEASED``.
``contend``
    Print ``READY``, wait for a ``go`` line, then for ``--seconds`` loop: blocking acquire
    (``--poll-interval``), append ``ENTER <pid> <time.time()> <token>`` to ``--log``
    (opened with ``O_APPEND``), sleep ``--hold-for`` seconds, append ``EXIT <pid> <time>
    <token>``, release, sleep up to ``--pause`` seconds (random). Print ``CONTENDED <grants>``.
    A lease found lost on leaving the block appends ``LOST <pid> <time> <token>`` and the
    loop goes on. With ``--limit N`` (a semaphore) each line ends with the lease's slot.

In every command, leaving the ``with`` block with LockNotHeld prints
``EXIT_RAISED LockNotHeld`` (exit status 0). An unknown stdin line, or an error raised by a
``hold`` command, prints ``ERROR <type>: <message>`` and the worker keeps holding. Any other
unexpected error prints ``ERROR <type>: <message>`` and exits with status 3.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

EXIT_ERROR = 3
WATCH_INTERVAL = 0.05

_print_lock = threading.Lock()


def say(*words: object) -> None:
    """Print one protocol line and flush it (safe from any thread)."""
    with _print_lock, contextlib.suppress(BrokenPipeError):
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


def commands() -> Iterator[str]:
    """Stripped stdin lines until EOF (blank lines skipped)."""
    for raw in sys.stdin:
        line = raw.strip()
        if line:
            yield line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.worker")
    parser.add_argument("command", choices=["hold", "try", "wait", "hold-many", "contend"])
    parser.add_argument("count", nargs="?", type=int, help="number of locks for hold-many")
    parser.add_argument("--name", required=True)
    parser.add_argument("--using", default=None)
    parser.add_argument("--heartbeat-interval", type=float, default=None)
    parser.add_argument("--alert-after", type=float, default=None)
    parser.add_argument("--stale-after", type=float, default=None)
    parser.add_argument("--poll-interval", type=float, default=None)
    parser.add_argument("--advisory", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument("--limit", type=int, default=1, help="a semaphore of this many")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--seconds", type=float, default=6.0, help="contend: how long to loop")
    parser.add_argument("--log", default=None, help="contend: the shared O_APPEND log file")
    parser.add_argument("--hold-for", type=float, default=0.005, help="contend: time held")
    parser.add_argument("--pause", type=float, default=0.0, help="contend: max pause between")
    args = parser.parse_args(argv)
    if args.command == "contend" and not args.log:
        parser.error("contend needs --log")
    if args.command == "hold-many" and (args.count is None or args.count < 1):
        parser.error("hold-many needs a positive count")
    return args


def make_lock(args: argparse.Namespace, name: str) -> Any:
    """A Lock with only the options given on the command line (the rest: package defaults)."""
    from django_pglock import Lock

    kwargs: dict[str, Any] = {}
    for option in ("using", "heartbeat_interval", "alert_after", "stale_after", "poll_interval"):
        value = getattr(args, option)
        if value is not None:
            kwargs[option] = value
    if args.advisory != "auto":
        kwargs["advisory"] = args.advisory == "on"
    if args.limit != 1:
        kwargs["limit"] = args.limit
    return Lock(name, **kwargs)


def acquire_kwargs(args: argparse.Namespace, *, blocking: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"blocking": blocking}
    if args.timeout is not None:
        kwargs["timeout"] = args.timeout
    return kwargs


def watch_lost(lease: Any, stop: threading.Event) -> threading.Thread:
    """Print LOST_DETECTED once, as soon as the lease reports it is lost."""

    def run() -> None:
        while not stop.wait(WATCH_INTERVAL):
            if lease.lost:
                say("LOST_DETECTED")
                return

    thread = threading.Thread(target=run, name="worker-lost-watch", daemon=True)
    thread.start()
    return thread


def _outcome(call: Any) -> str:
    """``ok``, or the name of the exception ``call()`` raised (one word, no spaces)."""
    try:
        call()
    except BaseException as exc:
        return type(exc).__name__
    return "ok"


def _probe_in_fork_child(lease: Any, new_lock: Any) -> str:
    """What a forked child sees of its parent's lease, as ``key=value`` words."""
    words = []
    try:
        words.append(f"lost={bool(lease.lost)}")
    except BaseException as exc:
        words.append(f"lost=error:{type(exc).__name__}")
    words.append(f"check={_outcome(lease.check)}")
    words.append(f"release={_outcome(lease.release)}")
    try:
        own = new_lock().try_acquire()
    except BaseException as exc:
        words.append(f"try=error:{type(exc).__name__}")
    else:
        if own is None:
            words.append("try=REFUSED")
        else:
            words.append(f"try=ACQUIRED:{own.token}")
            own.release()
    return " ".join(words)


def fork_and_probe(lease: Any, new_lock: Any) -> str:
    """Fork; the child probes the inherited lease and reports on a pipe (see ``fork``)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the parent's code, never run its atexit
        status = 0
        try:
            os.close(read_fd)
            report = _probe_in_fork_child(lease, new_lock)
            os.write(write_fd, (report + "\n").encode())
        except BaseException:
            status = EXIT_ERROR
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks = []
    with os.fdopen(read_fd, "rb") as pipe:
        chunks.append(pipe.read())
    _, wait_status = os.waitpid(pid, 0)
    report = b"".join(chunks).decode().strip() or "no-report"
    return f"{report} status={os.waitstatus_to_exitcode(wait_status)}"


def run_hold_command(line: str, lease: Any, new_lock: Any = None) -> bool:
    """Carry out one `hold` command; False means: leave the with block.

    ``new_lock`` makes a fresh ``Lock`` with the command line's options (for ``fork``).
    """
    from django_pglock import LockNotHeld

    if line == "exit":
        return False
    if line == "fork" and new_lock is not None:
        say("FORKED", fork_and_probe(lease, new_lock))
        return True
    if line == "release":
        lease.release()
        say("RELEASED")
    elif line == "check":
        try:
            lease.check()
        except LockNotHeld as exc:
            say("LOST", type(exc).__name__)
        else:
            say("OK")
    elif line == "lost?":
        say("LOST", bool(lease.lost))
    else:
        say("ERROR", f"UnknownCommand: {line!r}")
    return True


def cmd_hold(args: argparse.Namespace) -> int:
    from django_pglock import LockNotHeld

    lock = make_lock(args, args.name)
    stop = threading.Event()
    try:
        with lock.acquire(**acquire_kwargs(args, blocking=args.blocking)) as lease:
            if lease is None:
                say("REFUSED")
                return 0
            say("ACQUIRED", lease.token)
            watch_lost(lease, stop)
            for line in commands():
                try:
                    if not run_hold_command(line, lease, lambda: make_lock(args, args.name)):
                        break
                except Exception as exc:  # report it and keep holding: the test decides
                    say("ERROR", f"{type(exc).__name__}: {exc}")
    except LockNotHeld:
        # Only leaving the block can raise here: commands report their own errors.
        say("EXIT_RAISED", "LockNotHeld")
        return 0
    finally:
        stop.set()
    say("EXITED")
    return 0


def cmd_try(args: argparse.Namespace) -> int:
    lease = make_lock(args, args.name).try_acquire()
    if lease is None:
        say("REFUSED")
        return 0
    say("ACQUIRED", lease.token)
    lease.release()
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from django_pglock import LockNotHeld

    lock = make_lock(args, args.name)
    started = time.monotonic()
    try:
        with lock.acquire(**acquire_kwargs(args, blocking=True)) as lease:
            if lease is None:
                say("TIMEOUT")
                return 0
            say("ACQUIRED", lease.token, f"{time.monotonic() - started:.3f}")
            for line in commands():
                if line == "release":
                    lease.release()
                    say("RELEASED")
                    break
                say("ERROR", f"UnknownCommand: {line!r}")
    except LockNotHeld:
        say("EXIT_RAISED", "LockNotHeld")
    return 0


def cmd_hold_many(args: argparse.Namespace) -> int:
    from django_pglock import LockNotHeld

    try:
        with contextlib.ExitStack() as stack:
            for i in range(args.count):
                name = f"{args.name}-{i}"
                lock = make_lock(args, name)
                lease = stack.enter_context(
                    lock.acquire(**acquire_kwargs(args, blocking=args.blocking))
                )
                if lease is None:
                    say("REFUSED", name)
                    return 0
            say("ACQUIRED_ALL")
            for line in commands():
                if line == "release":
                    break
                say("ERROR", f"UnknownCommand: {line!r}")
    except LockNotHeld:
        say("EXIT_RAISED", "LockNotHeld")
        return 0
    say("RELEASED")
    return 0


def cmd_contend(args: argparse.Namespace) -> int:
    from django_pglock import LockNotHeld

    lock = make_lock(args, args.name)
    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    grants = 0

    def log(event: str, token: int, slot: int = 1) -> None:
        # A semaphore's lines end with the slot.
        tail = f" {slot}" if args.limit != 1 else ""
        os.write(fd, f"{event} {pid} {time.time():.6f} {token}{tail}\n".encode())

    try:
        say("READY")
        for line in commands():
            if line == "go":
                break
            say("ERROR", f"UnknownCommand: {line!r}")
        else:
            return 0
        deadline = time.monotonic() + args.seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            lease = None
            try:
                with lock.acquire(blocking=True, timeout=remaining) as lease:
                    if lease is None:
                        break
                    log("ENTER", lease.token, lease.slot)
                    time.sleep(args.hold_for)
                    log("EXIT", lease.token, lease.slot)
                    grants += 1
            except LockNotHeld:  # recorded for the test to judge; keep contending
                log("LOST", lease.token if lease is not None else 0)
            if args.pause > 0:
                time.sleep(random.uniform(0, args.pause))
    finally:
        os.close(fd)
    say("CONTENDED", grants)
    return 0


HANDLERS = {
    "hold": cmd_hold,
    "try": cmd_try,
    "wait": cmd_wait,
    "hold-many": cmd_hold_many,
    "contend": cmd_contend,
}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
        import django

        django.setup()
        return HANDLERS[args.command](args)
    except Exception as exc:
        say("ERROR", f"{type(exc).__name__}: {exc}")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
