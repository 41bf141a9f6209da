"""The lock connection applies what Django's backend applies to each new connection:
``OPTIONS["assume_role"]`` (``SET ROLE``) and the connection's time zone.

The roles are real: a login role that may use the lock tables only through ``SET ROLE``
to an owner role (it does not inherit its rights), as with short-lived credentials from a
secrets manager.
"""

from __future__ import annotations

import contextlib
import copy
import uuid

import psycopg
import pytest
from django.db import connections
from psycopg import sql

from django_pglock import Lock, LockError
from django_pglock import connection as connection_module
from django_pglock.heartbeat import registry
from django_pglock.models import JobLock, JobRun
from django_pglock.schedule import ScheduleSlot
from tests.subprocs import open_db

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

PASSWORD = "role-s3cret"


@pytest.fixture
def roles(pg_url, test_db_name):
    """(login role, owner role): the owner holds the privileges on the test database's
    tables and sequences; the login role is a member that does not inherit them."""
    suffix = uuid.uuid4().hex[:8]
    login, owner = f"pglock_login_{suffix}", f"pglock_owner_{suffix}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(owner)))
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN NOINHERIT PASSWORD {}").format(
                sql.Identifier(login), sql.Literal(PASSWORD)
            )
        )
        admin.execute(
            sql.SQL("GRANT {} TO {}").format(sql.Identifier(owner), sql.Identifier(login))
        )
    with open_db(pg_url, test_db_name) as db:
        for grant in (
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}",
            "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {}",
        ):
            db.execute(sql.SQL(grant).format(sql.Identifier(owner)))
    try:
        yield login, owner
    finally:
        with open_db(pg_url, test_db_name) as db:
            db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(owner)))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            for role in (login, owner):
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def alias_as():
    """Database aliases on the test database, logging in as a given role with OPTIONS of
    the test's choosing; their Django and lock connections are closed afterwards."""
    made = []

    def make(user, password, **options):
        alias = f"role_{uuid.uuid4().hex[:8]}"
        settings_dict = copy.deepcopy(connections["default"].settings_dict)
        settings_dict.update(USER=user, PASSWORD=password)
        settings_dict["OPTIONS"] = {**settings_dict.get("OPTIONS", {}), **options}
        connections.settings[alias] = settings_dict
        made.append(alias)
        return alias

    yield make
    for alias in made:
        with registry()._lock:
            registry()._leases.pop(alias, None)
        conn = connection_module._registry.pop(alias, None)
        if conn is not None:
            conn.close()
        with contextlib.suppress(Exception):
            connections[alias].close()
            del connections[alias]
        del connections.settings[alias]


def test_assume_role_is_applied_to_the_lock_connection(roles, alias_as):
    login, owner = roles
    alias = alias_as(login, PASSWORD, assume_role=owner)
    # Acquire (with its run record), a schedule claim, release: every table, as the owner.
    lock = Lock(f"as-owner-{uuid.uuid4().hex[:8]}", using=alias, record=True)
    lease = lock.try_acquire()
    assert lease is not None
    assert JobLock.objects.filter(name=lock.name, token=lease.token).exists()
    assert ScheduleSlot("* * * * *", lock.name, using=alias).claim()
    lease.release()
    assert JobRun.objects.get(name=lock.name).outcome == "succeeded"
    conn = connection_module.get_connection(alias)
    assert conn.execute("SELECT current_user, session_user", {}) == [(owner, login)]
    # A session opened again (after a network failure, say) takes the role again.
    conn.close()
    with lock.acquire(blocking=False) as again:
        assert again is not None
    assert conn.execute("SELECT current_user", {}) == [(owner,)]


def test_without_assume_role_the_login_role_has_no_rights(roles, alias_as):
    """What the test above would meet if the role were not applied (as before)."""
    login, _ = roles
    alias = alias_as(login, PASSWORD)
    with pytest.raises(LockError, match="permission denied"):
        Lock("no-role", using=alias).try_acquire()


def test_a_role_the_login_role_cannot_take_is_a_clear_error(roles, alias_as, pg_url):
    login, _ = roles
    other = f"pglock_other_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(other)))
    try:
        alias = alias_as(login, PASSWORD, assume_role=other)
        with pytest.raises(LockError) as excinfo:
            Lock("wrong-role", using=alias).try_acquire()
        message = str(excinfo.value)
        assert f"OPTIONS['assume_role'] = {other!r}" in message
        assert alias in message and "permission denied" in message
        assert PASSWORD not in message
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(other)))


def test_the_lock_connection_takes_djangos_time_zone(alias_as, pg_url, settings):
    """Django sets its time zone (UTC with USE_TZ) on each connection, whatever the
    server's or the OPTIONS' default; the lock session does the same."""
    assert settings.USE_TZ
    default = connections["default"].settings_dict
    alias = alias_as(default["USER"], default["PASSWORD"], options="-c TimeZone=Asia/Tokyo")
    with psycopg.connect(pg_url, options="-c TimeZone=Asia/Tokyo") as plain:
        assert plain.execute("SHOW TimeZone").fetchone() == ("Asia/Tokyo",)
    assert connections[alias].timezone_name == "UTC"
    conn = connection_module.get_connection(alias)
    assert conn.execute("SHOW TimeZone", {}) == [("UTC",)]
    lease = Lock("time-zone", using=alias).try_acquire()
    assert lease is not None
    assert lease.acquired_at.utcoffset().total_seconds() == 0
    lease.release()
