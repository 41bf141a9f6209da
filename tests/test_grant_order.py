"""Tokens follow grants, and a retried release never frees a newer holder's key.

Two ways one name could get two holders, or tokens that go down, found by the stress test
on a loaded machine and made deterministic here with triggers on the real server (a test
fixture, dropped afterwards):

* An acquire whose statement paused between ``nextval`` and its insert (a busy machine)
  let another process's whole grant and release pass, then inserted its older token: the
  name's tokens went down (a write fenced with the newer token would pass after a write
  with the older one). A ``BEFORE INSERT`` trigger holds the first statement at exactly
  that point.
* A release statement that failed after its ``pg_advisory_unlock`` ran (an unlock is not
  undone by the rollback) left the row behind and the key free; this process took the
  name again, and the release's retry unlocked the new holder's key: any contender then
  took over at once, two holders. An ``AFTER DELETE`` trigger fails the release after its
  unlock, as long as the test wants.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from django_pglock import Lock, LockError
from django_pglock.sql import advisory_key
from django_pglock.states import State
from tests.subprocs import key_free, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

TABLE = "django_pglock_joblock"
PAUSE = "pglock-test-pause-insert"  # description of the acquire the trigger holds
HOLD_KEY = 0x7E57_0001  # the bigint advisory key the test holds while the insert waits


def unique(label):
    return f"order-{label}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def paused_insert(db):
    """A trigger that holds an insert described PAUSE until the test lets it go."""
    db.execute(
        f"""
        CREATE FUNCTION pglock_test_pause() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.description = '{PAUSE}' THEN
                PERFORM pg_advisory_lock({HOLD_KEY});
                PERFORM pg_advisory_unlock({HOLD_KEY});
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER pglock_test_pause BEFORE INSERT ON {TABLE}
            FOR EACH ROW EXECUTE FUNCTION pglock_test_pause();
        """
    )
    try:
        yield
    finally:
        db.execute(
            f"DROP TRIGGER IF EXISTS pglock_test_pause ON {TABLE};"
            "DROP FUNCTION IF EXISTS pglock_test_pause();"
        )


@pytest.fixture
def failing_release(db):
    """A trigger that fails every delete of a row while its name is in the flag table."""
    db.execute(
        f"""
        CREATE TABLE pglock_test_fail (name text PRIMARY KEY);
        CREATE FUNCTION pglock_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM pglock_test_fail f WHERE f.name = OLD.name) THEN
                RAISE EXCEPTION 'test: this release fails after its unlock';
            END IF;
            RETURN OLD;
        END $$;
        CREATE TRIGGER pglock_test_fail AFTER DELETE ON {TABLE}
            FOR EACH ROW EXECUTE FUNCTION pglock_test_fail();
        """
    )
    try:
        yield
    finally:
        db.execute(
            f"DROP TRIGGER IF EXISTS pglock_test_fail ON {TABLE};"
            "DROP FUNCTION IF EXISTS pglock_test_fail(); DROP TABLE IF EXISTS pglock_test_fail;"
        )


def backend_waits_on_advisory(db, exclude):
    """Backends (other than ``exclude``) waiting for an advisory lock right now."""
    rows = db.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND pid <> ALL(%s)",
        [list(exclude)],
    ).fetchall()
    return {pid for (pid,) in rows}


def test_a_paused_acquire_never_grants_an_older_token_after_a_newer_grant(db, paused_insert, procs):
    """Before: the paused statement's token 1 was granted after a contender's grant and
    release with token 2 (the contender said ACQUIRED while the first was paused)."""
    name = unique("paused")
    db.execute("SELECT pg_advisory_lock(%s)", [HOLD_KEY])  # the pause starts closed
    me = db.execute("SELECT pg_backend_pid()").fetchone()[0]
    result = {}

    def first():
        try:
            result["lease"] = Lock(name, description=PAUSE).try_acquire()
        except BaseException as exc:  # pragma: no cover - reported below
            result["error"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        first_pid = wait_until(
            lambda: next(iter(backend_waits_on_advisory(db, [me])), None),
            30,
            f"the first acquire never reached its insert: {result}",
        )
        contender = procs.child("try", "--name", name)
        # The contender either finishes (granted while the first is paused: the bug) or
        # waits for the first's statement to end.
        wait_until(
            lambda: (
                contender.popen.poll() is not None or backend_waits_on_advisory(db, [me, first_pid])
            ),
            30,
            "the contender neither finished nor waited",
        )
    finally:
        db.execute("SELECT pg_advisory_unlock(%s)", [HOLD_KEY])
        thread.join(30)
    assert "error" not in result, result
    lease = result["lease"]
    assert lease is not None, "the first acquire was refused: nobody else held the name"
    said = contender.result(30).stdout.split()
    try:
        if said[0] == "ACQUIRED":
            assert int(said[1]) < lease.token, (
                f"token {said[1]} was granted and released before token {lease.token}'s grant"
            )
        else:
            assert said == ["REFUSED"], said
        assert db.execute(f"SELECT token FROM {TABLE} WHERE name = %s", [name]).fetchone() == (
            lease.token,
        )
    finally:
        lease.release()


def test_a_retried_release_never_frees_the_key_of_the_next_lease_of_its_session(
    db, failing_release, procs
):
    """Before: the retry of the failed release unlocked the key the second lease took, and
    a contender took the name from that live holder at once (ACQUIRED)."""
    name = unique("retry")
    first = Lock(name).try_acquire()
    assert first is not None and first.advisory
    db.execute("INSERT INTO pglock_test_fail VALUES (%s)", [name])
    with pytest.raises(LockError, match="retried in the background"):
        first.release()
    # The failed statement gave the key back all the same; its row is still there.
    assert key_free(db, name)
    second = Lock(name).try_acquire()
    assert second is not None, "this process could not take its own abandoned name again"
    try:
        assert second.advisory and second.token > first.token
        db.execute("DELETE FROM pglock_test_fail WHERE name = %s", [name])
        wait_until(lambda: first.state is State.RELEASED, 30, "the first release never settled")
        assert not key_free(db, name), "the retried release freed the second lease's key"
        said = procs.child("try", "--name", name).result(30).stdout.split()
        assert said == ["REFUSED"], f"a contender took the name from a live holder: {said}"
        assert not second.lost
    finally:
        second.release()
    assert key_free(db, name)
    assert db.execute(f"SELECT count(*) FROM {TABLE} WHERE name = %s", [name]).fetchone() == (0,)


def test_the_gate_uses_its_own_key_space(db):
    """The name's gate is a transaction lock on two int4 keys: it never waits for, or
    blocks, the session key of the same name (a bigint key) held by a live holder."""
    name = unique("space")
    key = advisory_key(name)
    db.execute("SELECT pg_advisory_lock(%s)", [key])  # someone holds the session key
    try:
        lease = Lock(name).try_acquire()
        assert lease is not None and not lease.advisory  # granted on the table path
        lease.release()
    finally:
        db.execute("SELECT pg_advisory_unlock(%s)", [key])
