"""``DJANGO_PGLOCK`` is read the same way everywhere: the lock engine, ``check`` (with and
without ``--database``) and ``migrate`` accept ``None`` as "unset" and refuse anything
else that is not a dict, with E001 in the checks and ``ImproperlyConfigured`` at run time,
never an ``AttributeError``."""

from __future__ import annotations

import json
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_pglock import Lock, checks, conf

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

NOT_A_DICT = [pytest.param([], id="list"), pytest.param("", id="empty-str")]


def run_django(procs, child_env, configured, *args):
    """``python -m django <args>`` with ``DJANGO_PGLOCK = configured`` (tests.fault_settings)."""
    env = {
        **child_env,
        "DJANGO_SETTINGS_MODULE": "tests.fault_settings",
        "PGLOCK_FAULT_SETTINGS": json.dumps(configured),
    }
    return procs.start(sys.executable, "-m", "django", *args, env=env).result()


def assert_no_traceback(result):
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out
    assert "AttributeError" not in out, out


@pytest.mark.parametrize("command", [["check", "--database", "default"], ["migrate"]])
def test_none_is_unset_for_check_database_and_migrate(procs, child_env, command):
    result = run_django(procs, child_env, None, *command)
    assert_no_traceback(result)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("configured", NOT_A_DICT)
@pytest.mark.parametrize("command", [["check"], ["check", "--database", "default"], ["migrate"]])
def test_not_a_dict_is_e001_everywhere(procs, child_env, configured, command):
    result = run_django(procs, child_env, configured, *command)
    assert_no_traceback(result)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "django_pglock.E001" in result.stderr
    assert "not a dict" in result.stderr


def test_a_database_that_is_not_an_alias_name_is_e006_with_database(procs, child_env):
    configured = {"DATABASE": ["default"]}
    result = run_django(procs, child_env, configured, "check", "--database", "default")
    assert_no_traceback(result)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "django_pglock.E006" in result.stderr


def test_check_database_reads_the_setting_as_check_settings_does():
    for configured in (None, [], "", 0, ()):
        with override_settings(DJANGO_PGLOCK=configured):
            assert checks.check_database(databases=["default"]) == []
            expected = [] if configured is None else ["django_pglock.E001"]
            assert [message.id for message in checks.check_settings()] == expected


@pytest.mark.parametrize("configured", NOT_A_DICT)
def test_not_a_dict_is_refused_at_run_time_too(configured):
    # Before, a falsy value (an empty list or string) counted as unset at run time while
    # `check` reported E001: both now refuse it, naming the value and the fix.
    with override_settings(DJANGO_PGLOCK=configured):
        with pytest.raises(ImproperlyConfigured, match=r"DJANGO_PGLOCK is .*not a dict.*a dict"):
            conf.read_setting()
        with pytest.raises(ImproperlyConfigured, match="not a dict"):
            Lock("setting-read").try_acquire()


def test_none_is_unset_at_run_time():
    with override_settings(DJANGO_PGLOCK=None):
        assert conf.read_setting() == {}
        lease = Lock("setting-read-none").try_acquire()
        assert lease is not None
        lease.release()
