"""Helpers for the tests with real child processes (tests/test_jobs.py, tests/test_commands.py,
tests/test_locked_run_tree.py, ...): waiting for what a child does, a separate database
session, received Django signals.

The children themselves are started through the ``procs`` fixture (tests/procs.py): each
runs from the repository root with the ``child_env`` environment (same server, same test
database, ``DJANGO_SETTINGS_MODULE=tests.settings``) in a session of its own, so that
teardown kills it together with anything it started (``locked_run``'s job).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg
import pytest


def wait_for_file(path, timeout=30.0, *, procs=()):
    """Wait until ``path`` exists; fail early if one of ``procs`` (tests.procs.Proc) has
    exited meanwhile."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        for proc in procs:
            if proc.poll() is not None:
                result = proc.result()
                pytest.fail(
                    f"{proc} exited ({result.returncode}) before {path} appeared;"
                    f"\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
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


def wait_for_early_in_minute(conn, latest=40.0):
    """Sleep until the database clock is at most ``latest`` seconds into a minute.

    Tests of `* * * * *` schedule slots must run inside one slot, and a slot ends
    SCHEDULE_TOLERANCE (5 s by default) before the next minute, when runs start to belong
    to the next tick; this leaves them at least 55 - latest seconds.
    """
    (seconds,) = conn.execute("SELECT extract(second FROM now())::float8").fetchone()
    if seconds >= latest:
        time.sleep(60.2 - seconds)
    (minute,) = conn.execute("SELECT date_trunc('minute', now())").fetchone()
    return minute


def open_db(pg_url, dbname):
    """A separate autocommit session on the test database: the view of another process."""
    return psycopg.connect(pg_url, dbname=dbname, autocommit=True)


def key_free(conn, name):
    """Would the next contender get the advisory key of lock ``name`` now? (``conn``: an
    autocommit session on the test database, which is left holding nothing.)"""
    from django_pglock.sql import advisory_key

    key = advisory_key(name)
    (got,) = conn.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()
    if got:
        conn.execute("SELECT pg_advisory_unlock(%s)", [key])
    return got


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
