"""Attacks on issue 15's features: waiting (NOTIFY), semaphores and leader election.

Each test here reproduces one finding and fails on the code it was written against
(see the report of the wt-attack branch). Real server, real leases; processes where the
finding needs them. Every wait is for an event, bounded generously for a busy machine.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

import django_pglock.wakeups as wakeups
from django_pglock import Lock, signals, sql
from django_pglock.connection import get_connection
from django_pglock.health import job_health
from tests import faultkit
from tests.subprocs import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

QUIET = {"heartbeat_interval": 30.0, "alert_after": 60.0, "stale_after": 600.0}


def unique(label):
    return f"atk15-{label}-{uuid.uuid4().hex[:8]}"


def listening_channels():
    """The channels this process's lock session listens on (asked on that session)."""
    rows = get_connection("default").execute("SELECT pg_listening_channels()", {})
    return [row[0] for row in rows]


# -- 1. job health ignores a semaphore's slots above the first ------------------------------


def test_job_health_shows_a_semaphore_job_running_in_slot_two(db):
    """README, "Semaphores": runs are recorded under the lock's name; "Job health": a job
    whose lock is held is ``running``. A job held only in slot 2 (slot 1 free) is judged
    from slot 1's row alone, so it shows as not running."""
    name = unique("health")
    lock = Lock(name, limit=2, record=True, **QUIET)
    first, second = lock.try_acquire(), lock.try_acquire()
    assert first is not None and second is not None and second.slot == 2
    first.release()  # slot 2 still runs the job
    try:
        (job,) = [j for j in job_health(announce=False) if j.name == name]
        assert job.state == "running", (job.state, job.detail, job.holder)
        assert job.holder is not None and job.holder["token"] == second.token
    finally:
        second.release()


# -- 2. a release between a refused attempt and its subscription is never heard ------------


def test_a_release_right_after_the_first_refusal_wakes_the_waiter(db):
    """README: "a notification wakes that name's waiters in the process, which retry at
    once ... a session that starts listening ... polls once at once (a release just before
    it was not heard)". The waiter subscribes only after its first attempt was refused;
    when its session listens already (another waiter of this process, or the 30 s linger),
    a release committed between that refusal and the subscription wakes nobody, and the
    waiter sleeps its whole poll interval (15..30 s here) while the lock is free."""
    # Another waiter keeps this process's lock session listening throughout.
    other = unique("other")
    other_holder = Lock(other, **QUIET).try_acquire()
    assert other_holder is not None
    other_done = threading.Event()

    def other_waiter():
        with Lock(other, poll_interval=30.0, **QUIET).acquire(timeout=120):
            other_done.set()

    threading.Thread(target=other_waiter, daemon=True).start()
    wait_until(lambda: "django_pglock" in listening_channels(), 30, "no session listened")

    name = unique("race")
    holder = Lock(name, **QUIET).try_acquire()
    assert holder is not None
    released = threading.Event()

    def release_after_first_refusal(sender, name=None, **kwargs):
        # In the waiter's thread, after its first refused attempt and before it
        # subscribes: the holder (another thread of this process) releases now.
        if name == target and not released.is_set():
            holder.release()
            released.set()

    target = name
    signals.lock_contended.connect(release_after_first_refusal, weak=False)
    got: list[float] = []
    try:

        def waiter():
            with Lock(name, poll_interval=30.0, **QUIET).acquire(timeout=120) as lease:
                got.append(time.monotonic())
                assert lease is not None

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        assert released.wait(30), "the waiter was never refused"
        at = time.monotonic()
        thread.join(60)
        assert got, "the waiter never got the lock"
        handoff = got[0] - at
        assert handoff < 5.0, f"a free lock was handed over only after {handoff:.1f} s"
    finally:
        signals.lock_contended.disconnect(release_after_first_refusal)
        other_holder.release()
        assert other_done.wait(60)


# -- 3. a cancelled async waiter stays subscribed for ever ---------------------------------


def test_a_cancelled_async_waiter_does_not_keep_the_session_listening(db, monkeypatch):
    """README: "Thirty seconds after the last waiter of a process has gone, its connection
    stops listening (one UNLISTEN)". An ``acquire_async`` cancelled while its attempt runs
    in its worker thread: the task's ``finally`` unsubscribes first, then the attempt,
    refused, subscribes again, and nobody ever unsubscribes that wake-up: the process
    listens (and reads every release of the database) for as long as it lives."""
    monkeypatch.setattr(wakeups, "LINGER", 1.0)
    name = unique("cancel")
    holder = Lock(name, **QUIET).try_acquire()
    assert holder is not None
    in_attempt, cancelled = threading.Event(), threading.Event()

    def hold_the_attempt(sender, name=None, **kwargs):
        if name == target:
            in_attempt.set()
            cancelled.wait(30)  # the task is cancelled while its attempt is refused

    target = name
    signals.lock_contended.connect(hold_the_attempt, weak=False)
    try:

        async def main():
            lock = Lock(name, poll_interval=30.0, **QUIET)
            task = asyncio.ensure_future(lock.acquire_async(timeout=120).__aenter__())
            assert await asyncio.to_thread(in_attempt.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled.set()

        asyncio.run(main())  # waits for the worker thread too
    finally:
        signals.lock_contended.disconnect(hold_the_attempt)
        cancelled.set()
    holder.release()
    # No waiter is left: after LINGER (1 s here) the session stops listening.
    wait_until(
        lambda: "django_pglock" not in listening_channels(),
        15,
        f"still listening with no waiter: {wakeups.wakeups()._waiting!r}",
    )


# -- 4. the admin's forced release of a semaphore slot row ---------------------------------


def test_the_admin_force_releases_a_slot_row_whose_name_holds_the_separator(client):
    """(Held.) README, "Semaphores": "the admin action always releases the grants it
    showed, by token". Slot 2's row is named ``name + "\\x1f2"``: select it, confirm, and exactly
    that grant is released, the other slot kept."""
    from django.contrib.auth.models import Permission, User
    from django.urls import reverse

    from django_pglock.models import JobLock
    from tests.adminforms import confirmation_form

    holders = reverse("admin:django_pglock_joblock_changelist")
    name = unique("admin")
    lock = Lock(name, limit=2, **QUIET)
    first, second = lock.try_acquire(), lock.try_acquire()
    assert second is not None and second.slot == 2
    row = sql.slot_row(name, 2)
    user = User.objects.create_user(username=unique("u"), password="pw", is_staff=True)
    for codename in ("view_joblock", "force_release_joblock"):
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_pglock", codename=codename)
        )
    client.force_login(user)
    page = client.get(holders)
    assert page.status_code == 200
    assert {obj.pk for obj in page.context["cl"].result_list} == {name, row}
    confirm = client.post(
        holders, {"action": "force_release", "_selected_action": [row], "index": "0"}
    )
    assert confirm.status_code == 200
    form = confirmation_form(confirm)
    assert form["lock_token"] == [str(second.token)], form
    done = client.post(holders, form, follow=True)
    assert done.status_code == 200
    left = dict(JobLock.objects.values_list("name", "token"))
    try:
        assert left == {name: first.token}, (left, [m.message for m in done.context["messages"]])
    finally:
        first.release()
        second.release()


# -- 5. a forced release of a semaphore slot admits nobody while its old holder lives -----

QUIET_ARGS = ("--heartbeat-interval", "30", "--alert-after", "60", "--stale-after", "600")


def test_a_forced_release_of_a_slot_lets_a_waiter_in_at_once(run_child, db):
    """README: a forced release wakes the name's waiters (NOTIFY), and "lets a standby in
    at once" (Leader election); a semaphore's holder has "the same guarantees as the holder
    of a plain lock". For a plain lock that holds (the freed row is inserted again on the
    table path while the old holder's key is still held). A semaphore's acquire skips a
    free slot whose advisory key someone else holds, so the released slot admits nobody
    until the old holder's next heartbeat (30 s here) notices and gives its key back."""
    from django_pglock.operations import force_release
    from tests.test_processes import Db, acquired_token
    from tests.test_wakeups import settled_waiter

    name = unique("forced")
    first = run_child("hold", "--name", name, "--limit", "2", *QUIET_ARGS)
    token = acquired_token(first.expect("ACQUIRED"))
    second = run_child("hold", "--name", name, "--limit", "2", *QUIET_ARGS)
    second.expect("ACQUIRED")
    before = Db(db).lock_sessions()
    waiter = run_child(
        "wait",
        "--name",
        name,
        "--limit",
        "2",
        "--poll-interval",
        "0.2",
        "--timeout",
        "90",
        *QUIET_ARGS,
    )
    # The waiter has been refused (both slots held) before the release.
    settled_waiter(Db(db), before, idle_for=0.05)
    assert force_release(name, token=token) is not None
    released_at = time.monotonic()
    waiter.expect("ACQUIRED", timeout=80)
    handoff = time.monotonic() - released_at
    assert handoff < 5.0, f"the released slot admitted the waiter only {handoff:.1f} s later"


# -- 6. the same through Chromium (the holders page, a slot row's checkbox) ---------------


def test_force_release_of_a_slot_row_in_the_browser(live_server, procs):
    """(Held.) The checkbox and the confirmation form of slot 2's row carry ``"\\x1f"`` through a
    real browser's HTML parser and form encoding."""
    from django.contrib.auth.models import User

    from django_pglock.models import JobLock
    from tests.test_browser import CHROMIUM, TIMEOUT_MS, chromium

    faultkit.require(CHROMIUM is not None, "Chromium is not installed (apt-get install chromium)")
    User.objects.create_superuser("ops15", "ops@example.com", "ops-password-not-secret")
    name = unique("browser")
    lock = Lock(name, limit=2, **QUIET)
    first, second = lock.try_acquire(), lock.try_acquire()
    assert second is not None and second.slot == 2
    with chromium() as browser:
        from playwright.sync_api import expect

        page = browser.new_page(viewport={"width": 1500, "height": 700})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "ops15")
        page.fill("#id_password", "ops-password-not-secret")
        page.click("input[type=submit]")
        expect(page.locator("#user-tools")).to_contain_text("ops15")
        page.goto(f"{live_server.url}/admin/django_pglock/joblock/")
        row = page.locator("#result_list tbody tr").filter(
            has=page.get_by_text(str(second.token), exact=True)
        )
        expect(row).to_have_count(1)
        expect(row.locator("td.field-slot_display")).to_contain_text("2 (2 of 2 held)")
        row.locator("input.action-select").check()
        page.select_option("select[name=action]", "force_release")
        page.click("button[name=index]")
        expect(page.locator("#content h1")).to_have_text("Force release: are you sure?")
        expect(page.locator("#content table tbody tr")).to_have_count(1)
        page.click("input[type=submit][value='Yes, force release']")
        expect(page.locator("ul.messagelist li")).to_contain_text(str(second.token))
        page.close()
    left = dict(JobLock.objects.values_list("name", "token"))
    first.release()
    second.release()
    assert left == {name: first.token}, left
