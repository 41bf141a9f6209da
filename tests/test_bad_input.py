"""The bad-input catalogue: every bad value gets a clear error and changes nothing.

Each case checks the exception type, that the message quotes the bad value (its ``repr``)
and says how to fix it, and that nothing was written: the rows of the lock table and the
state of the fencing-token sequence are the same before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import sys
import time
import traceback
import uuid

import psycopg
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

from django_pglock import Lock, LockError, LockNotAcquired, singleton_job
from django_pglock import connection as lock_connection
from django_pglock.identity import redact
from django_pglock.operations import force_release

LOCK_TABLE = "django_pglock_joblock"
TOKEN_SEQUENCE = "django_pglock_token_seq"

# The lock engine writes on its own connection, so tests see real commits; this mark also
# makes pytest-django create the test database.
pytestmark = pytest.mark.django_db(transaction=True)


def unique_name(prefix="bad-input"):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def lock_db(pg_url, test_db_name, clean_locks):
    """An autocommit connection to the test database, for looking at what was written."""
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


def snapshot(conn):
    """Everything a lock operation could write: the rows and the token sequence."""
    rows = conn.execute(
        f"SELECT name, token, holder, last_heartbeat FROM {LOCK_TABLE} ORDER BY name"
    ).fetchall()
    sequence = conn.execute(f"SELECT last_value, is_called FROM {TOKEN_SEQUENCE}").fetchone()
    return rows, sequence


@pytest.fixture
def unchanged(lock_db):
    """Assert, at the end of the test, that nothing was written to the lock table.

    Another process's live lock sits in the table throughout, so "unchanged" is not
    trivially true of an empty table.
    """
    name = unique_name("bystander")
    lock_db.execute(
        f"INSERT INTO {LOCK_TABLE} (name, token, holder, host, pid, backend_pid, description,"
        " acquired_at, last_heartbeat, heartbeat_interval, alert_after, stale_after, advisory)"
        f" VALUES (%s, nextval('{TOKEN_SEQUENCE}'), 'elsewhere:1:x', 'elsewhere', 1, 1, '',"
        " now(), now(), 10, 30, 600, false)",
        [name],
    )
    before = snapshot(lock_db)
    assert len(before[0]) == 1
    yield lock_db
    assert snapshot(lock_db) == before, "a rejected call wrote to the lock table"


def assert_clear(excinfo, bad_value, fix, *, quoted=None):
    """The message quotes ``bad_value`` with repr (or ``quoted``) and matches ``fix``."""
    message = str(excinfo.value)
    expected = repr(bad_value) if quoted is None else quoted
    assert expected in message, f"message does not quote {expected}: {message!r}"
    assert re.search(fix, message), f"message does not say how to fix it ({fix}): {message!r}"


# -- names --------------------------------------------------------------------------------

NAME_CASES = [
    pytest.param("", r"pass a non-empty string", None, id="empty"),
    pytest.param("n" * 256, r"256 characters long; the limit is 255", repr("n" * 40), id="256"),
    pytest.param("a\x00b", r"contains a NUL character; remove it", None, id="nul"),
    pytest.param(42, r"is an int; pass a string", None, id="int"),
    pytest.param(None, r"is None; pass a string", None, id="none"),
    pytest.param(b"nightly", r"is a bytes object; pass a string", None, id="bytes"),
    pytest.param(uuid.UUID(int=1), r"is a UUID; pass a string", None, id="uuid"),
    pytest.param(" ", r"is blank \(only whitespace\); pass a name such as", None, id="blank"),
    pytest.param("\t\n ", r"is blank", None, id="blank-tab-newline"),
    pytest.param(" nightly", r"leading or trailing whitespace; pass 'nightly'", None, id="lead"),
    pytest.param("nightly\n", r"leading or trailing whitespace; pass 'nightly'", None, id="trail"),
]


@pytest.mark.parametrize(("name", "fix", "quoted"), NAME_CASES)
def test_bad_name(unchanged, name, fix, quoted):
    with pytest.raises(ValueError) as excinfo:
        Lock(name)
    assert_clear(excinfo, name, fix, quoted=quoted)


BLANK_NAMES = ["", "   ", "\t", " nightly", "nightly "]


@pytest.mark.parametrize("name", BLANK_NAMES)
def test_blank_name_refused_by_singleton_job_and_its_key(unchanged, name):
    with pytest.raises(ValueError) as excinfo:
        singleton_job(name)
    assert_clear(excinfo, name, r"pass")

    @singleton_job(key=lambda: name)
    def job():
        raise AssertionError("a job under a blank name ran")

    with pytest.raises(ValueError) as excinfo:
        job()
    assert_clear(excinfo, name, r"pass")


@pytest.mark.parametrize("name", BLANK_NAMES)
def test_blank_name_refused_by_force_release(unchanged, name):
    with pytest.raises(ValueError) as excinfo:
        force_release(name)
    assert_clear(excinfo, name, r"pass")


def test_name_with_inner_spaces_is_a_name(lock_db):
    name = unique_name("nightly report")
    with Lock(name).acquire() as lease:
        assert lease is not None
        assert lock_db.execute(f"SELECT name FROM {LOCK_TABLE}").fetchall() == [(name,)]


def test_name_of_255_characters_acquires(lock_db):
    name = unique_name("x").ljust(255, "y")
    assert len(name) == 255
    lease = Lock(name).try_acquire()
    assert lease is not None
    try:
        stored = lock_db.execute(
            f"SELECT name FROM {LOCK_TABLE} WHERE token = %s", [lease.token]
        ).fetchone()
        assert stored == (name,)
    finally:
        lease.release()
    assert lock_db.execute(f"SELECT count(*) FROM {LOCK_TABLE}").fetchone() == (0,)


# -- thresholds and poll interval ---------------------------------------------------------

THRESHOLD_LABELS = ["heartbeat_interval", "alert_after", "stale_after", "poll_interval"]

BAD_SECONDS = [
    pytest.param(0, r"out of range; it must be greater than zero and finite", id="zero"),
    pytest.param(0.0, r"out of range; it must be greater than zero and finite", id="zero-float"),
    pytest.param(-1, r"out of range; it must be greater than zero and finite", id="negative"),
    pytest.param(-0.5, r"out of range; it must be greater than zero and finite", id="neg-float"),
    pytest.param(math.nan, r"out of range; it must be greater than zero and finite", id="nan"),
    pytest.param(math.inf, r"out of range; it must be greater than zero and finite", id="inf"),
    pytest.param(-math.inf, r"out of range; it must be greater than zero and finite", id="-inf"),
    pytest.param(True, r"not a number; pass a number of seconds", id="true"),
    pytest.param(False, r"not a number; pass a number of seconds", id="false"),
    pytest.param("10", r"not a number; pass a number of seconds", id="str"),
]


@pytest.mark.parametrize("label", THRESHOLD_LABELS)
@pytest.mark.parametrize(("value", "fix"), BAD_SECONDS)
def test_bad_seconds(unchanged, label, value, fix):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), **{label: value})
    assert_clear(excinfo, value, fix, quoted=f"{label}={value!r}")


ORDER_FIX = r"out of order; they must satisfy heartbeat_interval < alert_after < stale_after"

OUT_OF_ORDER = [
    pytest.param({"heartbeat_interval": 30, "alert_after": 30, "stale_after": 600}, id="hb=alert"),
    pytest.param({"heartbeat_interval": 40, "alert_after": 30, "stale_after": 600}, id="hb>alert"),
    pytest.param({"heartbeat_interval": 10, "alert_after": 600, "stale_after": 600}, id="al=stale"),
    pytest.param({"heartbeat_interval": 10, "alert_after": 700, "stale_after": 600}, id="al>stale"),
    pytest.param({"heartbeat_interval": 5, "alert_after": 3, "stale_after": 1}, id="reversed"),
]


@pytest.mark.parametrize("thresholds", OUT_OF_ORDER)
def test_thresholds_out_of_order_in_constructor(unchanged, thresholds):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), **thresholds)
    for label, value in thresholds.items():
        assert_clear(excinfo, value, ORDER_FIX, quoted=f"{label}={value!r}")


PARTIAL_OUT_OF_ORDER = [
    # Out of order only together with the package defaults (10 / 30 / 600): refused by
    # the constructor (settings are configured here), and in any case before any I/O.
    pytest.param({"heartbeat_interval": 45}, id="hb-over-default-alert"),
    pytest.param({"alert_after": 5}, id="alert-under-default-hb"),
    pytest.param({"stale_after": 20}, id="stale-under-default-alert"),
    pytest.param({"heartbeat_interval": 10, "alert_after": 700}, id="alert-over-default-stale"),
]


@pytest.mark.parametrize("thresholds", PARTIAL_OUT_OF_ORDER)
@pytest.mark.parametrize("how", ["try_acquire", "acquire", "acquire_or_raise", "async"])
def test_thresholds_out_of_order_with_defaults(unchanged, thresholds, how):
    with pytest.raises(ValueError) as excinfo:
        attempt(Lock(unique_name(), **thresholds), how)
    for label, value in thresholds.items():
        assert_clear(excinfo, value, ORDER_FIX, quoted=f"{label}={value!r}")


def attempt(lock, how, **kwargs):
    """Acquire ``lock`` the way ``how`` names; release at once if it was granted."""
    if how == "try_acquire":
        lease = lock.try_acquire(**kwargs)
        if lease is not None:
            lease.release()
    elif how == "acquire":
        with lock.acquire(**kwargs):
            pass
    elif how == "acquire_or_raise":
        lock.acquire_or_raise(**kwargs).release()
    elif how == "async":

        async def run():
            async with lock.acquire_async(**kwargs):
                pass

        asyncio.run(run())
    else:  # pragma: no cover - a typo in a parameter list
        raise AssertionError(how)


# -- thresholds that cannot keep a lease: stale_after < 2 x heartbeat_interval -----------
#
# The holder gives up stale_after - min(heartbeat_interval, 0.1 * stale_after) after its
# last confirmed heartbeat: with heartbeat_interval=1, stale_after=1.1 that is 0.99 s, so
# every lease would be lost before its first heartbeat. Refused, naming both values (with
# the label of where each came from) and the two ways out.

TIGHT_FIX = r"stale_after must be at least twice heartbeat_interval"

TOO_TIGHT = [
    # (thresholds, smallest stale_after that works, largest heartbeat_interval that works)
    pytest.param(
        {"heartbeat_interval": 1, "alert_after": 1.05, "stale_after": 1.1}, 2.0, 0.55, id="1s"
    ),
    pytest.param(
        {"heartbeat_interval": 10.0, "alert_after": 12.0, "stale_after": 19.5},
        20.0,
        9.75,
        id="just-under",
    ),
    pytest.param(
        {"heartbeat_interval": 0.3, "alert_after": 0.4, "stale_after": 0.5}, 0.6, 0.25, id="small"
    ),
]


@pytest.fixture
def no_lock_session(unchanged):
    """Also: the process's dedicated lock connection was not opened by the rejected call."""
    conn = lock_connection.get_connection("default")
    conn.close()
    sessions = conn.generation
    yield unchanged
    assert not conn.is_open() and conn.generation == sessions, (
        "a rejected call opened the lock connection"
    )


def assert_too_tight(excinfo, hb, stale, smallest_stale, largest_hb):
    """The message names both values (``hb``, ``stale``: "label=repr") and both fixes."""
    hb_label, _, _ = hb.partition("=")
    stale_label, _, _ = stale.partition("=")
    message = str(excinfo.value)
    for part in (
        hb,
        stale,
        f"{stale_label}={smallest_stale!r} or more",
        f"{hb_label}={largest_hb!r} or less",
    ):
        assert part in message, f"message does not say {part!r}: {message!r}"
    assert re.search(TIGHT_FIX, message), message


@pytest.mark.parametrize(("thresholds", "smallest_stale", "largest_hb"), TOO_TIGHT)
def test_stale_after_under_two_heartbeats_in_constructor(
    no_lock_session, thresholds, smallest_stale, largest_hb
):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), **thresholds)
    hb, stale = thresholds["heartbeat_interval"], thresholds["stale_after"]
    assert_too_tight(
        excinfo, f"heartbeat_interval={hb!r}", f"stale_after={stale!r}", smallest_stale, largest_hb
    )
    # Either fix it names is accepted.
    Lock(unique_name(), **{**thresholds, "stale_after": smallest_stale})
    Lock(unique_name(), **{**thresholds, "heartbeat_interval": largest_hb})


def test_stale_after_of_exactly_two_heartbeats_holds_a_lease(lock_db):
    """The boundary is allowed, and such a lease survives heartbeats (it is not lost)."""
    lock = Lock(unique_name(), heartbeat_interval=0.2, alert_after=0.3, stale_after=0.4)
    with lock.acquire() as lease:
        assert lease is not None
        time.sleep(1.0)  # what is tested: 2.5 stale_after periods, kept by heartbeats
        assert not lease.lost
        lease.check()


@pytest.mark.parametrize("how", ["try_acquire", "acquire", "acquire_or_raise", "async"])
def test_stale_after_under_two_heartbeats_from_settings(no_lock_session, how):
    lock = Lock(unique_name())  # settings are read at acquire time
    configured = {"HEARTBEAT_INTERVAL": 1.0, "ALERT_AFTER": 1.05, "STALE_AFTER": 1.1}
    with override_settings(DJANGO_PGLOCK=configured), pytest.raises(ValueError) as excinfo:
        attempt(lock, how)
    assert_too_tight(
        excinfo,
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=1.0",
        "DJANGO_PGLOCK['STALE_AFTER']=1.1",
        2.0,
        0.55,
    )


def test_stale_after_under_two_heartbeats_mixing_arguments_and_settings(no_lock_session):
    """Each value is named where it came from: the setting, or the argument."""
    with (
        override_settings(DJANGO_PGLOCK={"HEARTBEAT_INTERVAL": 4.0}),
        pytest.raises(ValueError) as excinfo,
    ):
        Lock(unique_name(), alert_after=5.0, stale_after=6.0)
    assert_too_tight(
        excinfo, "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=4.0", "stale_after=6.0", 8.0, 3.0
    )
    # The other way round: an argument heartbeat interval against the configured stale_after.
    with (
        override_settings(DJANGO_PGLOCK={"ALERT_AFTER": 30.0, "STALE_AFTER": 40.0}),
        pytest.raises(ValueError) as excinfo,
    ):
        Lock(unique_name(), heartbeat_interval=25.0)
    assert_too_tight(
        excinfo, "heartbeat_interval=25.0", "DJANGO_PGLOCK['STALE_AFTER']=40.0", 50.0, 20.0
    )


@pytest.mark.parametrize("how", ["try_acquire", "acquire", "acquire_or_raise", "async"])
def test_stale_after_under_two_heartbeats_after_a_settings_change(no_lock_session, how):
    """Fine when constructed; the settings changed before the acquire: refused there."""
    with override_settings(DJANGO_PGLOCK={"HEARTBEAT_INTERVAL": 1.0}):
        lock = Lock(unique_name(), alert_after=5.0, stale_after=6.0)
    with (
        override_settings(DJANGO_PGLOCK={"HEARTBEAT_INTERVAL": 4.0}),
        pytest.raises(ValueError) as excinfo,
    ):
        attempt(lock, how)
    assert_too_tight(
        excinfo, "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=4.0", "stale_after=6.0", 8.0, 3.0
    )


def test_stale_after_under_two_heartbeats_in_singleton_job(no_lock_session):
    """Refused when the decorator is applied (at import time), before any call."""
    with pytest.raises(ValueError) as excinfo:

        @singleton_job("tight", heartbeat_interval=1, alert_after=1.05, stale_after=1.1)
        def job():  # pragma: no cover - never defined
            raise AssertionError("ran")

    assert_too_tight(excinfo, "heartbeat_interval=1", "stale_after=1.1", 2.0, 0.55)


@pytest.mark.parametrize("kind", ["function", "coroutine"])
def test_stale_after_under_two_heartbeats_from_settings_in_singleton_job(no_lock_session, kind):
    """Settings are read per call: the call is refused, the body never runs."""
    ran = []
    if kind == "function":

        @singleton_job(unique_name())
        def job():
            ran.append(1)

        call = job
    else:

        @singleton_job(unique_name())
        async def ajob():
            ran.append(1)

        def call():
            return asyncio.run(ajob())

    configured = {"HEARTBEAT_INTERVAL": 1.0, "ALERT_AFTER": 1.05, "STALE_AFTER": 1.1}
    with override_settings(DJANGO_PGLOCK=configured), pytest.raises(ValueError) as excinfo:
        call()
    assert ran == []
    assert_too_tight(
        excinfo,
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=1.0",
        "DJANGO_PGLOCK['STALE_AFTER']=1.1",
        2.0,
        0.55,
    )


def test_stale_after_under_two_heartbeats_in_locked_run(no_lock_session, tmp_path):
    """A usage error (exit status 2) before the child starts or anything is written."""
    marker = tmp_path / "ran"
    args = ["--heartbeat-interval", "1", "--alert-after", "1.05", "--stale-after", "1.1"]
    args += ["--shell", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(CommandError) as excinfo:
        call_command("locked_run", *args)
    assert excinfo.value.returncode == 2
    # locked_run parses the numbers as floats: the message shows them so.
    assert_too_tight(excinfo, "heartbeat_interval=1.0", "stale_after=1.1", 2.0, 0.55)
    assert not marker.exists(), "the wrapped program ran"


def test_stale_after_under_two_heartbeats_in_locked_run_with_settings(no_lock_session, tmp_path):
    marker = tmp_path / "ran"
    args = ["--alert-after", "5", "--stale-after", "6"]
    args += ["--shell", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    with (
        override_settings(DJANGO_PGLOCK={"HEARTBEAT_INTERVAL": 4.0}),
        pytest.raises(CommandError) as excinfo,
    ):
        call_command("locked_run", *args)
    assert excinfo.value.returncode == 2
    assert_too_tight(
        excinfo, "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=4.0", "stale_after=6.0", 8.0, 3.0
    )
    assert not marker.exists(), "the wrapped program ran"


def test_stale_after_under_two_heartbeats_in_a_locked_run_process(procs, unchanged, tmp_path):
    """As an operator runs it: exit status 2, the message on stderr, no traceback."""
    marker = tmp_path / "ran"
    result = procs.run_django(
        "locked_run",
        *("--heartbeat-interval", "1", "--alert-after", "1.05", "--stale-after", "1.1"),
        *("--shell", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"),
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    for part in ("heartbeat_interval=1.0", "stale_after=1.1", "stale_after=2.0 or more"):
        assert part in result.stderr, result.stderr
    assert re.search(TIGHT_FIX, result.stderr), result.stderr
    assert not marker.exists(), "the wrapped program ran"


# -- timeouts and blocking ----------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-1, -0.001, -math.inf, math.nan, math.inf])
@pytest.mark.parametrize("how", ["acquire", "acquire_or_raise", "async"])
def test_bad_timeout(unchanged, timeout, how):
    with pytest.raises(ValueError) as excinfo:
        attempt(Lock(unique_name()), how, timeout=timeout)
    assert_clear(
        excinfo,
        timeout,
        r"out of range; it must be zero or more and finite",
        quoted=f"timeout={timeout!r}",
    )


@pytest.mark.parametrize("timeout", [True, "5"])
def test_timeout_not_a_number(unchanged, timeout):
    with pytest.raises(ValueError) as excinfo:
        attempt(Lock(unique_name()), "acquire", timeout=timeout)
    assert_clear(
        excinfo, timeout, r"not a number; pass a number of seconds", quoted=f"timeout={timeout!r}"
    )


@pytest.mark.parametrize("how", ["acquire", "acquire_or_raise", "async"])
def test_timeout_with_blocking_false(unchanged, how):
    with pytest.raises(ValueError) as excinfo:
        attempt(Lock(unique_name()), how, blocking=False, timeout=2.5)
    assert_clear(
        excinfo,
        2.5,
        r"was given with blocking=False; drop the timeout or pass blocking=True",
        quoted="timeout=2.5",
    )


@pytest.mark.parametrize("blocking", ["yes", 1, None])
def test_blocking_not_a_bool(unchanged, blocking):
    with pytest.raises(ValueError) as excinfo:
        attempt(Lock(unique_name()), "acquire", blocking=blocking)
    assert_clear(excinfo, blocking, r"must be True or False", quoted=f"blocking={blocking!r}")


@pytest.mark.parametrize("advisory", ["yes", 1, 0])
def test_advisory_not_a_bool(unchanged, advisory):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), advisory=advisory)
    assert_clear(excinfo, advisory, r"must be True, False or None", quoted=f"advisory={advisory!r}")


def test_description_not_a_string(unchanged):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), description=b"nightly")
    assert_clear(excinfo, b"nightly", r"must be a string", quoted="description=b'nightly'")
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), description=42)
    assert_clear(excinfo, 42, r"must be a string, not an int", quoted="description=42")


@pytest.mark.parametrize(
    ("description", "fix"),
    [
        pytest.param("nightly\x00report", r"NUL character.*PostgreSQL.*remove it", id="nul"),
        pytest.param("report-\udcff.csv", r"cannot be stored as UTF-8.*pass valid text", id="byte"),
        pytest.param("job-\ud800", r"lone surrogate", id="surrogate"),
    ],
)
def test_description_that_cannot_be_stored(unchanged, description, fix):
    """Refused in Lock() with the value and the fix, not a UnicodeEncodeError at acquire."""
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), description=description)
    assert_clear(excinfo, description, fix, quoted=f"description={description!r}")


def test_description_error_does_not_show_a_secret(unchanged):
    with pytest.raises(ValueError) as excinfo:
        Lock(unique_name(), description="backup --password=hunter2\x00")
    assert "hunter2" not in str(excinfo.value)
    assert "--password=***" in str(excinfo.value)


@pytest.mark.parametrize("size", [2001, 1_000_000])
def test_long_description_is_stored_cut_to_2000_characters(lock_db, size):
    name = unique_name()
    started = time.monotonic()
    lock = Lock(name, description="report " + "x" * size)
    assert time.monotonic() - started < 5  # redaction reads a bounded prefix
    with lock.acquire() as lease:
        assert lease is not None
        (stored,) = lock_db.execute(
            f"SELECT description FROM {LOCK_TABLE} WHERE name = %s", [name]
        ).fetchone()
    assert stored == ("report " + "x" * size)[:2000]


# -- database aliases ---------------------------------------------------------------------

ALIAS_FIX = r"pass using= one of them or set DJANGO_PGLOCK\['DATABASE'\]"


@pytest.mark.parametrize("alias", ["nope", "", "DEFAULT", 0])
def test_unknown_alias(unchanged, alias):
    with pytest.raises(ImproperlyConfigured) as excinfo:
        Lock(unique_name(), using=alias)
    assert_clear(excinfo, alias, ALIAS_FIX)
    assert "'default'" in str(excinfo.value), "the known aliases should be listed"


def test_non_postgresql_alias(unchanged):
    with pytest.raises(ImproperlyConfigured) as excinfo:
        Lock(unique_name(), using="sqlite")
    assert_clear(excinfo, "sqlite", r"needs PostgreSQL: point using= at an alias with ENGINE")


@pytest.mark.parametrize(
    ("alias", "exception"), [("nope", ImproperlyConfigured), ("sqlite", ImproperlyConfigured)]
)
@pytest.mark.parametrize("how", ["try_acquire", "acquire", "acquire_or_raise", "async"])
def test_bad_alias_from_settings(unchanged, alias, exception, how):
    lock = Lock(unique_name())
    with override_settings(DJANGO_PGLOCK={"DATABASE": alias}), pytest.raises(exception) as exc:
        attempt(lock, how)
    assert_clear(exc, alias, r"using=")


# -- bad DJANGO_PGLOCK values -------------------------------------------------------------

SETTINGS_CASES = [
    pytest.param(
        {"HEARTBEAT_INTERVAL": 40.0},
        ORDER_FIX,
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']=40.0",
        id="hb>alert",
    ),
    pytest.param(
        {"ALERT_AFTER": 900.0}, ORDER_FIX, "DJANGO_PGLOCK['ALERT_AFTER']=900.0", id="alert>stale"
    ),
    pytest.param(
        {"HEARTBEAT_INTERVAL": 5.0, "ALERT_AFTER": 60.0, "STALE_AFTER": 60.0},
        ORDER_FIX,
        "DJANGO_PGLOCK['STALE_AFTER']=60.0",
        id="alert=stale",
    ),
    pytest.param(
        {"STALE_AFTER": 0},
        r"greater than zero and finite",
        "DJANGO_PGLOCK['STALE_AFTER']=0",
        id="stale=0",
    ),
    pytest.param(
        {"HEARTBEAT_INTERVAL": "10"},
        r"not a number; pass a number of seconds",
        "DJANGO_PGLOCK['HEARTBEAT_INTERVAL']='10'",
        id="hb-str",
    ),
    pytest.param(
        {"ALERT_AFTER": math.nan},
        r"greater than zero and finite",
        "DJANGO_PGLOCK['ALERT_AFTER']=nan",
        id="nan",
    ),
    pytest.param(
        {"POLL_INTERVAL": 0},
        r"greater than zero and finite",
        "DJANGO_PGLOCK['POLL_INTERVAL']=0",
        id="poll=0",
    ),
    pytest.param(
        {"POLL_INTERVAL": -1.0},
        r"greater than zero and finite",
        "DJANGO_PGLOCK['POLL_INTERVAL']=-1.0",
        id="poll<0",
    ),
]


@pytest.mark.parametrize(("configured", "fix", "quoted"), SETTINGS_CASES)
@pytest.mark.parametrize("how", ["try_acquire", "acquire", "acquire_or_raise", "async"])
def test_bad_settings_refused_at_acquire(unchanged, configured, fix, quoted, how):
    lock = Lock(unique_name())  # settings are read at acquire time, not here
    with override_settings(DJANGO_PGLOCK=configured), pytest.raises(ValueError) as excinfo:
        attempt(lock, how)
    assert_clear(excinfo, None, fix, quoted=quoted)


def test_per_lock_arguments_win_over_bad_settings(lock_db):
    """Sanity check for the cases above: a lock that overrides the bad values acquires."""
    lock = Lock(unique_name(), heartbeat_interval=1.0, alert_after=2.0, stale_after=3.0)
    with override_settings(DJANGO_PGLOCK={"HEARTBEAT_INTERVAL": 40.0}):
        lease = lock.try_acquire()
    assert lease is not None
    lease.release()


# -- secrets never leak -------------------------------------------------------------------

PASSWORD = "s3cr3t-PASSWORD"
BAD_ALIAS = "bad"


@pytest.fixture
def bad_alias(monkeypatch):
    """A PostgreSQL alias pointing at a port where nothing listens, with a password.

    ``override_settings(DATABASES=...)`` does not rebuild ``django.db.connections`` (Django
    only warns that overriding DATABASES "can lead to unexpected behavior"), so the alias is
    added to the connection handler's settings directly, and removed again afterwards.
    """
    entry = {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "127.0.0.1",
        "PORT": "1",
        "USER": "u",
        "PASSWORD": PASSWORD,
        "NAME": "x",
        "OPTIONS": {"connect_timeout": 5},
        "ATOMIC_REQUESTS": False,
        "AUTOCOMMIT": True,
        "CONN_MAX_AGE": 0,
        "CONN_HEALTH_CHECKS": False,
        "TIME_ZONE": None,
        "TEST": {"CHARSET": None, "COLLATION": None, "MIGRATE": True, "MIRROR": None, "NAME": None},
    }
    monkeypatch.setitem(connections.settings, BAD_ALIAS, entry)
    yield BAD_ALIAS
    lock_connection.get_connection(BAD_ALIAS).close()
    lock_connection._registry.pop(BAD_ALIAS, None)
    with contextlib.suppress(AttributeError):
        del connections[BAD_ALIAS]


def exception_chain(exc):
    """``exc`` and every exception reachable through ``__cause__`` / ``__context__``."""
    seen, todo = [], [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        todo.extend([current.__cause__, current.__context__])
    return seen


def leaked(text):
    """True if ``text`` shows the password, plainly or inside a DSN / conninfo."""
    return PASSWORD.lower() in text.lower() or "s3cr3t" in text


def test_password_never_in_errors_or_logs(bad_alias, caplog, unchanged):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    lock = Lock(unique_name(), using=bad_alias)
    with pytest.raises(LockError) as excinfo:
        lock.try_acquire()
    error = excinfo.value
    message = str(error)
    assert "'bad'" in message and "Check DATABASES['bad']" in message, message

    chain = exception_chain(error)
    for exc in chain:
        for text in (str(exc), repr(exc), *(repr(arg) for arg in exc.args)):
            assert not leaked(text), f"{type(exc).__name__} shows the password: {text!r}"
    shown = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    assert not leaked(shown), shown
    for exc in chain:  # also what a "raise from" elsewhere would print for a chained one
        assert not leaked("".join(traceback.format_exception_only(type(exc), exc)))

    for record in caplog.records:
        assert not leaked(record.getMessage()), record.getMessage()
        assert not leaked(repr(record.args)), record.args
        if record.exc_info:
            formatted = "".join(traceback.format_exception(*record.exc_info))
            assert not leaked(formatted), formatted
    assert not leaked(caplog.text), caplog.text

    dedicated = lock_connection.get_connection(bad_alias)
    assert not leaked(repr(dedicated)), repr(dedicated)
    assert not leaked(str(dedicated)), str(dedicated)


def test_password_never_in_errors_of_blocking_acquire(bad_alias, caplog, unchanged):
    caplog.set_level(logging.DEBUG)
    lock = Lock(unique_name(), using=bad_alias, poll_interval=0.05)
    with pytest.raises(LockError) as excinfo:
        lock.acquire_or_raise(timeout=0.2)
    assert not isinstance(excinfo.value, LockNotAcquired), "a dead server is not contention"
    for exc in exception_chain(excinfo.value):
        assert not leaked(str(exc)) and not leaked(repr(exc))
    assert not leaked(caplog.text), caplog.text


# -- redaction of stored command lines ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("--password=x", "--password=***"),
        (
            "manage.py run --password=hunter2 --verbosity 2",
            "manage.py run --password=*** --verbosity 2",
        ),
        ("--db-password hunter2", "--db-password ***"),
        ("--api-key=abc123", "--api-key=***"),
        ("postgres://user:pass@host/db", "postgres://user:***@host/db"),
        (
            "postgresql+psycopg://user:p%40ss@db.example:5432/app?sslmode=require",
            "postgresql+psycopg://user:***@db.example:5432/app?sslmode=require",
        ),
        ("API_TOKEN=abc", "API_TOKEN=***"),
        ("DB_PASSWORD=abc", "DB_PASSWORD=***"),
        ("PGPASSWORD=abc psql", "PGPASSWORD=*** psql"),
        ("host=db password=abc dbname=app", "host=db password=*** dbname=app"),
        ("SENTRY_DSN=https://k@sentry.io/1", "SENTRY_DSN=***"),
    ],
)
def test_redact_hides_secrets(text, expected):
    assert redact(text) == expected
    assert "abc" not in redact(text).replace("abc123", "")  # nothing of the secret is left


@pytest.mark.parametrize(
    "text",
    [
        "manage.py nightly_report",
        "manage.py nightly_report --verbosity 2 --date=2024-01-01 --tenant 42",
        "python -m worker --name report --timeout 30 --blocking",
        "locked_run --shell -- /usr/bin/backup --full /var/lib/data",
        "https://example.com/path?page=2",
        "user@example.com",
    ],
)
def test_redact_keeps_ordinary_arguments(text):
    assert redact(text) == text


# -- found while writing this catalogue: the library accepts these and should not ---------
#
# Each test states the behaviour the design asks for ("bad input gets a clear error and
# changes nothing"); they fail against the current library.


def test_name_that_cannot_be_stored_is_refused_up_front(unchanged):
    """A lone surrogate cannot be encoded as UTF-8, so PostgreSQL can never store it.

    Today ``Lock()`` accepts it and the first acquire fails with a bare
    ``UnicodeEncodeError`` from hashing the advisory key, which names neither the lock nor
    the fix.
    """
    name = "job-\ud800"
    with pytest.raises(ValueError) as excinfo:
        Lock(name)
    assert_clear(excinfo, name, r"(?i)utf-?8|surrogate|encod")


@pytest.mark.parametrize("stale_after", [1e13, 1e300, sys.float_info.max])
def test_huge_stale_after_is_refused_or_works(lock_db, stale_after):
    """A threshold beyond PostgreSQL's interval range must not poison the lock name.

    Either ``Lock()`` refuses it with a clear ``ValueError`` (nothing written), or a lock
    holding it behaves like any other: a contender is refused, not broken. Today the
    holder's row is written and every contender's acquire on that name then fails with
    ``LockError: ... interval out of range`` (``stale_after * interval '1 second'``
    overflows above about 9.2e12 seconds), and ``manage.py pglock_status`` fails with
    ``DataError`` for all locks while that row exists.
    """
    name = unique_name("huge")
    try:
        lock = Lock(name, stale_after=stale_after)
    except ValueError as exc:
        assert f"stale_after={stale_after!r}" in str(exc), str(exc)
        assert lock_db.execute(f"SELECT count(*) FROM {LOCK_TABLE}").fetchone() == (0,)
        return
    holder = lock.try_acquire()
    assert holder is not None
    try:
        assert Lock(name).try_acquire() is None
    finally:
        holder.release()


@pytest.mark.parametrize("configured", ["yes", [("HEARTBEAT_INTERVAL", 5.0)]])
def test_settings_that_are_not_a_dict(unchanged, configured):
    """Today: ``AttributeError: 'str' object has no attribute 'get'`` at acquire."""
    lock = Lock(unique_name())
    with (
        override_settings(DJANGO_PGLOCK=configured),
        pytest.raises(ImproperlyConfigured) as excinfo,
    ):
        lock.try_acquire()
    assert_clear(excinfo, configured, r"DJANGO_PGLOCK.*dict")


@pytest.mark.parametrize("value", ["False", "off", "0"])
def test_advisory_setting_not_a_bool(lock_db, value):
    """``ADVISORY = "False"`` (say, read from an environment variable) must not mean True.

    ``Lock(advisory="False")`` is refused, but the same value from settings is taken as
    truthy today, which turns the advisory path *on* where the operator meant to turn it
    off (for example behind PgBouncer).
    """
    lock = Lock(unique_name())
    with (
        override_settings(DJANGO_PGLOCK={"ADVISORY": value}),
        pytest.raises((ValueError, ImproperlyConfigured)) as excinfo,
    ):
        attempt(lock, "try_acquire")
    assert_clear(excinfo, value, r"True or False")
