"""A user's own TestCases calling @singleton_job functions, with nothing configured.

Each TestCase must see only what its own tests (and its own setUpTestData) ran: no run
record, schedule claim or lock of another TestCase. Both Django's runner and pytest
run this module (tests/test_user_tests.py).
"""

import os

from django.db import connection
from django.test import TestCase, TransactionTestCase

from django_pglock import Lock
from django_pglock.models import JobLock, JobRun, ScheduleClaim

from .jobs import report, yearly

if os.environ.get("USERPROJECT_EARLY_LOCK"):
    # Something that takes a lock before the test database exists (here, at import,
    # while the tests are collected): the lock connection is then open on the project's
    # own database, and must follow Django to the test database.
    with Lock("userproject-early").acquire(blocking=False) as early:
        assert early is not None


def outcomes():
    return sorted(JobRun.objects.values_list("name", "outcome"))


class FirstTests(TestCase):
    def test_a_job_inside_an_execute_wrapper_leaves_the_wrappers_as_they_were(self):
        seen = []

        def spy(execute, sql, params, many, context):
            seen.append(sql)
            return execute(sql, params, many, context)

        before = list(connection.execute_wrappers)
        with connection.execute_wrapper(spy):
            report()
            self.assertEqual(JobRun.objects.count(), 1)
        self.assertNotIn(spy, connection.execute_wrappers)
        self.assertEqual(len(seen), 1)
        self.assertLessEqual(len(connection.execute_wrappers), len(before) + 1)

    def test_report_runs_under_its_lock(self):
        token = report()
        run = JobRun.objects.get()
        self.assertEqual(
            (run.name, run.token, run.outcome), ("userproject-report", token, "succeeded")
        )
        self.assertFalse(JobLock.objects.exists())

    def test_a_run_record_the_test_changed_goes_too(self):
        report()
        # The test's transaction now locks the row until it is rolled back.
        self.assertEqual(JobRun.objects.update(description="changed by the test"), 1)

    def test_yearly_starts_once_per_slot(self):
        self.assertEqual(yearly(), "ran")
        self.assertIsNone(yearly())
        self.assertEqual(ScheduleClaim.objects.count(), 1)
        self.assertEqual(
            outcomes(), [("userproject-yearly", "skipped"), ("userproject-yearly", "succeeded")]
        )

    def test_a_lease_left_held_is_released_when_the_test_ends(self):
        lease = Lock("userproject-left-held").try_acquire()
        self.assertIsNotNone(lease)
        self.assertEqual(JobLock.objects.count(), 1)

    def test_a_call_while_another_holder_has_the_lock_is_skipped(self):
        # The README's example ("Testing your jobs").
        with Lock("userproject-report").acquire(blocking=False) as held:
            self.assertIsNotNone(held)
            self.assertIsNone(report())
        run = JobRun.objects.get()
        self.assertEqual((run.outcome, run.reason), ("skipped", "held"))


class SecondTests(TestCase):
    @classmethod
    def setUpTestData(cls):
        cls.token = report()  # lives as long as the class's data

    def test_sees_only_its_own_run(self):
        self.assertEqual(list(JobRun.objects.values_list("token", flat=True)), [self.token])
        self.assertFalse(JobLock.objects.exists())
        self.assertFalse(ScheduleClaim.objects.exists())

    def test_the_slot_another_testcase_started_is_free_again(self):
        self.assertEqual(yearly(), "ran")
        self.assertEqual(
            outcomes(), [("userproject-report", "succeeded"), ("userproject-yearly", "succeeded")]
        )

    def test_the_lock_another_test_left_held_is_free(self):
        with Lock("userproject-left-held").acquire(blocking=False) as lease:
            self.assertIsNotNone(lease)


class ThirdTransactionTests(TransactionTestCase):
    def test_a_transaction_test_case_sees_only_its_own_run(self):
        token = report()
        self.assertEqual(list(JobRun.objects.values_list("token", flat=True)), [token])
        self.assertFalse(ScheduleClaim.objects.exists())
