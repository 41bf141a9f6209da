"""Bad input to the management commands, run as operators run them: real processes
(``python -m django ...``) against the real server.

A non-UTF-8 argument must reach the job byte for byte and be stored displayable; an empty
or blank lock name, an age beyond what can be asked for, an empty ``--schedule`` or
``--database`` end in a clear error (exit status 2) that names the value, with no
traceback and nothing written. ``migrate`` does not tell the operator to run ``migrate``.
"""

from __future__ import annotations

import io
import os
import sys
import uuid

import psycopg
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from psycopg import sql

from django_pglock import Lock, checks
from tests.settings import ENV_TEST_DB_NAME

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

EXIT_USAGE = 2
# A file name as a Latin-1 system would write it: not UTF-8.
RAW_ARGUMENT = b"report-\xff.csv"
# What Python makes of it in sys.argv (os.fsdecode, surrogateescape); subprocess turns it
# back into the same bytes (os.fsencode) for the child.
ARGUMENT = os.fsdecode(RAW_ARGUMENT)
# The job: write the bytes of its argument to a file.
WRITE_ARGUMENT = "import os, sys; open(sys.argv[1], 'wb').write(os.fsencode(sys.argv[2]))"


@pytest.fixture
def db(pg_url, test_db_name):
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


def unique(label):
    return f"input-{label}-{uuid.uuid4().hex[:8]}"


def runs(db, name):
    return db.execute(
        "SELECT description, outcome FROM django_pglock_jobrun WHERE name = %s", [name]
    ).fetchall()


def lock_rows(db):
    return db.execute("SELECT count(*) FROM django_pglock_joblock").fetchone()[0]


def assert_usage_error(result, *quoted):
    assert result.returncode == EXIT_USAGE, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for text in quoted:
        assert text in result.stderr, result.stderr


# -- a non-UTF-8 argument ----------------------------------------------------------------


def test_locked_run_passes_a_non_utf8_argument_unchanged(procs, db, tmp_path):
    assert ARGUMENT == "report-\udcff.csv"
    name, written = unique("bytes"), tmp_path / "argument"
    result = procs.run_django(
        "locked_run", "--name", name, "--shell", "--",
        sys.executable, "-c", WRITE_ARGUMENT, written, ARGUMENT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert written.read_bytes() == RAW_ARGUMENT  # the job got the byte itself
    [(description, outcome)] = runs(db, name)
    assert outcome == "succeeded"
    assert description.endswith(f"{written} report-\\xff.csv"), description


def test_locked_run_skips_with_a_non_utf8_argument(procs, db, tmp_path):
    name, written = unique("bytes-skip"), tmp_path / "argument"
    lease = Lock(name).try_acquire()
    assert lease is not None
    try:
        result = procs.run_django(
            "locked_run", "--name", name, "--shell", "--",
            sys.executable, "-c", WRITE_ARGUMENT, written, ARGUMENT,
        )  # fmt: skip
    finally:
        lease.release()
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("Skipped ") and "report-\\\\xff.csv" in result.stderr
    assert lease.holder in result.stderr
    assert not written.exists()
    [(description, outcome)] = runs(db, name)
    assert outcome == "skipped"
    assert description.endswith("report-\\xff.csv"), description


HOLD_AND_RELEASE = """
import sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True).try_acquire()
assert lease is not None
lease.release()
"""


def test_default_description_of_a_non_utf8_command_line(procs, db):
    """A lock with no description= (every @singleton_job) in a process whose argv holds
    a byte that is not UTF-8: stored as \\xff, not a UnicodeEncodeError at acquire."""
    name = unique("bytes-default")
    result = procs.python(HOLD_AND_RELEASE, name, ARGUMENT).result()
    assert result.returncode == 0, result.stderr
    assert runs(db, name) == [(f"-c {name} report-\\xff.csv", "succeeded")]


def test_locked_run_names_the_fix_when_a_program_name_cannot_name_a_lock(procs, db):
    program = os.fsdecode(b"/nonexistent/job-\xff")
    result = procs.run_django("locked_run", "--shell", "--", program)
    assert_usage_error(result, "job-\\udcff", "UTF-8", "--name")
    assert lock_rows(db) == 0


# -- blank lock names ---------------------------------------------------------------------

BLANK_NAMES = ["", "   ", "\t", " nightly", "nightly "]


@pytest.mark.parametrize("name", BLANK_NAMES)
def test_locked_run_refuses_an_empty_or_blank_name(procs, db, tmp_path, name):
    marker = tmp_path / "ran"
    recorded = db.execute("SELECT count(*) FROM django_pglock_jobrun").fetchone()
    result = procs.run_django(
        "locked_run", "--name", name, "--shell", "--",
        sys.executable, "-c", WRITE_ARGUMENT, marker, "x",
    )  # fmt: skip
    assert_usage_error(result, f"Lock name {name!r}")
    assert not marker.exists()
    assert lock_rows(db) == 0
    assert db.execute("SELECT count(*) FROM django_pglock_jobrun").fetchone() == recorded


@pytest.mark.parametrize("name", ["", "   "])
def test_pglock_release_refuses_an_empty_or_blank_name(procs, name):
    result = procs.run_django("pglock_release", name)
    assert_usage_error(result, f"Lock name {name!r}")


# -- pglock_prune --older-than ------------------------------------------------------------


def test_prune_refuses_an_age_too_large_from_the_command_line(procs, db):
    name = unique("run")
    Lock(name, record=True).try_acquire().release()
    result = procs.run_django("pglock_prune", "--older-than", "99999999999w")
    assert_usage_error(result, "'99999999999w'", "too large", "36500d")
    assert len(runs(db, name)) == 1


@pytest.mark.parametrize("age", ["36501d", "5215w", "876001h", "9" * 400 + "s"])
def test_prune_refuses_ages_beyond_100_years(age):
    with pytest.raises(CommandError) as raised:
        call_command("pglock_prune", f"--older-than={age}")
    assert raised.value.returncode == EXIT_USAGE
    assert repr(age) in str(raised.value) and "36500d" in str(raised.value)


@pytest.mark.parametrize("age", ["36500d", "5214w", "3153600000s"])
def test_prune_accepts_the_largest_ages(db, age):
    """The largest ages run against PostgreSQL: no interval or timestamp overflow."""
    name = unique("run")
    Lock(name, record=True).try_acquire().release()
    out = io.StringIO()
    call_command("pglock_prune", f"--older-than={age}", stdout=out)
    assert "Deleted 0 run(s)" in out.getvalue()
    assert len(runs(db, name)) == 1


def test_prune_refuses_an_empty_database_alias():
    with pytest.raises(CommandError) as raised:
        call_command("pglock_prune", "--older-than=1d", "--database=")
    assert raised.value.returncode == EXIT_USAGE
    assert "--database '': no such database alias" in str(raised.value)


# -- locked_run --schedule ----------------------------------------------------------------


def test_locked_run_refuses_an_empty_schedule(procs, db, tmp_path):
    marker = tmp_path / "ran"
    result = procs.run_django(
        "locked_run", "--schedule", "", "--shell", "--",
        sys.executable, "-c", WRITE_ARGUMENT, marker, "x",
    )  # fmt: skip
    assert_usage_error(result, "schedule=''")
    assert not marker.exists()


def test_locked_run_help_names_the_schedule_extra(procs):
    result = procs.run_django("locked_run", "--help")
    assert result.returncode == 0, result.stderr
    assert "cronsim" in result.stdout
    assert "croniter" not in result.stdout


# -- grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "kind"), [(5, "an int"), ([("STALE_AFTER", 60)], "a list"), ("x", "a str")]
)
def test_settings_not_a_dict_names_the_type_with_its_article(configured, kind):
    with override_settings(DJANGO_PGLOCK=configured):
        (message,) = checks.check_settings()
    assert message.msg == f"DJANGO_PGLOCK is {kind}, not a dict."


# -- migrate on a fresh database ----------------------------------------------------------

CALL_MIGRATE = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", skip_checks=False)  # call_command skips checks by default
"""


@pytest.fixture
def fresh_database(pg_url, child_env):
    """An empty database on the suite's server, and the environment of a child using it."""
    name = f"fresh_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name, {**child_env, ENV_TEST_DB_NAME: name}
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.mark.parametrize("how", ["manage.py", "call_command"])
def test_migrate_on_a_fresh_database_does_not_say_run_migrate(procs, pg_url, fresh_database, how):
    name, env = fresh_database
    # The check itself works on that database: before migrate, W002 says to run it.
    before = procs.start(sys.executable, "-m", "django", "check", "--database", "default", env=env)
    before = before.result()
    assert before.returncode == 0, before.stderr
    assert "django_pglock.W002" in before.stdout + before.stderr

    if how == "manage.py":
        migrate = procs.start(sys.executable, "-m", "django", "migrate", env=env)
    else:
        migrate = procs.start(sys.executable, "-c", CALL_MIGRATE, env=env)
    result = migrate.result(timeout=180)
    assert result.returncode == 0, result.stderr
    assert "Applying django_pglock.0001_initial... OK" in result.stdout
    assert "W002" not in result.stdout + result.stderr, result.stdout + result.stderr
    with psycopg.connect(pg_url, dbname=name, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('django_pglock_joblock')").fetchone() == (
            "django_pglock_joblock",
        )
