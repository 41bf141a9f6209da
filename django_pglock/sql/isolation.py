"""What a test's jobs committed outside Django's ``TestCase`` transaction (see
:mod:`django_pglock.testcases`)."""

from __future__ import annotations

from .names import RUNS as _RUNS
from .names import quote_name

_CLAIMS = quote_name("django_pglock_scheduleclaim")

__all__ = ["FORGET_TEST_ROWS"]

# Delete the run records and schedule claims a finished test's jobs committed. A row that
# a transaction still locks (the test's own, whose rollback may be waiting for this very
# caller) is skipped, not waited for; the statement returns those, to be tried again.
FORGET_TEST_ROWS = f"""
WITH runs AS (
    DELETE FROM {_RUNS} WHERE id IN (
        SELECT id FROM {_RUNS} WHERE id = ANY(%(runs)s::bigint[]) FOR UPDATE SKIP LOCKED
    ) RETURNING id
), claims AS (
    DELETE FROM {_CLAIMS} WHERE id IN (
        SELECT id FROM {_CLAIMS} WHERE id = ANY(%(claims)s::bigint[]) FOR UPDATE SKIP LOCKED
    ) RETURNING id
)
SELECT ARRAY(SELECT r.id FROM {_RUNS} r
             WHERE r.id = ANY(%(runs)s::bigint[]) AND r.id NOT IN (SELECT id FROM runs)),
       ARRAY(SELECT c.id FROM {_CLAIMS} c
             WHERE c.id = ANY(%(claims)s::bigint[]) AND c.id NOT IN (SELECT id FROM claims))
"""
