"""Job health at scale: 1,000 jobs with 100,000 history rows, next to a floor.

    python benchmarks/bench_health.py [--jobs 1000] [--runs 100] [--rounds 15] [--json]

Starts a throwaway PostgreSQL server the way the test suite does (or uses ``DATABASE_URL``),
creates a throwaway database, migrates ``django_pglock`` into it and fills it: ``--jobs``
job names with ``--runs`` runs each (succeeded, failed, lost, skipped, spread over the
last days), a schedule claim with a cron expression for every fifth job, a declared
``JOBS`` entry for every tenth, and 50 locks held. Then, per round:

* ``server``: the statement's execution time on the server (``EXPLAIN (ANALYZE, TIMING
  OFF)``), without sending the rows;
* ``floor``: bare psycopg runs the health statement (``sql.JOB_HEALTH``) and fetches it in
  binary, as ``job_health`` does;
* ``job_health()``: the whole answer, as the command, the view and the metrics get it
  (the statement, the abandoned check of advisory holders, the states and next due
  starts in Python), without announcing episodes;

and prints the median time of each, its ratio to the floor, the breakdown (server; fetch:
the floor less the server; Python and the other statements: ``job_health`` less the
floor), the statements one call sends, and the indexes the plan used.

What the summaries cost where runs are written: a recorded cycle (``Lock(record=True)``:
acquire, which starts a run, and release, which finishes it) and a refused recorded acquire
(which writes no run), each timed in alternating blocks with the summary triggers enabled
and disabled (``ALTER TABLE .. DISABLE TRIGGER``: the summaries drift meanwhile, which
nothing reads any more), medians of the blocks. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_cycle import configure_django  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000, help="job names (1000)")
    parser.add_argument("--runs", type=int, default=100, help="history rows per job (100)")
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds (15)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if min(args.jobs, args.runs, args.rounds) < 1:
        parser.error("--jobs, --runs and --rounds must be at least 1")
    return args


FILL = """
INSERT INTO django_pglock_jobrun (name, token, holder, host, pid, description, started_at,
    finished_at, duration, outcome, reason)
SELECT 'job-' || j, NULL, 'bench', 'host', 1, '',
       now() - (r * interval '37 minutes') - (j * interval '1 second'),
       now() - (r * interval '37 minutes') - (j * interval '1 second') + interval '3 seconds',
       3.0,
       CASE WHEN r %% 10 = 3 THEN 'failed' WHEN r %% 50 = 7 THEN 'lost'
            WHEN r %% 4 = 1 THEN 'skipped' ELSE 'succeeded' END,
       CASE WHEN r %% 4 = 1 AND r %% 10 <> 3 AND r %% 50 <> 7 THEN 'held' END
FROM generate_series(1, %(jobs)s) AS j, generate_series(1, %(runs)s) AS r
"""
CLAIMS = """
INSERT INTO django_pglock_scheduleclaim (name, slot, holder, claimed_at, schedule)
SELECT 'job-' || j, date_trunc('hour', now()), 'bench', now(), '0 * * * *'
FROM generate_series(1, %(jobs)s, 5) AS j
"""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import psycopg
    import psycopg.sql

    from tests.pgserver import ensure_database_url

    url = ensure_database_url()
    dbname = f"pglock_health_{os.getpid()}"
    admin = psycopg.connect(url, autocommit=True)
    admin.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(dbname)))
    try:
        report = run(args, url, dbname)
    finally:
        from django.db import connections

        connections.close_all()
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            [dbname],
        )
        admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {}").format(psycopg.sql.Identifier(dbname))
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def run(args: argparse.Namespace, url: str, dbname: str) -> dict[str, Any]:
    import psycopg
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext, override_settings

    from django_pglock import Lock, sql
    from django_pglock.health import job_health

    configure_django(url, dbname)
    call_command("migrate", verbosity=0)
    floor = psycopg.connect(url, dbname=dbname, autocommit=True)
    params = {"jobs": args.jobs, "runs": args.runs}
    floor.execute(FILL, params)
    floor.execute(CLAIMS, params)
    floor.execute("VACUUM ANALYZE")  # as autovacuum leaves a table of this size
    held = [Lock(f"job-{j}").try_acquire() for j in range(1, 51)]
    declared = {f"job-{j}": {"every": "1h", "max_duration": "1h"} for j in range(1, args.jobs, 10)}
    config = {**getattr(settings, "DJANGO_PGLOCK", {}), "JOBS": declared}
    floor_params = {"declared": list(declared), "gone_names": [], "gone_tokens": []}
    times: dict[str, list[float]] = {"server": [], "floor": [], "job_health": []}
    explain = "EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + sql.JOB_HEALTH
    with override_settings(DJANGO_PGLOCK=config):
        job_health(announce=False)  # warm-up: plans, cronsim, connections
        for _ in range(args.rounds):
            server = floor.execute(explain, floor_params).fetchone()[0][0]
            times["server"].append(server["Execution Time"] / 1000)
            started = time.perf_counter()
            rows = floor.execute(sql.JOB_HEALTH, floor_params, binary=True).fetchall()
            times["floor"].append(time.perf_counter() - started)
            started = time.perf_counter()
            jobs = job_health(announce=False)
            times["job_health"].append(time.perf_counter() - started)
        with CaptureQueriesContext(connection) as queries:
            job_health(announce=False)
        plan = floor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql.JOB_HEALTH, floor_params
        ).fetchone()[0][0]
    for lease in held:
        if lease is not None:
            lease.release()
    writes = _write_costs(floor, args.rounds)
    floor.close()
    states: dict[str, int] = {}
    for job in jobs:
        states[job.state] = states.get(job.state, 0) + 1
    server_ms = statistics.median(times["server"]) * 1000
    floor_ms = statistics.median(times["floor"]) * 1000
    ours_ms = statistics.median(times["job_health"]) * 1000
    return {
        "jobs": len(jobs),
        "rows_in_history": args.jobs * args.runs,
        "statement_rows": len(rows),
        "rounds": args.rounds,
        "server_ms": round(server_ms, 2),
        "floor_ms": round(floor_ms, 2),
        "job_health_ms": round(ours_ms, 2),
        "ratio": round(ours_ms / floor_ms, 2),
        "statements_per_call": len(queries.captured_queries),
        "plan_execution_ms": plan.get("Execution Time"),
        "indexes": sorted(_indexes(plan["Plan"])),
        "states": states,
        **writes,
    }


_TRIGGERS = (
    "ALTER TABLE django_pglock_jobrun {0} TRIGGER USER;"
    " ALTER TABLE django_pglock_scheduleclaim {0} TRIGGER USER"
)


def _write_costs(floor: Any, rounds: int, per_block: int = 100) -> dict[str, Any]:
    """Microseconds per recorded cycle and per refused recorded acquire, with the summary triggers
    and without them (alternating blocks of ``per_block``)."""
    from django_pglock import Lock

    holder = Lock("bench-write-held").try_acquire()
    times: dict[str, list[float]] = {
        "cycle_on": [], "cycle_off": [], "skip_on": [], "skip_off": []
    }  # fmt: skip
    try:
        for block in range(2 * rounds):
            state = "on" if block % 2 == 0 else "off"
            floor.execute(_TRIGGERS.format("ENABLE" if state == "on" else "DISABLE"))
            started = time.perf_counter()
            for _ in range(per_block):
                lease = Lock("bench-write", record=True).try_acquire()
                assert lease is not None
                lease.release()
            times[f"cycle_{state}"].append((time.perf_counter() - started) / per_block)
            started = time.perf_counter()
            for _ in range(per_block):
                assert Lock("bench-write-held", record=True).try_acquire() is None
            times[f"skip_{state}"].append((time.perf_counter() - started) / per_block)
    finally:
        floor.execute(_TRIGGERS.format("ENABLE"))
        if holder is not None:
            holder.release()
    us = {key: statistics.median(values) * 1e6 for key, values in times.items()}
    return {
        "recorded_cycle_us": round(us["cycle_on"], 1),
        "recorded_cycle_without_summary_us": round(us["cycle_off"], 1),
        "refused_us": round(us["skip_on"], 1),
        "refused_without_summary_us": round(us["skip_off"], 1),
    }


def _indexes(node: dict[str, Any]) -> set[str]:
    found = {node["Index Name"]} if "Index Name" in node else set()
    for child in node.get("Plans", []):
        found |= _indexes(child)
    return found


def print_report(report: dict[str, Any]) -> None:
    print(
        f"Job health: {report['jobs']} jobs, {report['rows_in_history']:,} history rows, "
        f"median of {report['rounds']} rounds"
    )
    print(f"  floor (bare psycopg, the health statement): {report['floor_ms']:8.2f} ms")
    print(
        f"  job_health()                              : {report['job_health_ms']:8.2f} ms"
        f"  ({report['ratio']:.2f}x the floor)"
    )
    server, floor, ours = report["server_ms"], report["floor_ms"], report["job_health_ms"]
    print(
        f"  breakdown: server {server:.1f} ms, fetch {floor - server:.1f} ms, "
        f"Python and the other statements {ours - floor:.1f} ms"
    )
    print(f"  statements per call: {report['statements_per_call']}")
    print(f"  plan execution (EXPLAIN ANALYZE): {report['plan_execution_ms']:.2f} ms")
    print(f"  indexes used: {', '.join(report['indexes']) or 'none (no job is recounted)'}")
    print(f"  states: {report['states']}")
    on, off = report["recorded_cycle_us"], report["recorded_cycle_without_summary_us"]
    print(
        f"  a recorded cycle (acquire + release): {on:.0f} us with the summary triggers, "
        f"{off:.0f} us without ({on / off:.2f}x)"
    )
    on, off = report["refused_us"], report["refused_without_summary_us"]
    print(f"  a refused recorded acquire: {on:.0f} us with, {off:.0f} us without ({on / off:.2f}x)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
