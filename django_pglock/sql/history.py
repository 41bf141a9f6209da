"""The admin's jobs page: the recent runs of the jobs it shows, in one statement."""

from __future__ import annotations

from .names import RUNS as _RUNS

__all__ = ["RECENT_RUNS"]

# The last ``limit`` runs of each name that ran its body (skips left out), oldest first:
# one probe per name on django_pglock_run_name_idx (name, started_at DESC), whatever the
# number of names or the length of their history. A run still going on has no duration
# yet: it counts from its start to now (the database clock).
RECENT_RUNS = f"""
SELECT n.name, r.started_at, r.outcome,
       coalesce(r.duration, extract(epoch FROM coalesce(r.finished_at, now()) - r.started_at))
FROM unnest(%(names)s::varchar[]) AS n(name)
CROSS JOIN LATERAL (
    SELECT r.started_at, r.finished_at, r.duration, r.outcome FROM {_RUNS} r
    WHERE r.name = n.name AND r.outcome <> 'skipped'
    ORDER BY r.started_at DESC LIMIT %(limit)s
) r
ORDER BY n.name, r.started_at
"""
