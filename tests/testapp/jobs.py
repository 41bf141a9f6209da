"""Jobs decorated with the public ``@singleton_job`` API, exercised by tests/test_jobs.py."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from django_pglock import singleton_job
from django_pglock.models import JobLock


def _append(path, text):
    with open(path, "a", encoding="utf-8") as out:
        out.write(text + "\n")


@singleton_job
def refresh():
    """Bare decorator: the lock is named after the function's module and qualname.

    Returns the names of the locks held while it runs, read from the table itself.
    """
    return sorted(JobLock.objects.values_list("name", flat=True))


@singleton_job("nightly-report")
def report(path, seconds=0.0):
    """Append one line naming this process to ``path``, sleep, and return a value."""
    _append(path, f"report {os.getpid()}")
    time.sleep(seconds)
    return f"report done by {os.getpid()}"


@singleton_job(key=lambda tenant_id, **kw: f"training:{tenant_id}")
def advance_pipeline(tenant_id, started=None, proceed=None):
    """One lock per tenant. ``started``/``proceed`` (threading.Event) let a test hold it."""
    if started is not None:
        started.set()
    if proceed is not None:
        assert proceed.wait(30), "the test never let the pipeline step finish"
    return f"advanced {tenant_id} in {threading.current_thread().name}"


@singleton_job("async-sync")
async def sync(calls, seconds=0.0):
    """An async job: record the call in ``calls`` (a list), sleep, return a value."""
    calls.append(os.getpid())
    await asyncio.sleep(seconds)
    return "synced"


@singleton_job("slot-job", schedule="* * * * *")
def slot_job(path, seconds=0.0):
    """At most one start per minute (cron slot), judged by the database clock."""
    _append(path, f"slot {os.getpid()}")
    time.sleep(seconds)
    return "slot done"


# -- run history (tests/test_admin.py) ------------------------------------------------


@singleton_job("recorded-job", record=True)
def recorded_job(seconds=0.0, fail=False):
    """A job recorded in the run history whatever the settings say."""
    time.sleep(seconds)
    if fail:
        raise RuntimeError("recorded-job failed on purpose")
    return "recorded"


@singleton_job("recorded-lost", record=True)
def recorded_lost_job():
    """Loses its own lock mid-run (a forced release), then returns normally."""
    from django_pglock.operations import force_release

    released = force_release("recorded-lost")
    assert released is not None, "the job's own lock was not held while it ran"
    return "returned normally"


@singleton_job("settings-recorded-job")
def settings_recorded_job():
    """Recorded or not as ``DJANGO_PGLOCK['RECORD_RUNS']`` says (no ``record=``)."""
    return "ran"
