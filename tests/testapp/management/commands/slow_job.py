"""A management command whose ``handle`` is a singleton job (lock name: ``slow_job``)."""

from __future__ import annotations

import os
import time

from django.core.management.base import BaseCommand

from django_pglock import singleton_job


class Command(BaseCommand):
    help = "Sleep a while under the 'slow_job' lock, leaving a marker line."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=0.0)
        parser.add_argument("--marker", default=None, help="Append 'RAN <pid>' to this file.")

    @singleton_job()
    def handle(self, *args, **options):
        if options["marker"]:
            with open(options["marker"], "a", encoding="utf-8") as out:
                out.write(f"RAN {os.getpid()}\n")
        time.sleep(options["seconds"])
        self.stdout.write("RAN")
