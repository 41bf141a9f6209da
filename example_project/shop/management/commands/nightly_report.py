"""`manage.py nightly_report`: cron fires it on every host; one runs, the others skip."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_pglock import singleton_job


class Command(BaseCommand):
    help = "Build the nightly report (runs on one machine at a time)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seconds", type=float, default=5.0, help="How long the work takes.")

    @singleton_job()  # the lock is named after the command: "nightly_report"
    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(f"Building the nightly report on {socket.gethostname()}:{os.getpid()}…")
        time.sleep(options["seconds"])
        self.stdout.write("Report done.")
