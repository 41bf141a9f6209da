"""In-process leadership, for tests/test_leadership.py: ``python -m tests.leader_worker NAME``.

Runs the loop the README shows: stand by until elected (``with lock.leadership(...)``),
lead until demoted, stand by again. Prints, flushed, with ``time.monotonic()`` last:
``WAITING <t>`` before each wait, ``LEADING <token> <t>`` once elected, ``DEMOTED
<token> <t>`` from the demotion callback, ``LEFT <state> <reason or -> <t>`` after
leaving the block. A ``resign`` line on stdin makes the leader leave its block (the
lock is released) and the worker exit 0; EOF on stdin ends it at once.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

_print_lock = threading.Lock()


def say(*words: object) -> None:
    with _print_lock, contextlib.suppress(BrokenPipeError):
        sys.stdout.write(" ".join(str(w) for w in (*words, time.monotonic())) + "\n")
        sys.stdout.flush()


def main(name: str) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django_pglock import Lock

    resign = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "resign":
                resign.set()
        os._exit(0)  # EOF: the test is done with us

    threading.Thread(target=read_stdin, daemon=True).start()
    lock = Lock(name, heartbeat_interval=0.2, alert_after=0.6, stale_after=3, poll_interval=0.1)
    while not resign.is_set():
        say("WAITING")
        leadership = lock.leadership(on_demotion=lambda lease: say("DEMOTED", lease.token))
        with leadership as lease:
            say("LEADING", lease.token)
            while not leadership.wait(0.05) and not resign.is_set():
                pass  # one step of the leader's work
        say("LEFT", leadership.state.value, (leadership.reason or "-").replace(" ", "_"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
