"""A server crash (``pg_ctl stop -m immediate``) forgets nothing a holder was told.

A heartbeat the holder counts its local deadline from, and a release whose caller was
told it is done, must both be on disk when the statement returns: a crash right after
either must not bring back an older heartbeat (which would let a contender in before the
holder's deadline) or a released row (which would block the name on the table path until
``stale_after``). Real worker processes, a real server of the tests' own that is crashed
here; the rows are read on a separate session.
"""

from __future__ import annotations

import signal
import uuid

import pytest

from tests import faultkit
from tests.faultkit import (  # noqa: F401  (fixtures "log", "procs")
    SMALL,
    Db,
    log_fixture,
    procs_fixture,
    worker_env,
)

pytestmark = pytest.mark.slow

CRASHES = 3  # a commit left in the WAL buffers is lost by most crashes: try a few


@pytest.fixture
def pg():
    return faultkit.shared_server()


@pytest.fixture
def db(pg):
    session = Db(pg.url())
    yield session
    session.close()


def unique(label: str) -> str:
    return f"durable-{label}-{uuid.uuid4().hex[:8]}"


def beat_after(db, name, first):
    def newer():
        row = db.row(name)
        return row is not None and row["last_heartbeat"] > first["last_heartbeat"]

    return newer


def test_a_release_the_caller_was_told_about_survives_a_server_crash(pg, db, procs, log):
    env = worker_env(pg.url())
    for attempt in range(CRASHES):
        name = unique(f"release-{attempt}")
        args = ["job", "--name", name, "--log", log, *SMALL, "--advisory", "off"]
        worker = procs.worker(env, *args, "--hold-for", "0.05", "--once")
        worker.ready()
        left = worker.expect("LEFT", 20, skip=("GRANTED", "FAIL"))
        assert left.endswith("ok"), left
        pg.restart("immediate")  # right after the release returned
        row = db.row(name)
        assert row is None, f"crash {attempt}: the released row came back: {row}"
        worker.finish()


def test_a_heartbeat_the_holder_counted_survives_a_server_crash(pg, db, procs, log):
    env = worker_env(pg.url())
    for attempt in range(CRASHES):
        name = unique(f"beat-{attempt}")
        args = ["job", "--name", name, "--log", log, *SMALL, "--hold-for", "inf", "--once"]
        worker = procs.worker(env, *args)
        worker.ready()
        worker.expect("GRANTED", 20, skip=("FAIL",))
        first = db.row(name)
        assert first is not None
        # Wait for a heartbeat after the grant, then crash as soon as it is visible.
        assert faultkit.wait_until(beat_after(db, name, first), 20, interval=0.005)
        # Freeze the holder, so that after the crash the row shows what reached the disk.
        worker.signal(signal.SIGSTOP)
        try:
            seen = db.row(name)
            assert seen is not None
            pg.restart("immediate")
            after = db.row(name)
        finally:
            worker.signal(signal.SIGCONT)
        assert after is not None and after["token"] == seen["token"]
        assert after["last_heartbeat"] >= seen["last_heartbeat"], (
            f"crash {attempt}: a heartbeat seen committed at {seen['last_heartbeat']} was "
            f"lost; the row went back to {after['last_heartbeat']}"
        )
        worker.finish()
