"""System checks of the ``DJANGO_PGLOCK`` setting and of the lock table."""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.core import checks as django_checks
from django.db import connection
from django.test import override_settings

from django_pglock import checks

OK = {
    "HEARTBEAT_INTERVAL": 5.0,
    "ALERT_AFTER": 20.0,
    "STALE_AFTER": 300.0,
    "POLL_INTERVAL": 0.25,
    "ADVISORY": True,
    "DATABASE": "default",
    "METRICS": None,
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
