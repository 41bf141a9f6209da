"""``locked_run``'s process tree: the job's process group, its parent's death, the kill grace.

``locked_run`` does not start its job itself: it starts (through
:class:`~django_pglock.supervisor.GuardedJob`) a small guardian process (this file, run
by path with ``python -I``: standard library only, no Django, a few milliseconds to
start) that

* makes itself a child subreaper (Linux), so that members of the job orphaned by their
  parent are re-parented to it and reaped by it;
* starts the job in a new session, so the job and everything it starts form one
  process group (the job's "tree") outside the terminal's foreground group: a Ctrl-C
  reaches the job once, forwarded by ``locked_run``; the group's id is in the job's
  environment (``DJANGO_PGLOCK_JOB_PGID``): only its members run under the grant;
* holds a duplicate of the lock connection's socket without ever reading or writing
  it, so the lock's server session, and with it the advisory key, lasts until the
  guardian exits, which it does only once no process of the group is left;
* learns of ``locked_run``'s death from the end of file on its order pipe (whose write
  end only ``locked_run`` holds) and then SIGKILLs the group at once: nobody heartbeats
  any more;
* takes its orders from ``locked_run`` over that pipe (``signal <n> <kill after>``,
  ``kill``, ``expire <instant>``) and ignores the terminal's signals itself;
* keeps a dead man's switch: ``locked_run`` moves its instant on with every confirmed
  heartbeat (to where a contender could reclaim the lock, less half the safety margin),
  so that a ``locked_run`` that hangs or is stopped cannot let its job outlive the lease;
* reports ``started <pid>`` (or ``failed <errno>``), ``exited <status>``, ``expired``
  and ``gone``.

After the job's leader exits, leftover members of its group get SIGTERM, and SIGKILL
after the kill grace. Without ``prctl`` (not Linux) orphans are reaped by init instead
and the guardian only watches the group (``kill(-pgid, 0)``) until it is empty.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["GROUP_VARIABLE", "POLL", "group_alive", "main", "signal_group"]

#: The job's process group id, in the job's environment: only its members run under
#: ``locked_run``'s grant (see ``django_pglock.inherit``).
GROUP_VARIABLE = "DJANGO_PGLOCK_JOB_PGID"

PR_SET_CHILD_SUBREAPER = 36
ORDERS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # never for the guardian itself
#: How often a group whose leader is gone is looked at (its members are not all ours).
POLL = 0.02


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is more than an unreaped zombie
    (a member whose main thread exited while its other threads run is not one)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member runs as another user: it runs
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: trust kill()
    members = 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            members += 1
            # A process whose main thread exited shows Z while other threads run on.
            threads = int(fields[17]) if len(fields) > 17 else 1
            if fields[0] != b"Z" or threads > 1:
                return True
    return members == 0  # only zombies: gone; none visible in /proc: trust kill()


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


# -- the guardian process ------------------------------------------------------------------


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False  # pragma: no cover - not Linux
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # pragma: no cover - a Linux libc always has prctl
        return False


class _Guardian:
    def __init__(self, orders: int, reports: int, grace: float) -> None:
        self.orders: int | None = orders
        self.reports: int | None = reports
        self.grace = grace
        self.pgid = 0
        self.status: int | None = None  # the leader's exit status, once reaped
        self.kill_at = math.inf  # when the group gets SIGKILL
        # The dead man's switch: SIGKILL at this instant (time.monotonic(), a clock
        # shared by all processes), unless locked_run, having heard of a newer heartbeat,
        # moves it on. It kills the job even if locked_run hangs or is stopped.
        self.expire_at = math.inf
        self.cleaning = False  # the leader is gone: its leftovers are being stopped
        self._partial = b""  # the start of an order whose end has not been read yet
        self._wake_r, wake_w = os.pipe()
        for fd in (self._wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, _ignore)  # a handler, so that SIGCHLD wakes select()

    def report(self, line: str) -> None:
        if self.reports is None:
            return
        try:
            os.write(self.reports, line.encode() + b"\n")
        except OSError:  # locked_run is gone: nobody reads reports any more
            os.close(self.reports)
            self.reports = None

    def start(self, argv: Sequence[str]) -> bool:
        # Orders sent before the start (the dead man's switch) count from the start; a
        # locked_run already gone by now gets no job at all.
        if self.orders is not None and select.select([self.orders], [], [], 0)[0]:
            self._take_orders()
        if self.orders is None:
            self.report("failed 0")
            return False
        try:
            # A new session: a process group of its own, and no controlling terminal,
            # so the terminal's job control never reaches it behind locked_run's back.
            job = subprocess.Popen(argv, start_new_session=True, preexec_fn=_name_group)
        except OSError as exc:
            self.report(f"failed {exc.errno or 0}")
            return False
        job.returncode = 0  # reaped below with waitpid(-1), never through the Popen object
        self.pgid = job.pid
        self.report(f"started {job.pid}")
        return True

    def run(self) -> int:
        while True:
            self._reap()
            now = time.monotonic()
            if self.status is not None and not self.cleaning:
                self.cleaning = True
                self.report(f"exited {self.status}")
                if group_alive(self.pgid):  # leftovers: what the leader started and left
                    self._order_signal(signal.SIGTERM, self.grace, now)
            if now >= self.expire_at and self.kill_at > now:
                self.report("expired")
                self.kill_at = now
            if now >= self.kill_at:
                signal_group(self.pgid, signal.SIGKILL)  # again, for any late fork
            if self.cleaning and not group_alive(self.pgid):
                self.report("gone")
                return 0
            self._wait(now)

    def _wait(self, now: float) -> None:
        timeout: float | None = None
        kill_at = min(self.kill_at, self.expire_at)
        if kill_at is not math.inf:
            timeout = max(0.0, kill_at - now) if now < kill_at else POLL
        if self.cleaning:
            timeout = POLL if timeout is None else min(timeout, POLL)
        watched = [self._wake_r] + ([self.orders] if self.orders is not None else [])
        ready = select.select(watched, [], [], timeout)[0]
        if self._wake_r in ready:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)
        if self.orders is not None and self.orders in ready:
            self._take_orders()

    def _take_orders(self) -> None:
        assert self.orders is not None
        data = os.read(self.orders, 4096)
        now = time.monotonic()
        if not data:  # locked_run died: nobody heartbeats the lock, kill the job now
            os.close(self.orders)
            self.orders = None
            self.kill_at = now
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            order = line.decode("ascii", "replace").split()
            if order[:1] == ["kill"]:
                self.kill_at = now
            elif order[:1] == ["expire"] and len(order) == 2:
                self.expire_at = float(order[1])
            elif order[:1] == ["signal"] and len(order) == 3:
                self._order_signal(int(order[1]), float(order[2]), now)

    def _order_signal(self, signum: int, kill_after: float, now: float) -> None:
        """Send ``signum`` to the group, and SIGKILL ``kill_after`` seconds later at most."""
        if now < self.kill_at:  # not being killed already
            signal_group(self.pgid, signum)
            if signum == signal.SIGTERM:
                signal_group(self.pgid, signal.SIGCONT)  # a stopped member must hear it
        if kill_after >= 0:
            self.kill_at = min(self.kill_at, now + kill_after)

    def _reap(self) -> None:
        """Reap every child: the leader, and orphans of the group re-parented to us."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pgid:
                self.status = os.waitstatus_to_exitcode(status)


def _name_group() -> None:
    """In the job, before its program starts: name its process group (its own pid, as the
    leader of a new session) in its environment, inherited by all it starts."""
    os.environ[GROUP_VARIABLE] = str(os.getpid())


def _ignore(signum: int, frame: object) -> None:
    """A no-op handler: unlike SIG_IGN, it is not inherited by the job across exec."""


def main(argv: Sequence[str]) -> int:
    """``guardian.py ORDERS_FD REPORTS_FD HOLD_FD GRACE IGNORED -- <job argv…>``."""
    orders, reports, hold = (int(fd) for fd in argv[:3])
    grace, ignored = float(argv[3]), {int(n) for n in argv[4].split(",") if n}
    job = list(argv[6:])
    for fd in (orders, reports, hold):
        if fd >= 0:
            os.set_inheritable(fd, False)  # the job gets none of them
    for signum in ORDERS:
        # Signals ignored where locked_run runs (nohup) stay ignored for the job.
        signal.signal(signum, signal.SIG_IGN if signum in ignored else _ignore)
    _become_subreaper()
    guardian = _Guardian(orders, reports, grace)
    if not guardian.start(job):
        return 127
    try:
        return guardian.run()
    except BaseException:
        signal_group(guardian.pgid, signal.SIGKILL)  # never leave the job unguarded
        while group_alive(guardian.pgid):
            guardian._reap()
            time.sleep(POLL)
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
