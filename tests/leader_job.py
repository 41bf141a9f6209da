"""A leader, for tests/test_leadership.py (run by ``locked_run --wait --shell``).

``python tests/leader_job.py --log LOG --flock FLOCK``

Proves its leadership from the outside. First it takes ``flock(LOCK_EX | LOCK_NB)`` on
FLOCK, which the kernel holds for it until it dies: if another leader still runs, that
fails, and it appends ``overlap <pid> <time>`` to LOG and exits 3. Then it appends
``start <pid> <locked_run pid> <token> <time>`` and ``beat <pid> <time>`` every 20 ms,
all with ``O_APPEND`` (whole lines, never interleaved), the time being
``time.monotonic()`` (one clock for every process of the machine). On SIGTERM it appends
``stop <pid> <time>`` and exits 0 (as a scheduler that shuts down cleanly); on SIGUSR1
it appends ``resign <pid> <time>`` and exits 7 (a leader that ends by itself).

Standard library only, so that it starts fast.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

EXIT_OVERLAP = 3
EXIT_RESIGNED = 7
BEAT = 0.02


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--flock", required=True)
    args = parser.parse_args()
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()

    def write(*words: object) -> None:
        os.write(log, (" ".join(str(w) for w in (*words, time.monotonic())) + "\n").encode())

    side = os.open(args.flock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(side, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        write("overlap", pid)
        return EXIT_OVERLAP

    def leave(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            write("stop", pid)
            os._exit(0)
        write("resign", pid)
        os._exit(EXIT_RESIGNED)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGUSR1, leave)
    # Our parent is locked_run's guardian; its parent is locked_run.
    locked_run = parent_of(os.getppid())
    write("start", pid, locked_run, os.environ.get("DJANGO_PGLOCK_TOKEN", "?"))
    while True:
        write("beat", pid)
        time.sleep(BEAT)


if __name__ == "__main__":
    sys.exit(main())
