"""A user's own test suite works with nothing configured (tests/userproject/).

The small project's TestCases call ``@singleton_job`` functions; its suite is run as a
user runs it, in a subprocess against the real server: ``manage.py test`` (Django's
runner) and ``pytest`` (pytest-django). Each must pass (no TestCase sees another's run
records, claims or locks), and leave no test database behind (its teardown drops it:
the lock session does not keep it in use).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import uuid

import psycopg
import pytest
from django.db import connections
from psycopg import sql

from django_pglock import Lock
from django_pglock import connection as connection_module
from tests.procs import REPO_ROOT
from tests.settings import ENV_TEST_DB_NAME

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

PROJECT = REPO_ROOT / "tests" / "userproject"
#: Python, Django, migrations of a new database, the tests, teardown.
SUITE_TIMEOUT = 240.0


@pytest.fixture
def user_test_db(pg_url):
    """The name of the user project's test database; dropped afterwards if it is left."""
    name = f"test_userproject_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name]
        )
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def user_env(child_env, test_db_name, user_test_db):
    env = {k: v for k, v in child_env.items() if k != ENV_TEST_DB_NAME}
    env["DJANGO_SETTINGS_MODULE"] = "site_settings"
    env["USERPROJECT_DB"] = test_db_name  # it has the lock tables: the early lock works
    env["USERPROJECT_TEST_DB"] = user_test_db
    return env


RUNNERS = {
    "django": ([sys.executable, str(PROJECT / "manage.py"), "test", "jobsapp", "-v", "2"], 10),
    "pytest": (
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(PROJECT / "pytest.ini"),
            "-p",
            "no:cacheprovider",
            "-v",
            str(PROJECT / "jobsapp"),
        ],
        12,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "early", [pytest.param(False, id="plain"), pytest.param(True, id="lock-before-test-db")]
)
@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_a_users_test_suite_passes_and_drops_its_test_database(
    procs, user_env, user_test_db, pg_url, test_db_name, runner, early
):
    """``lock-before-test-db``: the project takes a lock before the test database exists
    (the lock connection is open on its own database when Django switches NAME)."""
    argv, count = RUNNERS[runner]
    env = {**user_env, "USERPROJECT_EARLY_LOCK": "1"} if early else user_env
    result = procs.start(*argv, env=env).result(SUITE_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    if runner == "django":
        assert f"Ran {count} tests" in output and "\nOK" in output, output
        # The lease a test left held was released when that test ended, and said so
        # (pytest keeps the logs of a test that passed to itself).
        assert "'userproject-left-held'" in output and "was still held" in output, output
    else:
        assert f"{count} passed" in output, output
    assert "being accessed by other users" not in output, output
    with psycopg.connect(pg_url, autocommit=True) as admin:
        left = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [user_test_db])
        assert left.fetchone() is None, f"test database {user_test_db} was left behind"
    # The lock taken before the test database existed went to the project's database;
    # the jobs of the tests, to the test database only.
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as db:
        names = db.execute(
            "SELECT name FROM django_pglock_jobrun WHERE name LIKE 'userproject-%%'"
            " UNION ALL SELECT name FROM django_pglock_scheduleclaim"
            " WHERE name LIKE 'userproject-%%'"
            " UNION ALL SELECT name FROM django_pglock_joblock WHERE name LIKE 'userproject-%%'"
        ).fetchall()
        assert names == []


@pytest.fixture
def idle_alias():
    """A second alias on the test database, whose lock connection will hold no lease."""
    alias = f"idle_{uuid.uuid4().hex[:8]}"
    connections.settings[alias] = copy.deepcopy(connections["default"].settings_dict)
    yield alias
    conn = connection_module._registry.pop(alias, None)
    if conn is not None:
        conn.close()
    with contextlib.suppress(Exception):
        del connections[alias]
    del connections.settings[alias]


def test_lock_sessions_step_aside_when_django_connects_to_the_maintenance_database(idle_alias):
    """What Django's test runner does before CREATE, clone or DROP DATABASE: an idle lock
    session is closed (and opened again by its next statement); one that holds a lease
    stays, with its lease."""
    held = Lock(f"stays-{uuid.uuid4().hex[:8]}").try_acquire()
    with Lock("idle", using=idle_alias).acquire(blocking=False) as lease:
        assert lease is not None
    busy, idle = (
        connection_module.get_connection("default"),
        connection_module.get_connection(idle_alias),
    )
    assert busy.is_open() and idle.is_open()
    with connections["default"]._nodb_cursor() as cursor:  # as creation.py does
        cursor.execute("SELECT 1")
    assert not idle.is_open()
    assert busy.is_open() and not held.lost
    held.check()
    held.release()
    with Lock("idle", using=idle_alias).acquire(blocking=False) as again:
        assert again is not None  # the next statement opened a session again
    assert idle.is_open()
