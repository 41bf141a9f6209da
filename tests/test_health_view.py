"""The health endpoint, the Prometheus exposition and the django-health-check check
(issue 14, items 4 and 5), against the real server with real runs (``locked_run``
subprocesses) and the metrics parsed by ``prometheus_client``'s own parser."""

from __future__ import annotations

import json
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from django_pglock import Lock
from django_pglock.contrib import health_check as pglock_health_check
from django_pglock.contrib.prometheus import PrometheusMetrics

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

TOKEN = "a-test-token-of-some-length-0123456789"
HEALTH = "/health/"


def unique(label):
    return f"view-{label}-{uuid.uuid4().hex[:8]}"


def run(procs, name, code):
    result = procs.run_django("locked_run", "--name", name, "exit_with", str(code))
    assert result.returncode == code, result.stderr


def settings_for(**jobs):
    return override_settings(DJANGO_PGLOCK={"JOBS": jobs, "HEALTH_TOKEN": TOKEN})


@pytest.fixture
def staff_client():
    user = User.objects.create_user("staff", password="pw", is_staff=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def failing_job(procs):
    name = unique("failing")
    run(procs, name, 1)
    return name


def test_the_url_name_is_django_pglock_health():
    assert reverse("django_pglock:health") == HEALTH


def test_anonymous_callers_get_the_status_alone(failing_job):
    with settings_for(**{failing_job: {}}):
        response = Client().get(HEALTH)
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy"}
    assert failing_job.encode() not in response.content
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]


def test_healthy_is_200(procs):
    name = unique("ok")
    run(procs, name, 0)
    # Only this test's job is declared; others in the history may be failing: judge one.
    with settings_for(**{name: {}}):
        body = Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").get(HEALTH).json()
    mine = [job for job in body["jobs"] if job["name"] == name]
    assert mine[0]["state"] == "healthy"
    assert set(body["counts"]) == {
        "healthy",
        "running",
        "overdue",
        "failing",
        "too-long",
        "abandoned",
    }
    assert body["status"] == ("healthy" if not body["problems"] else "unhealthy")


def test_staff_and_token_holders_get_every_jobs_details(failing_job, staff_client):
    with settings_for(**{failing_job: {}}):
        for response in (
            staff_client.get(HEALTH),
            Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").get(HEALTH),
        ):
            assert response.status_code == 503
            body = response.json()
            assert body["status"] == "unhealthy"
            (job,) = [job for job in body["jobs"] if job["name"] == failing_job]
            assert job["state"] == "failing" and job["last_run"]["outcome"] == "failed"
            assert any(line.startswith(f"{failing_job}: failing:") for line in body["problems"])


@pytest.mark.parametrize(
    "header",
    ["Bearer wrong-token-wrong-token-wrong", "Basic " + TOKEN, TOKEN, "Bearer ", ""],
)
def test_a_wrong_token_gets_the_status_alone(failing_job, header):
    with settings_for(**{failing_job: {}}):
        response = Client(HTTP_AUTHORIZATION=header).get(HEALTH)
    assert response.json() == {"status": "unhealthy"}


def test_a_token_that_is_too_short_never_opens_the_details(failing_job):
    with override_settings(DJANGO_PGLOCK={"HEALTH_TOKEN": "short"}):
        response = Client(HTTP_AUTHORIZATION="Bearer short").get(HEALTH)
        from django_pglock.checks import check_settings

        assert [m.id for m in check_settings()] == ["django_pglock.E015"]
        assert "short" not in check_settings()[0].msg
    assert response.json() == {"status": "unhealthy"}


def test_only_get_and_head(failing_job):
    client = Client()
    assert client.head(HEALTH).status_code == 503
    assert client.post(HEALTH).status_code == 405


def test_prometheus_needs_staff_or_the_token():
    assert Client().get("/metrics/").status_code == 403


def test_prometheus_exposes_declared_jobs_at_zero_and_real_health(procs):
    fresh, failing = unique("fresh"), unique("bad")
    run(procs, failing, 1)
    with settings_for(**{fresh: {"every": "1h"}, failing: {}}):
        response = Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").get("/metrics/")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def value(metric, **labels):
        return samples[(metric, tuple(sorted(labels.items())))]

    # A declared job that never ran has its series, at zero.
    assert value("django_pglock_job_last_success_timestamp_seconds", job=fresh) == 0.0
    assert value("django_pglock_job_overdue", job=fresh) == 0.0
    assert value("django_pglock_job_state", job=fresh, state="healthy") == 1.0
    assert value("django_pglock_job_state", job=failing, state="failing") == 1.0
    assert value("django_pglock_job_state", job=failing, state="healthy") == 0.0
    assert value("django_pglock_job_last_run_duration_seconds", job=failing) > 0.0


def test_the_prometheus_hook_counts_grants_contention_and_holds():
    name = unique("hook")
    hook = PrometheusMetrics()
    with override_settings(DJANGO_PGLOCK={"HEALTH_TOKEN": TOKEN}):
        with Lock(name, metrics=hook).acquire():
            assert Lock(name, metrics=hook).try_acquire() is None  # held: contended
        response = Client(HTTP_AUTHORIZATION=f"Bearer {TOKEN}").get("/metrics/")
    text = response.content.decode()
    samples = {
        (s.name, s.labels.get("name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("django_pglock_acquisitions_total", name)] == 1.0
    assert samples[("django_pglock_contentions_total", name)] == 1.0
    assert samples[("django_pglock_hold_seconds_count", name)] == 1.0
    assert samples[("django_pglock_wait_seconds_count", name)] == 1.0


def test_the_health_check_backend_fails_on_a_failing_job_without_naming_it(failing_job):
    with settings_for(**{failing_job: {}}):
        message = pglock_health_check.problem_message()
        assert message is not None and "failing" in message and failing_job not in message
        check = pglock_health_check.JobHealthCheck()
        if hasattr(check, "run"):  # django-health-check 4
            from asgiref.sync import async_to_sync
            from health_check.exceptions import ServiceUnavailable

            with pytest.raises(ServiceUnavailable):
                async_to_sync(check.run)()
            response = Client().get("/ht/?format=json")
            assert response.status_code == 500
            assert failing_job not in json.dumps(response.json())
        else:  # django-health-check 3
            check.check_status()
            assert check.errors and "failing" in str(check.errors[0])
