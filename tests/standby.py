"""A primary and a streaming standby for the failover tests (tests/test_failover.py).

:class:`ReplicatedPair` runs two throwaway servers from Debian's PostgreSQL 15
(``/usr/lib/postgresql/15/bin``; as root they run as the ``postgres`` system user), each
on ``127.0.0.1`` with a port of its own: a primary with the lock tables, and a standby
made from it with ``pg_basebackup -R`` that streams its WAL, asynchronously or, with
``sync=True``, as the primary's synchronous standby (``synchronous_standby_names = '*'``).
The standby's own configuration clears that setting, as a failover manager does, unless
``inherit_sync=True``: then the promoted standby waits for a standby it does not have.

:meth:`~ReplicatedPair.crash_primary` does what ``pg_ctl stop -m immediate`` does (SIGQUIT
to the postmaster); the old primary is never started again (it is fenced).
:meth:`~ReplicatedPair.promote` promotes the standby and waits until it accepts writes.
Clients reach whichever is the primary through :meth:`~ReplicatedPair.dsn`, a libpq
multi-host URL with ``target_session_attrs=read-write``.

Cleanup stops both servers and removes their directories, at :meth:`~ReplicatedPair.close`,
at exit, and through a watcher process if the test process is killed (``faultkit.Reaper``).
The lock tables are migrated once per run into a template data directory that every pair's
primary is copied from. A missing prerequisite fails under CI and skips elsewhere
(``faultkit.require``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
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


def _tool(tool: str, *args: str, cwd: Path, timeout: float = READY_TIMEOUT) -> None:
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


def _private_dir(prefix: str) -> Path:
    """A new directory under /tmp (every parent enterable) owned by the server's user."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(SERVER_USER)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    return root


def _append_settings(pgdata: Path, settings: dict[str, str], why: str) -> None:
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
        _tool("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", *args, cwd=self.pgdata.parent)

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


def _template_pgdata() -> Path:
    """A stopped data directory with the ``faults`` database and the lock tables,
    made once per run (initdb and migrate are the slow part of a pair)."""
    global _template
    if _template is not None:
        return _template
    root = _private_dir("pglock-failover-template-")
    reaper = faultkit.Reaper(paths=[str(root)])
    atexit.register(lambda: (shutil.rmtree(root, ignore_errors=True), reaper.stop()))
    node = Node(root, "data", faultkit.free_port())
    initdb = ["-D", str(node.pgdata), "-U", "postgres", "--auth=trust", "--encoding=UTF8"]
    _tool("initdb", *initdb, "--no-locale", "--no-sync", "--no-instructions", cwd=root)
    _append_settings(node.pgdata, SETTINGS, "both servers")
    _append_settings(node.pgdata, {"port": str(node.port)}, "the template's own run")
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


class ReplicatedPair:
    """A primary and its streaming standby; see the module docstring.

    ``sync``: the standby is synchronous (a commit returns once the standby has it).
    ``inherit_sync``: the standby keeps the primary's ``synchronous_standby_names``.
    ``lag_proxy``: the standby streams through a ``faultkit.TcpProxy``, so that
    :meth:`stall_replication` can make it fall behind. Use as a context manager, or call
    :meth:`close`.
    """

    def __init__(self, *, sync: bool, inherit_sync: bool = False, lag_proxy: bool = False) -> None:
        require_binaries()
        self.sync = sync
        self.mode = "sync" if sync else "async"
        template = _template_pgdata()
        self.root = _private_dir(f"pglock-failover-{self.mode}-")
        self.primary = Node(self.root, "primary", faultkit.free_port())
        self.standby = Node(self.root, "standby", faultkit.free_port())
        self._reaper = faultkit.Reaper(
            commands=[self.primary.argv_stop_immediate(), self.standby.argv_stop_immediate()],
            paths=[str(self.root)],
        )
        self.owner = os.getpid()
        atexit.register(self.close)
        self.replication = faultkit.TcpProxy(self.primary.port) if lag_proxy else None
        self.crashed_at: float | None = None  # time.time(): the crash was asked for
        self.down_at: float | None = None  # time.time(): the old primary had stopped
        self.promoted_at: float | None = None  # time.time(): the standby took writes
        try:
            self._start(template, inherit_sync)
        except BaseException:
            self.close()
            raise

    def _start(self, template: Path, inherit_sync: bool) -> None:
        # cp -a keeps the owner (the server's user) and the 0700 mode PostgreSQL wants.
        subprocess.run(["cp", "-a", str(template), str(self.primary.pgdata)], check=True)
        primary = {"port": str(self.primary.port)}
        if self.sync:
            primary["synchronous_standby_names"] = "*"
        _append_settings(self.primary.pgdata, primary, f"the primary ({self.mode})")
        self.primary.start()
        # -R writes the port it used into primary_conninfo: the proxy's, if there is one.
        port = self.primary.port if self.replication is None else self.replication.port
        _tool(
            "pg_basebackup",
            *("-h", HOST, "-p", str(port), "-U", "postgres"),
            *("-D", str(self.standby.pgdata), "-R", "-X", "stream", "-c", "fast", "--no-sync"),
            cwd=self.root,
        )
        standby = {"port": str(self.standby.port)}
        if not inherit_sync:  # what a failover manager does before it promotes
            standby["synchronous_standby_names"] = ""
        _append_settings(self.standby.pgdata, standby, "the standby")
        self.standby.start()
        wanted = "sync" if self.sync else "async"
        wait_for(
            lambda: self.primary.query(
                "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = %s",
                [wanted],
            ),
            READY_TIMEOUT,
            f"the standby streaming ({wanted}) from the primary",
        )

    # -- what clients use --------------------------------------------------------------

    def dsn(self) -> str:
        """A libpq multi-host URL: whichever of the two accepts writes."""
        ports = f"{self.primary.port},{self.standby.port}"
        return (
            f"postgresql://postgres@/{DB_NAME}?host={HOST},{HOST}&port={ports}"
            "&target_session_attrs=read-write"
        )

    # -- events ------------------------------------------------------------------------

    def wait_replayed(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        (lsn,) = self.primary.query("SELECT pg_current_wal_lsn()")[0]
        replayed = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
        wait_for(
            lambda: self.standby.query(replayed, [str(lsn)])[0][0],
            timeout,
            f"the standby replaying up to {lsn}",
        )

    def stall_replication(self) -> None:
        """Stop forwarding WAL to the standby (``lag_proxy`` only): it falls behind."""
        assert self.replication is not None, "made without lag_proxy=True"
        self.replication.set_mode("drop")

    def cut_replication(self) -> None:
        """Reset the standby's replication connection: what it had not received is lost."""
        assert self.replication is not None, "made without lag_proxy=True"
        self.replication.close()

    def crash_primary(self) -> float:
        """Crash the primary as ``pg_ctl stop -m immediate`` does (SIGQUIT to the
        postmaster: every server process exits at once, nothing is flushed or sent any
        more) and wait until it is gone; returns ``time.time()`` of the signal.

        The signal is sent from here rather than through pg_ctl, so that the crash
        happens within microseconds of the caller's last event, and so that measured
        times start at the crash rather than at pg_ctl's own start-up.
        """
        pidfile = self.primary.pgdata / "postmaster.pid"
        postmaster = int(pidfile.read_text().split()[0])
        self.crashed_at = time.time()
        os.kill(postmaster, signal.SIGQUIT)
        # Like pg_ctl -w: gone once the postmaster has removed its pid file.
        wait_for(lambda: not pidfile.exists(), READY_TIMEOUT, "the crashed primary exiting")
        self.down_at = time.time()
        return self.crashed_at

    def promote(self) -> float:
        """Promote the standby; ``time.time()`` once it is seen accepting writes."""
        self.standby.pg_ctl("promote")
        wait_for(
            lambda: self.standby.query("SELECT NOT pg_is_in_recovery()")[0][0],
            READY_TIMEOUT,
            "the promoted standby leaving recovery",
        )
        self.promoted_at = time.time()
        return self.promoted_at

    def fail_over(self) -> tuple[float, float]:
        """Crash the primary and promote the standby at once; (crashed, promoted)."""
        return self.crash_primary(), self.promote()

    # -- cleanup -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop both servers and remove their directories (only in the owning process)."""
        if os.getpid() != self.owner or not self.root.exists():
            return
        for node in (self.standby, self.primary):
            node.stop("immediate")
        if self.replication is not None:
            self.replication.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self._reaper.stop()

    def __enter__(self) -> ReplicatedPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
