"""Admin pages: who holds what and whether it looks alive, forced release, run history,
and the jobs page (each job's health, :mod:`.admin_jobs`)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from . import admin_jobs, sql
from .admin_base import OUTCOME_COLOURS, LockDatabaseAdmin, badge
from .admin_filters import (
    JobNameFilter,
    LastSuccessFilter,
    OutcomeFilter,
    ReasonFilter,
    StateFilter,
)
from .models import JobLock, JobRun
from .operations import abandoned_grants, force_release

STATE_COLOURS = {"ok": "#2e7d32", "alert": "#e65100", "stale": "#c62828", "abandoned": "#616161"}


@admin.register(JobLock)
class JobLockAdmin(LockDatabaseAdmin):
    """Read-only holders page. State and heartbeat age come from the database clock."""

    list_display = (
        "name_display",
        "slot_display",
        "state_badge",
        "heartbeat_age_display",
        "holder_display",
        "acquired_at",
        "token",
        "description",
    )
    list_filter = (StateFilter,)
    search_fields = ("name", "host")
    ordering = ("-acquired_at",)
    actions = ["force_release"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[JobLock]:
        queryset: QuerySet[JobLock] = super().get_queryset(request)
        return queryset.annotate(
            state=RawSQL(sql.STATE_EXPRESSION, abandoned_grants(queryset.db)),
            heartbeat_age=RawSQL(sql.HEARTBEAT_AGE_EXPRESSION, ()),
            held=RawSQL(sql.HELD_EXPRESSION, ()),
            lock_limit=RawSQL(sql.LIMIT_EXPRESSION, ()),
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # releasing goes through the force-release action only

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("django_pglock.force_release_joblock")

    @admin.display(description="name", ordering="name")
    def name_display(self, obj: JobLock) -> str:
        return obj.lock_name_and_slot[0]

    @admin.display(description="slot")
    def slot_display(self, obj: Any) -> str:
        """A semaphore's holder: its slot, and how many of the lock's slots are held."""
        slot = obj.lock_name_and_slot[1]
        if slot == 1 and obj.slot_limit == 1 and obj.held == 1:
            return "-"
        return f"{slot} ({obj.held} of {obj.lock_limit} held)"

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: Any) -> str:
        return badge(obj.state, STATE_COLOURS[obj.state])

    @admin.display(description="heartbeat age", ordering="-last_heartbeat")
    def heartbeat_age_display(self, obj: Any) -> str:
        return f"{obj.heartbeat_age:.1f} s"

    @admin.display(description="holder", ordering="host")
    def holder_display(self, obj: JobLock) -> str:
        return f"{obj.host}:{obj.pid}"

    @admin.action(permissions=["force_release"], description="Force release selected locks")
    def force_release(
        self, request: HttpRequest, queryset: QuerySet[JobLock]
    ) -> HttpResponse | None:
        if not self.has_force_release_permission(request):  # pragma: no cover - Django checks
            self.message_user(request, "You may not force-release locks.", messages.ERROR)
            return None
        if request.POST.get("post") != "yes":
            if not queryset.exists():
                self.message_user(
                    request, "None of the selected locks is held any more.", messages.WARNING
                )
                return None
            context = {
                **self.admin_site.each_context(request),
                "title": "Force release: are you sure?",
                "opts": self.model._meta,
                "locks": list(queryset),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
            }
            return TemplateResponse(
                request, "admin/django_pglock/joblock/force_release_confirmation.html", context
            )
        # Release exactly the grants the confirmation page showed, and only those the
        # action's queryset holds now: get_queryset (a subclass may narrow it, to a
        # tenant's rows say), the selection and the page's filters. What the form names
        # is a request; the queryset is what this user may release.
        names, tokens = request.POST.getlist("lock_name"), request.POST.getlist("lock_token")
        if len(names) != len(tokens):
            self.message_user(request, "The confirmation form was incomplete.", messages.ERROR)
            return None
        current = dict(queryset.values_list("name", "token"))
        for name, token_text in sorted(dict(zip(names, tokens, strict=True)).items()):
            if not (token_text.isascii() and token_text.isdigit()):
                continue  # no grant carries such a token: nothing to release
            token = int(token_text)
            # A token that cannot be one (0) goes on to force_release, which says so.
            if name not in current or (token >= 1 and current[name] != token):
                self._not_released(request, name, token_text)
                continue
            self._release(request, name, token, queryset.db)
        return None

    def _release(self, request: HttpRequest, name: str, token: int, using: str) -> None:
        """Release grant ``token`` of ``name``, log it and tell the user what happened."""
        try:
            # A semaphore's slot row: its lock's name, and the grant's token.
            name = sql.slot_of(name)[0]
            released = force_release(name, token=token, using=using)
        except ValueError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        if released is None:
            self._not_released(request, name, str(token))
            return
        holder = f"{released['host']}:{released['pid']} ({released['holder']})"
        message = f"Force-released lock {name!r} held by {holder}, token {released['token']}."
        gone = JobLock(name=name, token=released["token"], holder=released["holder"])
        self.log_change(request, gone, message)
        self.message_user(request, message, messages.SUCCESS)

    def _not_released(self, request: HttpRequest, name: str, token: str) -> None:
        # The same words for a grant that ended and for a lock this page does not list:
        # what another tenant holds is not told apart from what nobody holds.
        self.message_user(
            request,
            f"Lock {name!r} changed hands or was released since the confirmation page "
            f"showed token {token}, or it is not among the locks this page lists; nothing "
            "was released.",
            messages.WARNING,
        )


@admin.register(JobRun)
class JobRunAdmin(LockDatabaseAdmin):
    """Read-only run history of @singleton_job and locked_run."""

    list_display = (
        "name",
        "outcome_badge",
        "reason",
        "started_at",
        "finished_at",
        "duration_display",
        "exit_code",
        "holder",
        "token",
    )
    list_filter = (LastSuccessFilter, OutcomeFilter, ReasonFilter, JobNameFilter)
    search_fields = ("name", "host", "holder")
    date_hierarchy = "started_at"
    ordering = ("-started_at",)

    def get_urls(self) -> list[URLPattern]:
        """The run history's URLs, and the jobs page (``jobs/``, named
        ``admin:django_pglock_jobrun_jobs``) before them: the change page's catch-all
        would take ``jobs/`` for a run's id."""
        name = f"{self.opts.app_label}_{self.opts.model_name}_jobs"
        jobs = path("jobs/", self.admin_site.admin_view(self.jobs_view), name=name)
        return [jobs, *super().get_urls()]

    def jobs_view(self, request: HttpRequest) -> HttpResponse:
        """Each job's health, last runs and recent runs (see :mod:`.admin_jobs`)."""
        return admin_jobs.jobs_page(self, request)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # history is read-only; forget old runs with pglock_prune

    @admin.display(description="outcome", ordering="outcome")
    def outcome_badge(self, obj: JobRun) -> str:
        return badge(obj.outcome, OUTCOME_COLOURS.get(obj.outcome, "#616161"))

    @admin.display(description="duration", ordering="duration")
    def duration_display(self, obj: JobRun) -> str:
        return "" if obj.duration is None else f"{obj.duration:.1f} s"
