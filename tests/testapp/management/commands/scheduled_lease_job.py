"""``lease_job`` as a schedule-slot job: at most one start per minute (lock and job name:
``scheduled_lease_job``)."""

from __future__ import annotations

from django_pglock import singleton_job
from tests.testapp.management.commands.lease_job import Command as LeaseJob


class Command(LeaseJob):
    help = "lease_job, started at most once per minute."

    @singleton_job(schedule="* * * * *")
    def handle(self, *args, **options):
        self.work(options)
