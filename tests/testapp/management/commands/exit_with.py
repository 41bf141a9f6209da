"""A plain management command (not decorated), for wrapping with ``locked_run``."""

from __future__ import annotations

import os
import signal
import sys
import time

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Optionally write a pidfile, sleep, then exit with the given status."

    def add_arguments(self, parser):
        parser.add_argument("code", type=int)
        parser.add_argument("--seconds", type=float, default=0.0)
        parser.add_argument("--pidfile", default=None, help="Write this process's pid here.")
        parser.add_argument(
            "--on-term-marker",
            default=None,
            help="On SIGTERM, append 'TERM' to this file and exit 0 at once.",
        )

    def handle(self, *args, **options):
        marker = options["on_term_marker"]
        if marker:

            def on_term(signum, frame):
                with open(marker, "a", encoding="utf-8") as out:
                    out.write("TERM\n")
                os._exit(0)

            # Installed before the pidfile appears, so a test that waits for the pidfile
            # and then signals always reaches the handler.
            signal.signal(signal.SIGTERM, on_term)
        if options["pidfile"]:
            partial = options["pidfile"] + ".tmp"
            with open(partial, "w", encoding="utf-8") as out:
                out.write(str(os.getpid()))
            os.replace(partial, options["pidfile"])  # never seen half-written
        time.sleep(options["seconds"])
        sys.exit(options["code"])
