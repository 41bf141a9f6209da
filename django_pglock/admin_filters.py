"""The admin's list filters. Each accepts only the values it offers and ignores any other.

A value the filter does not offer (a typo, a stale bookmark, a NUL byte: ``?state=x%00``)
is ignored, as if none were given: the page lists everything, with *All* selected,
instead of failing on the database.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from .models import JobRun
from .options import validate_name

__all__ = ["JobNameFilter", "LastSuccessFilter", "OutcomeFilter", "ReasonFilter", "StateFilter"]


class OfferedValueFilter(admin.SimpleListFilter):
    """A filter on ``field`` whose value must be one of its ``lookups``."""

    field = ""
    #: The (value, label) pairs offered, unless ``lookups`` is overridden.
    offered_choices: list[tuple[str, str]] = []

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(value), str(label)) for value, label in self.offered_choices]

    def value(self) -> str | None:
        """The value asked for, if the filter offers it; ``None`` (no filter) otherwise."""
        value = super().value()
        offered = {str(lookup) for lookup, _title in self.lookup_choices}
        return value if value in offered else None

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        return queryset.filter(**{self.field: value})


class StateFilter(OfferedValueFilter):
    """Held locks by state (the ``state`` annotation of the holders page)."""

    title = "state"
    parameter_name = "state"
    field = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("ok", "ok"),
            ("alert", "alert"),
            ("stale", "stale"),
            ("abandoned", "abandoned (holder gone)"),
        ]


class OutcomeFilter(OfferedValueFilter):
    """Runs by outcome."""

    title = "outcome"
    parameter_name = "outcome"
    field = "outcome"

    offered_choices = JobRun.Outcome.choices


class ReasonFilter(OfferedValueFilter):
    """Skipped runs by the reason of the skip."""

    title = "reason"
    parameter_name = "reason"
    field = "reason"

    offered_choices = JobRun.Reason.choices


class JobNameFilter(OfferedValueFilter):
    """Runs of one job, from ``?name=<job>``: the page's links, bookmarks, the health view.

    Job names are not listed (a project with a lock per tenant has thousands; the search
    box finds them): the filter shows only when a name is asked for, as *All* and that
    name.
    """

    title = "job name"
    parameter_name = "name"
    field = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        asked = self.used_parameters.get(self.parameter_name)
        try:
            name = validate_name(asked)
        except ValueError:
            return []
        return [(name, name)]


class LastSuccessFilter(OfferedValueFilter):
    """The last successful run of each job."""

    title = "show"
    parameter_name = "show"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("last-success", "Last successful run of each job")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() != "last-success":
            return queryset
        latest = (
            JobRun.objects.using(queryset.db)
            .filter(outcome=JobRun.Outcome.SUCCEEDED)
            .order_by("name", "-started_at")
            .distinct("name")
            .values("pk")
        )
        return queryset.filter(pk__in=latest)
