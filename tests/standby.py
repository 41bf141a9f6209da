"""A primary and a streaming standby for the failover tests (tests/test_failover.py).

:class:`ReplicatedPair` runs two throwaway servers from Debian's PostgreSQL 15
(``/usr/lib/postgresql/15/bin``; as root they run as the ``postgres`` system user), each
on ``127.0.0.1`` with a port of its own: a primary with the lock tables, and a standby
made from it with ``pg_basebackup -R`` that streams its WAL, asynchronously or, with
``sync=True``, as the primary's synchronous standby (``synchronous_standby_names = '*'``).
The standby's own configuration clears that setting, as a failover manager does, unless
``inherit_sync=True``: then the promoted standby waits for a standby it does not have.

:meth:`~ReplicatedPair.crash_primary` does what ``pg_ctl stop -m immediate`` does (SIGQUIT
to the postmaster); the old primary is never started again (it is fenced).
:meth:`~ReplicatedPair.promote` promotes the standby and waits until it accepts writes.
Clients reach whichever is the primary through :meth:`~ReplicatedPair.dsn`, a libpq
multi-host URL with ``target_session_attrs=read-write``.

Cleanup stops both servers and removes their directories, at :meth:`~ReplicatedPair.close`,
at exit, and through a watcher process if the test process is killed (``faultkit.Reaper``).
The servers themselves, and the template their primary is copied from, are tests/pgnode.py's.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import faultkit
from tests.pgnode import (
    DB_NAME,
    HOST,
    READY_TIMEOUT,
    Node,
    append_settings,
    private_dir,
    require_binaries,
    run_tool,
    template_pgdata,
    wait_for,
)


class ReplicatedPair:
    """A primary and its streaming standby; see the module docstring.

    ``sync``: the standby is synchronous (a commit returns once the standby has it).
    ``inherit_sync``: the standby keeps the primary's ``synchronous_standby_names``.
    ``lag_proxy``: the standby streams through a ``faultkit.TcpProxy``, so that
    :meth:`stall_replication` can make it fall behind. ``remote_apply`` (with ``sync``):
    the primary's ``synchronous_commit`` is ``remote_apply``, so that after
    :meth:`delay_replay` a commit the standby has received still waits on the primary.
    :meth:`close` stops both (at exit too).
    """

    def __init__(
        self,
        *,
        sync: bool,
        inherit_sync: bool = False,
        lag_proxy: bool = False,
        remote_apply: bool = False,
    ) -> None:
        require_binaries()
        self.sync = sync
        self.mode = "sync" if sync else "async"
        template = template_pgdata()
        self.root = private_dir(f"pglock-failover-{self.mode}-")
        self.primary = Node(self.root, "primary", faultkit.free_port())
        self.standby = Node(self.root, "standby", faultkit.free_port())
        self._reaper = faultkit.Reaper(
            commands=[self.primary.argv_stop_immediate(), self.standby.argv_stop_immediate()],
            paths=[str(self.root)],
        )
        self.owner = os.getpid()
        atexit.register(self.close)
        self.replication = faultkit.TcpProxy(self.primary.port) if lag_proxy else None
        self.crashed_at: float | None = None  # time.time(): the crash was asked for
        self.down_at: float | None = None  # time.time(): the old primary had stopped
        self.promoted_at: float | None = None  # time.time(): the standby took writes
        try:
            self._start(template, inherit_sync, remote_apply)
        except BaseException:
            self.close()
            raise

    def _start(self, template: Path, inherit_sync: bool, remote_apply: bool) -> None:
        # cp -a keeps the owner (the server's user) and the 0700 mode PostgreSQL wants.
        subprocess.run(["cp", "-a", str(template), str(self.primary.pgdata)], check=True)
        primary = {"port": str(self.primary.port)}
        if self.sync:
            primary["synchronous_standby_names"] = "*"
        if remote_apply:
            primary["synchronous_commit"] = "remote_apply"
        append_settings(self.primary.pgdata, primary, f"the primary ({self.mode})")
        self.primary.start()
        # -R writes the port it used into primary_conninfo: the proxy's, if there is one.
        port = self.primary.port if self.replication is None else self.replication.port
        run_tool(
            "pg_basebackup",
            *("-h", HOST, "-p", str(port), "-U", "postgres"),
            *("-D", str(self.standby.pgdata), "-R", "-X", "stream", "-c", "fast", "--no-sync"),
            cwd=self.root,
        )
        standby = {"port": str(self.standby.port)}
        if not inherit_sync:  # what a failover manager does before it promotes
            standby["synchronous_standby_names"] = ""
        append_settings(self.standby.pgdata, standby, "the standby")
        self.standby.start()
        wanted = "sync" if self.sync else "async"
        wait_for(
            lambda: self.primary.query(
                "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = %s",
                [wanted],
            ),
            READY_TIMEOUT,
            f"the standby streaming ({wanted}) from the primary",
        )

    # -- what clients use --------------------------------------------------------------

    def dsn(self) -> str:
        """A libpq multi-host URL: whichever of the two accepts writes."""
        ports = f"{self.primary.port},{self.standby.port}"
        return (
            f"postgresql://postgres@/{DB_NAME}?host={HOST},{HOST}&port={ports}"
            "&target_session_attrs=read-write"
        )

    # -- events ------------------------------------------------------------------------

    def wait_replayed(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        (lsn,) = self.primary.query("SELECT pg_current_wal_lsn()")[0]
        replayed = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
        wait_for(
            lambda: self.standby.query(replayed, [str(lsn)])[0][0],
            timeout,
            f"the standby replaying up to {lsn}",
        )

    def wait_received(self, timeout: float = READY_TIMEOUT) -> None:
        """Until the standby has received (and flushed) all the primary has written."""
        (lsn,) = self.primary.query("SELECT pg_current_wal_lsn()")[0]
        received = "SELECT pg_last_wal_receive_lsn() >= %s::pg_lsn"
        wait_for(
            lambda: self.standby.query(received, [str(lsn)])[0][0],
            timeout,
            f"the standby receiving up to {lsn}",
        )

    def delay_replay(self) -> None:
        """The standby goes on receiving WAL but replays no further commit (an hour's
        ``recovery_min_apply_delay``); a promotion replays what it held back."""
        append_settings(self.standby.pgdata, {"recovery_min_apply_delay": "1h"}, "delay")
        self.standby.query("SELECT pg_reload_conf()")
        wait_for(
            lambda: self.standby.query("SHOW recovery_min_apply_delay")[0][0] == "1h",
            READY_TIMEOUT,
            "the standby delaying its replay",
        )

    def stall_replication(self) -> None:
        """Stop forwarding WAL to the standby (``lag_proxy`` only): it falls behind."""
        assert self.replication is not None, "made without lag_proxy=True"
        self.replication.set_mode("drop")

    def cut_replication(self) -> None:
        """Reset the standby's replication connection: what it had not received is lost."""
        assert self.replication is not None, "made without lag_proxy=True"
        self.replication.close()

    def crash_primary(self) -> float:
        """Crash the primary as ``pg_ctl stop -m immediate`` does (SIGQUIT to the
        postmaster: every server process exits at once, nothing is flushed or sent any
        more) and wait until it is gone; returns ``time.time()`` of the signal.

        The signal is sent from here rather than through pg_ctl, so that the crash
        happens within microseconds of the caller's last event, and so that measured
        times start at the crash rather than at pg_ctl's own start-up.
        """
        pidfile = self.primary.pgdata / "postmaster.pid"
        postmaster = int(pidfile.read_text().split()[0])
        self.crashed_at = time.time()
        os.kill(postmaster, signal.SIGQUIT)
        # Like pg_ctl -w: gone once the postmaster has removed its pid file.
        wait_for(lambda: not pidfile.exists(), READY_TIMEOUT, "the crashed primary exiting")
        self.down_at = time.time()
        return self.crashed_at

    def promote(self) -> float:
        """Promote the standby; ``time.time()`` once it is seen accepting writes."""
        self.standby.pg_ctl("promote")
        wait_for(
            lambda: self.standby.query("SELECT NOT pg_is_in_recovery()")[0][0],
            READY_TIMEOUT,
            "the promoted standby leaving recovery",
        )
        self.promoted_at = time.time()
        return self.promoted_at

    def fail_over(self) -> tuple[float, float]:
        """Crash the primary and promote the standby at once; (crashed, promoted)."""
        return self.crash_primary(), self.promote()

    # -- cleanup -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop both servers and remove their directories (only in the owning process)."""
        if os.getpid() != self.owner or not self.root.exists():
            return
        for node in (self.standby, self.primary):
            node.stop("immediate")
        if self.replication is not None:
            self.replication.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self._reaper.stop()
