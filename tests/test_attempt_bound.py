"""A blocking acquire ends near its timeout whatever the server does.

Each attempt of a blocking acquire with a timeout is bounded by the time left (at least
``waiting.LEAST_ATTEMPT``): its statements, its wait for the lock connection and opening
a session (``connect_timeout`` by the time left, at least 2 s). A statement cut off by the
bound gives its session up, as one with no answer within ``STATEMENT_DEADLINE`` does: a
grant whose answer is cut off is released by the orphan sweep and never used.
Every test runs against a real server: a server process is stopped (SIGSTOP), a listener
never answers, or a proxy holds back the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from django.db import connections

from django_pglock import DatabaseUnavailable, Lock
from django_pglock import connection as connection_module
from django_pglock.connection import get_connection
from tests import faultkit
from tests.faultkit import Db, require_local_backend, worker_env
from tests.subprocs import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

#: An acquire with ``timeout=1`` must have returned by then: its last attempt gets
#: LEAST_ATTEMPT (2 s), opening a session 2 s; the old bounds were 32 s and 10 s.
NEAR = 6.0


def unique(label: str) -> str:
    return f"bound-{label}-{uuid.uuid4().hex[:8]}"


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


@contextlib.contextmanager
def stopped(pid: int):
    """The server process ``pid`` stopped (SIGSTOP) for the block: it answers nothing."""
    require_local_backend(pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: process_state(pid) == "T", 10, "the server process did not stop")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def in_thread(call):
    """Run ``call()`` in a thread: ``(done event, [result or exception, seconds])``."""
    done = threading.Event()
    outcome: list[object] = []

    def run() -> None:
        started = time.monotonic()
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)
        outcome.append(time.monotonic() - started)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, outcome


@pytest.fixture
def alias_at():
    """A database alias like ``default`` but at another host and port."""
    made = []

    def make(host: str, port: int) -> str:
        alias = f"bound_{uuid.uuid4().hex[:8]}"
        settings_dict = copy.deepcopy(connections["default"].settings_dict)
        settings_dict.update(HOST=host, PORT=str(port))
        connections.settings[alias] = settings_dict
        made.append(alias)
        return alias

    yield make
    for alias in made:
        conn = connection_module._registry.pop(alias, None)
        if conn is not None:
            conn.close()
        connections.settings.pop(alias, None)


def test_an_async_acquire_on_an_unresponsive_server_ends_near_its_timeout():
    """``acquire_async(timeout=1)`` against a stopped server process: the attempt in the
    worker thread is bounded too, and the wait ends with ``DatabaseUnavailable``."""
    conn = get_connection("default")
    conn.ensure_open()
    backend = conn.backend_pid
    lock = Lock(unique("async"), advisory=False)

    async def acquire():
        async with lock.acquire_async(timeout=1) as lease:
            return lease

    with stopped(backend):
        done, outcome = in_thread(lambda: asyncio.run(acquire()))
        returned = done.wait(NEAR)
    assert done.wait(60)
    assert returned, f"acquire_async(timeout=1) took {outcome[1]:.1f} s: {outcome[0]!r}"
    assert isinstance(outcome[0], DatabaseUnavailable), outcome
    assert "Gave up waiting after 1 s (timeout)" in str(outcome[0])
    assert "the time left of the caller's timeout" in str(outcome[0])
    # The given-up session was replaced; the name was never granted to anyone.
    lease = lock.try_acquire()
    assert lease is not None and conn.backend_pid != backend
    lease.release()


def test_opening_a_session_for_an_acquire_with_a_timeout_ends_near_it(alias_at):
    """A server that accepts TCP but never answers (a stopped old primary): opening the
    session took ``connect_timeout`` (10 s by default) whatever the acquire's timeout."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # never accepts, never answers
    try:
        alias = alias_at("127.0.0.1", silent.getsockname()[1])
        lock = Lock(unique("silent"), using=alias, advisory=False)
        started = time.monotonic()
        with pytest.raises(DatabaseUnavailable) as raised:
            lock.acquire_or_raise(timeout=1)
        took = time.monotonic() - started
    finally:
        silent.close()
    assert took < NEAR, f"acquire_or_raise(timeout=1) took {took:.1f} s: {raised.value}"
    assert "Gave up waiting after 1 s (timeout)" in str(raised.value)


def test_the_last_attempt_at_the_timeout_keeps_a_healthy_session():
    """The last attempt of a blocking acquire is made at its timeout, with no time left:
    it still gets LEAST_ATTEMPT seconds, so a healthy session is never given up for it."""
    name = unique("contended")
    conn = get_connection("default")
    done, outcome = in_thread(lambda: Lock(name).try_acquire())  # held by another thread
    assert done.wait(30) and outcome[0] is not None, outcome
    holder = outcome[0]
    try:
        generation, backend = conn.generation, conn.backend_pid
        for _ in range(3):
            assert Lock(name, poll_interval=0.05).acquire(timeout=0.2).__enter__() is None
        assert (conn.generation, conn.backend_pid) == (generation, backend)
        assert not conn.orphans_possible
    finally:
        holder.release()


# -- a grant whose answer is cut off by the bound --------------------------------------------


class AnswerHolder:
    """``127.0.0.1:<port>`` forwarding to the fault server; once :meth:`hold` was called,
    the answers on the connections open then are held back for ever (a stalled network),
    while new connections pass."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._held: set[int] = set()
        self._open: set[int] = set()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._held |= self._open

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), 5)
            except OSError:
                return
            upstream.settimeout(None)  # a held answer is waited for as long as it takes
            self._sockets += [client, upstream]
            self._open.add(id(client))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, client), daemon=True
            ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, held: socket.socket | None):
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if held is None or id(held) not in self._held:
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


# Opens its lock session, says OPEN and waits for a line; then acquire_or_raise(timeout=1)
# on argv[1] (table path, recorded): says UNAVAILABLE <seconds> or GRANTED <token>. On the
# next line it waits up to 60 s for the name and says GRANTED <token>.
CUT_TAKER = """
import sys, time
import django
django.setup()
from django_pglock import DatabaseUnavailable, Lock
from django_pglock.connection import get_connection
get_connection("default").ensure_open()
print("OPEN", flush=True)
sys.stdin.readline()
lock = Lock(sys.argv[1], advisory=False, record=True, poll_interval=0.1)
started = time.monotonic()
try:
    lease = lock.acquire_or_raise(timeout=1)
    print("GRANTED", lease.token, flush=True)
except DatabaseUnavailable:
    print("UNAVAILABLE", round(time.monotonic() - started, 1), flush=True)
sys.stdin.readline()
lease = lock.acquire_or_raise(timeout=60)
print("GRANTED", lease.token, flush=True)
lease.release()
"""


@pytest.mark.slow
def test_a_grant_whose_answer_is_cut_off_by_the_bound_is_released_and_never_used(procs):
    """The server grants (and commits) an attempt whose answer is held back: the acquire
    ends near its timeout with ``DatabaseUnavailable``; the grant nobody received is
    released by the process's orphan sweep (its run closed as lost), and the next acquire
    gets a grant of its own, with a higher token."""
    pg = faultkit.shared_server()
    fdb = Db(pg.url())
    proxy = AnswerHolder(pg.port)
    name = unique("cut")
    try:
        taker = procs.start(
            sys.executable,
            "-c",
            CUT_TAKER,
            name,
            env=worker_env(pg.url(port=proxy.port), PGLOCK_FAULT_NO_PREPARE="1"),
            stdin=True,
        )
        taker.expect("OPEN", 60)
        proxy.hold()
        taker.send("go")
        wait_until(lambda: fdb.row(name) is not None, 30, "the server never granted")
        cut_token = int(fdb.row(name)["token"])
        line = taker.expect("UNAVAILABLE", 60).split()
        assert float(line[1]) < NEAR, f"acquire_or_raise(timeout=1) took {line[1]} s"
        # Released by the sweep of the process that made it, while that process lives on.
        wait_until(lambda: fdb.row(name) is None, 30, "the cut-off grant was never released")
        (outcome,) = fdb.execute(
            "SELECT outcome FROM django_pglock_jobrun WHERE name = %s AND token = %s",
            [name, cut_token],
        ).fetchone()
        assert outcome == "lost"
        taker.send("again")
        token = int(taker.expect("GRANTED", 60).split()[1])
        assert token > cut_token
        assert taker.finish() == 0, taker.stderr_text
    finally:
        proxy.close()
        fdb.close()
