"""A management command whose ``handle`` is a singleton job (lock name: ``lease_job``)
that reports what ``current_lease()`` gives it; see tests/test_compose.py."""

from __future__ import annotations

import json
import os
import time

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from django_pglock import current_lease, singleton_job


class Command(BaseCommand):
    help = "Write current_lease() as JSON, optionally wait for a file, check or guard."

    def add_arguments(self, parser):
        parser.add_argument("--out", required=True, help="Write current_lease() here (JSON).")
        parser.add_argument("--wait-for", default=None, help="Then wait until this file exists.")
        parser.add_argument(
            "--check", action="store_true", help="Then call check() and guard() on the lease."
        )

    @singleton_job()
    def handle(self, *args, **options):
        self.work(options)

    def work(self, options):
        lease = current_lease()
        found = None
        if lease is not None:
            found = {
                "type": type(lease).__name__,
                "name": lease.name,
                "token": lease.token,
                "holder": lease.holder,
                "lost": lease.lost,
            }
        report = {"pid": os.getpid(), "lease": found}
        partial = options["out"] + ".tmp"
        with open(partial, "w", encoding="utf-8") as out:
            out.write(json.dumps(report))
        os.replace(partial, options["out"])  # never seen half-written
        if options["wait_for"]:
            deadline = time.monotonic() + 60
            while not os.path.exists(options["wait_for"]):
                if time.monotonic() > deadline:
                    raise CommandError(f"{options['wait_for']} never appeared.", returncode=3)
                time.sleep(0.02)
        if options["check"]:
            lease.check()
            with transaction.atomic(using=lease.using):
                lease.guard()
        self.stdout.write("DONE")
