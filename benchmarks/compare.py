"""django_pglock next to the PostgreSQL lock libraries users would pick instead.

    python benchmarks/compare.py [--quick] [--json] [--doc PATH | --no-doc]
                                 [--only LIB,...] [--phases PHASE,...] [--venv PATH]

One run, one PostgreSQL server (the test suite's throwaway server, or ``DATABASE_URL``),
one database per library. Every library, and a bare-psycopg floor, runs in driver
subprocesses (this same file, started with ``--driver KIND``) that speak one tiny
line-of-JSON protocol, so the measuring code is the same for all of them. The three
competitors are installed from PyPI, pinned, into a separate virtual environment that
this script creates under the user's cache directory (``--venv`` to choose another).

Measured in rounds of floor, A, floor, B, floor, ... (order rotating), each slot compared
with the floor slots right before and after it, so that drift cancels out of the ratios:

1. cycle: one acquire + release, time per cycle, against the floor (``INSERT .. ON
   CONFLICT DO NOTHING RETURNING`` + ``DELETE`` on one autocommit connection);
2. contention: 8 processes loop try-acquire -> tiny work -> release (a refused try sleeps
   a short jittered while) on one name; grants per second against the same loop on the
   floor, and every ENTER/EXIT logged and checked for overlapping holders;
3. takeover: SIGKILL the holder; seconds until a waiting contender (the library's own
   blocking acquire with its default poll interval, or a 0.5 s poll loop) gets the lock,
   at the library's default thresholds;
4. 1,000 locks held by one process: server connections, threads in the process, and
   refresh (heartbeat) statements per 10 s from pg_stat_statements.

The results table is printed and written into docs/benchmarks.md (between markers, so
text around them is kept). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# Only the standard library at module level: the competitors' drivers run this file with
# the competitors' interpreter, where neither Django nor this repository is installed.

REPO_ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = REPO_ROOT / "docs" / "benchmarks.md"
BEGIN_MARK = "<!-- compare.py:begin (generated: do not edit by hand) -->"
END_MARK = "<!-- compare.py:end -->"

PROCESSES = 8  # contention: processes on one name
LOCKS = 1000  # locks held by one process
WORK_SECONDS = 0.0002  # contention: the "tiny work" done while holding
BACKOFF_SECONDS = 0.002  # contention: sleep after a refused try (jittered x0.5..1.5)
POLL_SECONDS = 0.5  # takeover: poll interval for libraries without a blocking acquire
STATEMENT_OPS = 100  # cycles run to count statements and sessions per cycle
HANDOFF_HOLD = 0.1  # handoff: seconds each grant is held before its release (jittered)


@dataclass(frozen=True)
class Settings:
    cycle_rounds: int
    cycle_slot: float  # seconds each driver cycles per round
    contention_rounds: int
    contention_seconds: float
    takeover_trials: int
    takeover_cap: float
    hold_window: float  # seconds over which refresh statements are counted
    handoff_seconds: float = 20.0  # handoff: seconds of handoffs per library
    idle_window: float = 5.0  # handoff: seconds over which waiting statements are counted


FULL = Settings(20, 0.1, 4, 1.5, 5, 30.0, 20.0)
QUICK = Settings(8, 0.1, 2, 1.0, 3, 10.0, 10.0, 10.0, 3.0)


@dataclass(frozen=True)
class Library:
    key: str  # the driver kind
    label: str
    db: str  # database suffix (variants share their library's database)
    phases: frozenset[str]
    requirement: str | None = None  # pip requirement; None: runs in this interpreter
    defaults: str = ""
    linger: float | None = None  # how long a SIGKILLed holder's lock stays, by default
    linger_what: str = ""
    ours: bool = False
    client: str = "psycopg"  # the PostgreSQL driver the library uses


PHASES = ("cycle", "contention", "takeover", "hold", "handoff")
ALL = frozenset(PHASES)
LIBRARIES = [
    Library(
        "floor",
        "floor: bare psycopg",
        "floor",
        frozenset({"cycle", "contention"}),
        defaults="INSERT .. ON CONFLICT DO NOTHING RETURNING + DELETE, one autocommit connection",
    ),
    Library(
        "django_pglock",
        "django_pglock",
        "pglock",
        ALL,
        defaults="Lock(name): heartbeat 10 s, alert 30 s, stale 600 s, poll 0.5 s "
        "(jittered), advisory on",
        linger=600.0,
        linger_what="stale_after",
        ours=True,
    ),
    Library(
        "django_pglock-table",
        "django_pglock, advisory=False",
        "pglock",
        frozenset({"cycle"}),
        defaults="Lock(name, advisory=False)",
        ours=True,
    ),
    Library(
        "postgres-mutex",
        "postgres-mutex",
        "pgmutex",
        ALL,
        requirement="postgres-mutex==0.1.0",
        defaults="Mutex(dsn, name): heartbeat 10 s, alert 30 s, stale 600 s, poll 0.5 s",
        linger=600.0,
        linger_what="stale_threshold",
    ),
    Library(
        "pglease",
        "pglease",
        "pglease",
        ALL,
        requirement="pglease==0.0.4",
        defaults="PGLease(dsn) (PostgresBackend): ttl 60 s, heartbeat 10 s, "
        "wait_for_lease poll 5 s",
        linger=60.0,
        linger_what="ttl",
        client="psycopg2-binary",
    ),
    Library(
        "pglease-hybrid",
        "pglease, HybridPostgresBackend",
        "pglease",
        frozenset({"takeover"}),
        requirement="pglease==0.0.4",
        defaults="PGLease(HybridPostgresBackend(dsn)): advertised '<1 s failover'",
        linger=60.0,
        linger_what="ttl",
        client="psycopg2-binary",
    ),
    Library(
        "dislock",
        "dislock",
        "dislock",
        ALL,
        requirement="dislock==0.1.0",
        defaults="LeaseLock: TTL 60 s, renewed every 10 s (the CLI defaults); no blocking "
        "acquire (polled every 0.5 s)",
        linger=60.0,
        linger_what="TTL",
    ),
]
BY_KEY = {lib.key: lib for lib in LIBRARIES}


class DriverError(RuntimeError):
    """A driver subprocess failed, died or did not answer."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(error: BaseException) -> str:
    """``Type: message`` on one line, libpq's socket preamble cut, with its cause."""
    text = str(error)
    if "FATAL:" in text:  # "connection to server on socket ... failed: FATAL: ..."
        text = "FATAL:" + text.split("FATAL:", 1)[1]
    message = f"{type(error).__name__}: {one_line(text, 200)}"
    cause = error.__cause__ or error.__context__
    if cause is not None and not isinstance(error, DriverError):
        said = one_line(str(cause), 120)
        shown = len(said) < 20 or said[:60] not in " ".join(text.split())
        message += f" (from {type(cause).__name__}{': ' + said if shown else ''})"
    return message


# =========================================================================================
# Drivers: run in subprocesses, one library each.
# =========================================================================================

FLOOR_TABLE = "floor_t"


class PollingWait:
    """A blocking acquire for libraries that have none: try every POLL_SECONDS."""

    def try_acquire(self, name: str) -> Any:
        raise NotImplementedError

    def wait_acquire(self, name: str, cap: float) -> Any:
        deadline = time.monotonic() + cap
        while True:
            handle = self.try_acquire(name)
            if handle is not None or time.monotonic() >= deadline:
                return handle
            time.sleep(POLL_SECONDS)


class FloorDriver(PollingWait):
    distribution = "psycopg"

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.holder = f"floor:{os.getpid()}"

    def setup(self) -> None:
        self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (name varchar(255) PRIMARY KEY, holder text)"
        )

    def try_acquire(self, name: str) -> Any:
        row = self.conn.execute(
            f"INSERT INTO {FLOOR_TABLE} (name, holder) VALUES (%s, %s)"
            " ON CONFLICT DO NOTHING RETURNING 1",
            (name, self.holder),
        ).fetchone()
        return name if row else None

    def release(self, handle: Any) -> None:
        self.conn.execute(f"DELETE FROM {FLOOR_TABLE} WHERE name = %s", (handle,))


class PglockDriver:
    distribution = "django-singleton-jobs"

    def __init__(self, url: str, advisory: bool | None = None) -> None:
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        import django
        from django.conf import settings

        from tests.settings import parse_database_url

        settings.configure(
            DATABASES={"default": parse_database_url(url)},
            INSTALLED_APPS=["django_pglock"],
            USE_TZ=True,
            TIME_ZONE="UTC",
            DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        )
        django.setup()
        from django_pglock import Lock, LockNotAcquired

        self._lock_class = Lock
        self._not_acquired = LockNotAcquired
        self.advisory = advisory
        self.locks: dict[str, Any] = {}

    def _lock(self, name: str) -> Any:
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = self._lock_class(name, advisory=self.advisory)
        return lock

    def setup(self) -> None:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)

    def try_acquire(self, name: str) -> Any:
        return self._lock(name).try_acquire()

    def release(self, handle: Any) -> None:
        handle.release()

    def wait_acquire(self, name: str, cap: float) -> Any:
        try:
            return self._lock(name).acquire_or_raise(timeout=cap)
        except self._not_acquired:
            return None


class PgMutexDriver:
    distribution = "postgres-mutex"

    def __init__(self, url: str) -> None:
        from postgres_mutex import LockAcquisitionTimeout, Mutex

        self.url = url
        self._mutex_class = Mutex
        self._timeout = LockAcquisitionTimeout
        self.mutexes: dict[str, Any] = {}

    def _mutex(self, name: str) -> Any:
        mutex = self.mutexes.get(name)
        if mutex is None:
            mutex = self.mutexes[name] = self._mutex_class(dsn=self.url, lock_name=name)
        return mutex

    def setup(self) -> None:
        mutex = self._mutex_class(dsn=self.url, lock_name="setup")
        mutex.create_schema()
        mutex.close()

    def try_acquire(self, name: str) -> Any:
        acquisition = self._mutex(name).acquire(blocking=False)
        if acquisition.__enter__():
            return acquisition
        acquisition.__exit__(None, None, None)
        return None

    def release(self, handle: Any) -> None:
        handle.__exit__(None, None, None)

    def wait_acquire(self, name: str, cap: float) -> Any:
        acquisition = self._mutex(name).acquire(blocking=True, timeout=cap)
        try:
            acquired = acquisition.__enter__()
        except self._timeout:
            return None
        return acquisition if acquired else None


class PgleaseDriver:
    distribution = "pglease"

    def __init__(self, url: str, hybrid: bool = False) -> None:
        from pglease import AcquisitionError, HybridPostgresBackend, PGLease

        self._error = AcquisitionError
        self.pglease = PGLease(HybridPostgresBackend(url) if hybrid else url)

    def setup(self) -> None:
        pass  # PostgresBackend creates its table when constructed (auto_initialize)

    def try_acquire(self, name: str) -> Any:
        return name if self.pglease.try_acquire(name) else None

    def release(self, handle: Any) -> None:
        self.pglease.release(handle)

    def wait_acquire(self, name: str, cap: float) -> Any:
        try:
            self.pglease.wait_for_lease(name, timeout=cap)  # its default poll: 5 s
        except self._error:
            return None
        return name


class DislockDriver(PollingWait):
    distribution = "dislock"
    # dislock's CLI defaults: RUN_LOCK_TTL_SECONDS=60, interval clamp(60 * 0.3, 1, 10) = 10.
    TTL = 60.0
    INTERVAL = 10.0

    def __init__(self, url: str) -> None:
        from dislock import LeaseLock, LockContext, LockNotAcquiredError

        self.url = url
        self._lease_lock = LeaseLock
        self._context = LockContext
        self._busy = LockNotAcquiredError
        self.owner = f"{os.uname().nodename}:{os.getpid()}"
        self.contexts: dict[str, Any] = {}

    def setup(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(  # the schema from dislock's README
                "CREATE TABLE IF NOT EXISTS key_value ("
                " key text PRIMARY KEY, value text NOT NULL, expire_at timestamptz NOT NULL)"
            )

    def try_acquire(self, name: str) -> Any:
        context = self.contexts.get(name)
        if context is None:
            context = self.contexts[name] = self._context(
                url=self.url,
                table_parts=["key_value"],
                lock_key=name,
                owner=self.owner,
                run_ttl_seconds=self.TTL,
                lease_interval_seconds=self.INTERVAL,
            )
        lock = self._lease_lock(context)
        try:
            lock.__enter__()
        except self._busy:
            return None
        return lock

    def release(self, handle: Any) -> None:
        handle.__exit__(None, None, None)


def make_driver(kind: str, url: str) -> Any:
    if kind == "floor":
        return FloorDriver(url)
    if kind == "django_pglock":
        return PglockDriver(url)
    if kind == "django_pglock-table":
        return PglockDriver(url, advisory=False)
    if kind == "postgres-mutex":
        return PgMutexDriver(url)
    if kind == "pglease":
        return PgleaseDriver(url)
    if kind == "pglease-hybrid":
        return PgleaseDriver(url, hybrid=True)
    if kind == "dislock":
        return DislockDriver(url)
    raise ValueError(f"unknown driver kind {kind!r}")


def _versions(distribution: str) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in (distribution, "psycopg", "psycopg-binary", "psycopg2-binary", "Django"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _cycles(driver: Any, name: str, stop: Callable[[int], bool]) -> tuple[int, int]:
    ops = 0
    started = time.perf_counter_ns()
    while not stop(ops):
        handle = driver.try_acquire(name)
        if handle is None:
            raise RuntimeError(f"{name!r} was refused; nothing else should hold it")
        driver.release(handle)
        ops += 1
    return ops, time.perf_counter_ns() - started


def _until(deadline: float) -> Callable[[int], bool]:
    return lambda _: time.perf_counter() >= deadline


def _count(n: int) -> Callable[[int], bool]:
    return lambda done: done >= n


def _contend(driver: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    name, log_path = cmd["name"], cmd["log"]
    start_at, until = cmd["start_at"], cmd["until"]
    rng = random.Random(os.getpid())
    intervals: list[tuple[int, int]] = []
    errors = 0
    samples: list[str] = []
    # Time spent in the library's calls (ns), by outcome: a small profile of the loop.
    spent = {"granted": 0, "refused": 0, "release": 0}
    counts = dict.fromkeys(spent, 0)
    while time.monotonic() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.monotonic())))
    clock = time.perf_counter_ns
    cpu = time.process_time_ns()  # all threads of this process
    while time.monotonic() < until:
        sent = clock()
        try:
            handle = driver.try_acquire(name)
        except Exception as error:
            errors += 1
            if len(samples) < 3:
                samples.append(describe(error))
            time.sleep(cmd["backoff"] * rng.uniform(0.5, 1.5))
            continue
        outcome = "refused" if handle is None else "granted"
        spent[outcome] += clock() - sent
        counts[outcome] += 1
        if handle is None:
            time.sleep(cmd["backoff"] * rng.uniform(0.5, 1.5))
            continue
        enter = time.monotonic_ns()
        time.sleep(cmd["work"])  # the tiny work
        leave = time.monotonic_ns()
        intervals.append((enter, leave))
        sent = clock()
        try:
            driver.release(handle)
        except Exception as error:
            errors += 1
            if len(samples) < 3:
                samples.append("release: " + describe(error))
        spent["release"] += clock() - sent
        counts["release"] += 1
    cpu = time.process_time_ns() - cpu
    pid = os.getpid()
    with open(log_path, "w", encoding="utf-8") as out:
        for enter, leave in intervals:
            out.write(f"ENTER {pid} {enter}\nEXIT {pid} {leave}\n")
    return {
        "cpu_ns": cpu,
        "refused": counts["refused"],
        "errors": errors,
        "error_samples": samples,
        "spent_ns": spent,
        "counts": counts,
    }


def _hold_many(driver: Any, prefix: str, n: int) -> dict[str, Any]:
    held: list[Any] = []
    error = None
    started = time.monotonic()
    for i in range(n):
        try:
            handle = driver.try_acquire(f"{prefix}{i}")
        except Exception as exc:
            error = describe(exc)
            break
        if handle is None:
            error = f"{prefix}{i} was refused"
            break
        held.append(handle)
    _HELD.extend(held)
    # Threads that start connections in the background (dislock's renewers) settle first.
    time.sleep(1.0)
    return {"held": len(held), "error": error, "seconds": time.monotonic() - started}


_HELD: list[Any] = []  # keeps what a driver holds referenced until it is killed


def _handoffs(driver: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Wait (the library's blocking acquire), hold a while, release, and wait again once
    another process has been granted the name, until ``until``: each grant and each
    release stamped on the host's monotonic clock (the same for every process), just
    after the grant returned and just before the release call. Grants are appended to
    the shared log ``log``, which is how a process that released sees the next grant:
    so a release is always handed to one of the others, never back to its releaser."""
    rng = random.Random(os.getpid())
    grants: list[int] = []
    releases: list[int] = []
    errors, samples = 0, []
    fd = os.open(cmd["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    while time.monotonic() < cmd["until"]:
        try:
            handle = driver.wait_acquire(cmd["name"], max(0.1, cmd["until"] - time.monotonic()))
        except Exception as error:  # a library's own failure under contention
            errors += 1
            if len(samples) < 3:
                samples.append(describe(error))
            continue
        if handle is None:
            break
        granted = time.monotonic_ns()
        grants.append(granted)
        os.write(fd, f"{granted}\n".encode())
        time.sleep(cmd["hold"] * rng.uniform(0.5, 1.5))
        released = time.monotonic_ns()
        releases.append(released)
        driver.release(handle)
        while time.monotonic() < cmd["until"]:  # rest until another process holds it
            with open(cmd["log"], encoding="utf-8") as log_file:
                if any(int(line) > released for line in log_file.read().split()):
                    break
            time.sleep(0.001)
    os.close(fd)
    return {"grants": grants, "releases": releases, "errors": errors, "error_samples": samples}


def driver_main(kind: str, url: str) -> int:
    protocol = sys.stdout
    sys.stdout = sys.stderr  # anything a library prints stays off the protocol

    def emit(message: dict[str, Any]) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    driver: Any = None
    broken: str | None = None
    try:
        driver = make_driver(kind, url)
    except Exception as error:
        broken = describe(error)
        traceback.print_exc()

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            emit({"ok": True})
            protocol.flush()
            os._exit(0)
        if broken is not None:
            emit({"ok": False, "error": broken})
            continue
        try:
            if op == "info":
                result: dict[str, Any] = {
                    "pid": os.getpid(),
                    "python": platform.python_version(),
                    "versions": _versions(driver.distribution),
                }
            elif op == "setup":
                driver.setup()
                result = {}
            elif op == "cycle":
                ops, ns = _cycles(driver, cmd["name"], _until(time.perf_counter() + cmd["seconds"]))
                result = {"ops": ops, "ns": ns}
            elif op == "cycle_n":
                ops, ns = _cycles(driver, cmd["name"], _count(cmd["n"]))
                result = {"ops": ops, "ns": ns}
            elif op == "contend":
                result = _contend(driver, cmd)
            elif op == "hold":
                handle = driver.try_acquire(cmd["name"])
                _HELD.append(handle)
                result = {"held": handle is not None}
            elif op == "wait":
                handle = driver.try_acquire(cmd["name"])
                if handle is not None:
                    raise RuntimeError(f"{cmd['name']!r} was free: nobody held it")
                emit({"event": "waiting"})
                handle = driver.wait_acquire(cmd["name"], cmd["cap"])
                acquired = time.monotonic_ns()
                _HELD.append(handle)
                result = {"acquired_ns": acquired if handle is not None else None}
            elif op == "handoff":
                result = _handoffs(driver, cmd)
            elif op == "hold_many":
                result = _hold_many(driver, cmd["prefix"], cmd["n"])
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as error:
            traceback.print_exc()
            emit({"ok": False, "error": describe(error)})
        else:
            emit({"ok": True, **result})
    return 0


# =========================================================================================
# The harness: the competitors' venv, the server, the driver processes.
# =========================================================================================


class Driver:
    """A driver subprocess seen from the harness: send a command, read its answers."""

    def __init__(self, lib: Library, python: str, url: str, logs: Path, tag: str) -> None:
        self.lib = lib
        self.tag = tag
        self.stderr_path = logs / f"{lib.key}-{tag}.stderr"
        self._stderr = open(self.stderr_path, "w", encoding="utf-8")  # noqa: SIM115
        env = {**os.environ, "PGAPPNAME": f"compare-{lib.key}"[:63]}
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--driver", lib.key, "--url", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        self.pid = self.proc.pid
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self._answers.put(json.loads(line))
        self._answers.put(None)

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
        except OSError as error:
            raise DriverError(f"{self.lib.key} driver is gone: {self._tail()}") from error

    def recv(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise DriverError(f"{self.lib.key} driver gave no answer in {timeout:.0f} s") from None
        if answer is None:
            self._answers.put(None)
            raise DriverError(f"{self.lib.key} driver exited: {self._tail()}")
        if answer.get("ok") is False:
            raise DriverError(answer["error"])
        return answer

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.recv(timeout)

    def _tail(self) -> str:
        self._stderr.flush()
        text = self.stderr_path.read_text(errors="replace").strip().splitlines()
        return one_line(" | ".join(text[-3:]) or "(no output)")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._stderr.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(DriverError):
                self.call("quit", timeout=10)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        self.kill()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "django-pglock-bench"


def ensure_venv(path: Path | None, refresh: bool) -> tuple[str | None, dict[str, str]]:
    """The competitors' interpreter, and an error per requirement that did not install."""
    requirements = sorted({lib.requirement for lib in LIBRARIES if lib.requirement})
    if path is None:
        tag = hashlib.sha1(
            "\n".join([sys.version, *requirements]).encode(), usedforsecurity=False
        ).hexdigest()[:10]
        path = cache_dir() / f"competitors-{tag}"
    python = path / "bin" / "python"
    marker = path / "installed.json"
    if marker.exists() and python.exists() and not refresh:
        return str(python), json.loads(marker.read_text())
    log(f"creating the competitors' venv in {path} (pip install {' '.join(requirements)})")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(path)],
            check=True,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        return None, {req: f"could not create a venv: {one_line(detail)}" for req in requirements}
    failed: dict[str, str] = {}
    for requirement in requirements:
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", requirement],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if "ERROR" in ln] or [done.stderr]
            failed[requirement] = "pip install failed: " + one_line(" ".join(lines[-3:]))
    if not failed:  # after a failure, the next run tries again
        marker.write_text(json.dumps(failed))
    return str(python), failed


def db_url(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


@dataclass
class Harness:
    url: str
    settings: Settings
    logs: Path
    pythons: dict[str, str] = field(default_factory=dict)  # lib key -> interpreter
    broken: dict[str, str] = field(default_factory=dict)  # lib key -> why not measured
    versions: dict[str, dict[str, str]] = field(default_factory=dict)
    databases: dict[str, str] = field(default_factory=dict)  # db suffix -> name
    drivers: list[Driver] = field(default_factory=list)
    observer: Any = None
    statements: bool = False  # pg_stat_statements is available
    only: set[str] | None = None  # libraries selected (None: all)
    phases: set[str] = field(default_factory=lambda: set(PHASES))

    # -- server ------------------------------------------------------------------------

    def connect(self) -> None:
        import psycopg

        self.observer = psycopg.connect(self.url, autocommit=True)
        for suffix in sorted({lib.db for lib in LIBRARIES}):
            name = f"cmp_{os.getpid()}_{suffix}"
            self.observer.execute(f'CREATE DATABASE "{name}"')
            self.databases[suffix] = name
        try:
            self.observer.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self.observer.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
            self.statements = True
        except psycopg.Error as error:
            log(f"pg_stat_statements unavailable, statements not counted: {error}")
            self.statements = False

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return list(self.observer.execute(sql, args).fetchall())

    def facts(self) -> dict[str, Any]:
        show = {
            name: self.query(f"SHOW {name}")[0][0]
            for name in ("server_version", "synchronous_commit", "fsync", "max_connections")
        }
        host = self.observer.info.host
        return {**show, "connection": "unix socket" if host.startswith("/") else f"tcp ({host})"}

    def dburl(self, lib: Library) -> str:
        return db_url(self.url, self.databases[lib.db])

    def backends(self, lib: Library) -> int:
        return int(
            self.query(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND backend_type = 'client backend'",
                self.databases[lib.db],
            )[0][0]
        )

    def dbid(self, lib: Library) -> int:
        rows = self.query("SELECT oid FROM pg_database WHERE datname = %s", self.databases[lib.db])
        return int(rows[0][0])

    def reset_statements(self, lib: Library) -> None:
        self.query("SELECT pg_stat_statements_reset(0, %s, 0)", self.dbid(lib))

    def statements_of(self, lib: Library) -> list[tuple[str, int, float]]:
        """(query, calls, total execution ms) of lib's database since the last reset."""
        return [(q, c, t) for q, c, t, _ in self.statement_stats(lib)]

    def statement_stats(self, lib: Library) -> list[tuple[str, int, float, int]]:
        """(query, calls, total execution ms, WAL records) since the last reset."""
        rows = self.query(
            "SELECT query, sum(calls)::bigint, sum(total_exec_time), sum(wal_records)::bigint"
            " FROM pg_stat_statements WHERE dbid = %s AND toplevel GROUP BY query ORDER BY 2 DESC",
            self.dbid(lib),
        )
        return [(str(q), int(c), float(t), int(w or 0)) for q, c, t, w in rows]

    def sessions(self, lib: Library) -> int:
        self.query("SELECT pg_stat_clear_snapshot()")
        row = self.query(
            "SELECT sessions FROM pg_stat_database WHERE datname = %s", self.databases[lib.db]
        )
        return int(row[0][0] or 0)

    def drop(self) -> None:
        if self.observer is None:
            return
        for name in self.databases.values():
            with contextlib.suppress(Exception):
                self.observer.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.observer.close()

    # -- drivers -----------------------------------------------------------------------

    def spawn(self, lib: Library, tag: str) -> Driver:
        driver = Driver(lib, self.pythons[lib.key], self.dburl(lib), self.logs, tag)
        self.drivers.append(driver)
        return driver

    def retire(self, driver: Driver, kill: bool = False) -> None:
        driver.kill() if kill else driver.close()
        with contextlib.suppress(ValueError):
            self.drivers.remove(driver)

    def close_all(self) -> None:
        for driver in list(self.drivers):
            driver.kill()
        self.drivers.clear()

    def selected(self, lib: Library) -> bool:
        return self.only is None or lib.key in self.only

    def usable(self, phase: str) -> list[Library]:
        if phase not in self.phases:
            return []
        return [
            lib
            for lib in LIBRARIES
            if phase in lib.phases and lib.key not in self.broken and self.selected(lib)
        ]

    def wait_idle(self, lib: Library, timeout: float = 10.0) -> None:
        """Wait until no client is connected to lib's database (terminate stragglers)."""
        deadline = time.monotonic() + timeout
        while self.backends(lib) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.backends(lib):
            self.query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                self.databases[lib.db],
            )
            time.sleep(0.5)


def threads_of(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return -1


# -- phase 0: probe every library, start the pools ---------------------------------------


def start_pools(h: Harness) -> dict[str, list[Driver]]:
    """A setup driver per library, then PROCESSES drivers per pooled library."""
    for lib in LIBRARIES:
        if lib.key in h.broken or not h.selected(lib) or not lib.phases & h.phases:
            continue
        driver = h.spawn(lib, "setup")
        try:
            info = driver.call("info", timeout=120)
            h.versions[lib.key] = info["versions"]
            driver.call("setup", timeout=120)
        except DriverError as error:
            h.broken[lib.key] = f"does not start: {error}"
            log(f"{lib.label}: {h.broken[lib.key]}")
        h.retire(driver)
    pools: dict[str, list[Driver]] = {}
    pooled = [lib for lib in h.usable("cycle") + h.usable("contention")]
    for lib in dict.fromkeys(pooled):
        size = PROCESSES if "contention" in lib.phases else 1
        pools[lib.key] = [h.spawn(lib, f"pool{i}") for i in range(size)]
    for key, pool in list(pools.items()):
        try:
            for i, driver in enumerate(pool):
                driver.call("info", timeout=180)
                # Open connections and warm caches on a name of its own.
                driver.call("cycle_n", n=5, name=f"warm-{i}", timeout=120)
        except DriverError as error:
            h.broken[key] = f"failed warming up: {error}"
            log(f"{BY_KEY[key].label}: {h.broken[key]}")
            for driver in pools.pop(key):
                h.retire(driver, kill=True)
    return pools


# -- rounds bracketed by the floor -------------------------------------------------------


def bracketed(
    keys: list[str],
    rounds: int,
    measure: Callable[[str, int], float],
    what: str,
    warm_up: bool,
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, str]]:
    """Run ``measure`` in rounds of floor, A, floor, B, floor, ... (order rotating).

    Each value is compared with the mean of the two floor values measured right before
    and right after it, so drift slower than two slots cancels out of the ratio.
    Returns (values per key, ratios per key, errors per key); round 0 is discarded if
    ``warm_up``.
    """
    values: dict[str, list[float]] = {key: [] for key in ["floor", *keys]}
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    failed: dict[str, str] = {}
    for round_no in range(rounds + int(warm_up)):
        live = [key for key in keys if key not in failed]
        shift = round_no % max(1, len(live))
        order = live[shift:] + live[:shift]
        sequence = ["floor"]
        for key in order:
            sequence += [key, "floor"]
        got: list[float | None] = []
        for key in sequence:
            try:
                got.append(measure(key, round_no))
            except DriverError as error:
                failed[key] = str(error)
                got.append(None)
        if "floor" in failed:
            break
        if warm_up and round_no == 0:
            continue
        for i, key in enumerate(sequence):
            value = got[i]
            if value is None:
                continue
            values[key].append(value)
            if key != "floor":
                before, after = got[i - 1], got[i + 1]
                assert before is not None and after is not None
                if before + after > 0:
                    ratios[key].append(value / ((before + after) / 2))
        log(f"{what} round {round_no + int(not warm_up)}/{rounds} done")
    return values, ratios, failed


def spread(values: list[float]) -> tuple[float, float]:
    """The interquartile range (p25, p75) of ``values``."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


# -- phase 1: cycle ----------------------------------------------------------------------


def measure_cycles(h: Harness, pools: dict[str, list[Driver]]) -> dict[str, Any]:
    if "cycle" not in h.phases:
        return {}
    keys = [lib.key for lib in h.usable("cycle") if lib.key in pools and lib.key != "floor"]
    slot = h.settings.cycle_slot

    def measure(key: str, _round: int) -> float:
        answer = pools[key][0].call("cycle", seconds=slot, name=f"cycle-{key}", timeout=120)
        return float(answer["ns"] / answer["ops"] / 1000)

    values, ratios, failed = bracketed(keys, h.settings.cycle_rounds, measure, "cycle", True)
    results: dict[str, Any] = {}
    for key in ["floor", *keys]:
        if key in failed:
            results[key] = {"error": failed[key]}
            continue
        got = values[key]
        row: dict[str, Any] = {
            "median_us": statistics.median(got),
            "p25_us": spread(got)[0],
            "p75_us": spread(got)[1],
            "values_us": [round(v, 1) for v in got],
        }
        if key != "floor":
            row["ratio"] = statistics.median(ratios[key])
            row["ratio_p25"], row["ratio_p75"] = spread(ratios[key])
        results[key] = row
    # Statements the server ran, server time and sessions it started, per cycle.
    for key in ["floor", *keys]:
        if key in failed:
            continue
        lib = BY_KEY[key]
        before = h.sessions(lib)
        if h.statements:
            h.reset_statements(lib)
        try:
            pools[key][0].call("cycle_n", n=STATEMENT_OPS, name=f"cycle-{key}", timeout=300)
        except DriverError as error:
            results[key]["error"] = str(error)
            continue
        time.sleep(1.1)  # backends report session counts at most once a second
        if h.statements:
            stmts = h.statements_of(lib)
            results[key]["statements"] = sum(c for _, c, _ in stmts) / STATEMENT_OPS
            results[key]["server_us"] = sum(t for _, _, t in stmts) * 1000 / STATEMENT_OPS
            results[key]["statement_texts"] = [(one_line(q, 120), c) for q, c, _ in stmts[:8]]
        results[key]["sessions"] = (h.sessions(lib) - before) / STATEMENT_OPS
    return results


# -- phase 2: contention -----------------------------------------------------------------


def parse_logs(paths: list[Path], start_ns: int, until_ns: int) -> dict[str, Any]:
    """Grants inside the window, and holders whose ENTER..EXIT overlapped another's."""
    intervals: list[tuple[int, int, int]] = []
    for path in paths:
        if not path.exists():
            continue
        opened: dict[int, int] = {}
        for line in path.read_text().splitlines():
            what, pid, stamp = line.split()
            if what == "ENTER":
                opened[int(pid)] = int(stamp)
            else:
                intervals.append((opened.pop(int(pid)), int(stamp), int(pid)))
    intervals.sort()
    overlaps = 0
    worst_ns = 0
    latest_exit, latest_pid = 0, 0
    for enter, leave, pid in intervals:
        if enter < latest_exit and pid != latest_pid:
            overlaps += 1
            worst_ns = max(worst_ns, latest_exit - enter)
        if leave > latest_exit:
            latest_exit, latest_pid = leave, pid
    inside = [pid for enter, _, pid in intervals if start_ns <= enter < until_ns]
    return {
        "grants": len(inside),
        "holders": len(set(inside)),
        "overlaps": overlaps,
        "worst_overlap_ms": worst_ns / 1e6,
    }


def measure_contention(h: Harness, pools: dict[str, list[Driver]]) -> dict[str, Any]:
    if "contention" not in h.phases:
        return {}
    keys = [lib.key for lib in h.usable("contention") if lib.key in pools and lib.key != "floor"]
    seconds = h.settings.contention_seconds
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in ["floor", *keys]}

    def measure(key: str, round_no: int) -> float:
        pool = pools[key]
        slot = len(runs[key])
        start_at = time.monotonic() + 0.3
        until = start_at + seconds
        paths = [h.logs / f"contend-{key}-{slot}-{i}.log" for i in range(len(pool))]
        if h.statements:
            h.reset_statements(BY_KEY[key])
        for driver, path in zip(pool, paths, strict=True):
            driver.send(
                "contend",
                name=f"contend-{slot}",
                start_at=start_at,
                until=until,
                backoff=BACKOFF_SECONDS,
                work=WORK_SECONDS,
                log=str(path),
            )
        answers = [driver.recv(timeout=seconds + 120) for driver in pool]
        parsed = parse_logs(paths, int(start_at * 1e9), int(until * 1e9))
        parsed["rate"] = parsed["grants"] / seconds
        parsed["refused"] = sum(a["refused"] for a in answers)
        parsed["errors"] = sum(a["errors"] for a in answers)
        parsed["error_samples"] = sorted({s for a in answers for s in a["error_samples"]})
        parsed["client_cpu_ns"] = sum(a["cpu_ns"] for a in answers)
        if h.statements:
            parsed["stmts"] = h.statement_stats(BY_KEY[key])
            parsed["server_ms"] = sum(t for _, _, t, _ in parsed["stmts"])
        for part in ("granted", "refused", "release"):
            parsed[f"{part}_ns"] = sum(a["spent_ns"][part] for a in answers)
            parsed[f"{part}_n"] = sum(a["counts"][part] for a in answers)
        runs[key].append(parsed)
        return float(parsed["rate"])

    _, ratios, failed = bracketed(keys, h.settings.contention_rounds, measure, "contention", False)
    results: dict[str, Any] = {}
    for key in ["floor", *keys]:
        if key in failed:
            results[key] = {"error": failed[key]}
            continue
        got = runs[key]
        rates = [r["rate"] for r in got]
        row: dict[str, Any] = {
            "rate": statistics.median(rates),
            "rate_p25": spread(rates)[0],
            "rate_p75": spread(rates)[1],
            "rates": [round(r, 1) for r in rates],
            "overlaps": sum(r["overlaps"] for r in got),
            "worst_overlap_ms": max(r["worst_overlap_ms"] for r in got),
            "errors": sum(r["errors"] for r in got),
            "error_samples": sorted({s for r in got for s in r["error_samples"]})[:2],
            "grants": sum(r["grants"] for r in got),
            "refused": sum(r["refused"] for r in got),
            "holders_min": min(r["holders"] for r in got),
        }
        grants = sum(r["grants"] for r in got)
        row["client_cpu_us_per_grant"] = (
            sum(r["client_cpu_ns"] for r in got) / max(grants, 1) / 1000
        )
        if h.statements:
            row["server_us_per_grant"] = sum(r["server_ms"] for r in got) * 1000 / max(grants, 1)
            merged: dict[str, list[float]] = {}
            for r in got:
                for query, calls, ms, wal in r["stmts"]:
                    into = merged.setdefault(one_line(query, 70), [0, 0.0, 0])
                    into[0] += calls
                    into[1] += ms
                    into[2] += wal
            row["statements"] = [
                {
                    "query": query,
                    "per_grant": calls / max(grants, 1),
                    "mean_us": ms * 1000 / calls if calls else 0.0,
                    "wal_per_call": wal / calls if calls else 0.0,
                }
                for query, (calls, ms, wal) in sorted(merged.items(), key=lambda kv: -kv[1][0])
            ][:4]
        for part in ("granted", "refused", "release"):
            calls = sum(r[f"{part}_n"] for r in got)
            row[f"{part}_us"] = sum(r[f"{part}_ns"] for r in got) / calls / 1000 if calls else None
        if key != "floor":
            row["ratio"] = statistics.median(ratios[key])
            row["ratio_p25"], row["ratio_p75"] = spread(ratios[key])
        results[key] = row
        log(f"contention {key}: {row['rate']:.0f} grants/s, {row['overlaps']} overlaps")
    return results


# -- phase 3: takeover after SIGKILL -----------------------------------------------------


def takeover_trial(h: Harness, lib: Library, trial: int) -> dict[str, Any]:
    cap = h.settings.takeover_cap
    name = f"takeover-{trial}"
    holder = h.spawn(lib, f"holder{trial}")
    contender = h.spawn(lib, f"contender{trial}")
    try:
        holder.call("info", timeout=120)
        if not holder.call("hold", name=name, timeout=60)["held"]:
            raise DriverError(f"the holder could not take {name!r}")
        contender.call("info", timeout=120)
        # The contender gives up on its own a little after the cap; we judge the cap.
        contender.send("wait", name=name, cap=cap + 3.0)
        if contender.recv(timeout=60).get("event") != "waiting":
            raise DriverError("the contender did not start waiting")
        time.sleep(random.uniform(0.1, 0.7))  # kill at a random point of its poll cycle
        killed = time.monotonic_ns()
        holder.kill()
        answer = contender.recv(timeout=cap + 30)
    except DriverError as error:
        return {"error": str(error)}
    finally:
        h.retire(holder, kill=True)
        h.retire(contender, kill=True)
    acquired = answer["acquired_ns"]
    seconds = None if acquired is None else (acquired - killed) / 1e9
    if seconds is not None and seconds > cap:
        seconds = None
    return {"seconds": seconds}


def measure_takeover(h: Harness) -> dict[str, Any]:
    libs = h.usable("takeover")
    trials: dict[str, list[dict[str, Any]]] = {lib.key: [] for lib in libs}

    def run(lib: Library, trial: int) -> None:
        trials[lib.key].append(takeover_trial(h, lib, trial))

    # First trial of every library at once: the slow ones wait out the cap together.
    cap = h.settings.takeover_cap
    if libs:
        log(f"takeover: first trial of {len(libs)} libraries in parallel (cap {cap:.0f} s)")
    threads = [threading.Thread(target=run, args=(lib, 0)) for lib in libs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for lib in libs:
        if trials[lib.key][0].get("seconds") is not None:
            for trial in range(1, h.settings.takeover_trials):
                run(lib, trial)
    results: dict[str, Any] = {}
    for lib in libs:
        got = trials[lib.key]
        errors = [t["error"] for t in got if "error" in t]
        times = [t["seconds"] for t in got if "error" not in t]
        if errors and not times:
            results[lib.key] = {"error": errors[0]}
            continue
        row: dict[str, Any] = {"trials": len(times), "cap": h.settings.takeover_cap}
        if all(t is not None for t in times):
            row.update(median=statistics.median(times), max=max(times), all=times)
        else:
            row.update(median=None, max=None)
        if errors:
            row["errors"] = errors
        results[lib.key] = row
        log(f"takeover {lib.key}: {row}")
    return results


# -- phase 5: handoff from a release to the next waiter's grant --------------------------


def handoff_trial(h: Harness, lib: Library) -> dict[str, Any]:
    """PROCESSES waiting processes and a holder. First the statements per second of the
    waiters while the holder keeps the name; then every process loops wait -> hold ->
    release, and each release is matched with the next grant (by anyone)."""
    drivers = [h.spawn(lib, f"handoff{i}") for i in range(PROCESSES + 1)]
    row: dict[str, Any] = {}
    try:
        for driver in drivers:
            driver.call("info", timeout=180)
        holder, waiters = drivers[0], drivers[1:]
        if not holder.call("hold", name="idle", timeout=60)["held"]:
            raise DriverError("the holder could not take 'idle'")
        window = h.settings.idle_window
        for driver in waiters:
            driver.send("wait", name="idle", cap=window + 60.0)
        for driver in waiters:
            if driver.recv(timeout=60).get("event") != "waiting":
                raise DriverError("a waiter did not start waiting")
        time.sleep(1.0)  # every waiter past its first refusal
        if h.statements:
            h.reset_statements(lib)
            time.sleep(window)
            calls = sum(c for q, c, _ in h.statements_of(lib) if "pg_stat_statements" not in q)
            row["waiting_statements_per_s"] = calls / window
    except DriverError as error:
        for driver in drivers:
            h.retire(driver, kill=True)
        return {"error": str(error)}
    for driver in drivers:  # the waiters still wait on 'idle': start afresh
        h.retire(driver, kill=True)
    h.wait_idle(lib)
    drivers = [h.spawn(lib, f"handoff{i}") for i in range(PROCESSES + 1)]
    try:
        for driver in drivers:
            driver.call("info", timeout=180)
            driver.call("cycle_n", n=2, name=f"warm-{driver.tag}", timeout=120)
        until = time.monotonic() + 1.0 + h.settings.handoff_seconds
        log_path = h.logs / f"handoff-{lib.key}.log"
        for driver in drivers:
            driver.send(
                "handoff", name="handoff", until=until, hold=HANDOFF_HOLD, log=str(log_path)
            )
        answers = [d.recv(timeout=h.settings.handoff_seconds + 120) for d in drivers]
    except DriverError as error:
        return {"error": str(error)}
    finally:
        for driver in drivers:
            h.retire(driver, kill=True)
    grants = sorted(g for a in answers for g in a["grants"])
    releases = sorted(r for a in answers for r in a["releases"])
    times = []
    for released in releases:
        later = [g for g in grants if g > released]
        if later:
            times.append((later[0] - released) / 1e6)
    if len(times) < 2:
        return {**row, "error": f"only {len(times)} handoffs in {h.settings.handoff_seconds} s"}
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    row.update(handoffs=len(times), median_ms=statistics.median(times), p99_ms=p99)
    errors = sum(a.get("errors", 0) for a in answers)
    if errors:
        samples = [e for a in answers for e in a.get("error_samples", [])]
        row.update(errors=errors, error_samples=samples[:3])
    return row


def measure_handoff(h: Harness) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for lib in h.usable("handoff"):
        log(f"handoff {lib.key}: {PROCESSES} waiting processes")
        results[lib.key] = handoff_trial(h, lib)
        log(f"handoff {lib.key}: {results[lib.key]}")
    return results


# -- phase 4: 1,000 locks in one process -------------------------------------------------


def is_refresh(query: str) -> bool:
    return "UPDATE" in query.upper()


def measure_hold(h: Harness) -> dict[str, Any]:
    results: dict[str, Any] = {}
    window = h.settings.hold_window
    for lib in h.usable("hold"):
        h.wait_idle(lib)
        base_conn = h.backends(lib)  # before the driver exists: some connect at import
        driver = h.spawn(lib, "hold")
        try:
            pid = driver.call("info", timeout=120)["pid"]
            base_threads = threads_of(pid)
            answer = driver.call("hold_many", prefix="many-", n=LOCKS, timeout=600)
            conns, threads = h.backends(lib) - base_conn, threads_of(pid)
            row: dict[str, Any] = {
                "held": answer["held"],
                "error": answer["error"],
                "acquire_seconds": answer["seconds"],
                "connections": conns,
                "threads": threads,
                "threads_before": base_threads,
            }
            if h.statements:
                h.reset_statements(lib)
                started = time.monotonic()
                time.sleep(window)
                stmts = h.statements_of(lib)
                elapsed = time.monotonic() - started
                refresh = [(q, c) for q, c, _ in stmts if is_refresh(q)]
                other = [(q, c) for q, c, _ in stmts if not is_refresh(q)]
                row["window"] = elapsed
                row["refresh_per_10s"] = sum(c for _, c in refresh) * 10 / elapsed
                row["other_per_10s"] = sum(c for _, c in other) * 10 / elapsed
                row["refresh_texts"] = [(one_line(q, 160), c) for q, c in refresh[:4]]
                row["other_texts"] = [(one_line(q, 80), c) for q, c in other[:4]]
            results[lib.key] = row
            brief = {k: v for k, v in row.items() if "texts" not in k}
            log(f"{LOCKS:,} locks {lib.key}: {brief}")
        except DriverError as error:
            results[lib.key] = {"error": str(error)}
        finally:
            h.retire(driver, kill=True)
        h.wait_idle(lib)
    return results


# =========================================================================================
# Report
# =========================================================================================


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError, IndexError, ValueError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f"{kib / 1024 / 1024:.0f} GiB"
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "memory": memory,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def fmt_ratio(value: float | None, row: dict[str, Any] | None = None) -> str:
    if value is None:
        return ""
    if row is not None and "ratio_p25" in row:
        return f"{value:.2f}x ({row['ratio_p25']:.2f}..{row['ratio_p75']:.2f})"
    return f"{value:.2f}x"


def fmt_takeover(row: dict[str, Any] | None, lib: Library) -> str:
    if row is None:
        return ""
    if "error" in row:
        return f"error: {row['error']}"
    if row["median"] is None:
        return f"> {row['cap']:.0f} s (waits for its {lib.linger_what} of {lib.linger:.0f} s)"
    return f"{row['median']:.2f} s (max {row['max']:.2f} s, {row['trials']} trials)"


def fmt_hold(row: dict[str, Any] | None) -> tuple[str, str, str]:
    if row is None:
        return "", "", ""
    if "error" in row and "held" not in row:
        return f"error: {row['error']}", "", ""
    held = row["held"]
    conns = f"{row['connections']}"
    if held < LOCKS:
        per = row["connections"] / held if held else 0
        conns += f" for {held} held ({per:.0f} per lock); lock {held + 1}: {row['error']}"
    threads = f"{row['threads']} (before: {row['threads_before']})"
    refresh = ""
    if "refresh_per_10s" in row:
        refresh = f"{row['refresh_per_10s']:.1f}"
        if held < LOCKS:
            refresh += f" (for {held} locks)"
    return conns, threads, refresh


def goals(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    key = "django_pglock"
    rows: list[tuple[str, str, str, str]] = []

    def verdict(ok: bool | None, miss: str = "") -> str:
        if ok is None:
            return "not measured"
        return "met" if ok else f"**not met**{': ' + miss if miss else ''}"

    cycle = report["cycle"].get(key, {})
    ratio = cycle.get("ratio")
    rows.append(
        (
            "acquire+release cycle",
            "<= 1.10x the floor",
            fmt_ratio(ratio),
            verdict(
                None if ratio is None else ratio <= 1.10,
                "" if ratio is None else f"{(ratio / 1.10 - 1) * 100:.0f}% over the goal",
            ),
        )
    )
    cont = report["contention"].get(key, {})
    ratio = cont.get("ratio")
    rows.append(
        (
            f"contention, {PROCESSES} processes",
            ">= 0.95x the floor, no overlap",
            f"{fmt_ratio(ratio)}, {cont.get('overlaps', '?')} overlaps",
            verdict(
                None if ratio is None else ratio >= 0.95 and cont.get("overlaps") == 0,
                "" if ratio is None else f"{(1 - ratio / 0.95) * 100:.0f}% under the goal",
            ),
        )
    )
    take = report["takeover"].get(key, {})
    worst = take.get("max")
    rows.append(
        (
            "takeover after SIGKILL, default thresholds",
            "<= poll interval + 0.1 s = 0.60 s",
            "" if worst is None else f"median {take['median']:.2f} s, max {worst:.2f} s",
            verdict(
                None if not take or "error" in take else worst is not None and worst <= 0.6,
                "" if worst is None else f"max {worst - 0.6:.2f} s over",
            ),
        )
    )
    hold = report["hold"].get(key, {})
    rows.append(
        (
            f"{LOCKS:,} locks: connections",
            "1",
            str(hold.get("connections", "")),
            verdict(None if "connections" not in hold else hold["connections"] == 1),
        )
    )
    per10 = hold.get("refresh_per_10s")
    rows.append(
        (
            f"{LOCKS:,} locks: heartbeat statements",
            "1 per interval (10 s)",
            "" if per10 is None else f"{per10:.1f} per 10 s",
            verdict(None if per10 is None else per10 <= 1.5),
        )
    )
    hand = report.get("handoff", {}).get(key, {})
    median, p99 = hand.get("median_ms"), hand.get("p99_ms")
    rows.append(
        (
            f"handoff, {PROCESSES} waiting processes",
            "median <= 5 ms, p99 <= 20 ms",
            "" if median is None else f"median {median:.1f} ms, p99 {p99:.1f} ms",
            verdict(None if median is None else median <= 5 and p99 <= 20),
        )
    )
    return rows


def fmt_errors(row: dict[str, Any]) -> str:
    if not row.get("errors"):
        return "0"
    return f"{row['errors']} ({one_line('; '.join(row.get('error_samples', [])), 160)})"


def markdown(report: dict[str, Any]) -> str:
    m, s, cfg = report["machine"], report["server"], report["settings"]
    libs = [lib for lib in LIBRARIES if lib.key in report["libraries"]]
    out: list[str] = []
    w = out.append
    w(f"Measured {report['finished']} with `{report['command']}`.\n")
    w(
        f"- Machine: {m['cores']} cores ({m['cpu'] or 'unknown CPU'}), {m['memory']} memory, "
        f"{m['os']}; load average {report['load_before']} before, {report['load_after']} after "
        "(other jobs share this machine: read the ratios, not the times)."
    )
    w(
        f"- PostgreSQL {s['server_version']}, synchronous_commit={s['synchronous_commit']}, "
        f"fsync={s['fsync']}, max_connections={s['max_connections']}, via {s['connection']}."
    )
    versions = []
    for lib in libs:
        got = report["versions"].get(lib.key, {})
        if lib.requirement and lib.key != "pglease-hybrid":
            dist = lib.requirement.split("==")[0]
            client = f"{lib.client.removesuffix('-binary')} {got.get(lib.client, '?')}"
            versions.append(f"{dist} {got.get(dist, '?')} (on {client})" if got else f"{dist}: n/a")
    ours = report["versions"].get("django_pglock", {})
    w(
        f"- Python {m['python']}; django_pglock with Django {ours.get('Django', '?')}, psycopg "
        f"{ours.get('psycopg', '?')}; competitors from PyPI in their own venv: "
        + ", ".join(versions)
        + "."
    )
    w(
        f"- Settings: cycle {cfg['cycle_rounds']} rounds x {cfg['cycle_slot']} s per library; "
        f"contention {PROCESSES} processes, {cfg['contention_rounds']} rounds x "
        f"{cfg['contention_seconds']} s, work {WORK_SECONDS * 1000:.1f} ms, refused-try sleep "
        f"{BACKOFF_SECONDS * 1000:.0f} ms (x0.5..1.5); takeover cap {cfg['takeover_cap']:.0f} s; "
        f"statements counted over {cfg['hold_window']:.0f} s.\n"
    )
    if set(report["broken"]) & set(report["libraries"]):
        w("**Not measured:**\n")
        for key, why in report["broken"].items():
            if key in report["libraries"]:
                w(f"- {BY_KEY[key].label}: {why}")
        w("")

    w("### Summary\n")
    w(
        "| library | cycle vs floor | contention vs floor | overlaps | takeover after SIGKILL "
        f"| connections for {LOCKS:,} locks | threads | refresh statements / 10 s |"
    )
    w("|---|---:|---:|---:|---|---|---|---:|")
    for lib in libs:
        if lib.key == "floor" or lib.key in report["broken"]:
            continue
        cyc = report["cycle"].get(lib.key, {})
        con = report["contention"].get(lib.key, {})
        conns, threads, refresh = fmt_hold(report["hold"].get(lib.key))
        w(
            f"| {lib.label} | {fmt_ratio(cyc.get('ratio'))} | {fmt_ratio(con.get('ratio'))} "
            f"| {con.get('overlaps', '')} | {fmt_takeover(report['takeover'].get(lib.key), lib)} "
            f"| {conns} | {threads} | {refresh} |"
        )
    w("")

    w("### 1. Acquire + release cycle\n")
    w(
        "| library | median us/cycle (p25..p75) | vs floor (p25..p75) | statements/cycle "
        "| server exec us/cycle | new sessions/cycle |"
    )
    w("|---|---:|---:|---:|---:|---:|")
    for lib in libs:
        row = report["cycle"].get(lib.key)
        if row is None:
            continue
        if "median_us" not in row:
            w(f"| {lib.label} | error: {row['error']} | | | | |")
            continue
        stm = "" if row.get("statements") is None else f"{row['statements']:.2f}"
        srv = "" if row.get("server_us") is None else f"{row['server_us']:.0f}"
        ses = "" if row.get("sessions") is None else f"{row['sessions']:.2f}"
        w(
            f"| {lib.label} | {row['median_us']:.0f} ({row['p25_us']:.0f}..{row['p75_us']:.0f}) "
            f"| {fmt_ratio(row.get('ratio'), row)} | {stm} | {srv} | {ses} |"
        )
    w("")

    w(f"### 2. Contention: {PROCESSES} processes, one name\n")
    w(
        "| library | grants/s, median (p25..p75) | vs floor (p25..p75) | overlaps "
        "| processes granted (min per slot) | refused tries | errors |"
    )
    w("|---|---:|---:|---:|---:|---:|---|")
    for lib in libs:
        row = report["contention"].get(lib.key)
        if row is None:
            continue
        if "rate" not in row:
            w(f"| {lib.label} | error: {row['error']} | | | | | |")
            continue
        errors = str(row["errors"])
        if row["error_samples"]:
            errors += ", e.g. " + "; ".join(row["error_samples"][:1])
        w(
            f"| {lib.label} | {row['rate']:.0f} ({row['rate_p25']:.0f}..{row['rate_p75']:.0f}) "
            f"| {fmt_ratio(row.get('ratio'), row)} | {row['overlaps']} "
            f"| {row['holders_min']} of {PROCESSES} | {row['refused']} | {errors} |"
        )
    w("")

    w(
        "Where the time goes in the contention loop (all processes together; a small "
        "profile): CPU of the client processes and server execution time "
        "(pg_stat_statements) per grant, and the mean time of one library call.\n"
    )
    w(
        "| library | client CPU us/grant | server exec us/grant | granted try us "
        "| refused try us | release us |"
    )
    w("|---|---:|---:|---:|---:|---:|")
    for lib in libs:
        row = report["contention"].get(lib.key)
        if row is None or "rate" not in row:
            continue
        cells = [
            row.get("client_cpu_us_per_grant"),
            row.get("server_us_per_grant"),
            row.get("granted_us"),
            row.get("refused_us"),
            row.get("release_us"),
        ]
        w(f"| {lib.label} | " + " | ".join("" if c is None else f"{c:.0f}" for c in cells) + " |")
    w("")
    w(
        "<details><summary>Statements the server ran during the contention slots, per "
        "library: calls per grant, mean execution time (lock waits included), WAL records "
        "per call</summary>\n"
    )
    for lib in libs:
        row = report["contention"].get(lib.key) or {}
        for st in row.get("statements", []):
            w(
                f"- {lib.label}: {st['per_grant']:.2f}/grant, {st['mean_us']:.0f} us, "
                f"{st['wal_per_call']:.2f} WAL records: `{st['query']}`"
            )
    w("\n</details>\n")

    w("### 3. Takeover after SIGKILL of the holder, default thresholds\n")
    w("| library | defaults | kill -> contender holds the lock |")
    w("|---|---|---|")
    for lib in libs:
        row = report["takeover"].get(lib.key)
        if row is None:
            continue
        w(f"| {lib.label} | {lib.defaults} | {fmt_takeover(row, lib)} |")
    w("")

    w(f"### 4. {LOCKS:,} locks held by one process\n")
    w("| library | server connections | threads in the process | refresh statements / 10 s |")
    w("|---|---|---|---:|")
    for lib in libs:
        if lib.key not in report["hold"]:
            continue
        conns, threads, refresh = fmt_hold(report["hold"][lib.key])
        w(f"| {lib.label} | {conns} | {threads} | {refresh} |")
    w(
        "\nStatements counted as refreshes (pg_stat_statements, top-level, in that library's "
        f"database; calls during the {cfg['hold_window']:.0f} s window):\n"
    )
    for lib in libs:
        row = report["hold"].get(lib.key, {})
        for text, calls in row.get("refresh_texts", []):
            w(f"- {lib.label}: {calls} x `{text}`")
        for text, calls in row.get("other_texts", []):
            w(f"- {lib.label} (not counted): {calls} x `{text}`")
    w("")

    w(f"### 5. Handoff: {PROCESSES} waiting processes, a holder releases\n")
    w(
        f"{PROCESSES + 1} processes loop blocking acquire -> hold "
        f"{HANDOFF_HOLD * 1000:.0f} ms (x0.5..1.5) -> release -> rest until another process "
        "holds the name; each release is matched with "
        "the next grant, stamped on the same host clock (just before the release call, just "
        "after the grant returned). Statements per second: all the library's statements "
        f"while the {PROCESSES} processes wait and the holder keeps the name "
        f"({cfg.get('idle_window', 0):.0f} s, pg_stat_statements).\n"
    )
    w("| library | handoffs | median | p99 | statements / s while waiting | errors |")
    w("|---|---:|---:|---:|---:|---|")
    for lib in libs:
        row = report.get("handoff", {}).get(lib.key)
        if row is None:
            continue
        if "error" in row and "median_ms" not in row:
            w(f"| {lib.label} | error: {one_line(row['error'], 120)} | | | | |")
            continue
        rate = row.get("waiting_statements_per_s")
        w(
            f"| {lib.label} | {row['handoffs']} | {row['median_ms']:.1f} ms "
            f"| {row['p99_ms']:.1f} ms | {'' if rate is None else f'{rate:.1f}'} "
            f"| {fmt_errors(row)} |"
        )
    w("")

    w("### Goals (django_pglock)\n")
    w("| goal | target | measured | verdict |")
    w("|---|---|---|---|")
    for goal in goals(report):
        w("| " + " | ".join(goal) + " |")
    return "\n".join(out) + "\n"


DOC_HEADER = """# Benchmarks: django_pglock next to the alternatives

Reproduce (about 4 minutes; `--quick` about 2; the first run also creates the competitors'
venv, which needs PyPI):

```sh
pip install -e ".[dev]"
python benchmarks/compare.py            # or --quick; --json for machine-readable output
```

How it measures: see [benchmarks/README.md](../benchmarks/README.md).

## Latest results

"""


def write_doc(path: Path, body: str) -> None:
    block = f"{BEGIN_MARK}\n{body}{END_MARK}\n"
    text = path.read_text() if path.exists() else ""
    if BEGIN_MARK in text and END_MARK in text:
        head, rest = text.split(BEGIN_MARK, 1)
        tail = rest.split(END_MARK, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = DOC_HEADER + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# =========================================================================================
# main
# =========================================================================================


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter run (about 2 minutes)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument(
        "--doc",
        type=Path,
        default=DOC_PATH,
        help=f"write results here ({DOC_PATH.relative_to(REPO_ROOT)})",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not write the results file")
    parser.add_argument("--venv", type=Path, help="the competitors' venv (default: in ~/.cache)")
    parser.add_argument("--refresh-venv", action="store_true", help="reinstall the competitors")
    parser.add_argument(
        "--only",
        help="comma-separated libraries to measure (the floor is always measured); "
        f"of: {', '.join(lib.key for lib in LIBRARIES if lib.key != 'floor')}",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated phases to run (default: all of {','.join(PHASES)})",
    )
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.phases = set(args.phases.split(","))
    if not args.phases <= set(PHASES):
        parser.error(f"--phases: choose from {', '.join(PHASES)}")
    if args.only:
        args.only = {"floor", *args.only.split(",")}
        if not args.only <= set(BY_KEY):
            parser.error(f"--only: unknown {', '.join(sorted(args.only - set(BY_KEY)))}")
    # A partial run does not replace the published results unless asked to.
    if (args.only or args.phases != set(PHASES)) and "--doc" not in argv:
        args.no_doc = True
    return args


@contextlib.contextmanager
def harness(url: str, settings: Settings, args: argparse.Namespace) -> Iterator[Harness]:
    with tempfile.TemporaryDirectory(prefix="pglock-compare-") as logs:
        h = Harness(url=url, settings=settings, logs=Path(logs), only=args.only, phases=args.phases)
        try:
            h.connect()
            yield h
        finally:
            h.close_all()
            h.drop()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.driver:
        return driver_main(args.driver, args.url)

    started = time.monotonic()
    settings = QUICK if args.quick else FULL
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    python, failed = ensure_venv(args.venv, args.refresh_venv)

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests.pgserver import ensure_database_url

    url = ensure_database_url()  # exported: drivers of django_pglock reach the same server
    with harness(url, settings, args) as h:
        for lib in LIBRARIES:
            if lib.requirement is None:
                h.pythons[lib.key] = sys.executable
            elif python is None or lib.requirement in failed:
                h.broken[lib.key] = failed.get(lib.requirement or "", "no venv")
            else:
                h.pythons[lib.key] = python
        server = h.facts()
        log(f"PostgreSQL {server['server_version']} via {server['connection']}; starting drivers")
        pools = start_pools(h)
        log(f"drivers ready ({time.monotonic() - started:.0f} s)")
        cycle = measure_cycles(h, pools)
        contention = measure_contention(h, pools)
        for pool in pools.values():
            for driver in pool:
                h.retire(driver)
        takeover = measure_takeover(h)
        hold = measure_hold(h)
        handoff = measure_handoff(h)
        versions = h.versions
        broken = dict(h.broken)
    command = "python benchmarks/compare.py" + (" --quick" if args.quick else "")
    if args.only:
        command += f" --only {','.join(sorted(args.only - {'floor'}))}"
    if args.phases != set(PHASES):
        command += f" --phases {','.join(p for p in PHASES if p in args.phases)}"
    report = {
        "command": command,
        "finished": time.strftime("%Y-%m-%d %H:%M %Z"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine(),
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "server": server,
        "settings": settings.__dict__,
        "versions": versions,
        "broken": broken,
        "libraries": [lib.key for lib in LIBRARIES if args.only is None or lib.key in args.only],
        "cycle": cycle,
        "contention": contention,
        "takeover": takeover,
        "hold": hold,
        "handoff": handoff,
    }
    body = markdown(report)
    if not args.no_doc:
        write_doc(args.doc, body)
        log(f"wrote {args.doc}")
    log(f"done in {report['duration_s']:.0f} s")
    print(json.dumps(report, indent=2, default=str) if args.json else body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
