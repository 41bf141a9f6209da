"""Errors a user can act on (issue 11, items 7 and 8): the management commands, run as real
subprocesses, report a database they cannot use in one line that names the alias and the
cause, exit 2, show no traceback (unless ``--traceback``) and never the password; options
are explained in command-line terms."""

from __future__ import annotations

import socket
import sys
import uuid

import psycopg
import pytest
from psycopg import sql

from tests.procs import Procs
from tests.settings import ENV_TEST_DB_NAME
from tests.subprocs import open_db

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

PASSWORD = "pw-Sup3r-s3cret"
COMMANDS = [
    ("locked_run", "--shell", "--", sys.executable, "-c", "pass"),
    ("locked_run", "--wait", "--timeout", "5", "--shell", "--", sys.executable, "-c", "pass"),
    ("pglock_status",),
    ("pglock_status", "--json", "--check"),
    ("pglock_release", "some-lock"),
    ("pglock_prune", "--older-than", "30d"),
]


def closed_port():
    """A local TCP port nobody listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def nologin_role(pg_url):
    """A role that exists but may not log in: the server itself refuses the session."""
    role = f"pglock_nologin_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} NOLOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(PASSWORD)
            )
        )
        try:
            yield role
        finally:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def env_with_url(child_env, url):
    env = dict(child_env)
    env["DATABASE_URL"] = url
    env.pop(ENV_TEST_DB_NAME, None)
    return env


def unusable_urls(pg_url, role):
    info = psycopg.conninfo.conninfo_to_dict(pg_url)
    host, port = info.get("host", "127.0.0.1"), info.get("port", "5432")
    if host.startswith("/"):  # a socket directory: the refused role still goes over it
        refused = f"postgresql://{role}:{PASSWORD}@/{info.get('dbname', 'postgres')}?host={host}"
    else:
        refused = f"postgresql://{role}:{PASSWORD}@{host}:{port}/{info.get('dbname', 'postgres')}"
    return {
        "unreachable": f"postgresql://app:{PASSWORD}@127.0.0.1:{closed_port()}/app",
        "login refused": refused,
    }


def assert_one_line_exit_2(result, *words):
    """Exit 2 and one line; a waiting ``locked_run --wait`` may also log, as the library's
    warnings do, that it waits out the outage (lines starting with ``django_pglock:``)."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith("django_pglock: waiting for lock")
    ]
    assert len(lines) == 1, out
    assert "Traceback" not in out
    assert PASSWORD not in out
    for word in words:
        assert word in lines[0], out
    return lines[0]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_a_database_that_cannot_be_used_is_one_line_and_exit_2(
    argv, child_env, pg_url, nologin_role
):
    for why, url in unusable_urls(pg_url, nologin_role).items():
        with Procs(env_with_url(child_env, url)) as procs:
            result = procs.run_django(*argv)
        line = assert_one_line_exit_2(result, "'default'")
        if why == "login refused":
            assert "not permitted to log in" in line, line
        else:
            assert "refused" in line.lower() and "server is up" in line, line


def test_traceback_shows_the_cause_on_request(child_env, pg_url, nologin_role):
    url = unusable_urls(pg_url, nologin_role)["unreachable"]
    with Procs(env_with_url(child_env, url)) as procs:
        result = procs.run_django("pglock_status", "--traceback")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "OperationalError" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr


def test_check_with_database_reports_an_unreachable_lock_database(child_env, pg_url, nologin_role):
    url = unusable_urls(pg_url, nologin_role)["unreachable"]
    with Procs(env_with_url(child_env, url)) as procs:
        result = procs.run_django("check", "--database", "default")
    assert result.returncode == 1
    assert "django_pglock.E013" in result.stderr and "'default'" in result.stderr
    assert "Traceback" not in result.stderr
    assert PASSWORD not in result.stdout + result.stderr


# -- item 8: CLI messages in CLI terms ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (("locked_run", "--timeout", "3", "--shell", "--", "true"), "--timeout 3 needs --wait"),
        (("locked_run", "--database", "nope", "--shell", "--", "true"), "--database nope:"),
        (("locked_run", "--database", "sqlite", "--shell", "--", "true"), "--database sqlite:"),
        (("pglock_status", "--database", "nope"), "--database nope:"),
        (("pglock_release", "x", "--database", "nope"), "--database nope:"),
        (("pglock_prune", "--older-than", "1d", "--database", "nope"), "--database nope:"),
    ],
)
def test_options_are_explained_in_command_line_terms(procs, argv, expected):
    result = procs.run_django(*argv)
    line = assert_one_line_exit_2(result, expected)
    assert "using=" not in line and "blocking=" not in line and "timeout=" not in line


def test_a_wait_that_expires_says_it_gave_up_and_who_holds(procs, pg_url, test_db_name):
    from django_pglock import Lock

    name = f"cli-wait-{uuid.uuid4().hex[:8]}"
    lease = Lock(name, description="manage.py rebuild_index --full").try_acquire()
    assert lease is not None
    try:
        program = ("--shell", "--", sys.executable, "-c", "pass")
        skipped = procs.run_django("locked_run", "--name", name, *program)
        gave_up = procs.run_django(
            "locked_run", "--name", name, "--wait", "--timeout", "0.5", *program
        )
    finally:
        lease.release()
    assert skipped.returncode == 0 and gave_up.returncode == 0
    (skip_line,) = skipped.stderr_lines
    assert skip_line.startswith("Skipped") and "Gave up" not in skip_line
    (line,) = gave_up.stderr_lines
    assert line.startswith("Gave up on") and "after waiting 0." in line, line
    assert "--timeout 0.5" in line
    for detail in (name, lease.holder, f"token {lease.token}", "rebuild_index --full"):
        assert detail in line, line
        assert detail in skip_line, skip_line
    with open_db(pg_url, test_db_name) as conn:
        assert conn.execute(
            "SELECT count(*) FROM django_pglock_joblock WHERE name = %s", [name]
        ).fetchone() == (0,)


# -- issue 12, item 6: a multi-host DSN says what each host answered -----------------------


@pytest.mark.slow
def test_a_multi_host_failure_names_each_hosts_answer():
    from django_pglock.failures import describe_hosts
    from tests import faultkit

    server = faultkit.shared_server()  # on TCP: a second host of the same DSN
    role = f"pglock_nologin_{uuid.uuid4().hex[:8]}"
    with server.connect("postgres") as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} NOLOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(PASSWORD)
            )
        )
        try:
            dead = closed_port()
            params = {
                "host": "127.0.0.1,127.0.0.1",
                "port": f"{dead},{server.port}",
                "user": role,
                "password": PASSWORD,
                "dbname": "postgres",
                "connect_timeout": 5,
            }
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(**params)
            said = describe_hosts(params, psycopg.connect)
        finally:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    first, second = said.split("; ")
    assert first.startswith(f"127.0.0.1:{dead}: ") and "refused" in first.lower(), said
    assert second.startswith(f"127.0.0.1:{server.port}: "), said
    assert "not permitted to log in" in second, said
    assert PASSWORD not in said
    assert describe_hosts({**params, "host": "127.0.0.1", "port": str(dead)}, None) is None
