"""Attacks on job health (issue 14): false status, lost or doubled episodes, leaks.

Each failing test is a broken promise of the README's "Job health" section; its docstring
says what the user sees. The passing ones pin attacks that held. Runs are written with SQL
where the promise is about judging history (fast, exact times by the database clock) and
with real processes where it is about processes.
"""

from __future__ import annotations

import uuid

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_pglock import Lock, signals
from django_pglock.health import job_health
from tests.subprocs import Received

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def unique(label):
    return f"atk14-{label}-{uuid.uuid4().hex[:8]}"


def jobs(**entries):
    return override_settings(DJANGO_PGLOCK={"JOBS": entries})


def health_of(name, **kwargs):
    (found,) = [job for job in job_health(**kwargs) if job.name == name]
    return found


def add_run(db, name, outcome, started_ago, duration=1.0):
    """A finished run of ``name`` that started ``started_ago`` seconds ago (database clock)."""
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome, reason) VALUES (%s, 'h', 'host', 1, '',"
        " now() - make_interval(secs => %s), now() - make_interval(secs => %s) +"
        " make_interval(secs => %s), %s, %s, '')",
        [name, started_ago, started_ago, duration, duration, outcome],
    )


def test_every_job_that_runs_on_time_but_fails_is_failing_not_overdue(db):
    """An ``every: 60s`` job succeeded 10 minutes ago and has started every minute since,
    each run failing. The user sees ``overdue: a start was due at … and none began`` (and
    gets ``job_overdue``; ``django_pglock_job_state{state="failing"}`` stays 0, so the
    JobFailing alert never fires), though a start began a few seconds ago."""
    name = unique("every-fails")
    add_run(db, name, "succeeded", 600)
    for ago in range(540, 0, -60):
        add_run(db, name, "failed", ago)
    with jobs(**{name: {"every": "60s", "grace": "30s"}}):
        found = health_of(name, announce=False)
    assert found.state == "failing", f"{found.state}: {found.detail}"


def test_a_retry_between_checks_does_not_end_the_failing_episode(db):
    """A failing job is retried; a check runs while the retry holds the lock; the retry
    fails too. The job was never healthy, yet ``job_failing`` is sent twice: the episode
    was closed when the job turned ``running`` (README: "the episode ends when the job is
    healthy again")."""
    name = unique("retry")
    add_run(db, name, "failed", 120)
    with jobs(**{name: {}}), Received(signals.job_failing) as heard:
        assert health_of(name).state == "failing"
        with pytest.raises(RuntimeError), Lock(name, record=True).acquire():
            assert health_of(name).state == "running"  # a check while the retry runs
            raise RuntimeError("the retry fails too")
        assert health_of(name).state == "failing"
    sent = [call["health"].detail for call in heard.calls]
    assert len(sent) == 1, sent


def test_pruning_old_history_does_not_make_an_overdue_every_job_healthy(db):
    """``every: 1d``: the last success was 3 days ago, so the job is overdue. The operator
    runs ``pglock_prune --older-than 2d`` (keep two days of history); the job is now
    ``healthy`` and the health endpoint 200, though nothing ran: ``every`` counts from the
    last success, and without one "nothing says when the first success was due"."""
    name = unique("pruned")
    add_run(db, name, "succeeded", 3 * 86400)
    with jobs(**{name: {"every": "1d", "grace": "1h"}}):
        assert health_of(name, announce=False).state == "overdue"
        call_command("pglock_prune", "--older-than", "2d")
        found = health_of(name, announce=False)
    assert found.state == "overdue", f"{found.state}: last success {found.last_success_at}"


def test_an_episode_whose_history_was_pruned_is_announced_when_it_fails_again(db):
    """An undeclared job fails (``job_failing`` sent); its history is then deleted, so it is
    no longer a job and its episode was never closed. Later it runs and fails again: no
    ``job_failing`` was sent, because the stale episode row still said it was announced.
    (``pglock_prune`` now keeps each job's latest failure; the history is deleted by hand.)"""
    name = unique("forgotten")
    add_run(db, name, "failed", 3 * 86400)
    with Received(signals.job_failing) as heard:
        assert health_of(name).state == "failing"
        db.execute("DELETE FROM django_pglock_jobrun WHERE name = %s", [name])
        job_health()  # the episode outlived its history: judged healthy, it closes
        assert name not in {job.name for job in job_health()}
        add_run(db, name, "failed", 10)
        assert health_of(name).state == "failing"
    assert [call["name"] for call in heard.calls] == [name, name]


def test_pruning_keeps_each_jobs_latest_failure_so_its_episode_stays(db):
    """With ``pglock_prune`` the latest failure stays: the job stays failing, one episode."""
    name = unique("pruned")
    add_run(db, name, "failed", 3 * 86400)
    with Received(signals.job_failing) as heard:
        assert health_of(name).state == "failing"
        call_command("pglock_prune", "--older-than", "2d")
        assert health_of(name).state == "failing"
    assert [call["name"] for call in heard.calls] == [name]


def test_a_stale_holder_does_not_hide_an_overdue_job(db):
    """``every: 60s``, last success an hour ago; the lock row of a holder that stopped
    heartbeating 50 minutes ago (stale: the next contender may take it) is still there.
    The job reads ``running`` and the health endpoint says 200 "healthy", though no start
    began for an hour."""
    name = unique("stale")
    add_run(db, name, "succeeded", 3600)
    db.execute(
        "INSERT INTO django_pglock_joblock (name, token, holder, host, pid, backend_pid,"
        " description, acquired_at, last_heartbeat, heartbeat_interval, alert_after,"
        " stale_after, advisory) VALUES (%s, nextval('django_pglock_token_seq'), 'gone', 'h',"
        " 1, 1, '', now() - interval '55 minutes', now() - interval '50 minutes', 10, 30,"
        " 600, false)",
        [name],
    )
    with jobs(**{name: {"every": "60s", "grace": "60s"}}):
        found = health_of(name, announce=False)
    assert found.holder["lock_state"] == "stale"
    assert found.problem, f"{found.state}: {found.detail}"


def test_the_health_view_answers_while_the_run_table_is_locked(db):
    """A migration (or ``VACUUM FULL``, ``LOCK TABLE``) holds an exclusive lock on the run
    table. ``GET /health/`` never answers: the statement runs on Django's own connection,
    without the lock session's ``lock_timeout``/``statement_timeout``, and waits for the
    lock. Each probe pins a web worker; no "unavailable" 503 comes (the test gives it 10 s,
    twice the lock session's own 5 s ``lock_timeout``)."""
    import threading

    from django.db import connections
    from django.test import Client

    answers = []

    def probe():
        try:
            answers.append(Client(raise_request_exception=False).get("/health/").status_code)
        finally:
            connections.close_all()

    db.execute("BEGIN")
    # (Job health reads the job summaries, not the history: the summaries are locked too.)
    db.execute("LOCK TABLE django_pglock_jobrun, django_pglock_jobsummary IN ACCESS EXCLUSIVE MODE")
    thread = threading.Thread(target=probe, daemon=True)
    try:
        thread.start()
        thread.join(10)
        answered = list(answers)
    finally:
        db.execute("ROLLBACK")
        thread.join(30)
    assert answered == [503], "no answer within 10 s while the run table was locked"


def test_a_logged_in_caller_gets_unavailable_when_the_database_is_down():
    """The lock database is the default one (the usual setup) and it is down. An anonymous
    probe gets 503 "unavailable", but a logged-in staff user (or any caller with a session
    cookie) gets a 500 server error: ``may_see_details`` reads ``request.user`` (the
    session table) before the ``try`` that turns database errors into "unavailable"."""
    from django.contrib.auth.models import User
    from django.db import connections
    from django.test import Client

    client = Client(raise_request_exception=False)
    client.force_login(User.objects.create_user("staff14", password="pw", is_staff=True))
    wrapper = connections["default"]
    port = wrapper.settings_dict["PORT"]
    wrapper.close()
    wrapper.settings_dict["PORT"] = "1"  # nothing listens there
    try:
        anonymous = Client(raise_request_exception=False).get("/health/")
        staff = client.get("/health/")
    finally:
        wrapper.close()
        wrapper.settings_dict["PORT"] = port
    assert (anonymous.status_code, anonymous.json()) == (503, {"status": "unavailable"})
    assert staff.status_code == 503, staff.content[:200]


TOKEN = "attack-token-0123456789-abcdef"


def scrape(**jobs_entries):
    from django.test import Client
    from prometheus_client.parser import text_string_to_metric_families

    with override_settings(DJANGO_PGLOCK={"JOBS": jobs_entries, "HEALTH_TOKEN": TOKEN}):
        response = Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").get("/metrics/")
    assert response.status_code == 200
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    ]


def test_prometheus_exposition_parses_with_hostile_job_names(db):
    """Held: quotes, backslashes, newlines and non-ASCII in job names are escaped; every
    job, declared or from history, has its series with its exact name."""
    tag = uuid.uuid4().hex[:6]
    hostile = [f'q"{tag}', f"b\\{tag}\\n", f"nl\n{tag}", f"ü\u2013🙂{tag}", f"sp {tag} }}{{"]
    for name in hostile[:3]:
        add_run(db, name, "failed", 5)
    samples = scrape(**{name: {"every": "1h"} for name in hostile[3:]})
    states = {
        labels["job"]: value
        for metric, labels, value in samples
        if metric == "django_pglock_job_state"
        and labels["state"] in ("failing", "healthy")
        and value == 1.0
    }
    assert all(name in states for name in hostile), sorted(states)


@pytest.mark.parametrize(
    "header",
    [
        f"bearer {TOKEN}",
        f"BEARER  {TOKEN} ",
    ],
)
def test_bearer_case_and_spaces_open_the_details(header):
    """Held: the scheme is case-insensitive and spaces around the token are ignored."""
    from django.test import Client

    with override_settings(DJANGO_PGLOCK={"HEALTH_TOKEN": TOKEN}):
        body = Client(HTTP_AUTHORIZATION=header).get("/health/").json()
    assert "jobs" in body


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN}x",
        f"Bearer\t{TOKEN}",
        f"Token {TOKEN}",
        f"Bearer {TOKEN.upper()}",
        "Bearer " + " " * 30,
    ],
)
def test_near_miss_tokens_and_anonymous_head_leak_nothing(db, header):
    """Held: a near-miss token, HEAD, 405 and never-cache: no job name for the anonymous."""
    from django.test import Client

    name = unique("secret-job")
    add_run(db, name, "failed", 5)
    with override_settings(DJANGO_PGLOCK={"HEALTH_TOKEN": TOKEN, "JOBS": {name: {}}}):
        client = Client(HTTP_AUTHORIZATION=header)
        got = client.get("/health/")
        head = client.head("/health/")
        post = client.post("/health/")
        metrics = client.get("/metrics/")
    assert got.json() == {"status": "unhealthy"}
    for response in (got, head, post, metrics):
        assert name.encode() not in response.content
        assert name not in str(response.headers)
    assert head.status_code == 503 and post.status_code == 405 and metrics.status_code == 403
    assert "max-age=0" in got["Cache-Control"] and "no-store" in got["Cache-Control"]


def test_an_inactive_staff_user_sees_the_status_alone(db):
    """Held: ``is_active`` is checked (a session of a deactivated staff user)."""
    from django.contrib.auth.models import User
    from django.test import Client

    name = unique("inactive")
    add_run(db, name, "failed", 5)
    user = User.objects.create_user("gone14", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    User.objects.filter(pk=user.pk).update(is_active=False)
    with jobs(**{name: {}}):
        assert client.get("/health/").json() == {"status": "unhealthy"}
        assert client.get("/metrics/").status_code == 403


def test_a_non_ascii_token_that_passes_e015_opens_the_details_over_wsgi():
    """``HEALTH_TOKEN = "jeton-sécurisé-0123456789"`` passes ``manage.py check`` (16
    printable characters). A client sends it as UTF-8 bytes, which a WSGI server hands to
    Django decoded as latin-1 (PEP 3333): the token never matches and the details stay
    closed for good. E015 should refuse a token that is not ASCII (or the comparison
    should be on the header's bytes)."""
    from django.core.handlers.wsgi import WSGIRequest

    from django_pglock.access import may_see_details
    from django_pglock.checks import check_settings

    token = "jeton-sécurisé-0123456789"
    wire = f"Bearer {token}".encode().decode("latin-1")  # what the WSGI environ holds
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/health/",
        "HTTP_AUTHORIZATION": wire,
        "wsgi.input": __import__("io").BytesIO(b""),
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
    }
    with override_settings(DJANGO_PGLOCK={"HEALTH_TOKEN": token}):
        accepted = not [m for m in check_settings() if m.id == "django_pglock.E015"]
        opened = may_see_details(WSGIRequest(environ))
    assert opened or not accepted, "E015 accepts a token that no WSGI client can present"


def test_one_job_one_state_whatever_the_callers_time_zone(db):
    """A job ``"M * * * *"`` (hourly) ran at its last tick; the probe (``TIME_ZONE="UTC"``)
    reads ``healthy``. A staff user whose middleware activates their own zone
    (``timezone.activate("Asia/Kolkata")``, UTC+5:30, a common per-user setup) opens
    ``/health/`` and reads ``overdue``, and the ``job_overdue`` signal goes out: the ticks
    are computed in whatever zone the calling request happens to have active, not in the
    zone the job's hosts schedule in."""
    import datetime

    from django.utils import timezone

    ((now,),) = db.execute("SELECT now()").fetchall()
    minute = (now.minute + 28) % 60  # UTC ticks ~32 min ago; Kolkata's ~2 min ago
    tick = now.replace(second=0, microsecond=0, minute=minute)
    if tick > now:
        tick -= datetime.timedelta(hours=1)
    name = unique("zone")
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome, reason) VALUES (%s, 'h', 'host', 1, '', %s, %s,"
        " 1, 'succeeded', '')",
        [name, tick, tick + datetime.timedelta(seconds=1)],
    )
    with jobs(**{name: {"schedule": f"{minute} * * * *", "grace": "30s"}}):
        probe = health_of(name, announce=False).state
        with timezone.override("Asia/Kolkata"):
            staff = health_of(name, announce=False).state
    assert (probe, staff) == ("healthy", "healthy")


NOTICER = """
import sys
import django
django.setup()
from django_pglock import signals
from django_pglock.health import job_health
name = sys.argv[1]
def heard(sender, name, health, **kwargs):
    if name == sys.argv[1]:
        print("SENT", name, flush=True)
signals.job_failing.connect(heard)
print("READY", flush=True)
sys.stdin.readline()
for _ in range(5):
    job_health()
print("DONE", flush=True)
"""


def test_processes_noticing_at_once_announce_an_episode_once(procs, db):
    """Held: four processes check a newly failing job at once; one ``job_failing``."""
    import sys

    from tests.procs import go_together

    name = unique("race")
    add_run(db, name, "failed", 5)
    noticers = [procs.start(sys.executable, "-c", NOTICER, name, stdin=True) for _ in range(4)]
    go_together(noticers)
    outputs = [proc.result(60).stdout for proc in noticers]
    assert all("DONE" in out for out in outputs), outputs
    assert sum(out.count("SENT") for out in outputs) == 1, outputs


def test_a_receiver_that_raises_does_not_break_health_nor_repeat_the_episode(db, caplog):
    """Held: the raising receiver is logged; the others hear it once; job_health answers."""
    name = unique("raises")
    add_run(db, name, "failed", 5)

    def boom(sender, **kwargs):
        raise RuntimeError("receiver bug")

    signals.job_failing.connect(boom)
    try:
        with Received(signals.job_failing) as heard:
            assert health_of(name).state == "failing"
            assert health_of(name).state == "failing"
    finally:
        signals.job_failing.disconnect(boom)
    assert [call["name"] for call in heard.calls] == [name]
    assert "receiver bug" in caplog.text


def test_job_health_is_two_statements_whatever_the_number_of_jobs(db):
    """Held for reads: 300 declared jobs, history and holders: two statements once the
    episodes are open (the first notice of N new problems adds N inserts)."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    names = [unique(f"many{i}") for i in range(300)]
    db.execute(
        "INSERT INTO django_pglock_jobrun (name, holder, host, pid, description, started_at,"
        " finished_at, duration, outcome, reason) SELECT n, 'h', 'host', 1, '', now() -"
        " interval '1 hour', now() - interval '1 hour', 1, CASE WHEN i %% 3 = 0 THEN 'failed'"
        " ELSE 'succeeded' END, '' FROM unnest(%s::varchar[]) WITH ORDINALITY AS t(n, i)",
        [names],
    )
    entries = {
        n: ({"every": "10m"} if i % 2 else {"schedule": "*/5 * * * *"}) for i, n in enumerate(names)
    }
    with jobs(**entries), Lock(names[1]).acquire():
        job_health()  # opens the episodes
        with CaptureQueriesContext(connections["default"]) as captured:
            judged = job_health()
    # Two reads, in a transaction that bounds them (BEGIN, SET LOCAL ..., COMMIT).
    frame = ("BEGIN", "COMMIT", "SET LOCAL")
    reads = [q for q in captured.captured_queries if not q["sql"].startswith(frame)]
    assert len(reads) <= 2, [q["sql"][:60] for q in captured.captured_queries]
    assert {job.name for job in judged} >= set(names)


def test_unavailable_names_no_secret_in_the_body_nor_the_log(caplog):
    """Held: the lock database refuses connections (a closed TCP port): anonymous 503
    "unavailable"; the password is neither in the body nor in any log record."""
    import logging

    from django.db import connections
    from django.test import Client

    wrapper = connections["default"]
    saved = dict(wrapper.settings_dict)
    wrapper.close()
    wrapper.settings_dict.update(HOST="127.0.0.1", PORT="1", PASSWORD="hunter2-secret-pw")
    try:
        with caplog.at_level(logging.DEBUG):
            response = Client(raise_request_exception=False).get("/health/")
    finally:
        wrapper.close()
        wrapper.settings_dict.clear()
        wrapper.settings_dict.update(saved)
    assert (response.status_code, response.json()) == (503, {"status": "unavailable"})
    assert "hunter2" not in caplog.text and b"hunter2" not in response.content
    assert "could not read job health" in caplog.text


COLLIDER = """
import sys
import django
django.setup()
import django_pglock.sql as pglock_sql
real = pglock_sql.advisory_key
shared = real(sys.argv[1])
pglock_sql.advisory_key = lambda name: shared if name in sys.argv[1:3] else real(name)
from django_pglock import Lock
for line in sys.stdin:
    lease = Lock(sys.argv[2]).try_acquire()
    print("GOT" if lease is not None else "REFUSED", flush=True)
    if lease is not None:
        lease.release()
"""


def test_colliding_keys_in_one_session_never_let_a_contender_in(procs, monkeypatch):
    """README: "Key collisions only ever cost speed". Two names whose advisory keys
    collide (simulated: both processes map them to one key) are held by one process;
    it releases the first. The release gives back the shared key (its ``ours`` check
    looks only at rows of the *same name*), so the second name's row still says
    "advisory" while nobody holds its key, and a contender in another process takes the
    second name at once: two holders."""
    import sys

    import django_pglock.sql as pglock_sql

    first, second = unique("collide-a"), unique("collide-b")
    real = pglock_sql.advisory_key
    shared = real(first)
    monkeypatch.setattr(
        pglock_sql, "advisory_key", lambda name: shared if name in (first, second) else real(name)
    )
    lease_a = Lock(first).try_acquire()
    lease_b = Lock(second).try_acquire()
    assert lease_a is not None and lease_b is not None
    contender = procs.start(sys.executable, "-c", COLLIDER, first, second, stdin=True)
    try:
        contender.send("try")
        assert contender.read_line(60) == "REFUSED"  # both held: the key is held
        lease_a.release()
        contender.send("try")
        answer = contender.read_line(60)
    finally:
        lease_b.release()
        contender.close_stdin()
    assert answer == "REFUSED", (
        f"{answer}: a contender took {second} while its live holder (this process) held it"
    )


@pytest.mark.parametrize("expression", ["30 2 * * *", "0 * * * *", "*/15 * * * *", "0 3 * * *"])
def test_dst_changes_a_run_in_its_slot_is_never_overdue(expression):
    """Held: across both 2026 DST changes in Europe/Berlin, a run in the slot the
    scheduler computes counts for the tick health says was due (grace 1 s)."""
    import datetime

    from django.utils import timezone

    from django_pglock.health import _due
    from django_pglock.jobspec import JobSpec
    from django_pglock.schedule import ScheduleSlot

    utc = datetime.timezone.utc
    spec = JobSpec("dst", schedule=expression, grace=1.0)
    slot = ScheduleSlot(expression, "dst")
    starts = [
        datetime.datetime(2026, 3, 28, 22, tzinfo=utc),
        datetime.datetime(2026, 10, 24, 22, tzinfo=utc),
    ]
    with override_settings(TIME_ZONE="Europe/Berlin"), timezone.override("Europe/Berlin"):
        for start in starts:
            for minute in range(0, 8 * 60, 5):
                ran = start + datetime.timedelta(minutes=minute)
                claimed = slot.current_slot(ran)
                for later in (2, 120, 299):
                    now = ran + datetime.timedelta(seconds=later)
                    due, _, overdue = _due(spec, now, claimed, None)
                    # Overdue only if a tick fell after the run's slot and before now - grace.
                    nxt = slot.current_slot(now - datetime.timedelta(seconds=1), tolerance=0)
                    assert overdue == (nxt > claimed), (ran, now, claimed, due)
