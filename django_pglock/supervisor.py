"""``locked_run``'s end of the guardian (see :mod:`.guardian`): start it, give it orders,
read its reports, and take over if it dies before the job's process group is gone."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from . import guardian
from .guardian import POLL, group_alive, signal_group

__all__ = ["GuardedJob", "JobNotStarted"]


class JobNotStarted(OSError):
    """The guardian could not start the job (``errno`` and ``strerror`` say why)."""


class GuardedJob:
    """The job of ``locked_run``, run by a guardian process.

    ``hold_fd`` (the lock connection's socket) is passed to the guardian, which keeps it
    open until the job's process group is gone. ``ignored`` are the forwarded signals
    that were ignored where ``locked_run`` started; they stay ignored for the job.
    ``expire_at`` arms the dead man's switch (see :meth:`expire_at`) before the job starts.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        *,
        grace: float,
        hold_fd: int | None = None,
        ignored: Sequence[int] = (),
        expire_at: float | None = None,
    ) -> None:
        self.pid: int | None = None  # the job's leader, and its process group id
        self.exit_code: int | None = None  # as Popen.returncode: -N for signal N
        self.gone = False  # no process of the job's group runs any more
        self.guardian_failed = False  # the guardian died before the group was gone
        self.expired = False  # the dead man's switch killed the leader (see expire_at())
        self._buffer = b""
        orders_r, self._orders = os.pipe()
        self._reports, reports_w = os.pipe()
        if expire_at is not None:
            # Armed before the guardian starts: a locked_run stopped right after it
            # forks cannot leave the job without a dead man's switch.
            os.write(self._orders, f"expire {expire_at!r}\n".encode())
        hold = -1 if hold_fd is None else hold_fd
        command = [
            sys.executable,
            "-I",  # no PYTHON* variables, no script or user directories on sys.path
            os.path.abspath(guardian.__file__),
            str(orders_r),
            str(reports_w),
            str(hold),
            repr(grace),
            ",".join(str(int(signum)) for signum in ignored),
            "--",
            *argv,
        ]
        passed = [orders_r, reports_w] + ([hold] if hold >= 0 else [])
        try:
            self.process = subprocess.Popen(
                command, env=env, pass_fds=passed, start_new_session=True
            )
        except BaseException:
            os.close(self._orders)
            os.close(self._reports)
            raise
        finally:
            os.close(orders_r)
            os.close(reports_w)
        while self.pid is None:
            if not self.poll(None):
                break
        if self.pid is None:
            self.wait_gone()
            errno_ = self._failed_errno or 0
            raise JobNotStarted(errno_, os.strerror(errno_) if errno_ else "the guardian failed")

    _failed_errno: int | None = None

    def fileno(self) -> int:
        """The report pipe, for ``select``."""
        return self._reports

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Read the reports available within ``timeout``; ``False`` at their end."""
        if self._reports < 0:
            return False
        if not select.select([self._reports], [], [], timeout)[0]:
            return True
        data = os.read(self._reports, 4096)
        if not data:
            os.close(self._reports)
            self._reports = -1
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            kind, _, value = line.decode("ascii", "replace").partition(" ")
            if kind == "started":
                self.pid = int(value)
            elif kind == "failed":
                self._failed_errno = int(value)
            elif kind == "exited":
                self.exit_code = int(value)
            elif kind == "gone":
                self.gone = True
            elif kind == "expired":  # pragma: no branch - no other kind; reports come in order
                self.expired = self.exit_code is None
        return True

    def forward(self, signum: int, kill_after: float | None) -> None:
        """Send ``signum`` to the job's group; SIGKILL it ``kill_after`` s later at most."""
        later = -1.0 if kill_after is None else max(0.0, kill_after)
        self._order(f"signal {int(signum)} {later!r}")

    def kill(self) -> None:
        """SIGKILL the job's group now."""
        self._order("kill")

    def expire_at(self, instant: float) -> None:
        """SIGKILL the job's group at ``instant`` (``time.monotonic()``) unless moved on."""
        self._order(f"expire {instant!r}")

    def _order(self, line: str) -> None:
        if self._orders < 0:
            return  # the job is gone
        with contextlib.suppress(OSError):  # the guardian is gone: wait_gone() takes over
            os.write(self._orders, line.encode() + b"\n")

    def wait_gone(self) -> None:
        """Wait until the job's group is gone and the guardian has exited.

        If the guardian died first, its orphaned job is SIGKILLed here and waited for.
        """
        while self.poll(None):
            pass
        self.process.wait()
        if self._orders >= 0:
            os.close(self._orders)
            self._orders = -1
        if not self.gone and self.pid is not None:
            self.guardian_failed = True
            while group_alive(self.pid):
                signal_group(self.pid, signal.SIGKILL)
                time.sleep(POLL)
            self.gone = True
