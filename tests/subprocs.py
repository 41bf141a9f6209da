"""Real child processes for tests/test_jobs.py and tests/test_commands.py.

Every child runs from the repository root with the `child_env` environment (same server,
same test database, `DJANGO_SETTINGS_MODULE=tests.settings`) in a session of its own, so
that cleanup can kill it together with anything it started (`locked_run`'s child).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self):
        return self.stderr.splitlines()


class Procs:
    """Starts child processes and kills whatever still runs at teardown."""

    def __init__(self, env):
        self.env = env
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *argv, env=None):
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=REPO_ROOT,
            env=self.env if env is None else env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started.append(proc)
        return proc

    def django(self, *args):
        """Start `python -m django <args>` (a management command)."""
        return self.start(sys.executable, "-m", "django", *args)

    def python(self, code, *args):
        """Start `python -c <code> <args>`."""
        return self.start(sys.executable, "-c", code, *args)

    @staticmethod
    def finish(proc, timeout=60.0):
        """Wait for ``proc`` and return its Result; fail the test if it does not end."""
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            pytest.fail(f"{proc.args!r} did not end within {timeout}s; stderr:\n{err}")
        return Result(proc.returncode, out, err)

    def run_django(self, *args, timeout=60.0):
        return self.finish(self.django(*args), timeout)

    def cleanup(self):
        """Kill what still runs, with its process group (a `locked_run` and its child)."""
        for proc in self.started:
            if proc.poll() is None:
                _kill_group(proc)
            with contextlib.suppress(Exception):
                proc.communicate(timeout=10)


def _kill_group(proc):
    # Only while the leader is unreaped: its pid (the group id) cannot have been reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def wait_for_file(path, timeout=30.0, *, procs=()):
    """Wait until ``path`` exists; fail early if one of ``procs`` has exited meanwhile."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(
                    f"{proc.args!r} exited ({proc.returncode}) before {path} appeared;"
                    f"\nstdout:\n{out}\nstderr:\n{err}"
                )
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def wait_until(predicate, timeout, message):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(message)
        time.sleep(0.02)


def pid_gone(pid):
    """True when ``pid`` no longer exists (or is a zombie that nobody waits for)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_for_early_in_minute(conn, latest=45.0):
    """Sleep until the database clock is at most ``latest`` seconds into a minute.

    Tests of `* * * * *` schedule slots must run inside one minute; this leaves them at
    least 60 - latest seconds.
    """
    (seconds,) = conn.execute("SELECT extract(second FROM now())::float8").fetchone()
    if seconds >= latest:
        time.sleep(60.2 - seconds)
    (minute,) = conn.execute("SELECT date_trunc('minute', now())").fetchone()
    return minute


def open_db(pg_url, dbname):
    """A separate autocommit session on the test database: the view of another process."""
    return psycopg.connect(pg_url, dbname=dbname, autocommit=True)


class Received:
    """Records the keyword arguments of every sending of a signal."""

    def __init__(self, signal):
        self.signal = signal
        self.calls = []

    def __call__(self, sender, **kwargs):
        self.calls.append(kwargs)

    def __enter__(self):
        self.signal.connect(self, weak=False)
        return self

    def __exit__(self, *exc):
        self.signal.disconnect(self)
