"""The admin of a project whose locks live on a database of their own (issue 13, item 1).

``DJANGO_PGLOCK["DATABASE"] = "locks"``, ``default`` on SQLite, and no database router
(tests/multidb_settings.py): the admin pages, their filters, search and the forced
release must read and act on the lock database, showing what ``pglock_status`` shows.
The admin runs in a child process with those settings (tests/multidb_admin.py); the
locks and runs it must show are made here, on the test database, which is that child's
``locks`` alias. ``manage.py check`` is run as a real process with those settings too.
"""

from __future__ import annotations

import json
import sys
import uuid

import pytest
from django.test import override_settings

from django_pglock import Lock, LockNotHeld, checks
from django_pglock.models import JobRun
from tests.subprocs import open_db
from tests.testapp import jobs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}
ALERT_AGE = 300.0
CHILD_TIMEOUT = 180.0  # migrate an SQLite file, then a dozen admin pages, on a busy machine


@pytest.fixture
def sql_db(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        conn.execute("DELETE FROM django_pglock_jobrun")
        yield conn


@pytest.fixture
def multidb_env(child_env, tmp_path):
    """The child's environment: tests.multidb_settings with an SQLite file of its own."""
    return {
        **child_env,
        "DJANGO_SETTINGS_MODULE": "tests.multidb_settings",
        "PGLOCK_MULTIDB_SQLITE": str(tmp_path / "default.sqlite3"),
    }


def unique(label):
    return f"multidb-{label}-{uuid.uuid4().hex[:8]}"


def hold(name):
    lease = Lock(name, **QUIET).try_acquire()
    assert lease is not None, f"could not take {name!r}"
    return lease


def rows(page):
    assert "error" not in page, page.get("trace")
    assert page["status"] == 200, page
    return {pk: state for pk, state in page["rows"]}


def test_both_admins_read_the_lock_database_without_a_router(procs, multidb_env, sql_db):
    ok, alert, victim = unique("ok"), unique("alert"), unique("victim")
    leases = {name: hold(name) for name in (ok, alert, victim)}
    sql_db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - %s * interval '1 second'"
        " WHERE name = %s",
        [ALERT_AGE, alert],
    )
    jobs.recorded_job()
    jobs.recorded_job()
    with pytest.raises(RuntimeError):
        jobs.recorded_job(fail=True)
    all_runs = list(JobRun.objects.order_by("started_at", "pk"))
    first, second, failed = all_runs

    child = procs.start(sys.executable, "-m", "tests.multidb_admin", victim, alert, env=multidb_env)
    result = child.result(CHILD_TIMEOUT)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])

    # The holders page lists exactly what pglock_status lists, with the same states.
    status = {row["name"]: row["state"] for row in seen["status_json"]}
    assert status == {ok: "ok", alert: "alert", victim: "ok"}
    assert rows(seen["holders"]) == status
    assert rows(seen["holders_ok"]) == {ok: "ok", victim: "ok"}
    assert rows(seen["holders_search"]) == {alert: "alert"}
    assert "error" not in seen["change"], seen["change"].get("trace")
    assert seen["change"]["status"] == 200
    assert str(leases[victim].token) in seen["change"]["content"]

    # The run history: every run, the filters, the last success (DISTINCT ON), search.
    assert set(rows(seen["runs"])) == {run.pk for run in all_runs}
    assert set(rows(seen["runs_last_success"])) == {second.pk}
    assert set(rows(seen["runs_failed"])) == {failed.pk}
    assert first.pk in rows(seen["runs"])
    assert rows(seen["runs_search"]) == {}  # no run of the lock named `alert`

    # The jobs page: the job's health and its recent runs, read on the lock database.
    for page in (seen["jobs"], seen["jobs_failing"]):
        assert "error" not in page, page.get("trace")
        assert page["status"] == 200
        assert ["recorded-job", "failing"] in page["jobs"]
        assert page["charts"]["recorded-job"] == 3

    # The forced release: confirmed on the lock database, logged in the default one.
    assert "error" not in seen["confirm"], seen["confirm"].get("trace")
    assert seen["confirm"]["confirming"] == [victim]
    released = seen["released"]
    assert "error" not in released, released.get("trace")
    assert any(
        victim in message and "Force-released" in message for message in released["messages"]
    ), released["messages"]
    assert victim not in rows(released)
    with pytest.raises(LockNotHeld):
        leases[victim].check()
    assert len(seen["log_entries"]) == 1 and victim in seen["log_entries"][0]
    for name in (ok, alert):
        leases[name].check()
        leases[name].release()


def run_check(procs, env):
    return procs.start(sys.executable, "-m", "django", "check", env=env).result()


def test_check_passes_for_locks_on_their_own_database_without_a_router(procs, multidb_env):
    result = run_check(procs, multidb_env)
    assert result.returncode == 0, result.stderr
    assert "django_pglock." not in result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_reports_a_router_that_keeps_the_tables_off_the_lock_database(procs, multidb_env):
    result = run_check(procs, {**multidb_env, "PGLOCK_MULTIDB_ROUTER": "refuse"})
    assert result.returncode == 0, result.stderr  # a warning: another project may migrate
    assert "django_pglock.W003" in result.stderr, result.stderr
    assert "'locks'" in result.stderr
    assert "tests.routers.DefaultOnlyRouter" in result.stderr


@pytest.mark.parametrize(
    ("routers", "expected"),
    [
        pytest.param([], [], id="no-router"),
        pytest.param(["tests.routers.LocksOnLocksRouter"], ["django_pglock.W003"], id="elsewhere"),
        pytest.param(["tests.routers.DefaultOnlyRouter"], [], id="default-only"),
    ],
)
def test_routers_that_refuse_the_lock_alias_warn(routers, expected):
    # The lock alias here is `default`: LocksOnLocksRouter migrates django_pglock on
    # `locks` only, DefaultOnlyRouter everything on `default`.
    with override_settings(DATABASE_ROUTERS=routers):
        found = [message.id for message in checks.check_settings()]
    assert found == expected
