"""Composition: ``locked_run`` around a ``@singleton_job`` command, and ``current_lease()``.

* A decorated command run as ``locked_run``'s job runs under its parent's grant (proven
  by the lock's row: that token, held by an ancestor on this host) instead of skipping,
  and the run is recorded once; a direct run beside it, a copied environment or a stale
  token in the environment still meets the lock (``DJANGO_PGLOCK_NAME`` /
  ``DJANGO_PGLOCK_TOKEN``).
* ``current_lease()`` gives the innermost job's lease, in sync and async bodies, in the
  tasks and ``to_thread`` calls they start, and ``None`` elsewhere.
* A decorated command whose lease was lost ends with one line on stderr and exit status
  75, like ``locked_run``; a decorated function keeps raising ``LockNotHeld``.

Commands run as real processes (``python -m django ...``) against the real server; they
are ``lease_job`` and ``scheduled_lease_job`` of tests/testapp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import uuid

import pytest
from django.core.management.base import CommandError
from django.db import transaction

from django_pglock import (
    InheritedLease,
    Lease,
    Lock,
    LockError,
    LockNotHeld,
    current_lease,
    singleton_job,
)
from django_pglock.exits import EXIT_LOST, LockLost
from django_pglock.inherit import _parent_from_ps, ancestors, parent_grant, parent_of
from django_pglock.operations import force_release
from tests.subprocs import open_db, wait_for_early_in_minute, wait_for_file

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

JOB = "lease_job"
LOG_PREFIX = "django_pglock: "  # a log record of the library (no LOGGING: Python's last resort)


@pytest.fixture
def db(pg_url, test_db_name):
    with open_db(pg_url, test_db_name) as conn:
        conn.execute(
            "DELETE FROM django_pglock_jobrun WHERE name IN (%s, %s)", [JOB, "scheduled_" + JOB]
        )
        yield conn


def unique(label):
    return f"compose-{label}-{uuid.uuid4().hex[:8]}"


def runs(db, name=JOB):
    cur = db.execute(
        "SELECT token, pid, outcome, exit_code FROM django_pglock_jobrun WHERE name = %s"
        " ORDER BY id",
        [name],
    )
    return [dict(zip([c.name for c in cur.description], row, strict=True)) for row in cur]


def lock_row(db, name):
    return db.execute(
        "SELECT token, holder, pid FROM django_pglock_joblock WHERE name = %s", [name]
    ).fetchone()


def report(path):
    return json.loads(path.read_text())


def command_lines(stderr):
    """stderr without the library's log records (which go to stderr here only because
    the test settings configure no logging)."""
    return [line for line in stderr.splitlines() if not line.startswith(LOG_PREFIX)]


def env_with(procs, **variables):
    env = dict(procs.env)
    env.update(variables)
    return env


def django_with_env(procs, env, *args):
    return procs.start(sys.executable, "-m", "django", *args, env=env)


# -- item 5: locked_run around a decorated command ----------------------------------------


def test_locked_run_of_a_decorated_command_runs_it_under_the_parents_grant(procs, tmp_path, db):
    out = tmp_path / "out.json"
    result = procs.run_django("locked_run", JOB, "--out", out, "--check")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing skipped, nothing lost
    assert "DONE" in result.stdout
    seen = report(out)["lease"]
    (run,) = runs(db)  # recorded once: by locked_run, not again by its job
    assert run["outcome"] == "succeeded" and run["exit_code"] == 0
    assert seen == {
        "type": "InheritedLease",
        "name": JOB,
        "token": run["token"],
        "holder": seen["holder"],
        "lost": False,
    }
    assert seen["holder"].split(":")[1] == str(run["pid"])  # the locked_run process
    assert lock_row(db, JOB) is None


def test_a_direct_run_or_a_copied_environment_beside_locked_run_still_skips(procs, tmp_path, db):
    out, go = tmp_path / "out.json", tmp_path / "go"
    runner = procs.django("locked_run", JOB, "--out", out, "--wait-for", go)
    wait_for_file(out, procs=[runner])
    grant = report(out)["lease"]
    assert grant["type"] == "InheritedLease"
    token, holder, _pid = lock_row(db, JOB)
    assert (grant["token"], grant["holder"]) == (token, holder)

    direct_out = tmp_path / "direct.json"
    direct = procs.run_django(JOB, "--out", direct_out)
    # A cron line or shell that exports the variables of the running grant: the
    # process is no descendant of locked_run, so the variables are not honoured.
    copied_env = env_with(procs, DJANGO_PGLOCK_NAME=JOB, DJANGO_PGLOCK_TOKEN=str(token))
    copied_out = tmp_path / "copied.json"
    copied = django_with_env(procs, copied_env, JOB, "--out", copied_out).result()
    go.touch()
    finished = procs.finish(runner)

    for skipped, path in ((direct, direct_out), (copied, copied_out)):
        assert skipped.returncode == 0, skipped.stderr
        (line,) = command_lines(skipped.stderr)
        assert line.startswith(f"Skipped {JOB}: lock '{JOB}' is held by {holder}"), line
        assert not path.exists()
    assert any("did not start this process" in line for line in copied.stderr_lines)
    assert finished.returncode == 0, finished.stderr
    assert [run["outcome"] for run in runs(db)] == ["succeeded", "skipped", "skipped"]


def test_a_stale_token_in_the_environment_does_not_bypass_the_lock(procs, tmp_path, db):
    """What a process started after its parent lost the lock sees: a token that the row
    no longer carries. It meets the lock as usual: skipped while someone holds it, run
    under a grant of its own once the lock is free."""
    stale = Lock(JOB).try_acquire()
    stale.release()
    env = env_with(procs, DJANGO_PGLOCK_NAME=JOB, DJANGO_PGLOCK_TOKEN=str(stale.token))
    holder = Lock(JOB).try_acquire()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    try:
        skipped = django_with_env(procs, env, JOB, "--out", first).result()
    finally:
        holder.release()
    assert skipped.returncode == 0, skipped.stderr
    assert f"held by {holder.holder}" in "\n".join(command_lines(skipped.stderr))
    assert not first.exists()

    ran = django_with_env(procs, env, JOB, "--out", second).result()
    assert ran.returncode == 0, ran.stderr
    seen = report(second)
    assert seen["lease"]["type"] == "Lease"
    assert seen["lease"]["token"] not in (stale.token, holder.token)
    assert [(r["outcome"], r["token"]) for r in runs(db)] == [
        ("skipped", None),
        ("succeeded", seen["lease"]["token"]),  # its own run, under its own grant
    ]


def test_locked_run_under_another_name_does_not_lend_its_grant(procs, tmp_path, db):
    out = tmp_path / "out.json"
    other = unique("other")
    result = procs.run_django("locked_run", "--name", other, JOB, "--out", out)
    assert result.returncode == 0, result.stderr
    seen = report(out)["lease"]
    assert seen["type"] == "Lease" and seen["name"] == JOB  # its own lock, taken by itself
    assert [run["outcome"] for run in runs(db)] == ["succeeded"]
    assert [run["outcome"] for run in runs(db, other)] == ["succeeded"]


@pytest.mark.slow
def test_a_scheduled_job_under_locked_run_schedule_counts_its_parents_slot(procs, tmp_path, db):
    job = "scheduled_" + JOB
    db.execute("DELETE FROM django_pglock_scheduleclaim WHERE name = %s", [job])
    wait_for_early_in_minute(db)
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    ran = procs.run_django("locked_run", "--schedule", "* * * * *", job, "--out", first)
    assert ran.returncode == 0, ran.stderr
    assert report(first)["lease"]["type"] == "InheritedLease"  # the parent's claim counted
    # Another locked_run in the same minute (without --schedule) lends its grant, but the
    # slot was claimed by someone else: the job's own schedule skips it.
    again = procs.run_django("locked_run", job, "--out", second)
    assert again.returncode == 0, again.stderr
    (line,) = command_lines(again.stderr)
    assert "schedule slot" in line and f"'{job}'" in line, line
    assert not second.exists()
    (claims,) = db.execute(
        "SELECT count(*) FROM django_pglock_scheduleclaim WHERE name = %s", [job]
    ).fetchone()
    assert claims == 1, "the test crossed a minute boundary"


# -- item 5: the proof of a parent's grant, in process ------------------------------------


def held_by_my_parent(db, lease):
    """Make ``lease``'s row look as if this process's parent held it (as locked_run holds
    its job's lock)."""
    db.execute(
        "UPDATE django_pglock_joblock SET pid = %s WHERE name = %s AND token = %s",
        [os.getppid(), lease.name, lease.token],
    )


def test_a_grant_held_by_an_ancestor_on_this_host_is_inherited(db, monkeypatch):
    name = unique("inherit")
    lease = Lock(name).try_acquire()
    try:
        monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
        monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(lease.token))
        monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job
        assert parent_grant(Lock(name)) is None  # this process holds it: not a parent
        held_by_my_parent(db, lease)
        inherited = parent_grant(Lock(name))
        assert isinstance(inherited, InheritedLease)
        assert (inherited.name, inherited.token, inherited.holder) == (
            name,
            lease.token,
            lease.holder,
        )
        assert inherited.using == "default" and not inherited.lost
        inherited.check()
        with transaction.atomic():
            inherited.guard()
        assert repr(inherited) == f"<InheritedLease {name!r} token={lease.token} inherited>"

        monkeypatch.setenv("DJANGO_PGLOCK_NAME", name + "-other")
        assert parent_grant(Lock(name)) is None  # the variables name another lock
        monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
        db.execute("UPDATE django_pglock_joblock SET host = 'elsewhere' WHERE name = %s", [name])
        assert parent_grant(Lock(name)) is None  # same pid, another machine
    finally:
        lease.release()


def test_an_inherited_lease_whose_row_is_gone_is_lost(db, monkeypatch):
    name = unique("gone")
    lease = Lock(name).try_acquire()
    held_by_my_parent(db, lease)
    monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
    monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(lease.token))
    monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job
    inherited = parent_grant(Lock(name))
    guarded = parent_grant(Lock(name))
    assert force_release(name) is not None
    with pytest.raises(LockNotHeld, match=rf"Lock '{name}' \(token {lease.token}"):
        inherited.check()
    assert inherited.lost and "lost" in repr(inherited)
    with pytest.raises(LockNotHeld):
        inherited.check()  # known lost: no need to ask again
    with transaction.atomic(), pytest.raises(LockNotHeld):
        guarded.guard()
    assert guarded.lost
    with pytest.raises(LockNotHeld):
        guarded.guard()
    lease.release()


def test_an_inherited_lease_guards_only_inside_a_transaction(db, monkeypatch):
    name = unique("guard")
    lease = Lock(name).try_acquire()
    try:
        held_by_my_parent(db, lease)
        monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
        monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(lease.token))
        monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job
        inherited = parent_grant(Lock(name))
        with pytest.raises(LockError, match=r"transaction\.atomic\(using='default'\)"):
            inherited.guard()
    finally:
        lease.release()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_job_under_its_parents_grant_neither_releases_nor_records(db, monkeypatch, kind):
    name = unique(f"under-{kind}")
    parent = Lock(name).try_acquire()
    try:
        held_by_my_parent(db, parent)
        monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
        monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(parent.token))
        monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job
        seen = []
        if kind == "sync":

            @singleton_job(name, record=True)
            def job():
                seen.append(current_lease())
                return "ran"

            assert job() == "ran"
        else:

            @singleton_job(name, record=True)
            async def job():
                seen.append(current_lease())
                return "ran"

            assert asyncio.run(job()) == "ran"
        (inherited,) = seen
        assert isinstance(inherited, InheritedLease)
        assert (inherited.name, inherited.token) == (name, parent.token)
        assert lock_row(db, name)[0] == parent.token  # still the parent's: not released
        assert runs(db, name) == []  # the parent records the run, not its job
        parent.check()
    finally:
        parent.release()


def test_an_async_job_offered_a_grant_it_cannot_prove_takes_its_own_lock(monkeypatch):
    name = unique("async-own")
    monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
    monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", str(2**62))  # no row of that name carries it
    monkeypatch.setenv("DJANGO_PGLOCK_JOB_PGID", str(os.getpgrp()))  # in the job

    @singleton_job(name)
    async def job():
        return current_lease()

    lease = asyncio.run(job())
    assert isinstance(lease, Lease) and lease.name == name


@pytest.mark.parametrize("token", ["abc", "0", "-3", str(2**63), ""])
def test_a_token_that_is_no_fencing_token_is_ignored_with_a_warning(token, monkeypatch, caplog):
    name = unique("junk")
    monkeypatch.setenv("DJANGO_PGLOCK_NAME", name)
    monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", token)
    with caplog.at_level(logging.WARNING, logger="django_pglock"):
        assert parent_grant(Lock(name)) is None
    (message,) = [r.getMessage() for r in caplog.records if r.name == "django_pglock"]
    assert f"DJANGO_PGLOCK_TOKEN={token!r} is not a fencing token" in message
    assert f"lock {name!r} is tried as usual" in message


def test_without_the_variables_nothing_is_inherited(monkeypatch):
    monkeypatch.delenv("DJANGO_PGLOCK_NAME", raising=False)
    monkeypatch.setenv("DJANGO_PGLOCK_TOKEN", "5")
    assert parent_grant(Lock(unique("none"))) is None  # no query: no database needed
    monkeypatch.setenv("DJANGO_PGLOCK_NAME", "x")
    monkeypatch.delenv("DJANGO_PGLOCK_TOKEN")
    assert parent_grant(Lock("x")) is None


def test_ancestors_walk_up_to_init(monkeypatch):
    found = list(ancestors())
    assert found[0] == os.getppid()
    assert len(found) == len(set(found))
    assert found[-1] == 1 or parent_of(found[-1]) == 0  # up to the top, then no further
    assert parent_of(os.getpid()) == os.getppid()
    assert _parent_from_ps(os.getpid()) == os.getppid()  # where there is no /proc
    assert parent_of(2**22 + 12345) == 0  # no such process
    assert _parent_from_ps(-1) == 0
    monkeypatch.setenv("PATH", "")  # no ps to ask
    assert _parent_from_ps(os.getpid()) == 0


# -- item 6: current_lease() ---------------------------------------------------------------


def test_current_lease_is_the_innermost_jobs_lease_and_none_outside():
    outer_name, inner_name = unique("outer"), unique("inner")
    seen = {}

    @singleton_job(inner_name)
    def inner():
        seen["inner"] = current_lease()

    @singleton_job(outer_name)
    def outer():
        seen["outer"] = current_lease()
        inner()
        seen["after"] = current_lease()
        with Lock(unique("raw")).acquire() as raw:  # a raw lock is not the job's lease
            seen["raw"] = (raw, current_lease())

    @singleton_job(unique("fails"))
    def fails():
        seen["fails"] = current_lease()
        raise RuntimeError("boom")

    assert current_lease() is None
    outer()
    assert isinstance(seen["outer"], Lease) and seen["outer"].name == outer_name
    assert seen["outer"].token > 0
    assert seen["inner"].name == inner_name and seen["inner"] is not seen["outer"]
    assert seen["after"] is seen["outer"]
    raw, current = seen["raw"]
    assert current is seen["outer"] and raw is not current
    with pytest.raises(RuntimeError):
        fails()
    assert seen["fails"] is not None
    assert current_lease() is None


def test_current_lease_follows_tasks_and_to_thread_but_not_plain_threads():
    names = [unique("a"), unique("b")]
    seen = {}
    inside = []

    def job_for(name):
        @singleton_job(name)
        async def job():
            inside.append(name)
            while len(inside) < len(names):  # the two jobs overlap
                await asyncio.sleep(0.01)
            mine = current_lease()
            in_task = await asyncio.create_task(_current_after_yield())
            in_thread = await asyncio.to_thread(current_lease)
            plain = []
            thread = threading.Thread(target=lambda: plain.append(current_lease()))
            thread.start()
            thread.join(30)
            seen[name] = (mine, in_task, in_thread, plain)

        return job

    async def main():
        await asyncio.gather(*(job_for(name)() for name in names))
        return current_lease()

    assert asyncio.run(main()) is None
    for name in names:
        mine, in_task, in_thread, plain = seen[name]
        assert isinstance(mine, Lease) and mine.name == name
        assert in_task is mine and in_thread is mine
        assert plain == [None]


async def _current_after_yield():
    await asyncio.sleep(0)
    return current_lease()


# -- item 6: a lost lease ------------------------------------------------------------------


def test_a_decorated_function_whose_lease_was_lost_raises_lock_not_held():
    name = unique("lost-fn")

    @singleton_job(name)
    def job():
        assert force_release(name) is not None  # an operator's forced release meanwhile
        return "done"

    with pytest.raises(LockNotHeld) as raised:
        job()
    assert not isinstance(raised.value, CommandError)


@pytest.mark.parametrize("where", ["release", "body"])
def test_a_decorated_command_whose_lease_was_lost_exits_75_with_one_line(
    procs, tmp_path, db, where
):
    out, go = tmp_path / "out.json", tmp_path / "go"
    args = ["--check"] if where == "body" else []
    job = procs.django(JOB, "--out", out, "--wait-for", go, *args)
    wait_for_file(out, procs=[job])
    token = report(out)["lease"]["token"]
    released = procs.run_django("pglock_release", JOB, "--token", token)
    assert released.returncode == 0, released.stderr
    go.touch()
    result = procs.finish(job)
    assert result.returncode == EXIT_LOST, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = command_lines(result.stderr)
    assert line.startswith(f"LockLost: Lock '{JOB}' (token {token})"), line
    assert "lost" in line
    assert ("DONE" in result.stdout) is (where == "release")  # the body ran to its end
    assert [run["outcome"] for run in runs(db)] == ["lost"]


def test_a_lost_command_lease_is_a_command_error_and_still_lock_not_held():
    name = unique("lost-cmd")
    from django.core.management.base import BaseCommand

    class Command(BaseCommand):
        @singleton_job(name)
        def handle(self, *args, **options):
            assert force_release(name) is not None

    with pytest.raises(LockLost) as raised:
        Command().handle()
    assert isinstance(raised.value, LockNotHeld) and isinstance(raised.value, CommandError)
    assert raised.value.returncode == EXIT_LOST
    assert "\n" not in str(raised.value) and name in str(raised.value)


def test_a_lost_lease_raised_by_a_nested_command_is_passed_on_unchanged():
    name = unique("nested-cmd")
    from django.core.management.base import BaseCommand

    inner_lost = LockLost("Lock 'x' was lost.", returncode=EXIT_LOST)

    class Command(BaseCommand):
        @singleton_job(name)
        def handle(self, *args, **options):
            raise inner_lost

    with pytest.raises(LockLost) as raised:
        Command().handle()
    assert raised.value is inner_lost
