"""A job with a process tree, for tests/test_locked_run_tree.py (run by ``locked_run --shell``).

``python tests/tree_job.py tree --pids FILE [--children-ignore-term | --all-ignore-term]
[--exit CODE]``
    Starts ``sleep 1000`` and ``sh -c 'sleep 1000 & echo $!; wait'`` (a grandchild) in its
    own process group, writes ``<pid> <start time>`` of all four processes to FILE (at
    once, never half-written), then sleeps, or with ``--exit`` exits at once leaving its
    children behind. With ``--children-ignore-term`` the children (and the grandchild)
    ignore SIGTERM; with ``--all-ignore-term`` the leader does too.

``python tests/tree_job.py probe --pids FILE --out OUT``
    Writes to OUT, as JSON, when it started (``time.time()``), which processes listed in
    FILE are still running at that moment, and the lock variables it was given.

``python tests/tree_job.py count-int --pids FILE --out OUT``
    Appends ``INT`` to OUT on every SIGINT; once it got one, it exits 0 after 0.5 s (the
    window in which a doubled SIGINT would arrive).

Standard library only, so that it starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start time)`` of a process, or ``None`` if there is none with that pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return pid, int(stat.rsplit(b")", 1)[1].split()[19])


def running(pid: int, started: int) -> bool:
    """True while the process ``(pid, started)`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    fields = stat.rsplit(b")", 1)[1].split()
    return int(fields[19]) == started and fields[0] != b"Z"


def read_pids(path: str | Path) -> list[tuple[int, int]]:
    lines = Path(path).read_text().split("\n")
    return [(int(pid), int(started)) for pid, started in (line.split() for line in lines if line)]


def write_atomically(path: str, text: str) -> None:
    partial = f"{path}.tmp"
    with open(partial, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(partial, path)


def tree(args: argparse.Namespace) -> int:
    if args.children_ignore_term or args.all_ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited across exec
    sleeper = subprocess.Popen(["sleep", "1000"])
    shell = subprocess.Popen(
        ["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True
    )
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    if not args.all_ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    found = [identity(pid) for pid in (os.getpid(), sleeper.pid, shell.pid, grandchild)]
    write_atomically(
        args.pids, "".join(f"{pid} {started}\n" for pid, started in filter(None, found))
    )
    if args.exit is not None:
        os._exit(args.exit)  # no waiting for the children: they are left behind
    while True:
        time.sleep(1000)


def probe(args: argparse.Namespace) -> int:
    started = time.time()
    alive = [pid for pid, start in read_pids(args.pids) if running(pid, start)]
    found = {
        "time": started,
        "alive": alive,
        "name": os.environ.get("DJANGO_PGLOCK_NAME"),
        "token": os.environ.get("DJANGO_PGLOCK_TOKEN"),
    }
    write_atomically(args.out, json.dumps(found))
    return 0


def count_int(args: argparse.Namespace) -> int:
    got = []

    def on_int(signum: int, frame: object) -> None:
        with open(args.out, "a", encoding="utf-8") as out:
            out.write("INT\n")
        got.append(time.monotonic())

    signal.signal(signal.SIGINT, on_int)
    found = identity(os.getpid())
    assert found is not None
    write_atomically(args.pids, f"{found[0]} {found[1]}\n")
    while not got or time.monotonic() < got[0] + 0.5:
        time.sleep(0.02)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    modes = parser.add_subparsers(dest="mode", required=True)
    one = modes.add_parser("tree")
    one.add_argument("--pids", required=True)
    one.add_argument("--children-ignore-term", action="store_true")
    one.add_argument("--all-ignore-term", action="store_true")
    one.add_argument("--exit", type=int, default=None)
    two = modes.add_parser("probe")
    two.add_argument("--pids", required=True)
    two.add_argument("--out", required=True)
    three = modes.add_parser("count-int")
    three.add_argument("--pids", required=True)
    three.add_argument("--out", required=True)
    args = parser.parse_args()
    return {"tree": tree, "probe": probe, "count-int": count_int}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
