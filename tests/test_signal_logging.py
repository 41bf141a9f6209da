"""A signal receiver that raises is logged once, and the lock goes on."""

from __future__ import annotations

import logging
import uuid

import pytest

from django_pglock import Lock, signals

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]


def test_a_failing_receiver_is_logged_once_and_does_not_break_the_lock(caplog):
    def broken(sender, **kwargs):
        raise RuntimeError("receiver broke on purpose")

    calls = []

    def healthy(sender, **kwargs):
        calls.append(kwargs["lease"].name)

    signals.lock_acquired.connect(broken)
    signals.lock_acquired.connect(healthy)
    name = f"signal-log-{uuid.uuid4().hex[:8]}"
    try:
        with caplog.at_level(logging.DEBUG):
            lease = Lock(name).try_acquire()
    finally:
        signals.lock_acquired.disconnect(broken)
        signals.lock_acquired.disconnect(healthy)
    assert lease is not None
    lease.release()
    assert calls == [name]  # the next receiver still ran
    about_it = [
        record
        for record in caplog.records
        if "receiver broke on purpose" in record.getMessage()
        or (record.exc_info and "receiver broke on purpose" in str(record.exc_info[1]))
    ]
    assert len(about_it) == 1, [(r.name, r.getMessage()) for r in about_it]
    (record,) = about_it
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None  # with its traceback
    assert "broken" in record.getMessage()  # names the receiver
