"""A holder that is gone shows as ``abandoned``, not as a lock in alert (issue 11, item 1).

The holder is a real process killed with SIGKILL; ``pglock_status`` runs as a real
subprocess against the same server.
"""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from django.contrib.auth.models import User
from django.db import connections
from django.urls import reverse

from django_pglock import Lock, signals
from django_pglock.models import JobRun
from django_pglock.operations import abandoned_grants, lock_status
from tests.subprocs import Received, key_free, open_db, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

HOLDERS = reverse("admin:django_pglock_joblock_changelist")

# Holds `name` (advisory on or off, as argv[2] says), says HELD, then waits to be killed.
HOLD_UNTIL_KILLED = """
import sys, time
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True, advisory=sys.argv[2] == "on").try_acquire()
assert lease is not None
print("HELD", lease.token, flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture
def sql_db(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        yield conn


def unique(label):
    return f"gone-{label}-{uuid.uuid4().hex[:8]}"


def start_holder(procs, name, advisory="on"):
    proc = procs.python(HOLD_UNTIL_KILLED, name, advisory)
    word, token = proc.read_line().split()
    assert word == "HELD"
    return proc, int(token)


def kill_and_wait_for_the_session_to_end(proc, sql_db, name):
    proc.kill()
    proc.wait()
    wait_until(lambda: key_free(sql_db, name), 30, "the killed holder's session to end")


def status_by_name(procs, *args):
    result = procs.run_django("pglock_status", "--json", *args)
    assert result.stdout.startswith("["), result.stderr
    return result, {row["name"]: row for row in json.loads(result.stdout)}


def test_a_killed_advisory_holder_is_abandoned_not_in_alert(procs, sql_db):
    name = unique("killed")
    live = unique("live")
    proc, token = start_holder(procs, name)
    other, other_token = start_holder(procs, live)
    # Old enough for an alert by its own thresholds: only the dead holder's session matters.
    sql_db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - interval '45 seconds'"
        " WHERE name = %s",
        [name],
    )
    _, rows = status_by_name(procs)
    assert rows[name]["state"] == "alert"  # alive: a late heartbeat is worth an alert
    assert rows[live]["state"] == "ok"

    kill_and_wait_for_the_session_to_end(proc, sql_db, name)

    checked, rows = status_by_name(procs, "--check")
    assert checked.returncode == 0, checked.stderr  # nothing to page anyone about
    assert rows[name]["state"] == "abandoned"
    assert rows[name]["token"] == token
    assert rows[live]["state"] == "ok"  # a live holder in another process stays ok

    table = procs.run_django("pglock_status")
    (line,) = [line for line in table.stdout.splitlines() if line.startswith(name)]
    assert "ABANDONED" in line
    assert "next contender takes the lock at once" in table.stdout

    # The run of the dead holder is closed as lost; the live one still runs.
    assert JobRun.objects.get(name=name, token=token).outcome == JobRun.Outcome.LOST
    assert JobRun.objects.get(name=live, token=other_token).outcome == JobRun.Outcome.RUNNING
    # And it is true: the next contender takes it at once.
    successor = Lock(name).try_acquire()
    assert successor is not None
    successor.release()
    other.kill()


def test_abandoned_sends_no_lock_alert_but_stale_still_does(procs, sql_db):
    name = unique("no-alert")
    proc, _ = start_holder(procs, name)
    sql_db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - interval '1 hour'"
        " WHERE name = %s",
        [name],
    )
    with Received(signals.lock_alert) as received:
        (row,) = [row for row in lock_status() if row.name == name]
    assert row.state == "stale" and [k["name"] for k in received.calls] == [name]
    kill_and_wait_for_the_session_to_end(proc, sql_db, name)
    with Received(signals.lock_alert) as received:
        (row,) = [row for row in lock_status() if row.name == name]
    assert row.state == "abandoned"
    assert received.calls == []


def test_a_dead_holder_on_the_table_path_is_not_called_abandoned(procs, sql_db):
    # Without the advisory key nobody can take the name before stale_after: saying
    # "the next contender takes it at once" would be false.
    name = unique("table-path")
    proc, _ = start_holder(procs, name, advisory="off")
    proc.kill()
    proc.wait()
    (row,) = [row for row in lock_status() if row.name == name]
    assert row.state == "ok"
    assert Lock(name).try_acquire() is None


def test_a_live_holder_in_this_process_is_never_abandoned():
    lease = Lock(unique("mine"), record=True).try_acquire()
    try:
        (row,) = lock_status()
        assert row.state == "ok" and row.advisory
        assert abandoned_grants("default") == ([], [])
    finally:
        lease.release()
    (run,) = JobRun.objects.filter(name=lease.name)
    assert run.outcome == JobRun.Outcome.SUCCEEDED


def test_clean_releases_racing_the_abandoned_check_are_never_closed_as_lost():
    # A release gives its key back in the statement that deletes the row: for that
    # instant the row is there and the key is free. Status must not call it abandoned,
    # nor close its run as lost.
    name = unique("race")
    stop = threading.Event()
    seen: list[tuple[list[str], list[int]]] = []

    def look() -> None:
        try:
            while not stop.is_set():
                seen.append(abandoned_grants("default"))
        finally:
            connections["default"].close()  # this thread's own connection

    looker = threading.Thread(target=look)
    looker.start()
    try:
        lock = Lock(name, record=True)
        for _ in range(300):
            lease = lock.try_acquire()
            assert lease is not None
            lease.release()
    finally:
        stop.set()
        looker.join()
    outcomes = set(JobRun.objects.filter(name=name).values_list("outcome", flat=True))
    assert outcomes == {JobRun.Outcome.SUCCEEDED}
    assert len(seen) > 10
    assert all(names == [] for names, _ in seen)


def test_admin_shows_and_filters_abandoned(procs, sql_db, client):
    name = unique("admin")
    live = unique("admin-live")
    proc, _ = start_holder(procs, name)
    lease = Lock(live).try_acquire()
    try:
        kill_and_wait_for_the_session_to_end(proc, sql_db, name)
        client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
        page = client.get(HOLDERS).content.decode()
        assert "abandoned" in page
        only = client.get(HOLDERS, {"state": "abandoned"}).content.decode()
        assert name in only and live not in only
        fine = client.get(HOLDERS, {"state": "ok"}).content.decode()
        assert live in fine and name not in fine
        alert = client.get(HOLDERS, {"state": "alert"}).content.decode()
        assert name not in alert
    finally:
        lease.release()
