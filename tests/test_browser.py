"""The holders page in a real browser: log in, see a lock in alert, force-release it.

Runs Debian's Chromium (``apt-get install chromium``) through Playwright for Python,
against pytest-django's ``live_server``. Playwright's own browser downloads are never
used: the browser is the system's ``chromium``. The screenshots it takes go to a
temporary folder; ``PGLOCK_SCREENSHOT_DIR=docs pytest tests/test_browser.py`` refreshes
the ones in the README (``docs/admin-holders.png``, ``docs/admin-force-release.png``).

Playwright's sync API keeps an event loop in this thread while it runs, and Django
refuses ORM calls from a thread with a running loop; so the ORM is used only before the
browser starts and after it is closed. Lock rows are aged through a separate psycopg
session meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User

from django_pglock import Lock, LockNotHeld
from django_pglock.models import JobLock
from tests.subprocs import key_free, open_db, wait_until

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 15_000

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is not installed (no `chromium` on PATH); on Debian/Ubuntu: "
        "apt-get install chromium",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("clean_locks"),
]

# The lock the test force-releases: a heartbeat interval long enough that the holder does
# not refresh its row (aged to ALERT_AGE) while the browser looks at it.
VICTIM = "nightly-report"
VICTIM_THRESHOLDS = {"heartbeat_interval": 60.0, "alert_after": 90.0, "stale_after": 900.0}
ALERT_AGE = 135.0
# Neighbours on the page, for a screenshot that shows all three states.
QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}
NEIGHBOURS = {
    "training:42": ("advance_pipeline(tenant_id=42)", None),
    "sync-invoices": ("manage.py sync_invoices", 4000.0),  # stale
}
# A neighbour whose holder was killed (SIGKILL): its session ended, so it is abandoned.
ABANDONED = "export:7"
HOLD_AND_DIE = """
import os, signal, sys
import django
django.setup()
from django_pglock import Lock
assert Lock(sys.argv[1], description="manage.py export --tenant 7").try_acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""


@contextlib.contextmanager
def chromium():
    """The system's Chromium under Playwright; Playwright's loop ends when the block ends."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "playwright is not importable: install the dev extra (pip install -e '.[dev]'), "
            "which brings Playwright for Python; the browser itself is the system's chromium "
            "(never run `playwright install`)."
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def age_row(conn, name, seconds):
    updated = conn.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - %s * interval '1 second'"
        " WHERE name = %s",
        [seconds, name],
    ).rowcount
    assert updated == 1


def force_release_in_the_browser(browser, base_url, pg_url, test_db_name, shots):
    """Log in, see the lock in alert, force-release it (screenshots on the way); its lease."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1500, "height": 560})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password-not-secret")
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text("ops")
    # Fold the admin's navigation sidebar away: the holders table gets the whole width.
    page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")

    # Take the lock only now: nothing refreshes its aged row before the test is done.
    lease = Lock(VICTIM, description="manage.py nightly_report", **VICTIM_THRESHOLDS)
    lease = lease.try_acquire()
    assert lease is not None
    with open_db(pg_url, test_db_name) as conn:
        age_row(conn, VICTIM, ALERT_AGE)
        for name, (_description, age) in NEIGHBOURS.items():
            if age is not None:
                age_row(conn, name, age)

    page.goto(f"{base_url}/admin/django_pglock/joblock/")
    expect(page.locator("#result_list")).to_be_visible()
    row = page.locator("#result_list tbody tr", has_text=VICTIM)
    expect(row).to_have_count(1)
    expect(row.locator("td.field-state_badge")).to_have_text("alert")
    expect(row.locator("td.field-token")).to_have_text(str(lease.token))
    for name, (_description, age) in NEIGHBOURS.items():
        state = "ok" if age is None else "stale"
        neighbour = page.locator("#result_list tbody tr", has_text=name)
        expect(neighbour.locator("td.field-state_badge")).to_have_text(state)
    gone = page.locator("#result_list tbody tr", has_text=ABANDONED)
    expect(gone.locator("td.field-state_badge")).to_have_text("abandoned")
    # The admin's stylesheet came through the live server's static files handler.
    background = page.evaluate(
        "getComputedStyle(document.querySelector('#header')).backgroundColor"
    )
    assert background not in ("", "rgba(0, 0, 0, 0)"), "the admin's CSS was not served"
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "admin-holders.png"), full_page=True)

    row.locator("input.action-select").check()
    page.select_option("select[name=action]", "force_release")
    page.click("button[name=index]")

    expect(page.locator("#content h1")).to_have_text("Force release: are you sure?")
    confirmation = page.locator("#content table tbody tr")
    expect(confirmation).to_have_count(1)
    expect(confirmation).to_contain_text(VICTIM)
    expect(confirmation).to_contain_text(lease.holder)
    expect(confirmation).to_contain_text(str(lease.token))
    expect(confirmation).to_contain_text("alert")
    page.screenshot(path=str(shots / "admin-force-release.png"), full_page=True)

    page.click("input[type=submit][value='Yes, force release']")
    expect(page.locator("ul.messagelist li.success")).to_contain_text(
        f"Force-released lock '{VICTIM}'"
    )
    expect(page.locator("ul.messagelist li.success")).to_contain_text(str(lease.token))
    expect(page.locator("#result_list tbody tr", has_text=VICTIM)).to_have_count(0)
    expect(page.locator("#result_list tbody tr")).to_have_count(len(NEIGHBOURS) + 1)
    # The state filter offers the abandoned grants alone.
    page.click("#changelist-filter a:has-text('abandoned')")
    expect(page.locator("#result_list tbody tr")).to_have_count(1)
    expect(page.locator("#result_list tbody tr")).to_contain_text(ABANDONED)
    page.close()
    return lease


def test_force_release_a_lock_in_alert_from_the_holders_page(
    live_server, pg_url, test_db_name, tmp_path, procs
):
    User.objects.create_superuser("ops", "ops@example.com", "ops-password-not-secret")
    neighbours = [
        Lock(name, description=description, **QUIET).try_acquire()
        for name, (description, _age) in NEIGHBOURS.items()
    ]
    assert all(neighbours)
    died = procs.finish(procs.python(HOLD_AND_DIE, ABANDONED))
    assert died.returncode == -signal.SIGKILL, died.stderr
    with open_db(pg_url, test_db_name) as conn:
        wait_until(lambda: key_free(conn, ABANDONED), 30, "the killed holder's session to end")
    # The browser starts only after the ORM work above, and has ended before the ORM is
    # used again (see the module docstring).
    with chromium() as browser:
        shots = Path(os.environ.get("PGLOCK_SCREENSHOT_DIR") or tmp_path)
        lease = force_release_in_the_browser(browser, live_server.url, pg_url, test_db_name, shots)
    assert (shots / "admin-holders.png").stat().st_size > 10_000

    assert not JobLock.objects.filter(pk=VICTIM).exists()
    assert set(JobLock.objects.values_list("name", flat=True)) == {*NEIGHBOURS, ABANDONED}
    assert VICTIM in LogEntry.objects.get().change_message
    with pytest.raises(LockNotHeld):
        lease.check()
    for neighbour in neighbours:
        neighbour.check()
        neighbour.release()


def test_no_take_me_back_returns_to_the_holders_page_and_releases_nothing(live_server):
    User.objects.create_superuser("ops", "ops@example.com", "ops-password-not-secret")
    lease = Lock("cancelled", **QUIET).try_acquire()
    assert lease is not None
    with chromium() as browser:
        from playwright.sync_api import expect

        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "ops")
        page.fill("#id_password", "ops-password-not-secret")
        page.click("input[type=submit]")
        page.goto(f"{live_server.url}/admin/django_pglock/joblock/")
        page.locator("#result_list tbody tr", has_text="cancelled").locator(
            "input.action-select"
        ).check()
        page.select_option("select[name=action]", "force_release")
        page.click("button[name=index]")
        expect(page.locator("#content h1")).to_have_text("Force release: are you sure?")
        page.click("text=No, take me back")
        try:
            expect(page.locator("#result_list tbody tr", has_text="cancelled")).to_have_count(
                1, timeout=5_000
            )
        finally:
            page.close()
    lease.check()
    lease.release()
