"""The same isolation in pytest-django's own style (run by pytest only)."""

import pytest

from django_pglock.models import JobRun, ScheduleClaim

from .jobs import report, yearly


@pytest.mark.django_db
def test_first():
    assert yearly() == "ran"
    token = report()
    assert JobRun.objects.filter(outcome="succeeded").count() == 2
    assert JobRun.objects.get(name="userproject-report").token == token


@pytest.mark.django_db
def test_second_sees_nothing_of_the_first():
    assert not JobRun.objects.exists()
    assert not ScheduleClaim.objects.exists()
    assert yearly() == "ran"
