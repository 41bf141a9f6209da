"""One throwaway PostgreSQL 15 server for the failover tests (tests/standby.py pairs two).

Debian's packaged binaries (``/usr/lib/postgresql/15/bin``, or ``PGLOCK_FAILOVER_BINDIR``);
as root every program runs as the ``postgres`` system user, since PostgreSQL refuses to
run as root. :func:`require_binaries` fails under CI and skips elsewhere when they are
missing (``faultkit.require``). :class:`Node` is one server: its data directory, port and
log, started and stopped with ``pg_ctl``. :func:`template_pgdata` makes, once per run, a
stopped data directory with the ``faults`` database and the lock tables (``manage.py
migrate``), which every pair's primary is copied from; it is removed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

from tests import faultkit

MAJOR = "15"
BINDIR = Path(os.environ.get("PGLOCK_FAILOVER_BINDIR", f"/usr/lib/postgresql/{MAJOR}/bin"))
TOOLS = ("initdb", "pg_ctl", "postgres", "pg_basebackup")
SERVER_USER = "postgres"  # Debian's; PostgreSQL refuses to run as root
DB_NAME = faultkit.DB_NAME
HOST = "127.0.0.1"
READY_TIMEOUT = 60.0  # for a server to start, a standby to stream, a promotion to finish

# Both servers: TCP on loopback only. fsync is off because `-m immediate` is a crash of the
# server, not of the operating system: nothing the server wrote is lost with it.
SETTINGS = {
    "listen_addresses": HOST,
    "unix_socket_directories": "",
    "max_connections": "100",
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
    "log_min_messages": "warning",
}


def _run_as() -> dict[str, object]:
    """subprocess keyword arguments: as root, run as the server's system user."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam(SERVER_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid}


def require_binaries() -> None:
    """PostgreSQL 15's server programs and, as root, the user to run them as."""
    missing = [tool for tool in TOOLS if not os.access(BINDIR / tool, os.X_OK)]
    faultkit.require(
        not missing,
        f"PostgreSQL {MAJOR}'s {', '.join(missing)} not found in {BINDIR}; install Debian's "
        f"postgresql-{MAJOR} (apt-get install -y postgresql-{MAJOR}, as .ci/run does)",
    )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            faultkit.require(False, f"no {SERVER_USER!r} system user to run PostgreSQL as")


def run_tool(tool: str, *args: str, cwd: Path, timeout: float = READY_TIMEOUT) -> None:
    """Run a PostgreSQL program; raise with its output (and nothing else) on failure."""
    # Output to a file, not a pipe: a server started by pg_ctl would inherit the pipe.
    with tempfile.TemporaryFile("w+") as out:
        result = subprocess.run(
            [str(BINDIR / tool), *args],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
            **_run_as(),  # type: ignore[arg-type]
        )
        out.seek(0)
        output = out.read()
    if result.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(args)} exited with {result.returncode}:\n{output}")


def private_dir(prefix: str) -> Path:
    """A new directory under /tmp (every parent enterable) owned by the server's user."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SERVER_USER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    return root


def append_settings(pgdata: Path, settings: dict[str, str], why: str) -> None:
    """Append ``settings`` to postgresql.conf (later lines win over earlier ones)."""
    with open(pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
        conf.write(f"\n# tests/standby.py: {why}\n")
        for key, value in settings.items():
            conf.write(f"{key} = '{value}'\n")


class Node:
    """One server of the pair: its data directory, port and log."""

    def __init__(self, root: Path, label: str, port: int) -> None:
        self.label = label
        self.pgdata = root / label
        self.logfile = root / f"{label}.log"
        self.port = port

    def __repr__(self) -> str:
        return f"<{self.label} 127.0.0.1:{self.port}>"

    def pg_ctl(self, *args: str) -> None:
        run_tool("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", *args, cwd=self.pgdata.parent)

    def start(self) -> None:
        try:
            self.pg_ctl("-l", str(self.logfile), "start")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self.label} log (tail):\n{self.log_tail()}") from None

    def stop(self, mode: str = "fast") -> None:
        """Stop the server if it runs; never raises."""
        if (self.pgdata / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
                self.pg_ctl("-m", mode, "stop")

    def url(self, dbname: str = DB_NAME) -> str:
        return f"postgresql://postgres@{HOST}:{self.port}/{dbname}"

    def connect(self, dbname: str = DB_NAME) -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5)

    def query(self, statement: str, params: list[object] | None = None) -> list[tuple]:
        """Rows of one statement (none for a command) on a short session of its own."""
        with self.connect() as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description is not None else []

    def log_tail(self, chars: int = 3000) -> str:
        return self.logfile.read_text(errors="replace")[-chars:] if self.logfile.exists() else ""

    def argv_stop_immediate(self) -> list[str]:
        """The watcher's stop command (as the server's user when run by root)."""
        argv = [str(BINDIR / "pg_ctl"), "-D", str(self.pgdata), "-m", "immediate", "stop"]
        return ["runuser", "-u", SERVER_USER, "--", *argv] if os.geteuid() == 0 else argv


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):  # type: ignore[no-untyped-def]
    """The first truthy value of ``predicate()`` within ``timeout`` s; raise naming
    ``what`` otherwise. A psycopg error counts as a falsy value (a server coming up)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except psycopg.Error as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s (last error: {last})")
        time.sleep(interval)


_template: Path | None = None


def template_pgdata() -> Path:
    """A stopped data directory with the ``faults`` database and the lock tables,
    made once per run (initdb and migrate are the slow part of a pair)."""
    global _template
    if _template is not None:
        return _template
    root = private_dir("pglock-failover-template-")
    reaper = faultkit.Reaper(paths=[str(root)])
    atexit.register(lambda: (shutil.rmtree(root, ignore_errors=True), reaper.stop()))
    node = Node(root, "data", faultkit.free_port())
    initdb = ["-D", str(node.pgdata), "-U", "postgres", "--auth=trust", "--encoding=UTF8"]
    run_tool("initdb", *initdb, "--no-locale", "--no-sync", "--no-instructions", cwd=root)
    append_settings(node.pgdata, SETTINGS, "both servers")
    append_settings(node.pgdata, {"port": str(node.port)}, "the template's own run")
    node.start()
    try:
        with node.connect("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        migrate = subprocess.run(
            [
                sys.executable,
                "-m",
                "django",
                "migrate",
                "django_pglock",
                "--noinput",
                "--skip-checks",
            ],
            cwd=faultkit.REPO_ROOT,
            env=faultkit.worker_env(node.url()),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if migrate.returncode != 0:
            raise RuntimeError(f"migrate failed:\n{migrate.stdout}\n{migrate.stderr}")
    finally:
        node.stop("fast")
    _template = node.pgdata
    return _template
