"""Child processes of the test suite, with reads that cannot hang it.

* :class:`Proc` — one child process. Background threads drain its stdout and stderr, so
  that a child can never block on a full pipe and a test can never block on a silent
  child: stdout is read line by line with a timeout (:meth:`Proc.read_line`,
  :meth:`Proc.expect`, :meth:`Proc.ready`), or whole once it ended (:meth:`Proc.result`).
  The line-protocol children are ``python -m tests.worker`` (see its docstring) and
  ``python -m tests.chaos_worker`` (the fault tests); both stop at EOF on stdin
  (:meth:`Proc.finish`).
* :class:`Procs` — the child processes one test started. At teardown whatever still runs
  is killed with its process group (every child is the leader of a session of its own,
  so this reaches what it started: a ``locked_run``'s job, a forked worker).
* :class:`Result` — how a child that ran to its end ended, and what it wrote.
* :func:`go_together` — start waiting workers at (nearly) the same moment.

The fixtures are ``procs`` and ``run_child`` (tests/conftest.py) and, for the fault tests,
``tests.faultkit.procs_fixture``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Default waits. They are generous, so that the suite holds when every core is busy; a
# test that measures something passes a timeout of its own.
LINE_TIMEOUT = 30.0  # for one line of output
READY_TIMEOUT = 60.0  # for a worker to start (Python, Django, the first connection)
END_TIMEOUT = 60.0  # for a child to end


@dataclass
class Result:
    """A child that ran to its end: its exit status and all it wrote."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


def _drain(stream: IO[str], chunks: list[str], lines: queue.Queue[str | None] | None) -> None:
    for line in stream:
        chunks.append(line)
        if lines is not None:
            lines.put(line.rstrip("\n"))
    if lines is not None:
        lines.put(None)  # EOF


class Proc:
    """One child process (started by :class:`Procs`), run from the repository root.

    ``pid`` is the child's pid, or, once :meth:`ready` has read ``READY <pid>``, the pid
    the worker reported (its own, behind a prefix such as ``faketime``); ``popen`` is the
    :class:`subprocess.Popen` of what was started. Read stdout only through this class
    (or ``lines``: every stdout line, ``None`` at EOF), never from ``popen.stdout``.
    Lines read are kept in ``seen``.
    """

    def __init__(self, argv: list[str], env: dict[str, str] | None, *, stdin: bool) -> None:
        self.argv = argv
        self.popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(
                target=_drain, args=(self.popen.stdout, self._stdout, self.lines), daemon=True
            ),
            threading.Thread(
                target=_drain, args=(self.popen.stderr, self._stderr, None), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()

    def __str__(self) -> str:
        command = " ".join(self.argv)
        return f"pid {self.popen.pid} ({command[:120]}{'...' if len(command) > 120 else ''})"

    @property
    def stdout_text(self) -> str:
        """All stdout so far (lines read through ``lines`` included)."""
        return "".join(self._stdout)

    @property
    def stderr_text(self) -> str:
        return "".join(self._stderr)

    # -- the line protocol --------------------------------------------------------------

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (a child that has exited is not an error
        here: the next read reports it, with its stderr)."""
        assert self.popen.stdin is not None, f"{self} was started without a stdin pipe"
        with contextlib.suppress(BrokenPipeError):
            self.popen.stdin.write(line + "\n")
            self.popen.stdin.flush()

    def close_stdin(self) -> None:
        """EOF on the child's stdin: tests.worker and tests.chaos_worker stop at it."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()

    def _next_line(self, timeout: float) -> str | None:
        """The next stdout line, ``None`` if none came within ``timeout``; fails at EOF."""
        try:
            line = self.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if line is None:
            self.lines.put(None)  # keep reporting EOF to later reads
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
            pytest.fail(
                f"{self} ended its output (exit status {self.popen.returncode}) before "
                f"answering; stderr:\n{self.stderr_text}"
            )
        self.seen.append(line)
        return line

    def read_line(self, timeout: float = LINE_TIMEOUT) -> str:
        """The next stdout line; fails the test on timeout or when the child has exited."""
        line = self._next_line(timeout)
        if line is None:
            pytest.fail(f"{self}: no output for {timeout}s; stderr:\n{self.stderr_text}")
        return line

    def expect(
        self, prefix: str, timeout: float = LINE_TIMEOUT, *, skip: tuple[str, ...] = ()
    ) -> str:
        """The next line, which must start with ``prefix``; lines starting with one of
        ``skip`` are passed over first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.read_line(max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line
            if not line.startswith(skip):
                pytest.fail(f"expected {prefix!r}, got {line!r}; stderr:\n{self.stderr_text}")

    def line_within(self, prefix: str, timeout: float) -> str | None:
        """The next line starting with ``prefix`` within ``timeout`` s (other lines are
        passed over), else ``None``; fails when the child has exited."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            line = self._next_line(remaining)
            if line is not None and line.startswith(prefix):
                return line
        return None

    def ready(self, timeout: float = READY_TIMEOUT) -> int:
        """Wait for ``READY [<pid>]``; a pid given there becomes ``pid`` (the worker's own
        behind a prefix such as faketime). Returns ``pid``."""
        words = self.expect("READY", timeout).split()
        if len(words) > 1:
            self.pid = int(words[1])
        return self.pid

    # -- signals and the end -------------------------------------------------------------

    def signal(self, signum: int) -> None:
        """Send ``signum`` to ``pid`` (nothing once the child has been reaped)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    send_signal = signal  # the name subprocess.Popen gives it

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the child has ended (raises TimeoutExpired)."""
        return self.popen.wait(timeout)

    def kill(self, *, group: bool = False) -> None:
        """SIGKILL the child, and the worker behind a prefix such as faketime; with
        ``group``, everything in its process group too. Not after it has been reaped (its
        pid may be another process's by then)."""
        if self.popen.poll() is not None:
            return
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in {self.pid, self.popen.pid}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _join_readers(self, timeout: float) -> bool:
        """Wait (``timeout`` s in all) for EOF on stdout and stderr; whether both came."""
        deadline = time.monotonic() + timeout
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return not any(reader.is_alive() for reader in self._readers)

    def result(self, timeout: float = END_TIMEOUT) -> Result:
        """Close stdin, wait for the child to end and its output with it; its Result.

        Fails the test (and kills the child with its group) if that takes longer than
        ``timeout`` s; a process it started that keeps its stdout open keeps it going.
        """
        self.close_stdin()
        deadline = time.monotonic() + timeout
        try:
            if not self._join_readers(timeout):
                raise subprocess.TimeoutExpired(self.argv, timeout)
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self} did not end within {timeout}s; stderr:\n{self.stderr_text}")
        return Result(self.popen.returncode, self.stdout_text, self.stderr_text)

    def finish(self, timeout: float = END_TIMEOUT) -> int:
        """Close stdin (EOF asks a worker to stop) and return the exit status, once the
        child and its output have ended (see :meth:`result`)."""
        return self.result(timeout).returncode

    def drain(self) -> list[str]:
        """Every stdout line not read yet (the child must have ended); kept in ``seen``."""
        self._join_readers(10)
        rest = []
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self.lines.put(None)
                break
            rest.append(line)
        self.seen.extend(rest)
        return rest

    def stop(self) -> None:
        """Kill the child with its process group if it still runs, reap it, close its pipes."""
        self.kill(group=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        self._join_readers(5)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def go_together(workers: Iterable[Proc], timeout: float = READY_TIMEOUT) -> None:
    """Wait for the ``READY`` of every worker (started waiting for ``go``: ``contend``,
    ``job --wait-go``), then send each its ``go``, so that they start nearly at once."""
    workers = list(workers)
    for worker in workers:
        worker.ready(timeout)
    for worker in workers:
        worker.send("go")


class Procs:
    """The child processes of one test; :meth:`cleanup` (at teardown) stops every one.

    ``env`` is the environment of children started without one of their own (``None``:
    this process's). Also a context manager that cleans up on exit.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env
        self.started: list[Proc] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def start(self, *argv: object, env: dict[str, str] | None = None, stdin: bool = False) -> Proc:
        """Start ``argv``; with ``stdin``, a pipe to write to (else /dev/null)."""
        proc = Proc([str(a) for a in argv], self.env if env is None else env, stdin=stdin)
        self.started.append(proc)
        return proc

    def child(self, *args: object, env: dict[str, str] | None = None) -> Proc:
        """Start ``python -m tests.worker <args>`` (the ``run_child`` fixture)."""
        return self.start(sys.executable, "-m", "tests.worker", *args, env=env, stdin=True)

    def worker(self, env: dict[str, str], *args: object, prefix: tuple[str, ...] = ()) -> Proc:
        """Start ``python -m tests.chaos_worker <args>``, behind ``prefix`` (faketime ...)."""
        argv = [*prefix, sys.executable, "-m", "tests.chaos_worker", *args]
        return self.start(*argv, env=env, stdin=True)

    def django(self, *args: object) -> Proc:
        """Start ``python -m django <args>`` (a management command)."""
        return self.start(sys.executable, "-m", "django", *args)

    def python(self, code: str, *args: object) -> Proc:
        """Start ``python -c <code> <args>``."""
        return self.start(sys.executable, "-c", code, *args)

    @staticmethod
    def finish(proc: Proc, timeout: float = END_TIMEOUT) -> Result:
        """``proc.result(timeout)``."""
        return proc.result(timeout)

    def run_django(self, *args: object, timeout: float = END_TIMEOUT) -> Result:
        """Run a management command to its end."""
        return self.django(*args).result(timeout)

    def cleanup(self) -> None:
        for proc in self.started:
            proc.stop()
