"""What the admin pages share: they read the lock database, ignore what cannot be text,
and show states as coloured words.

The lock engine writes its rows on ``DJANGO_PGLOCK["DATABASE"]``; the admin reads them
there too, whatever the project's database routers say (a project need not add a router
for the lock alias, and ``default`` may be SQLite). The admin's own records (users, the
admin log) stay where the project keeps them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views import main
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse, QueryDict
from django.utils.html import format_html

from .conf import get_setting, validate_alias

if TYPE_CHECKING:  # ModelAdmin is generic for type checkers only
    ModelAdminBase = admin.ModelAdmin[Any]
else:
    ModelAdminBase = admin.ModelAdmin

__all__ = ["OUTCOME_COLOURS", "LockDatabaseAdmin", "badge"]

OUTCOME_COLOURS = {
    "succeeded": "#2e7d32",
    "running": "#1565c0",
    "skipped": "#616161",
    "failed": "#c62828",
    "lost": "#e65100",
}


def badge(word: str, colour: str) -> str:
    """The word itself, coloured: readable with or without colour."""
    return format_html(
        '<span style="color:#fff;background:{};padding:1px 8px;border-radius:8px;'
        'font-weight:bold">{}</span>',
        colour,
        word,
    )


# What a change list reads besides its filters: search, ordering, page, "show all", popups,
# the error flag, facets (Django 5.0+).
_PAGE_PARAMETERS = frozenset(
    getattr(main, name)
    for name in (
        "ALL_VAR",
        "ORDER_VAR",
        "PAGE_VAR",
        "SEARCH_VAR",
        "ERROR_FLAG",
        "TO_FIELD_VAR",
        "IS_POPUP_VAR",
        "IS_FACETS_VAR",
    )
    if hasattr(main, name)
)
# The lookups a field's list filter or a date hierarchy puts in the query string.
_FILTER_LOOKUPS = frozenset(
    {"exact", "iexact", "isnull", "in", "gte", "gt", "lte", "lt", "year", "month", "day"}
)


def _is_text(value: str) -> bool:
    """Whether PostgreSQL can compare ``value`` with a text column (no NUL byte in it)."""
    return "\x00" not in value


class LockDatabaseAdmin(ModelAdminBase):
    """The admin of django_pglock's rows, on the lock database.

    ``get_queryset`` reads ``DJANGO_PGLOCK["DATABASE"]``; a subclass that narrows it
    (rows per tenant, say) narrows the list, the filters and the actions alike. Query
    parameters that cannot be compared with text (a NUL byte) are dropped before the
    list is built, as is a selection or an object id holding one.
    """

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The model's rows on the lock database."""
        alias = validate_alias(get_setting("DATABASE"))
        return super().get_queryset(request).using(alias)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, with parameters that cannot be text (``?q=x%00``) or that the page
        does not offer (``?name__regex=(``, an old bookmark) ignored."""
        pairs = _pairs(request.GET)
        offered = self._offered_parameters()
        kept = [
            (key, value)
            for key, value in pairs
            if _is_text(key) and _is_text(value) and _is_offered(key, offered)
        ]
        if len(kept) < len(pairs):
            request.GET = QueryDict(urlencode(kept))
        return super().changelist_view(request, extra_context)

    def _offered_parameters(self) -> tuple[set[str], set[str]]:
        """(exact parameter names, field paths whose filter lookups are offered)."""
        names, fields = set(_PAGE_PARAMETERS), set()
        for spec in self.list_filter:
            if isinstance(spec, (list, tuple)):
                spec = spec[0]
            if isinstance(spec, str):
                fields.add(spec)
            elif hasattr(spec, "parameter_name"):
                names.add(spec.parameter_name)
        if self.date_hierarchy:
            fields.add(self.date_hierarchy)
        return names, fields

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Model | None:
        """The row, or ``None`` (Django's "does not exist") for an id that cannot be text."""
        if not _is_text(object_id):
            return None
        return super().get_object(request, object_id, from_field)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """Run the chosen action, unless the selection holds a value that cannot be text."""
        selected = request.POST.getlist(ACTION_CHECKBOX_NAME)
        if not all(_is_text(value) for value in selected):
            self.message_user(
                request,
                "The selection holds a value with a NUL character, which no row can have; "
                "select rows on the list and try again. Nothing was done.",
                messages.WARNING,
            )
            return None
        return super().response_action(request, queryset, *args, **kwargs)


def _is_offered(key: str, offered: tuple[set[str], set[str]]) -> bool:
    names, fields = offered
    if key in names or key in fields:
        return True
    field, _, lookup = key.rpartition("__")
    return field in fields and lookup in _FILTER_LOOKUPS


def _pairs(query: QueryDict) -> list[tuple[str, str]]:
    return [(key, value) for key, values in query.lists() for value in values]
