"""`manage.py demo`: two workers fire the same job at once; one runs, one skips; then
per-tenant exclusion and job health."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand

from shop.jobs import advance_pipeline


class Command(BaseCommand):
    help = "Show django_pglock at work: cron on two hosts, then per-tenant exclusion."

    def handle(self, *args: Any, **options: Any) -> None:
        call_command("migrate", verbosity=0)
        manage = sys.argv[0]
        # An export that succeeds once, then nobody runs it again (see step 4).
        subprocess.run(
            [sys.executable, manage, "locked_run", "--name", "export-orders", "check"],
            capture_output=True,
            check=True,
        )
        self.stdout.write("1. Cron fires `nightly_report` on two workers at the same moment:\n")
        workers = [
            subprocess.Popen(
                [sys.executable, manage, "nightly_report", "--seconds", "4"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        time.sleep(2)
        self.stdout.write("   While it runs, `manage.py pglock_status` shows the holder:\n")
        call_command("pglock_status", stdout=self.stdout)
        for number, worker in enumerate(workers, 1):
            out, err = worker.communicate()
            said = (out + err).strip().replace("\n", "\n      ")
            self.stdout.write(
                f"\n   worker {number} (exit status {worker.returncode}):\n      {said}"
            )

        self.stdout.write("\n2. Three replicas advance tenants 1, 1 and 2 at once:\n")
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda tenant: advance_pipeline(tenant, seconds=1), [1, 1, 2]))
        for tenant, result in zip([1, 1, 2], results, strict=True):
            self.stdout.write(
                f"   tenant {tenant}: {result or 'skipped (held by another replica)'}"
            )

        self.stdout.write("\n3. Afterwards nothing is held:\n")
        call_command("pglock_status", stdout=self.stdout)

        self.stdout.write(
            "\n4. Job health: `export-orders` must succeed every 3 s (settings.py) and ran"
            " once,\n   at the start; since then no host has run it:\n"
        )
        call_command("pglock_status", "--jobs", stdout=self.stdout)
