"""System checks of the ``DJANGO_PGLOCK`` setting and of the lock table."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection
from django.test import override_settings

from django_pglock import checks
from django_pglock import connection as lock_connection
from django_pglock.models import JobLock, JobRun

OK = {
    "HEARTBEAT_INTERVAL": 5.0,
    "ALERT_AFTER": 20.0,
    "STALE_AFTER": 300.0,
    "POLL_INTERVAL": 0.25,
    "ADVISORY": True,
    "DATABASE": "default",
    "METRICS": None,
    "SCHEDULE_TOLERANCE": 2.5,
}


def ids(messages):
    return [message.id for message in messages]


def check(configured):
    with override_settings(DJANGO_PGLOCK=configured):
        return checks.check_settings()


@contextmanager
def extra_database(alias, **overrides):
    """``settings.DATABASES`` plus one PostgreSQL alias (a copy of default, changed)."""
    databases = {**settings.DATABASES, alias: {**settings.DATABASES["default"], **overrides}}
    with warnings.catch_warnings():
        # Django warns that overriding DATABASES does not rebuild connections; the
        # checks read the setting itself, which is what is tested here.
        warnings.filterwarnings("ignore", "Overriding setting DATABASES", UserWarning)
        with override_settings(DATABASES=databases):
            yield


@pytest.mark.parametrize(
    "configured",
    [
        pytest.param(None, id="absent"),
        pytest.param({}, id="empty"),
        pytest.param(OK, id="everything"),
        pytest.param({"STALE_AFTER": 60, "ALERT_AFTER": 15, "HEARTBEAT_INTERVAL": 1}, id="ints"),
        pytest.param({"ADVISORY": False}, id="table-only"),
        pytest.param({"SCHEDULE_TOLERANCE": 0}, id="exact-slots"),
        pytest.param({"SCHEDULE_TOLERANCE": 30.0}, id="widest-tolerance"),
        pytest.param(
            {"HEARTBEAT_INTERVAL": 1, "ALERT_AFTER": 1.5, "STALE_AFTER": 2}, id="stale=2*hb"
        ),
    ],
)
def test_valid_settings_pass(configured):
    assert check(configured) == []


def test_valid_metrics_path_passes():
    # Any importable dotted path; the hook methods are optional.
    assert check({"METRICS": "collections.Counter"}) == []


@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        pytest.param([("STALE_AFTER", 60)], ["django_pglock.E001"], id="E001-list"),
        pytest.param("STALE_AFTER=60", ["django_pglock.E001"], id="E001-str"),
        pytest.param({"STALE": 60.0}, ["django_pglock.E002"], id="E002"),
        pytest.param(
            {"stale_after": 60.0, "Database": "default"},
            ["django_pglock.E002", "django_pglock.E002"],
            id="E002-twice",
        ),
        pytest.param({"STALE_AFTER": -1}, ["django_pglock.E003"], id="E003-negative"),
        pytest.param({"STALE_AFTER": "600"}, ["django_pglock.E003"], id="E003-string"),
        pytest.param({"HEARTBEAT_INTERVAL": True}, ["django_pglock.E003"], id="E003-bool"),
        pytest.param({"ALERT_AFTER": float("nan")}, ["django_pglock.E003"], id="E003-nan"),
        pytest.param({"STALE_AFTER": float("inf")}, ["django_pglock.E003"], id="E003-inf"),
        pytest.param({"POLL_INTERVAL": 0}, ["django_pglock.E003"], id="E003-zero-poll"),
        pytest.param({"ALERT_AFTER": 5.0}, ["django_pglock.E004"], id="E004-alert-below-hb"),
        pytest.param({"STALE_AFTER": 30.0}, ["django_pglock.E004"], id="E004-equal"),
        pytest.param(
            {"HEARTBEAT_INTERVAL": 60.0, "ALERT_AFTER": 30.0, "STALE_AFTER": 10.0},
            ["django_pglock.E004"],
            id="E004-reversed",
        ),
        pytest.param(
            {"HEARTBEAT_INTERVAL": 1.0, "ALERT_AFTER": 1.05, "STALE_AFTER": 1.1},
            ["django_pglock.E011"],
            id="E011-1s",
        ),
        pytest.param(
            {"HEARTBEAT_INTERVAL": 20.0, "ALERT_AFTER": 30.0, "STALE_AFTER": 39.9},
            ["django_pglock.E011"],
            id="E011-just-under",
        ),
        pytest.param(
            {"ALERT_AFTER": 12.0, "STALE_AFTER": 15.0}, ["django_pglock.E011"], id="E011-default-hb"
        ),
        pytest.param(
            {"HEARTBEAT_INTERVAL": 1.0, "ALERT_AFTER": 0.5, "STALE_AFTER": 0.8},
            ["django_pglock.E004"],
            id="E004-not-E011-too",
        ),
        pytest.param({"ADVISORY": "yes"}, ["django_pglock.E005"], id="E005-str"),
        pytest.param({"ADVISORY": 1}, ["django_pglock.E005"], id="E005-int"),
        pytest.param({"DATABASE": "nope"}, ["django_pglock.E006"], id="E006"),
        pytest.param({"DATABASE": None}, ["django_pglock.E006"], id="E006-none"),
        pytest.param({"DATABASE": "sqlite"}, ["django_pglock.E007"], id="E007"),
        pytest.param(
            {"METRICS": "no_such_module.Metrics"}, ["django_pglock.E008"], id="E008-module"
        ),
        pytest.param(
            {"METRICS": "django_pglock.NoSuchClass"}, ["django_pglock.E008"], id="E008-attr"
        ),
        pytest.param({"METRICS": 42}, ["django_pglock.E008"], id="E008-not-a-path"),
        pytest.param({"SCHEDULE_TOLERANCE": -0.5}, ["django_pglock.E012"], id="E012-negative"),
        pytest.param({"SCHEDULE_TOLERANCE": 31}, ["django_pglock.E012"], id="E012-too-big"),
        pytest.param({"SCHEDULE_TOLERANCE": "5"}, ["django_pglock.E012"], id="E012-string"),
        pytest.param({"SCHEDULE_TOLERANCE": True}, ["django_pglock.E012"], id="E012-bool"),
        pytest.param({"SCHEDULE_TOLERANCE": float("nan")}, ["django_pglock.E012"], id="E012-nan"),
        pytest.param(
            {"STALE": 1, "POLL_INTERVAL": -1, "ADVISORY": "no", "DATABASE": "sqlite"},
            [
                "django_pglock.E002",
                "django_pglock.E003",
                "django_pglock.E005",
                "django_pglock.E007",
            ],
            id="several",
        ),
    ],
)
def test_bad_settings_give_exactly_these_ids(configured, expected):
    messages = check(configured)
    assert ids(messages) == expected
    for message in messages:
        assert message.level == django_checks.ERROR
        assert message.hint  # every error says how to fix it


def test_messages_name_the_bad_value():
    (message,) = check({"STALE_AFTER": -7.5})
    assert "STALE_AFTER" in message.msg and "-7.5" in message.msg
    (message,) = check({"DATABASE": "nope"})
    assert "'nope'" in message.msg and "'default'" in message.hint
    (message,) = check({"DATABASE": "sqlite"})
    assert "'sqlite'" in message.msg
    (message,) = check({"SCHEDULE_TOLERANCE": 90})
    assert "SCHEDULE_TOLERANCE" in message.msg and "90" in message.msg


def test_out_of_order_thresholds_name_the_values_and_the_rule():
    (message,) = check({"HEARTBEAT_INTERVAL": 40.0})
    assert message.id == "django_pglock.E004"
    for part in (
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=40.0",
        "DJANGO_PGLOCK['ALERT_AFTER']=30.0",
        "DJANGO_PGLOCK['STALE_AFTER']=600.0",
    ):
        assert part in message.msg, message.msg
    assert "heartbeat_interval < alert_after < stale_after" in message.hint


TIGHT = {"HEARTBEAT_INTERVAL": 1.0, "ALERT_AFTER": 1.05, "STALE_AFTER": 1.1}


def assert_names_tight_values_and_fix(text):
    for part in (
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=1.0",
        "DJANGO_PGLOCK['STALE_AFTER']=1.1",
        "stale_after must be at least twice heartbeat_interval",
        "DJANGO_PGLOCK['STALE_AFTER']=2.0 or more",
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=0.55 or less",
    ):
        assert part in text, f"{part!r} not in {text!r}"


def test_stale_after_under_two_heartbeats_names_the_values_and_the_fix():
    (message,) = check(TIGHT)
    assert message.id == "django_pglock.E011"
    assert message.level == django_checks.ERROR
    assert_names_tight_values_and_fix(f"{message.msg}\n{message.hint}")
    assert "0.99 s" in message.msg  # when the holder would give up
    # The hint alone is the fix.
    assert "or more" in message.hint and "or less" in message.hint


def test_stale_after_under_two_heartbeats_with_the_default_heartbeat_interval():
    (message,) = check({"ALERT_AFTER": 12.0, "STALE_AFTER": 15.0})
    text = f"{message.msg}\n{message.hint}"
    assert "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=10.0" in text, text
    assert "DJANGO_PGLOCK['STALE_AFTER']=20.0 or more" in text, text
    assert "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=7.5 or less" in text, text


@pytest.mark.django_db(transaction=True)
def test_manage_py_check_reports_stale_after_under_two_heartbeats():
    """``manage.py check`` fails with E011, naming values and fix; nothing is written."""
    conn = lock_connection.get_connection("default")
    conn.close()
    sessions = conn.generation
    out, err = io.StringIO(), io.StringIO()
    with override_settings(DJANGO_PGLOCK=TIGHT), pytest.raises(SystemCheckError) as excinfo:
        call_command("check", stdout=out, stderr=err)
    report = str(excinfo.value)
    assert "django_pglock.E011" in report, report
    assert_names_tight_values_and_fix(report)
    assert not conn.is_open() and conn.generation == sessions, "check opened the lock connection"
    assert JobLock.objects.count() == 0 and JobRun.objects.count() == 0


def test_manage_py_check_process_exits_non_zero_for_stale_after_under_two_heartbeats(tmp_path):
    """The same from a process, as in a deploy pipeline: exit status 1, E011 on stderr."""
    (tmp_path / "tight_settings.py").write_text(
        f"from tests.settings import *  # noqa: F403\nDJANGO_PGLOCK = {TIGHT!r}\n"
    )
    repo = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tight_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "django_pglock.E011" in result.stderr, result.stderr
    assert_names_tight_values_and_fix(result.stderr)
    assert "Traceback" not in result.stderr


def test_threshold_order_is_not_checked_when_a_threshold_is_not_a_number():
    # One clear error, not a second one about an order that cannot be judged.
    assert ids(check({"HEARTBEAT_INTERVAL": "fast", "ALERT_AFTER": 1.0})) == ["django_pglock.E003"]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"PORT": "6432"}, id="pgbouncer-port"),
        pytest.param({"PORT": 6432}, id="pgbouncer-port-int"),
        pytest.param({"DISABLE_SERVER_SIDE_CURSORS": True}, id="disable-server-side-cursors"),
    ],
)
def test_pooled_alias_with_advisory_warns(overrides):
    with extra_database("pooled", **overrides):
        messages = check({"DATABASE": "pooled"})
        assert ids(messages) == ["django_pglock.W001"]
        assert messages[0].level == django_checks.WARNING
        assert "ADVISORY" in messages[0].hint
        # Table-only locking is the documented fix: no warning then.
        assert check({"DATABASE": "pooled", "ADVISORY": False}) == []


def test_direct_alias_does_not_warn():
    with extra_database("direct", PORT="5432"):
        assert check({"DATABASE": "direct"}) == []


def test_checks_are_registered_with_django():
    with override_settings(DJANGO_PGLOCK={"STALE": 1, "DATABASE": "sqlite"}):
        found = [m.id for m in django_checks.run_checks() if m.id.startswith("django_pglock.")]
    assert found == ["django_pglock.E002", "django_pglock.E007"]
    assert checks.check_settings in django_checks.registry.registry.get_checks()
    database_checks = django_checks.registry.registry.get_checks(include_deployment_checks=False)
    assert checks.check_database in database_checks


def test_check_ids_are_unique_and_stable():
    source = Path(checks.__file__).read_text(encoding="utf-8")
    used = re.findall(r"""id=["'](django_pglock\.[EW]\d{3})["']""", source)
    assert used, "no check ids found in checks.py"
    assert len(used) == len(set(used)), f"duplicate check ids: {sorted(used)}"
    # Every id is written as a literal (so that it can be found, documented and silenced).
    assert len(used) == source.count("id=")
    assert {"django_pglock.E001", "django_pglock.E008", "django_pglock.W001"} <= set(used)
    # Retired ids are never given a new meaning.
    assert "django_pglock.E009" not in used


def test_check_database_without_databases_does_nothing():
    assert checks.check_database(databases=None) == []
    assert checks.check_database(databases=[]) == []


@pytest.mark.django_db
def test_check_database_passes_when_the_table_exists():
    assert checks.check_database(databases=["default"]) == []
    assert checks.check_database(databases=["default", "sqlite"]) == []


@pytest.mark.django_db
def test_check_database_ignores_an_alias_that_is_not_the_lock_alias():
    assert checks.check_database(databases=["sqlite"]) == []


@pytest.mark.django_db
def test_check_database_reports_a_missing_table():
    # Inside the test's transaction: the rename is rolled back at the end.
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE django_pglock_joblock RENAME TO django_pglock_joblock_gone")
    messages = checks.check_database(databases=["default"])
    assert ids(messages) == ["django_pglock.W002"]
    assert "migrate django_pglock" in messages[0].hint
