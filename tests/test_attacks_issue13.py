"""Attacks of issue 13: the grant gate, the release's conditional unlock, the admin,
TestCase isolation and the settings, against a real PostgreSQL server."""

from __future__ import annotations

import threading
import uuid

import pytest

from django_pglock import Lock
from django_pglock.operations import force_release
from tests.subprocs import key_free, wait_until

TABLE = "django_pglock_joblock"
LONG = {"heartbeat_interval": 20, "alert_after": 40, "stale_after": 60}


def unique(label):
    return f"i13-{label}-{uuid.uuid4().hex[:8]}"


def in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # pragma: no cover - reported by the caller
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert "error" not in out, out
    return out["value"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_release_of_a_force_released_lease_leaks_the_key_when_its_session_took_the_name_again(
    db, procs
):
    """What the user sees: after an operator's forced release, the same process takes the
    name again (another thread) before the first lease noticed; both leases are released,
    no row is left, yet the process's lock session keeps the name's advisory key for ever.
    Every later holder of the name in another process is then granted on the table path
    (``advisory=False``): when it crashes, contenders wait ``stale_after`` instead of
    taking over at once, and the key can never be adopted.
    """
    name = unique("leak")
    first = Lock(name, **LONG).try_acquire()
    assert first is not None and first.advisory
    assert force_release(name)["token"] == first.token
    # Another thread of this process takes the name again: the key nests (count 2).
    second = in_thread(lambda: Lock(name, **LONG).try_acquire())
    assert second is not None and second.advisory
    first.release()  # deletes nothing; a row of the name says this session holds the key
    in_thread(second.release)
    assert db.execute(f"SELECT count(*) FROM {TABLE} WHERE name = %s", [name]).fetchone() == (0,)
    leaked = not key_free(db, name)
    # What that costs: a holder in another process that crashes keeps the name.
    holder = procs.child("hold", "--name", name)
    holder.expect("ACQUIRED")
    advisory, backend = db.execute(
        f"SELECT advisory, backend_pid FROM {TABLE} WHERE name = %s", [name]
    ).fetchone()
    holder.kill(group=True)
    wait_until(
        lambda: (
            not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend]).fetchone()
        ),
        30,
        "the crashed holder's session never ended",
    )
    said = procs.child("try", "--name", name).result(30).stdout.split()
    assert not leaked and said[:1] == ["ACQUIRED"], (
        f"key still held by this process after both releases: {leaked}; the next holder's "
        f"row advisory={advisory}; after that holder crashed, a contender said {said}"
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"name__regex": "("}, id="regex-unbalanced"),
        pytest.param({"acquired_at__year": "99999"}, id="year-out-of-range"),
    ],
)
def test_a_lookup_the_holders_page_does_not_offer_is_ignored_not_a_500(admin_client, params):
    """What the user sees: README promises that a filter value the page does not offer
    (a typo, an old bookmark) is ignored and the page lists everything. A hand-edited or
    bookmarked query such as ``?name__regex=(`` or ``?acquired_at__year=99999`` instead
    fails with a 500 (DataError: invalid regular expression / ValueError: year out of
    range); only NUL bytes are scrubbed."""
    from django.urls import reverse

    lease = Lock(unique("adm")).try_acquire()
    try:
        response = admin_client.get(reverse("admin:django_pglock_joblock_changelist"), params)
        assert response.status_code in (200, 302), response.status_code
    finally:
        lease.release()


USER_SUITE = """
from django.db import transaction
from django.test import TestCase, TransactionTestCase

from django_pglock import Lock
from django_pglock.models import JobLock, JobRun
from jobsapp.jobs import report


class AFirst(TransactionTestCase):
    def test_a_transaction_test_case_job(self):
        report()
        self.assertEqual(JobRun.objects.count(), 1)


class BNested(TestCase):
    def test_nested_atomic(self):
        with transaction.atomic():
            with transaction.atomic():
                report()
        self.assertEqual(JobRun.objects.count(), 1)

    def test_left_held(self):
        Lock("userproject-held13").try_acquire()

    def test_sees_nothing_of_the_others(self):
        self.assertEqual(JobRun.objects.count(), 0)
        self.assertFalse(JobLock.objects.exists())


class CSetUpTestData(TestCase):
    @classmethod
    def setUpTestData(cls):
        report()

    def test_one(self):
        self.assertEqual(JobRun.objects.count(), 1)
        self.assertFalse(JobLock.objects.exists())
        self.assertIsNotNone(Lock("userproject-held13").try_acquire())


class DAfter(TestCase):
    def test_clean(self):
        self.assertEqual(JobRun.objects.count(), 0)
        self.assertFalse(JobLock.objects.exists())
"""


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("--parallel", "2"), id="parallel-2"),
        pytest.param(("--keepdb",), id="keepdb-twice"),
        pytest.param(("--reverse",), id="reverse"),
    ],
)
def test_a_users_suite_with_mixed_test_cases_passes(
    procs, child_env, test_db_name, pg_url, tmp_path, extra
):
    """What the user sees: ``manage.py test`` of a suite mixing TransactionTestCase,
    nested atomic blocks, setUpTestData and a lease left held fails, or its teardown
    reports the test database in use."""
    import os
    import sys

    import psycopg
    from psycopg import sql as psql

    from tests.procs import REPO_ROOT
    from tests.settings import ENV_TEST_DB_NAME

    (tmp_path / "attack13_user_tests.py").write_text(USER_SUITE)
    test_db = f"test_userproject_{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in child_env.items() if k != ENV_TEST_DB_NAME}
    env.update(
        DJANGO_SETTINGS_MODULE="site_settings",
        USERPROJECT_DB=test_db_name,
        USERPROJECT_TEST_DB=test_db,
        PYTHONPATH=os.pathsep.join([str(tmp_path), env["PYTHONPATH"]]),
    )
    manage = REPO_ROOT / "tests" / "userproject" / "manage.py"
    try:
        for _ in range(2 if "--keepdb" in extra else 1):
            result = procs.start(
                sys.executable, manage, "test", "attack13_user_tests", "-v", "2", *extra, env=env
            ).result(240)
            output = result.stdout + result.stderr
            assert result.returncode == 0, output
            assert "being accessed by other users" not in output, output
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            names = [test_db] + [f"{test_db}_{i}" for i in (1, 2)]
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = ANY(%s)",
                [names],
            )
            for name in names:
                admin.execute(psql.SQL("DROP DATABASE IF EXISTS {}").format(psql.Identifier(name)))


STRESS_CHILD = r"""
import os, random, sys, time
import django
django.setup()
from django_pglock import Lock
names, log, seconds = sys.argv[1].split(","), sys.argv[2], float(sys.argv[3])
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
def say(*words):
    os.write(fd, (" ".join(str(w) for w in words) + "\n").encode())
print("READY", os.getpid(), flush=True)
sys.stdin.readline()
end = time.monotonic() + seconds
errors = 0
while time.monotonic() < end:
    name = random.choice(names)
    lock = Lock(name, poll_interval=0.01, advisory=random.random() < 0.8)
    try:
        if random.random() < 0.5:
            lease = lock.try_acquire()
        else:
            lease = lock.acquire(blocking=True, timeout=2).__enter__()
    except Exception as exc:
        say("ERROR", os.getpid(), name, type(exc).__name__, str(exc).replace("\n", " ")[:200])
        errors += 1
        continue
    if lease is None:
        continue
    say("ENTER", name, lease.token, f"{time.time():.6f}", os.getpid())
    time.sleep(random.uniform(0, 0.003))
    say("EXIT", name, lease.token, f"{time.time():.6f}", os.getpid())
    lease.release()
print("DONE", errors, flush=True)
"""


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("clean_locks")
def test_mixed_contention_on_several_names_keeps_one_holder_and_rising_tokens(db, procs, tmp_path):
    """Invariant pinned (held under attack): 6 processes, 3 names, blocking and
    non-blocking, advisory and table-only attempts mixed: per name one holder at a time,
    tokens rising in grant order, no error or hang on the gate, no key left held."""
    from tests.procs import go_together

    names = [unique(f"mix{i}") for i in range(3)]
    log = tmp_path / "mix.log"
    import sys

    argv = (sys.executable, "-c", STRESS_CHILD, ",".join(names), log, "4")
    workers = [procs.start(*argv, stdin=True) for _ in range(6)]
    go_together(workers)
    for worker in workers:
        line = worker.expect("DONE", timeout=60)
        assert line == "DONE 0", (line, log.read_text()[-2000:])
    events = [line.split() for line in log.read_text().splitlines()]
    assert not [e for e in events if e[0] == "ERROR"], events
    for name in names:
        mine = [e for e in events if e[1] == name]
        assert mine, f"nobody got {name}"
        last_token, last_exit = 0, 0.0
        for enter, leave in zip(mine[::2], mine[1::2], strict=True):
            assert enter[0] == "ENTER" and leave[0] == "EXIT" and enter[2] == leave[2], (
                f"two holders of {name}: {enter} {leave}"
            )
            assert int(enter[2]) > last_token, f"token {enter[2]} after {last_token}"
            assert float(enter[3]) >= last_exit
            last_token, last_exit = int(enter[2]), float(leave[3])
        assert key_free(db, name)
    assert db.execute(f"SELECT count(*) FROM {TABLE}").fetchone() == (0,)
