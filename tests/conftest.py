from __future__ import annotations

import os

import psycopg
import pytest
from django.db import connections
from psycopg import sql

from tests.pgserver import ensure_database_url
from tests.procs import REPO_ROOT, Procs
from tests.settings import ENV_TEST_DB_NAME

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
def db(pg_url, test_db_name):
    """An autocommit session on the test database of its own: what another process sees.
    (The fault and failover suites define their own ``db``, on their own servers.)"""
    from tests.subprocs import open_db

    with open_db(pg_url, test_db_name) as conn:
        yield conn


@pytest.fixture
def child_env(test_db_name):
    """Environment for worker processes: same server, same test database, same code."""
    env = os.environ.copy()
    env["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    env[ENV_TEST_DB_NAME] = test_db_name
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def procs(child_env):
    """Child processes (tests.procs.Procs) in the test database's environment; whatever
    still runs at teardown is killed with its process group."""
    with Procs(child_env) as started:
        yield started


@pytest.fixture
def run_child(child_env):
    """Start `python -m tests.worker *args` (a tests.procs.Proc); killed at teardown."""
    with Procs(child_env) as started:
        yield started.child


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
