from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import psycopg
import pytest
from django.db import connections
from psycopg import sql

from tests.pgserver import ensure_database_url
from tests.settings import ENV_TEST_DB_NAME

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCK_TABLE = "django_pglock_joblock"


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test databases, plus: end leftover sessions before they are dropped.

    Lock connections (this process's dedicated one, or a stuck worker's) would otherwise
    keep the test database open, and DROP DATABASE at teardown would fail.
    """
    yield
    with django_db_blocker.unblock():
        connections.close_all()
        names = [
            conn.settings_dict["NAME"] for conn in connections.all() if conn.vendor == "postgresql"
        ]
        with psycopg.connect(ensure_database_url(), autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()",
                [names],
            )


@pytest.fixture(scope="session")
def pg_url():
    """URL of the PostgreSQL server (its maintenance database, not the test database)."""
    return ensure_database_url()


@pytest.fixture(scope="session")
def test_db_name(django_db_setup):
    """NAME of the test database pytest-django created on the default alias."""
    return connections["default"].settings_dict["NAME"]


@pytest.fixture
def child_env(test_db_name):
    """Environment for worker processes: same server, same test database, same code."""
    env = os.environ.copy()
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env[ENV_TEST_DB_NAME] = test_db_name
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Worker(subprocess.Popen):
    """A `python -m tests.worker` process, with line reads that cannot hang the suite.

    Background threads drain stdout and stderr; read stdout only through `read_line` /
    `expect`, never from `.stdout` directly.
    """

    def __init__(self, args, env):
        super().__init__(
            [sys.executable, "-m", "tests.worker", *args],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._drain_stdout, name="worker-stdout", daemon=True),
            threading.Thread(target=self._drain_stderr, name="worker-stderr", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _drain_stdout(self):
        for line in self.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _drain_stderr(self):
        for line in self.stderr:
            self._stderr.append(line)

    @property
    def stderr_text(self):
        return "".join(self._stderr)

    def send(self, line):
        """Write one command line to the worker's stdin."""
        self.stdin.write(line + "\n")
        self.stdin.flush()

    def close_stdin(self):
        if not self.stdin.closed:
            self.stdin.close()

    def read_line(self, timeout=15.0):
        """Next stdout line; fails the test on timeout or when the worker has exited."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"worker sent nothing for {timeout}s; stderr:\n{self.stderr_text}")
        if line is None:
            self.lines.put(None)  # keep reporting EOF to later reads
            status = self.wait()
            pytest.fail(f"worker exited ({status}) before answering; stderr:\n{self.stderr_text}")
        return line

    def expect(self, prefix, timeout=15.0):
        """Read one line and check that it starts with `prefix`; return the line."""
        line = self.read_line(timeout)
        assert line.startswith(prefix), (
            f"expected {prefix!r}, got {line!r}; stderr:\n{self.stderr_text}"
        )
        return line

    def finish(self, timeout=15.0):
        """Close stdin (EOF tells the worker to stop) and return its exit status."""
        self.close_stdin()
        return self.wait(timeout)

    def stop(self):
        """Kill the worker if it still runs and release its pipes."""
        if self.poll() is None:
            self.kill()
        self.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()


@pytest.fixture
def run_child(child_env):
    """Start `python -m tests.worker *args`; every worker is killed at teardown."""
    workers = []

    def start(*args, env=None):
        worker = Worker([str(a) for a in args], env=child_env if env is None else env)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def _delete_lock_rows(pg_url, dbname):
    with psycopg.connect(pg_url, dbname=dbname, autocommit=True) as conn:
        conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(LOCK_TABLE)))


def _forget_leases():
    """Stop heartbeating leases that earlier tests left behind in this process.

    Their rows are deleted with the table's contents; without this, a leftover lease with
    a short heartbeat interval would make the heartbeat thread refresh this test's rows
    more often than the test's own thresholds say.
    """
    from django_pglock.heartbeat import registry

    for lease in registry().leases():
        registry().discard(lease)


@pytest.fixture
def clean_locks(pg_url, test_db_name):
    """Empty the lock table of the test database before and after the test."""
    _forget_leases()
    _delete_lock_rows(pg_url, test_db_name)
    yield
    _forget_leases()
    _delete_lock_rows(pg_url, test_db_name)


@pytest.fixture
def procs(child_env):
    """Child processes started through tests.subprocs.Procs, cleaned up at teardown."""
    from tests.subprocs import Procs

    manager = Procs(child_env)
    yield manager
    manager.cleanup()
