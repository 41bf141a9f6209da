"""@singleton_job composed with Django 6's django.tasks (@task above @singleton_job)."""

from __future__ import annotations

import pytest

pytest.importorskip("django.tasks", reason="django.tasks exists from Django 6.0 on")

from django_pglock import Lock, singleton_job

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def test_task_body_runs_under_the_lock(tmp_path):
    from tests.testapp.tasks import task_job

    marker = tmp_path / "ran.log"
    assert task_job.module_path == "tests.testapp.tasks.task_job"
    result = task_job.enqueue(str(marker))  # the default backend runs it at once
    assert result.return_value == "ran"
    assert marker.read_text() == "RAN\n"

    held = Lock("task-job").try_acquire()
    try:
        skipped = task_job.enqueue(str(marker))
        assert skipped.return_value is None  # held elsewhere: the body did not run
        assert marker.read_text() == "RAN\n"
    finally:
        held.release()


def test_singleton_job_on_top_of_a_task_names_the_right_order():
    from tests.testapp.tasks import task_job

    with pytest.raises(ValueError, match=r"put @task above @singleton_job"):
        singleton_job("wrong-order")(task_job)
