"""The README's demo runs out of the box: ``python example_project/manage.py demo``, here
against a fresh database of the test server (``DATABASE_URL``)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from tests.procs import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture
def demo_url(pg_url):
    name = f"demo_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base, _, query = pg_url.partition("?")
    url = base.rsplit("/", 1)[0] + "/" + name + ("?" + query if query else "")
    yield url
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name]
        )
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')


def test_the_demo_shows_one_run_a_skip_tenants_and_an_overdue_job(demo_url):
    env = {**os.environ, "DATABASE_URL": demo_url}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "example_project" / "manage.py"), "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Report done." in out and "Skipped" in out, out
    assert "skipped (held by another replica)" in out, out
    assert "No locks are held." in out, out
    jobs = out.split("4. Job health", 1)[1]
    assert "OVERDUE: export-orders:" in jobs, out
    assert "nightly_report" in jobs and "healthy" in jobs, out
