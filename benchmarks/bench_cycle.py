"""What one lock cycle costs, next to the cheapest thing PostgreSQL can do instead.

    python benchmarks/bench_cycle.py [--n 2000] [--rounds 7] [--json]

Starts a throwaway PostgreSQL server exactly as the test suite does (``DATABASE_URL`` is
used when set), creates a throwaway database on it, migrates django_pglock into it, and
measures, in one run against that one server:

floor-cycle    bare psycopg on one autocommit connection: ``INSERT .. ON CONFLICT DO
               NOTHING`` then ``DELETE`` of one row in a one-index table: two round trips;
cycle          ``lease = Lock("bench").try_acquire(); lease.release()``;
cycle-table    the same with ``advisory=False`` (table path only);
floor-refused  the floor's ``INSERT .. ON CONFLICT DO NOTHING`` on a row that exists;
refused        ``Lock("bench-held").try_acquire()`` while another process holds it.

Each round runs every operation ``--n`` times, in an order that rotates from round to
round; one warm-up round is discarded. Reported: the median over rounds of the per-op
time, the spread (min..max over rounds), the ratio to the matching floor (the median of
the per-round ratios, so that drift shared by a round cancels out), and, when the server
has pg_stat_statements loaded, the statements the server ran per operation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

FLOOR_TABLE = "floor_t"
CYCLE_NAME = "bench"
HELD_NAME = "bench-held"
HOLDER = "bench:floor"

FLOOR_INSERT = f"INSERT INTO {FLOOR_TABLE} (name, holder) VALUES (%s, %s) ON CONFLICT DO NOTHING"
FLOOR_DELETE = f"DELETE FROM {FLOOR_TABLE} WHERE name = %s"

# (key, label, the floor it is compared with)
OPERATIONS = [
    ("floor-cycle", "floor: INSERT ON CONFLICT DO NOTHING + DELETE", None),
    ("cycle", "ours: try_acquire() + release()", "floor-cycle"),
    ("cycle-table", "ours: same, advisory=False", "floor-cycle"),
    ("floor-refused", "floor: refused INSERT ON CONFLICT DO NOTHING", None),
    ("refused", "ours: refused try_acquire() (held elsewhere)", "floor-refused"),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="operations per round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (7)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    # Internal: run as the process that holds HELD_NAME for the "refused" operations.
    parser.add_argument("--hold-in", metavar="DBNAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        parser.error("--n and --rounds must be at least 1")
    return args


def configure_django(url: str, dbname: str) -> None:
    import django
    from django.conf import settings

    from tests.settings import parse_database_url

    database = parse_database_url(url)
    database["NAME"] = dbname
    settings.configure(
        DATABASES={"default": database},
        INSTALLED_APPS=["django_pglock"],
        USE_TZ=True,
        TIME_ZONE="UTC",
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


def hold(dbname: str) -> int:
    """Hold HELD_NAME from this separate process until stdin closes."""
    from tests.pgserver import ENV_URL

    configure_django(os.environ[ENV_URL], dbname)
    from django_pglock import Lock

    lease = Lock(HELD_NAME).try_acquire()
    if lease is None:
        print("REFUSED", flush=True)
        return 1
    print("HELD", lease.token, flush=True)
    sys.stdin.read()
    lease.release()
    return 0


class Bench:
    """The throwaway database, the connections and the operations measured on them."""

    def __init__(self, url: str, dbname: str) -> None:
        import psycopg.sql

        self.url = url
        self.dbname = dbname
        self.admin = psycopg.connect(url, autocommit=True)
        self.admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(self._ident()))
        self.holder: subprocess.Popen[str] | None = None
        self.floor: Any = None
        self.observer: Any = None

    def _ident(self) -> Any:
        import psycopg.sql

        return psycopg.sql.Identifier(self.dbname)

    def setup(self) -> None:
        import psycopg
        from django.core.management import call_command

        from django_pglock import Lock

        configure_django(self.url, self.dbname)
        call_command("migrate", verbosity=0)
        self.floor = psycopg.connect(self.url, dbname=self.dbname, autocommit=True)
        self.floor.execute(
            f"CREATE TABLE {FLOOR_TABLE} (name varchar(255) PRIMARY KEY, holder text)"
        )
        # Another session holds the floor's contended row, as another process holds ours.
        self.observer = psycopg.connect(self.url, dbname=self.dbname, autocommit=True)
        self.observer.execute(FLOOR_INSERT, (HELD_NAME, "bench:elsewhere"))
        self.holder = subprocess.Popen(
            [sys.executable, __file__, "--hold-in", self.dbname],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        if not line.startswith("HELD"):
            raise SystemExit(f"the holder process could not take {HELD_NAME!r}: {line!r}")
        self.lock = Lock(CYCLE_NAME)
        self.lock_table = Lock(CYCLE_NAME, advisory=False)
        self.lock_held = Lock(HELD_NAME)

    # -- the operations, each a loop of n ------------------------------------------------

    def floor_cycle(self, n: int) -> None:
        execute = self.floor.execute
        for _ in range(n):
            execute(FLOOR_INSERT, (CYCLE_NAME, HOLDER))
            execute(FLOOR_DELETE, (CYCLE_NAME,))

    def _cycle(self, lock: Any, n: int) -> None:
        for _ in range(n):
            lease = lock.try_acquire()
            if lease is None:
                raise RuntimeError(f"{lock!r} was refused; nothing else should hold it")
            lease.release()

    def cycle(self, n: int) -> None:
        self._cycle(self.lock, n)

    def cycle_table(self, n: int) -> None:
        self._cycle(self.lock_table, n)

    def floor_refused(self, n: int) -> None:
        execute = self.floor.execute
        for _ in range(n):
            if execute(FLOOR_INSERT, (HELD_NAME, HOLDER)).rowcount != 0:
                raise RuntimeError("the floor's held row was free")

    def refused(self, n: int) -> None:
        lock = self.lock_held
        for _ in range(n):
            if lock.try_acquire() is not None:
                raise RuntimeError(f"{HELD_NAME!r} was granted while held elsewhere")

    def runner(self, key: str) -> Callable[[int], None]:
        runner: Callable[[int], None] = getattr(self, key.replace("-", "_"))
        return runner

    # -- facts about the server ----------------------------------------------------------

    def server_facts(self) -> dict[str, Any]:
        import django
        import psycopg

        show = {
            name: self.observer.execute(f"SHOW {name}").fetchone()[0]
            for name in ("server_version", "synchronous_commit", "fsync")
        }
        via = "unix socket" if self.floor.info.host.startswith("/") else "tcp"
        return {
            **show,
            "connection": f"{via} ({self.floor.info.host})",
            "python": platform.python_version(),
            "psycopg": psycopg.__version__,
            "libpq": psycopg.pq.version(),
            "django": django.get_version(),
        }

    def statements_per_op(self, n: int = 200) -> dict[str, float] | None:
        """Statements the server ran per operation, from pg_stat_statements (or None)."""
        import psycopg

        try:
            self.observer.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self.observer.execute("SELECT pg_stat_statements_reset()")
        except psycopg.Error:
            return None
        counts = {}
        for key, _, _ in OPERATIONS:
            self.observer.execute("SELECT pg_stat_statements_reset()")
            self.runner(key)(n)
            (calls,) = self.observer.execute(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND query NOT ILIKE '%%pg_stat_statements%%'"
                # the holder process's own heartbeat (every 10 s) is not ours
                " AND query NOT LIKE '%%SET last_heartbeat%%'"
            ).fetchone()
            counts[key] = float(calls) / n
        return counts

    def close(self) -> None:
        import contextlib

        import psycopg.sql
        from django.db import connections

        if self.holder is not None:
            with contextlib.suppress(OSError):
                assert self.holder.stdin is not None
                self.holder.stdin.close()
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        if "default" in connections.settings:
            from django_pglock.connection import get_connection

            get_connection("default").close()
            connections.close_all()
        for conn in (self.floor, self.observer):
            if conn is not None:
                conn.close()
        self.admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(self._ident())
        )
        self.admin.close()


def measure(bench: Bench, n: int, rounds: int) -> dict[str, list[float]]:
    """Per-op microseconds of each operation, one value per measured round."""
    keys = [key for key, _, _ in OPERATIONS]
    results: dict[str, list[float]] = {key: [] for key in keys}
    for round_no in range(rounds + 1):  # round 0 warms up: caches, prepared statements
        shift = round_no % len(keys)
        for key in keys[shift:] + keys[:shift]:
            run = bench.runner(key)
            gc.collect()
            started = time.perf_counter_ns()
            run(n)
            elapsed = time.perf_counter_ns() - started
            if round_no:
                results[key].append(elapsed / n / 1000)
    return results


def summarise(
    results: dict[str, list[float]], statements: dict[str, float] | None
) -> list[dict[str, Any]]:
    rows = []
    for key, label, floor in OPERATIONS:
        per_round = results[key]
        row: dict[str, Any] = {
            "operation": key,
            "label": label,
            "median_us": statistics.median(per_round),
            "min_us": min(per_round),
            "max_us": max(per_round),
            "rounds_us": [round(v, 2) for v in per_round],
            "floor": floor,
            "ratio_to_floor": None,
            "statements_per_op": None if statements is None else statements[key],
        }
        if floor is not None:
            pairs = zip(per_round, results[floor], strict=True)
            row["ratio_to_floor"] = statistics.median(ours / base for ours, base in pairs)
        rows.append(row)
    return rows


def print_table(facts: dict[str, Any], n: int, rounds: int, rows: list[dict[str, Any]]) -> None:
    print(
        f"PostgreSQL {facts['server_version']}  synchronous_commit={facts['synchronous_commit']}"
        f"  fsync={facts['fsync']}  via {facts['connection']}"
    )
    print(
        f"Python {facts['python']}, psycopg {facts['psycopg']} (libpq {facts['libpq']}), "
        f"Django {facts['django']}"
    )
    print(f"{n} ops x {rounds} rounds (+1 warm-up), rounds interleaved, order rotating\n")
    header = f"{'operation':<48} {'median us/op':>12} {'min..max':>17} {'vs floor':>9} {'stmts':>6}"
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['min_us']:.1f}..{row['max_us']:.1f}"
        ratio = "" if row["ratio_to_floor"] is None else f"{row['ratio_to_floor']:.2f}x"
        stmts = "" if row["statements_per_op"] is None else f"{row['statements_per_op']:.2f}"
        print(f"{row['label']:<48} {row['median_us']:>12.1f} {spread:>17} {ratio:>9} {stmts:>6}")
    print(
        "\nvs floor: median over rounds of (ours / floor in the same round); "
        "stmts: statements run by the server per operation (pg_stat_statements)."
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.hold_in:
        return hold(args.hold_in)

    from tests.pgserver import ensure_database_url

    url = ensure_database_url()  # also exported, so the holder process reaches this server
    bench = Bench(url, f"pglock_bench_{os.getpid()}")
    try:
        bench.setup()
        facts = bench.server_facts()
        results = measure(bench, args.n, args.rounds)
        statements = bench.statements_per_op()
    finally:
        bench.close()
    rows = summarise(results, statements)
    if args.json:
        report = {"server": facts, "n": args.n, "rounds": args.rounds, "results": rows}
        print(json.dumps(report, indent=2))
    else:
        print_table(facts, args.n, args.rounds, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
