"""The admin of a project whose locks live on their own database, seen from a child process.

    DJANGO_SETTINGS_MODULE=tests.multidb_settings python -m tests.multidb_admin <victim> <search>

``default`` is SQLite, the locks are on ``locks`` (PostgreSQL) and there is no router
(tests/multidb_settings.py). The child migrates its SQLite file, logs a superuser in with
Django's test client, visits the admin pages (holders, runs, jobs) with their filters and
search, the change page of ``<victim>``, force-releases ``<victim>`` through the
confirmation page, runs ``pglock_status --json``, and prints one JSON object (its last
stdout line) with what it saw: per page the status code, the rows listed (lock names with
their state, run ids, jobs with their health), the messages, or the error a page raised.
tests/test_admin_multidb.py asserts on it.
"""

from __future__ import annotations

import io
import json
import sys
import traceback
from typing import Any

import django


def visit(client: Any, url: str, data: dict[str, Any] | None = None, *, post: bool = False):
    """One request; what the page showed, or the error it raised."""
    try:
        if post:
            response = client.post(url, data or {}, follow=True)
        else:
            response = client.get(url, data or {})
    except Exception as exc:  # a crash is what the test wants to see, not a traceback
        return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    seen: dict[str, Any] = {"status": response.status_code}
    context = response.context or {}
    if "cl" in context:
        seen["rows"] = [
            [obj.pk, getattr(obj, "state", obj.pk)] for obj in context["cl"].result_list
        ]
        seen["count"] = context["cl"].result_count
    if "rows" in context and "recent" in context:  # the jobs page
        seen["jobs"] = [[row.health.name, row.health.state] for row in context["rows"]]
        seen["charts"] = {row.health.name: row.chart.count("<rect") for row in context["rows"]}
    if "locks" in context:
        seen["confirming"] = [lock.pk for lock in context["locks"]]
    if "messages" in context:
        seen["messages"] = [message.message for message in context["messages"]]
    seen["content"] = response.content.decode(errors="replace")
    return seen


def main(victim: str, search: str) -> dict[str, Any]:
    django.setup()
    from django.contrib.admin.models import LogEntry
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment
    from django.urls import reverse

    from tests.adminforms import confirmation_form

    setup_test_environment()  # the test client's host, and response.context
    call_command("migrate", database="default", verbosity=0, interactive=False)
    user = User.objects.create_superuser("ops", password="ops-password-not-secret")
    client = Client()
    client.force_login(user)

    holders = reverse("admin:django_pglock_joblock_changelist")
    runs = reverse("admin:django_pglock_jobrun_changelist")
    change = reverse("admin:django_pglock_joblock_change", args=[victim])
    seen: dict[str, Any] = {
        "holders": visit(client, holders),
        "holders_ok": visit(client, holders, {"state": "ok"}),
        "holders_search": visit(client, holders, {"q": search}),
        "change": visit(client, change),
        "runs": visit(client, runs),
        "runs_last_success": visit(client, runs, {"show": "last-success"}),
        "runs_failed": visit(client, runs, {"outcome": "failed"}),
        "runs_search": visit(client, runs, {"q": search}),
        "jobs": visit(client, reverse("admin:django_pglock_jobrun_jobs")),
        "jobs_failing": visit(
            client, reverse("admin:django_pglock_jobrun_jobs"), {"state": "failing"}
        ),
    }
    status = io.StringIO()
    call_command("pglock_status", "--json", stdout=status)
    seen["status_json"] = json.loads(status.getvalue())

    confirm = visit(
        client, holders, {"action": "force_release", "_selected_action": [victim]}, post=True
    )
    seen["confirm"] = confirm
    if "error" not in confirm:
        response = client.post(holders, {"action": "force_release", "_selected_action": [victim]})
        seen["released"] = visit(client, holders, confirmation_form(response), post=True)
    seen["log_entries"] = [entry.change_message for entry in LogEntry.objects.all()]
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2]), default=str))
