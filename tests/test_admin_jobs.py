"""The admin's jobs page: each job's health, last runs and a chart of its recent runs.

Real server, no mocks: runs come from ``locked_run`` in child processes, or are written as
JobRun rows through a separate psycopg session when a test needs them old; holders are
real leases of this process. ``DJANGO_PGLOCK["JOBS"]`` is set per test with pytest-django's
``settings`` fixture.
"""

from __future__ import annotations

import re
import uuid

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_pglock import Lock, sql
from django_pglock.models import JobLock
from tests.subprocs import open_db

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

JOBS = reverse("admin:django_pglock_jobrun_jobs")
RUNS = reverse("admin:django_pglock_jobrun_changelist")
QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}


@pytest.fixture
def sql_db(pg_url, test_db_name):
    """A separate autocommit session on the test database, starting from no history."""
    with open_db(pg_url, test_db_name) as conn:
        for table in ("jobrun", "scheduleclaim", "jobepisode"):
            conn.execute(f"DELETE FROM django_pglock_{table}")
        yield conn


def unique(label):
    return f"jobs-{label}-{uuid.uuid4().hex[:6]}"


def insert_runs(db, name, *runs):
    """Runs of ``name``: (started how many minutes ago, duration in seconds, outcome)."""
    for minutes_ago, duration, outcome in runs:
        db.execute(
            "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
            " finished_at, duration, outcome) VALUES (%(name)s, 'h', 'worker-1', 1, '',"
            " now() - %(ago)s * interval '1 minute',"
            " CASE WHEN %(outcome)s = 'running' THEN NULL"
            "      ELSE now() - %(ago)s * interval '1 minute' + %(duration)s * interval '1 second'"
            " END, CASE WHEN %(outcome)s = 'running' THEN NULL ELSE %(duration)s END,"
            " %(outcome)s)",
            {"name": name, "ago": minutes_ago, "duration": duration, "outcome": outcome},
        )


def run(procs, name, code):
    result = procs.run_django("locked_run", "--name", name, "exit_with", str(code))
    assert result.returncode == code, result.stderr


def staff_user(*codenames, is_staff=True):
    user = User.objects.create_user(
        username=unique("user"), password="pw-not-secret", is_staff=is_staff
    )
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_pglock", codename=codename)
        )
    return user


def states(response):
    assert response.status_code == 200
    return {row.health.name: row.health.state for row in response.context["rows"]}


def row_html(response, name):
    """The table row of job ``name`` (its ``data-job`` attribute, escaped as the page does)."""
    html = response.content.decode()
    from django.utils.html import escape

    match = re.search(
        rf'<tr class="job [^"]*" data-job="{re.escape(escape(name))}">(.*?)</tr>', html, re.S
    )
    assert match, f"no row for {name!r}"
    return match.group(1)


def test_the_page_shows_each_job_with_its_state_last_runs_and_chart(
    admin_client, procs, sql_db, settings
):
    good, bad, late, busy, slow, never = (
        unique(label) for label in ("good", "bad", "late", "busy", "slow", "never")
    )
    settings.DJANGO_PGLOCK = {
        "JOBS": {
            late: {"every": "1h", "grace": "5m"},
            busy: {},
            slow: {"max_duration": "10m"},
            never: {"schedule": "0 3 * * *"},
        }
    }
    run(procs, good, 0)
    run(procs, bad, 0)
    run(procs, bad, 1)
    insert_runs(sql_db, late, (180, 2.5, "succeeded"))
    leases = [Lock(busy, **QUIET).try_acquire(), Lock(slow, **QUIET).try_acquire()]
    assert all(leases)
    sql_db.execute(
        "UPDATE django_pglock_joblock SET acquired_at = now() - interval '1 hour' WHERE name = %s",
        [slow],
    )

    response = admin_client.get(JOBS)
    shown = states(response)
    assert {name: shown[name] for name in (good, bad, late, busy, slow)} == {
        good: "healthy",
        bad: "failing",
        late: "overdue",
        busy: "running",
        slow: "too-long",
    }
    assert shown[never] in ("healthy", "overdue")  # overdue once a 3 a.m. tick passed grace

    # Health badges, styled as the holders page's.
    for name in (good, bad, late, busy, slow):
        assert re.search(
            rf'border-radius:8px;font-weight:bold">{shown[name]}</span>', row_html(response, name)
        )
    # The last run: its outcome, its host; the success and the failure.
    failing = row_html(response, bad)
    assert ">failed</span>" in failing
    chart = re.search(r"<svg .*?</svg>", failing, re.S).group(0)
    assert chart.count("<rect") == 2
    assert re.findall(r'class="run run-(\w+)"', chart) == ["succeeded", "failed"]
    assert "<title>failed, " in chart and "<title>succeeded, " in chart
    content = response.content.decode().split('id="content-main"')[1].split('id="footer"')[0]
    assert "<script" not in content  # no script of the page's own
    # A running job: its holder; a job that never ran: dashes and no chart.
    holder = JobLock.objects.get(pk=busy)
    assert f"{holder.host}:{holder.pid}" in row_html(response, busy)
    never_row = row_html(response, never)
    assert "<svg" not in never_row
    assert re.search(r'class="field-last-run">-</td>', never_row)
    assert re.search(r'class="field-last-success">-\s*</td>', never_row)
    assert re.search(r'class="field-holder">-</td>', never_row)
    # The job's name leads to its runs.
    assert f'href="{RUNS}?name={good}"' in row_html(response, good)
    for held in leases:
        held.release()


def test_filter_by_health_state_with_counts(admin_client, sql_db, settings):
    ok, bad = unique("ok"), unique("bad")
    insert_runs(sql_db, ok, (5, 1.0, "succeeded"))
    insert_runs(sql_db, bad, (5, 1.0, "succeeded"), (3, 1.0, "lost"))

    assert states(admin_client.get(JOBS, {"state": "failing"})) == {bad: "failing"}
    assert states(admin_client.get(JOBS, {"state": "healthy"})) == {ok: "healthy"}
    empty = admin_client.get(JOBS, {"state": "overdue"})
    assert states(empty) == {} and "No job is overdue." in empty.content.decode()
    page = admin_client.get(JOBS, {"state": "failing"}).content.decode()
    assert re.search(r'<li class="selected"><a href="\?state=failing">failing \(1\)</a>', page)
    assert '<a href="?">All (2)</a>' in page


@pytest.mark.parametrize(
    "params",
    [
        {"state": "bogus"},
        {"state": "failing\x00"},
        {"state": "\x00"},
        {"state": ""},
        {"state": "Failing"},
        {"p": "\x00"},
        {"p": "x"},
        {"p": "999"},
        {"p": "-1"},
        {"nonsense": "\x00", "state__regex": "("},
    ],
)
def test_an_invalid_filter_value_is_ignored(admin_client, sql_db, params):
    ok, bad = unique("ok"), unique("bad")
    insert_runs(sql_db, ok, (5, 1.0, "succeeded"))
    insert_runs(sql_db, bad, (3, 1.0, "failed"))
    response = admin_client.get(JOBS, params)
    assert states(response) == {ok: "healthy", bad: "failing"}
    assert '<li class="selected"><a href="?">All (2)</a>' in response.content.decode()


def test_permissions(client, sql_db):
    insert_runs(sql_db, unique("ok"), (5, 1.0, "succeeded"))
    login = reverse("admin:login")

    anonymous = client.get(JOBS)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith(login)
    client.force_login(staff_user("view_jobrun", is_staff=False))
    not_staff = client.get(JOBS)
    assert not_staff.status_code == 302 and not_staff["Location"].startswith(login)
    client.force_login(staff_user())
    assert client.get(JOBS).status_code == 403
    client.force_login(staff_user("view_joblock", "force_release_joblock"))
    assert client.get(JOBS).status_code == 403
    client.force_login(staff_user("view_jobrun"))
    response = client.get(JOBS)
    assert response.status_code == 200 and len(response.context["rows"]) == 1
    # Linked from the run history.
    assert f'href="{JOBS}"' in client.get(RUNS).content.decode()


def test_names_and_values_are_escaped(admin_client, sql_db):
    name = '<script>alert("x")</script>&"'
    insert_runs(sql_db, name, (5, 1.0, "failed"))
    sql_db.execute("UPDATE django_pglock_jobrun SET host = '<b>evil</b>' WHERE name = %s", [name])
    response = admin_client.get(JOBS)
    html = response.content.decode()
    assert states(response) == {name: "failing"}
    assert "<script>alert" not in html and "<b>evil" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&quot;" in html
    assert "&lt;b&gt;evil&lt;/b&gt;" in html
    row = row_html(response, name)
    assert 'aria-label="The last 1 runs of &lt;script&gt;' in row
    assert "?name=%3Cscript%3Ealert%28%22x%22%29%3C%2Fscript%3E%26%22" in row


def test_times_are_shown_in_the_active_time_zone(admin_client, sql_db, settings):
    settings.TIME_ZONE = "Asia/Tokyo"
    name = unique("tz")
    sql_db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome) VALUES (%s, 'h', 'w', 1, '',"
        " '2024-01-02 03:04:05+00', '2024-01-02 03:04:06+00', 1.0, 'succeeded')",
        [name],
    )
    response = admin_client.get(JOBS)
    row = row_html(response, name)
    assert '<time datetime="2024-01-02T12:04:05+09:00">' in row
    assert "<title>succeeded, 1.0 s, started Jan. 2, 2024, 12:04 p.m.</title>" in row


def test_the_chart_shows_the_last_20_runs_oldest_first(admin_client, sql_db):
    name = unique("many")
    outcomes = ["succeeded", "failed", "lost", "skipped"]
    insert_runs(sql_db, name, *((100 - i, float(i), outcomes[i % 4]) for i in range(30)))
    insert_runs(sql_db, name, (1, 0.0, "running"))
    response = admin_client.get(JOBS)
    chart = re.search(r"<svg .*?</svg>", row_html(response, name), re.S).group(0)
    kinds = re.findall(r'class="run run-(\w+)"', chart)
    assert len(kinds) == 20 and "skipped" not in kinds and kinds[-1] == "running"
    titles = re.findall(r"<title>(\w+), ([\d.]+) s", chart)
    # The newest non-skipped runs, oldest first: durations 9..29 without the skips (i % 4 == 3).
    expected = [float(i) for i in range(30) if i % 4 != 3][-19:]
    assert [float(seconds) for _outcome, seconds in titles[:19]] == expected
    assert "so far" in chart.split("<title>")[-1]


def test_the_recent_runs_are_one_statement_on_the_lock_alias(admin_client, sql_db):
    names = [unique(f"n{i}") for i in range(12)]
    for name in names:
        insert_runs(sql_db, name, (10, 1.0, "succeeded"), (5, 2.0, "failed"))
    with CaptureQueriesContext(connections["default"]) as queries:
        response = admin_client.get(JOBS)
    assert set(states(response)) == set(names)
    recent = [q["sql"] for q in queries.captured_queries if "CROSS JOIN LATERAL" in q["sql"]]
    assert len(recent) == 1
    assert sql.RECENT_RUNS.split("FROM")[0].strip()[:40] in recent[0]
    for name in names:
        assert row_html(response, name).count("<rect") == 2


def test_the_statement_uses_the_name_index(sql_db):
    with sql_db.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql.RECENT_RUNS, {"names": ["a", "b"], "limit": 20})
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("RESET enable_seqscan")
    assert "django_pglock_run_name_idx" in plan, plan


def test_pages_of_jobs_keep_the_filter(admin_client, sql_db, monkeypatch):
    from django.contrib import admin

    from django_pglock.models import JobRun

    monkeypatch.setattr(admin.site._registry[JobRun], "list_per_page", 2)
    names = sorted(unique(f"p{i}") for i in range(5))
    for name in names:
        insert_runs(sql_db, name, (5, 1.0, "failed"))
    insert_runs(sql_db, unique("ok"), (5, 1.0, "succeeded"))
    with CaptureQueriesContext(connections["default"]) as queries:
        first = admin_client.get(JOBS, {"state": "failing"})
    assert list(states(first)) == names[:2]
    (recent,) = [q["sql"] for q in queries.captured_queries if "CROSS JOIN LATERAL" in q["sql"]]
    assert names[0] in recent and names[2] not in recent  # the shown jobs' runs only
    html = first.content.decode()
    assert 'href="?state=failing&amp;p=2">next' in html and "page 1 of 3" in html
    last = admin_client.get(JOBS, {"state": "failing", "p": "3"})
    assert list(states(last)) == names[4:]
    assert 'href="?state=failing&amp;p=2">&lsaquo; previous' in last.content.decode()
