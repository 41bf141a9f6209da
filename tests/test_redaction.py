"""Redaction of stored command lines and descriptions: what is masked, what is kept.

The tables are the specification: each secret form is written as the program receives
it (a list of argv words) with the description it must become; each harmless command
line must come out unchanged. ``redact_argv`` is what ``locked_run`` and the default
description use; ``redact`` is applied to free text (``Lock(description=...)``) and must
leave ``redact_argv``'s output as it is, since a ``locked_run`` description goes through
both. The last tests run ``locked_run`` and a ``Lock`` in real processes against the real
server and read what was stored.
"""

from __future__ import annotations

import sys
import uuid

import psycopg
import pytest

from django_pglock.identity import redact
from django_pglock.redaction import redact_argv

SECRET_ARGV = [
    # curl
    (["curl", "-u", "user:pa55", "https://api.example"], "curl -u user:*** https://api.example"),
    (["curl", "--user", "user:pa55"], "curl --user user:***"),
    (["curl", "--user=user:pa55"], "curl --user=user:***"),
    (["curl", "-uuser:pa55"], "curl -uuser:***"),
    (
        ["curl", "-H", "Authorization: Bearer xyz-pa55", "https://api.example"],
        "curl -H Authorization: Bearer *** https://api.example",
    ),
    (["curl", "-HAuthorization: Bearer xyz-pa55"], "curl -HAuthorization: Bearer ***"),
    (
        ["curl", "--header=Authorization: Basic dXNlcjpwYTU1"],
        "curl --header=Authorization: Basic ***",
    ),
    (["curl", "-H", "X-Api-Key: pa55"], "curl -H X-Api-Key: ***"),
    (
        ["curl", "-d", '{"password": "pa55", "user": "bob"}'],
        'curl -d {"password": ***, "user": "bob"}',
    ),
    # long options, = or the next word (spaces and all)
    (["backup", "--password", "correct horse pa55"], "backup --password ***"),
    (["backup", "--password=correct horse pa55"], "backup --password=***"),
    (["backup", "--db-password", "pa55"], "backup --db-password ***"),
    (["backup", "--pass", "pa55"], "backup --pass ***"),
    (["backup", "--pass=pa55"], "backup --pass=***"),
    (["ssh-tool", "--private-key=pa55"], "ssh-tool --private-key=***"),
    (["ssh-tool", "--private-key", "pa55"], "ssh-tool --private-key ***"),
    (["tool", "--api-key", "pa55"], "tool --api-key ***"),
    (["tool", "--apikey=pa55"], "tool --apikey=***"),
    (["tool", "--auth-token", "pa55"], "tool --auth-token ***"),
    (["tool", "--client-secret", "pa55"], "tool --client-secret ***"),
    (["httpie", "--auth", "bob:pa55"], "httpie --auth ***"),
    (["sentry", "--dsn", "https://k@sentry.example/1pa55"], "sentry --dsn ***"),
    (["gotool", "-token", "pa55"], "gotool -token ***"),
    (["gotool", "-password=pa55"], "gotool -p***"),
    # short options of well-known tools
    (["redis-cli", "-a", "pa55", "ping"], "redis-cli -a *** ping"),
    (["mysql", "-pPa55w0rd", "shop"], "mysql -p*** shop"),
    (["mysqldump", "-u", "root", "-pPa55w0rd", "shop"], "mysqldump -u root -p*** shop"),
    # environment, conninfo, URLs
    (["env", "PGPASSWORD=pa55", "psql"], "env PGPASSWORD=*** psql"),
    (["env", "PGPASSWORD=correct horse pa55", "psql"], "env PGPASSWORD=*** psql"),
    (["env", "MYSQL_PWD=pa55", "mysql"], "env MYSQL_PWD=*** mysql"),
    (["env", "AWS_SECRET_ACCESS_KEY=pa55", "aws"], "env AWS_SECRET_ACCESS_KEY=*** aws"),
    (["env", "aws_secret_access_key=pa55"], "env aws_secret_access_key=***"),
    (
        ["aws", "configure", "set", "aws_secret_access_key", "pa55"],
        "aws configure set aws_secret_access_key ***",
    ),
    (
        ["psql", "host=db password=pa55 dbname=app"],
        "psql host=db password=*** dbname=app",
    ),
    (
        ["psql", "host=db password='correct horse pa55' dbname=app"],
        "psql host=db password=*** dbname=app",
    ),
    (["pg_dump", "postgres://user:pa55@db/app"], "pg_dump postgres://user:***@db/app"),
    (["redis-cli", "-u", "redis://:pa55@cache:6379"], "redis-cli -u redis://:***@cache:6379"),
    (["pg_dump", "postgres://user:p@55@db/app"], "pg_dump postgres://user:***@db/app"),
    (
        ["curl", "https://api.example/v1?password=pa55&page=2"],
        "curl https://api.example/v1?password=***&page=2",
    ),
    (
        ["curl", "https://api.example/v1?page=2&token=pa55"],
        "curl https://api.example/v1?page=2&token=***",
    ),
    (
        ["curl", "https://api.example/v1?access_token=pa55"],
        "curl https://api.example/v1?access_token=***",
    ),
    (["curl", "https://maps.example/api?key=pa55"], "curl https://maps.example/api?key=***"),
    # inside one word, as a shell runs it
    (
        ["sh", "-c", "mysql -pPa55w0rd shop && curl -u me:pa55 https://x"],
        "sh -c mysql -p*** shop && curl -u me:*** https://x",
    ),
    (
        ["sh", "-c", "backup --password 'correct horse pa55' --full"],
        "sh -c backup --password *** --full",
    ),
]

HARMLESS_ARGV = [
    ["manage.py", "nightly_report", "--verbosity", "2", "--date=2024-01-01", "--tenant", "42"],
    ["python", "-m", "worker", "--name", "report", "--timeout", "30", "--blocking"],
    ["/usr/bin/backup", "--full", "/var/lib/data"],
    # -p apart from its value is a port (ssh, psql, docker); MySQL's -p never takes the
    # next word
    ["ssh", "-p", "2222", "backup@host"],
    ["psql", "-U", "postgres", "-h", "db", "-p", "5432", "app"],
    ["mkdir", "-p", "/tmp/reports"],
    ["find", "/backups", "-path", "*/old", "-prune", "-o", "-print"],
    # names that only contain a secret-ish word
    ["tool", "--pattern", "x"],
    ["tool", "--tokenizer", "bert"],
    ["tool", "--max-tokens", "100"],
    ["tool", "--passes", "3"],
    ["tool", "--bypass-cache", "now"],
    ["tool", "--author", "alice"],
    ["tool", "--sort-key", "name"],
    ["tool", "--primary-key", "id"],
    ["echo", "password", "reset", "token", "sent"],
    # flags that take no value
    ["psql", "--no-password", "app"],
    ["docker", "login", "--password-stdin", "registry.example"],
    ["git", "commit", "-a", "-m", "nightly"],
    ["sort", "-u", "names.txt"],
    # a user name alone, an e-mail address, a URL without credentials, PWD
    ["curl", "--user", "alice", "https://example.com/path?page=2"],
    ["mail", "user@example.com"],
    ["git", "clone", "ssh://git@github.com/x/y"],
    ["env", "PWD=/tmp", "TZ=UTC", "time=10:30"],
    ["curl", "-H", "Content-Type: application/json", "localhost:8000"],
]

SECRET_TEXT = [
    ("--password=x1", "--password=***"),
    ("manage.py run --password=x1 --verbosity 2", "manage.py run --password=*** --verbosity 2"),
    ("--db-password x1", "--db-password ***"),
    ("run --password 'correct horse x1' now", "run --password *** now"),
    ('run --password "correct horse x1" now', "run --password *** now"),
    ("Authorization: Bearer x1 sent", "Authorization: Bearer *** sent"),
    ("password: x1", "password: ***"),
    ("API_TOKEN=x1", "API_TOKEN=***"),
    ("SENTRY_DSN=https://k@sentry.example/x1", "SENTRY_DSN=***"),
    ("host=db password=x1 dbname=app", "host=db password=*** dbname=app"),
    ("aws_secret_access_key = x1", "aws_secret_access_key = ***"),
    (
        "postgresql+psycopg://user:p%40x1@db.example:5432/app?sslmode=require",
        "postgresql+psycopg://user:***@db.example:5432/app?sslmode=require",
    ),
]

HARMLESS_TEXT = [
    "Nightly report for tenant 42: rebuild the search index",
    "locked_run --shell -- /usr/bin/backup --full /var/lib/data",
    "python -m worker --name report --timeout 30 --blocking",
    "https://example.com/path?page=2",
    "reset the password of user 42",
]


def _secret_left(shown):
    return "pa55" in shown or "horse" in shown or "dXNlcjpwYTU1" in shown


@pytest.mark.parametrize(
    ("argv", "expected"), [pytest.param(*case, id=" ".join(case[0])[:50]) for case in SECRET_ARGV]
)
def test_redact_argv_masks_secrets(argv, expected):
    shown = redact_argv(argv)
    assert shown == expected
    assert not _secret_left(shown), shown  # nothing of the secret is left
    assert redact(shown) == shown  # a locked_run description goes through both


@pytest.mark.parametrize("argv", HARMLESS_ARGV, ids=lambda argv: " ".join(argv)[:50])
def test_redact_argv_keeps_harmless_command_lines(argv):
    shown = redact_argv(argv)
    assert shown == " ".join(argv)
    assert redact(shown) == shown


@pytest.mark.parametrize(
    ("text", "expected"), [pytest.param(*case, id=case[0][:50]) for case in SECRET_TEXT]
)
def test_redact_masks_secrets_in_free_text(text, expected):
    assert redact(text) == expected
    assert "x1" not in redact(text) and "horse" not in redact(text)


@pytest.mark.parametrize("text", HARMLESS_TEXT)
def test_redact_keeps_harmless_free_text(text):
    assert redact(text) == text


def test_redact_argv_shows_undecodable_bytes_and_never_raises():
    argv = ["printf", "report-\udcff.csv", "--password", "pa55\udcfe", "lone-\ud800"]
    shown = redact_argv(argv)
    assert shown == "printf report-\\xff.csv --password *** lone-\\ud800"
    shown.encode("utf-8")  # storable


# -- what is stored, from real processes ----------------------------------------------------


@pytest.fixture
def db(pg_url, test_db_name):
    with psycopg.connect(pg_url, dbname=test_db_name, autocommit=True) as conn:
        yield conn


def stored_run(db, name):
    return db.execute(
        "SELECT description, outcome FROM django_pglock_jobrun WHERE name = %s", [name]
    ).fetchone()


SECRET_WORDS = [
    "--password",
    "correct horse pa55",
    "-H",
    "Authorization: Bearer pa55",
    "-u",
    "user:pa55",
    "-a",
    "pa55",
    "-pPa55w0rd",
    "PGPASSWORD=pa55",
    "postgres://u:pa55@h/db",
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_locked_run_stores_its_command_line_redacted(procs, db):
    name = f"redact-{uuid.uuid4().hex[:8]}"
    program = [sys.executable, "-c", "pass"]
    result = procs.run_django(
        "locked_run", "--name", name, "--shell", "--", *program, *SECRET_WORDS
    )
    assert result.returncode == 0, result.stderr
    description, outcome = stored_run(db, name)
    assert outcome == "succeeded"
    assert description.endswith(
        "-c pass --password *** -H Authorization: Bearer *** -u user:*** -a *** -p*** "
        "PGPASSWORD=*** postgres://u:***@h/db"
    ), description
    assert not _secret_left(description) and "Pa55w0rd" not in description


HOLD_AND_RELEASE = """
import sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True).try_acquire()
assert lease is not None
lease.release()
"""


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_default_description_is_the_command_line_redacted_word_by_word(procs, db):
    """A lock with no description= stores this process's command line (@singleton_job)."""
    name = f"redact-{uuid.uuid4().hex[:8]}"
    result = procs.python(HOLD_AND_RELEASE, name, *SECRET_WORDS).result()
    assert result.returncode == 0, result.stderr
    description, outcome = stored_run(db, name)
    assert outcome == "succeeded"
    assert description == f"-c {name} {redact_argv(SECRET_WORDS)}"
    assert not _secret_left(description) and "Pa55w0rd" not in description
