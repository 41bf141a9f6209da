"""A blocking acquire rides through a server crash and restart; only its timeout ends it
(issue 12, item 1). A non-blocking attempt raises ``DatabaseUnavailable`` at once.

Real worker processes, the fault suite's own server (crashed with ``pg_ctl stop -m
immediate`` and started again here).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from tests.faultkit import (  # noqa: F401  (fixtures "procs", "pg", "fdb")
    fault_db_fixture,
    fault_server_fixture,
    procs_fixture,
    wait_until,
    worker_env,
)

pytestmark = pytest.mark.slow

# Holds argv[1] on the advisory path until killed; says HELD <token>.
HOLDER = """
import sys, time
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1]).try_acquire()
print("HELD", lease.token, flush=True)
while True:
    time.sleep(3600)
"""

# Waits for argv[1] up to argv[2] seconds (blocking=argv[3]); says what became of it.
WAITER = """
import sys, time
import django
django.setup()
from django_pglock import DatabaseUnavailable, Lock
name, timeout, blocking = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "blocking"
started = time.monotonic()
print("WAITING", flush=True)
try:
    if blocking:
        with Lock(name, poll_interval=0.2).acquire(blocking=True, timeout=timeout) as lease:
            print("GRANTED", lease.token if lease else None, flush=True)
    else:
        lease = Lock(name).try_acquire()
        print("GRANTED", lease.token if lease else None, flush=True)
except DatabaseUnavailable as exc:
    print("UNAVAILABLE", round(time.monotonic() - started, 2), exc, flush=True)
"""


def unique(label):
    return f"outage-{label}-{uuid.uuid4().hex[:8]}"


def test_a_blocking_waiter_rides_through_a_crash_and_restart(pg, fdb, procs):
    env = worker_env(pg.url())
    name = unique("ride")
    holder = procs.start(sys.executable, "-c", HOLDER, name, env=env)
    held = int(holder.expect("HELD").split()[1])
    waiter = procs.start(sys.executable, "-c", WAITER, name, "120", "blocking", env=env)
    waiter.expect("WAITING")
    assert fdb.row(name)["token"] == held
    pg.stop("immediate")
    down_at = time.monotonic()
    # While the server is down, the waiter keeps waiting: it neither ends nor raises.
    assert waiter.line_within("", 1.5) is None, waiter.stderr_text
    pg.start()
    line = waiter.expect("GRANTED", 60)
    granted = int(line.split()[1])
    took = time.monotonic() - down_at
    assert granted > held, line  # the dead holder's row was taken over, not repeated
    assert waiter.finish() == 0, waiter.stderr_text
    assert "Traceback" not in waiter.stderr_text
    assert "the database is unavailable" in waiter.stderr_text  # said once, as a warning
    assert "answers again" in waiter.stderr_text
    print(f"waiter granted {took:.2f} s after the crash (server down for 1.5 s)")


def test_only_the_timeout_ends_a_wait_on_a_server_that_is_down(pg, procs):
    env = worker_env(pg.url())
    name = unique("down")
    pg.stop("immediate")
    try:
        waiter = procs.start(sys.executable, "-c", WAITER, name, "1.5", "blocking", env=env)
        line = waiter.expect("UNAVAILABLE", 60, skip=("WAITING",))
        waited = float(line.split()[1])
        assert waited >= 1.5, line
        assert "Gave up waiting after 1.5 s" in line, line
        assert waiter.finish() == 0

        once = procs.start(sys.executable, "-c", WAITER, name, "0", "once", env=env)
        line = once.expect("UNAVAILABLE", 60, skip=("WAITING",))
        assert float(line.split()[1]) < 15, line  # at once: libpq's refusal, no retry
        assert "Check DATABASES['default']" in line, line
    finally:
        pg.start()


def test_the_backoff_grows_is_bounded_and_warns_again_while_the_outage_lasts(caplog, monkeypatch):
    from django_pglock import DatabaseUnavailable, Lock, waiting

    waiter = Lock("backoff").acquire(blocking=True, timeout=None)._waiter
    exc = DatabaseUnavailable("server closed the connection unexpectedly")
    with caplog.at_level("WARNING", logger="django_pglock"):
        delays = [waiter.unavailable(exc) for _ in range(12)]
    assert delays[0] <= waiting.RETRY_FIRST
    assert all(d <= waiting.RETRY_MAX for d in delays)
    assert max(delays[-4:]) >= waiting.RETRY_MAX / 2  # it grew to the cap
    assert len(caplog.records) == 1  # one warning for the outage, not one per retry
    monkeypatch.setattr(waiting, "WARN_EVERY", 0.0)
    with caplog.at_level("WARNING", logger="django_pglock"):
        waiter.unavailable(exc)
    assert len(caplog.records) == 2 and "unavailable" in caplog.records[-1].getMessage()
    waiter.answered()
    assert "answers again" in caplog.records[-1].getMessage()
    assert waiter.failures == 0 and waiter.outage is None

    once = Lock("backoff").acquire(blocking=False)._waiter
    with pytest.raises(DatabaseUnavailable) as raised:
        once.unavailable(exc)
    assert raised.value is exc  # a non-blocking attempt: at once, unchanged

    timed = Lock("backoff").acquire(blocking=True, timeout=5)._waiter
    timed.deadline = time.monotonic() - 0.001  # its timeout has passed
    with pytest.raises(DatabaseUnavailable, match="Gave up waiting after 5 s") as raised:
        timed.unavailable(exc)
    assert raised.value.__cause__ is exc


# Holds argv[1] on the table path (its lease outlives its session) until a "release" line.
TABLE_HOLDER = """
import sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], advisory=False, heartbeat_interval=1, alert_after=5).try_acquire()
print("HELD", lease.token, flush=True)
for line in sys.stdin:
    if line.strip() == "release":
        lease.release()
        print("RELEASED", flush=True)
"""

# Waits for argv[1], polling only every 30 s (15..30 s jittered): a grant within seconds
# of a release can only come from its notification.
SLOW_WAITER = """
import sys
import django
django.setup()
from django_pglock import Lock
print("WAITING", flush=True)
with Lock(sys.argv[1], poll_interval=30).acquire(timeout=300) as lease:
    print("GRANTED", lease.token if lease else None, flush=True)
"""

IDLE_WAITER_SESSION = """
SELECT pid FROM pg_stat_activity
WHERE application_name = 'django_pglock' AND state = 'idle'
  AND query LIKE '%%pg_advisory_xact_lock%%' AND backend_start > %s
  AND now() - state_change > interval '1 second'
"""


def test_a_waiter_listens_again_after_a_restart(pg, fdb, procs):
    """Issue 15: the session that listened ends with the server; the waiter notices at
    once, connects again, listens on the new session (and polls once), so the next
    release still wakes it at once."""
    env = worker_env(pg.url())
    name = unique("relisten")
    holder = procs.start(sys.executable, "-c", TABLE_HOLDER, name, env=env, stdin=True)
    held = int(holder.expect("HELD").split()[1])
    waiter = procs.start(sys.executable, "-c", SLOW_WAITER, name, env=env)
    waiter.expect("WAITING")
    pg.stop("immediate")
    pg.start()
    restarted = fdb.execute("SELECT pg_postmaster_start_time()").fetchone()[0]
    # Well before its next poll (15 s at the earliest), the waiter is back, refused and
    # listening on a new session: only noticing the ended session explains that.
    found = wait_until(
        lambda: fdb.execute(IDLE_WAITER_SESSION, [restarted]).fetchall(), timeout=12.0
    )
    assert found, "the waiter did not come back on a new session before its next poll"
    holder.send("release")
    released_at = time.monotonic()
    holder.expect("RELEASED", 60)
    line = waiter.expect("GRANTED", 60)
    handoff = time.monotonic() - released_at
    print(f"\n[measure] handoff after a restart: {handoff:.3f} s")
    assert handoff < 5.0, f"the waiter was granted {handoff:.2f} s after the release"
    assert int(line.split()[1]) > held
