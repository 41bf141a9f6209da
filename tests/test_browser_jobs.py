"""The jobs page in a real browser: log in, open it from the run history, read the health
badges and the run charts, filter by health.

Debian's Chromium through Playwright, against ``live_server``, as tests/test_browser.py
(whose browser helper this reuses; the same rule holds: the ORM only before the browser
starts and after it ends). History older than the test is written through a psycopg
session; one failure comes from a real ``locked_run``, and the running and too-long jobs
hold real leases. ``PGLOCK_SCREENSHOT_DIR=docs pytest tests/test_browser_jobs.py``
refreshes ``docs/admin-jobs.png`` for the README.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import cronsim
import pytest
from django.contrib.auth.models import User

from django_pglock import Lock
from tests.subprocs import open_db
from tests.test_browser import CHROMIUM, TIMEOUT_MS, chromium

pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="Chromium is not installed (no `chromium` on PATH); on Debian/Ubuntu: "
        "apt-get install chromium",
    ),
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("clean_locks"),
]

QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}
NIGHTLY = "0 3 * * *"
JOBS = {
    "nightly-report": {"schedule": NIGHTLY, "grace": "1h", "max_duration": "2h"},
    "sync-prices": {"every": "15m", "grace": "5m"},
    "invoice-export": {"every": "1h", "grace": "10m"},
    "search-reindex": {"every": "1h", "grace": "10m"},
    "billing-close": {"every": "1d", "max_duration": "30m"},
    "tenant-sync:42": {"every": "1h"},
}
EXPECTED = {
    "nightly-report": "healthy",
    "sync-prices": "healthy",
    "invoice-export": "failing",
    "search-reindex": "overdue",
    "billing-close": "too-long",
    "tenant-sync:42": "running",
}


def insert(db, name, started, duration, outcome):
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome) VALUES (%s, 'h', %s, 4242, '', %s, %s, %s, %s)",
        [
            name,
            "worker-2.example" if duration % 2 else "worker-1.example",
            started,
            started + datetime.timedelta(seconds=duration),
            duration,
            outcome,
        ],
    )


def write_history(db, now):
    """Twenty runs or so of each job, with a few failures and durations that vary."""
    nightly = cronsim.CronSim(NIGHTLY, now, reverse=True)
    for i in range(20):
        tick = next(nightly)
        insert(
            db, "nightly-report", tick, 1800 + (i * 397) % 1500, "lost" if i == 13 else "succeeded"
        )
    for i in range(20):
        started = now - datetime.timedelta(minutes=15 * i + 4)
        insert(
            db, "sync-prices", started, 20 + (i * 7) % 25, "failed" if i in (6, 7) else "succeeded"
        )
    for i in range(1, 19):
        started = now - datetime.timedelta(hours=i, minutes=3)
        insert(db, "invoice-export", started, 60 + (i * 13) % 50, "succeeded")
    for i in range(14):
        started = now - datetime.timedelta(hours=3 + i)
        insert(db, "search-reindex", started, 300 + (i * 71) % 400, "succeeded")
    for i in range(1, 12):
        started = now - datetime.timedelta(days=i, hours=1)
        insert(db, "billing-close", started, 600 + (i * 113) % 900, "succeeded")
    for i in range(1, 16):
        started = now - datetime.timedelta(hours=i)
        insert(
            db, "tenant-sync:42", started, 90 + (i * 31) % 120, "failed" if i == 9 else "succeeded"
        )


def test_the_jobs_page_in_the_browser(live_server, pg_url, test_db_name, tmp_path, procs, settings):
    settings.DJANGO_PGLOCK = {"JOBS": JOBS}
    User.objects.create_superuser("ops", "ops@example.com", "ops-password-not-secret")
    with open_db(pg_url, test_db_name) as db:
        for table in ("jobrun", "scheduleclaim", "jobepisode"):
            db.execute(f"DELETE FROM django_pglock_{table}")
        (now,) = db.execute("SELECT now()").fetchone()
        write_history(db, now)
    failed = procs.run_django("locked_run", "--name", "invoice-export", "exit_with", "1")
    assert failed.returncode == 1, failed.stderr

    shots = Path(os.environ.get("PGLOCK_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with chromium() as browser:
        from playwright.sync_api import expect

        # Two holders: one running, one held past its max_duration (its grant aged by SQL).
        leases = [
            Lock(name, record=True, description=name, **QUIET).try_acquire()
            for name in ("tenant-sync:42", "billing-close")
        ]
        assert all(leases)
        with open_db(pg_url, test_db_name) as db:
            for table in ("joblock", "jobrun"):
                column = "acquired_at" if table == "joblock" else "started_at"
                db.execute(
                    f"UPDATE django_pglock_{table} SET {column} = now() - interval '47 minutes'"
                    f" WHERE name = 'billing-close' AND {column} > now() - interval '1 minute'"
                )

        page = browser.new_page(viewport={"width": 1500, "height": 640})
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{live_server.url}/admin/login/?next=/admin/django_pglock/jobrun/")
        page.fill("#id_username", "ops")
        page.fill("#id_password", "ops-password-not-secret")
        page.click("input[type=submit]")
        expect(page.locator("#user-tools")).to_contain_text("ops")
        page.evaluate("localStorage.setItem('django.admin.navSidebarIsOpen', 'false')")

        page.click("text=Jobs and their health")
        expect(page.locator("#content h1")).to_have_text("Jobs")
        rows = page.locator("#jobs-list tbody tr")
        expect(rows).to_have_count(len(EXPECTED))
        for name, state in EXPECTED.items():
            row = page.locator(f"#jobs-list tbody tr[data-job='{name}']")
            expect(row.locator("td.field-health span").first).to_have_text(state)
            expect(row.locator("svg.run-chart")).to_be_visible()
        # The charts: one bar per run, the latest on the right, exact values in its title.
        export = page.locator("#jobs-list tbody tr[data-job='invoice-export']")
        bars = export.locator("svg.run-chart rect")
        expect(bars).to_have_count(19)
        expect(bars.last).to_have_class("run run-failed")
        expect(bars.last.locator("title")).to_contain_text("failed, ")
        assert bars.last.evaluate("e => getComputedStyle(e).fill") == "rgb(198, 40, 40)"
        expect(export.locator("td.field-last-run")).to_contain_text("failed")
        running = page.locator("#jobs-list tbody tr[data-job='tenant-sync:42']")
        expect(running.locator("td.field-holder")).to_contain_text(f":{os.getpid()}")
        expect(running.locator("svg.run-chart rect").last).to_have_class("run run-running")
        page.screenshot(path=str(shots / "admin-jobs.png"), full_page=True)

        page.click("#changelist-filter a:has-text('failing (1)')")
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-job", "invoice-export")
        assert page.url.endswith("?state=failing")
        page.click("#changelist-filter a:has-text('All (6)')")
        expect(rows).to_have_count(len(EXPECTED))
        # The job's name leads to its run history.
        export.locator("th a").click()
        expect(page.locator("#result_list tbody tr")).to_have_count(19)
        assert errors == []
        page.close()
        for lease in leases:
            lease.release()
    assert (shots / "admin-jobs.png").stat().st_size > 10_000
