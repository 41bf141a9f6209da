"""System checks for the ``DJANGO_PGLOCK`` setting, with stable ids."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string

from .conf import (
    DEFAULTS,
    MAX_SCHEDULE_TOLERANCE,
    MAX_SECONDS,
    SETTING_NAME,
    ThresholdsOutOfOrder,
    ThresholdsTooTight,
    is_schedule_tolerance,
    kind_of,
    read_setting,
    setting_label,
    validate_thresholds,
)
from .identity import redact

__all__ = ["check_database", "check_settings"]

SECONDS_KEYS = ("HEARTBEAT_INTERVAL", "ALERT_AFTER", "STALE_AFTER", "POLL_INTERVAL")
POOLER_PORTS = {"6432"}  # PgBouncer's default port


def _is_seconds(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_SECONDS
    )


def check_settings(app_configs: Sequence[Any] | None = None, **kwargs: Any) -> list[CheckMessage]:
    """Types, ranges and order of the ``DJANGO_PGLOCK`` values."""
    try:
        configured = read_setting()
    except ImproperlyConfigured:
        return [
            Error(
                f"{SETTING_NAME} is {kind_of(getattr(settings, SETTING_NAME))}, not a dict.",
                hint=f"Set {SETTING_NAME} = {{'STALE_AFTER': 600.0, ...}} or remove it.",
                id="django_pglock.E001",
            )
        ]
    errors: list[CheckMessage] = []
    for key in sorted(set(configured) - set(DEFAULTS)):
        errors.append(
            Error(
                f"{SETTING_NAME} has an unknown key {key!r}.",
                hint=f"Valid keys: {', '.join(sorted(DEFAULTS))}.",
                id="django_pglock.E002",
            )
        )
    values = {**DEFAULTS, **configured}
    bad_seconds = [key for key in SECONDS_KEYS if not _is_seconds(values[key])]
    for key in bad_seconds:
        errors.append(
            Error(
                f"{SETTING_NAME}[{key!r}] = {values[key]!r} is not a positive number of seconds.",
                hint=f"Use a float such as 10.0 (at most {MAX_SECONDS:.0f}).",
                id="django_pglock.E003",
            )
        )
    ordered = ("HEARTBEAT_INTERVAL", "ALERT_AFTER", "STALE_AFTER")
    if not set(ordered) & set(bad_seconds):
        # The same rules, and messages, as Lock(...) applies at acquire time.
        hb, alert, stale = (values[key] for key in ordered)
        labels = (setting_label(ordered[0]), setting_label(ordered[1]), setting_label(ordered[2]))
        try:
            validate_thresholds(hb, alert, stale, labels)
        except ThresholdsOutOfOrder as exc:
            errors.append(Error(f"{exc.problem}.", hint=_capital(exc.fix), id="django_pglock.E004"))
        except ThresholdsTooTight as exc:
            errors.append(Error(exc.problem, hint=exc.fix, id="django_pglock.E011"))
    if not isinstance(values["ADVISORY"], bool):
        errors.append(
            Error(
                f"{SETTING_NAME}['ADVISORY'] = {values['ADVISORY']!r} is not a bool.",
                hint="Use True (crash-fast takeover) or False (behind a transaction pooler).",
                id="django_pglock.E005",
            )
        )
    if not isinstance(values["RECORD_RUNS"], bool):
        errors.append(
            Error(
                f"{SETTING_NAME}['RECORD_RUNS'] = {values['RECORD_RUNS']!r} is not a bool.",
                hint="Use True (keep a run history) or False.",
                id="django_pglock.E010",
            )
        )
    tolerance = values["SCHEDULE_TOLERANCE"]
    if not is_schedule_tolerance(tolerance):
        errors.append(
            Error(
                f"{SETTING_NAME}['SCHEDULE_TOLERANCE'] = {tolerance!r} is not a number of "
                f"seconds from 0 to {MAX_SCHEDULE_TOLERANCE:g}.",
                hint="Use a float such as 5.0: how far ahead of the database clock a host may "
                "fire a cron tick and still start that tick's slot.",
                id="django_pglock.E012",
            )
        )
    alias = values["DATABASE"]
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        errors.append(
            Error(
                f"{SETTING_NAME}['DATABASE'] = {alias!r} is not in settings.DATABASES.",
                hint=f"Use one of: {', '.join(map(repr, settings.DATABASES))}.",
                id="django_pglock.E006",
            )
        )
    else:
        engine = settings.DATABASES[alias].get("ENGINE", "")
        if not str(engine).startswith("django.db.backends.postgresql"):
            errors.append(
                Error(
                    f"Database alias {alias!r} uses {engine!r}; django_pglock needs PostgreSQL.",
                    hint="Point DJANGO_PGLOCK['DATABASE'] at a PostgreSQL alias.",
                    id="django_pglock.E007",
                )
            )
        elif values["ADVISORY"] is True and _looks_pooled(settings.DATABASES[alias]):
            errors.append(
                Warning(
                    f"Database alias {alias!r} looks like it goes through a transaction-mode "
                    "pooler, where session advisory locks are unsafe.",
                    hint="Set DJANGO_PGLOCK['ADVISORY'] = False (the table path alone still "
                    "excludes), or give the lock alias a direct or session-mode connection.",
                    id="django_pglock.W001",
                )
            )
        errors.extend(_check_routers(alias))
    metrics = values["METRICS"]
    if metrics is not None:
        try:
            if not isinstance(metrics, str):
                raise TypeError
            import_string(metrics)
        except (ImportError, TypeError):
            errors.append(
                Error(
                    f"{SETTING_NAME}['METRICS'] = {metrics!r} cannot be imported.",
                    hint="Use the dotted path of a class, such as 'myproject.metrics.LockMetrics'.",
                    id="django_pglock.E008",
                )
            )
    errors.extend(_check_jobs(values))
    return errors


def _check_jobs(values: dict[str, Any]) -> list[CheckMessage]:
    """``JOBS`` (one E014 per entry that cannot be read) and ``HEALTH_TOKEN`` (E015)."""
    from .access import is_usable_token
    from .jobspec import parse_jobs

    errors: list[CheckMessage] = [
        Error(problem, hint="See the README, section Job health.", id="django_pglock.E014")
        for problem in parse_jobs(values["JOBS"])[1]
    ]
    token = values["HEALTH_TOKEN"]
    if token is not None and not is_usable_token(token):
        errors.append(
            Error(
                f"{SETTING_NAME}['HEALTH_TOKEN'] is {kind_of(token)} that cannot be a token "
                "(its value is not shown).",
                hint="Use a random string of at least 16 printable ASCII characters without "
                "spaces at either end, such as secrets.token_urlsafe(32) read from the "
                "environment, or None.",
                id="django_pglock.E015",
            )
        )
    return errors


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _looks_pooled(database: dict[str, Any]) -> bool:
    # Django's advice for transaction pooling is DISABLE_SERVER_SIDE_CURSORS; PgBouncer
    # listens on 6432 by default.
    return (
        bool(database.get("DISABLE_SERVER_SIDE_CURSORS"))
        or str(database.get("PORT", "")) in POOLER_PORTS
    )


def _migrating() -> bool:
    """Whether these checks run inside ``migrate`` (Django runs them as it starts).

    ``migrate`` creates the lock table, so "run migrate" (W002) would only be noise there.
    Recognised by a ``migrate`` command object (Django's, or a subclass) calling us, so
    ``manage.py migrate`` and ``call_command("migrate")`` both count.
    """
    from django.core.management.commands.migrate import Command as Migrate

    frame = inspect.currentframe()
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back
    return False


def _check_routers(alias: str) -> list[CheckMessage]:
    """W003: the database routers keep django_pglock's tables off the lock database."""
    from django.apps import apps

    for model in apps.get_app_config("django_pglock").get_models():
        refusing = _refusing_router(alias, model)
        if refusing is None:
            continue
        name = f"{type(refusing).__module__}.{type(refusing).__qualname__}"
        # A warning, not an error: another project may migrate a shared lock database.
        return [
            Warning(
                f"The database router {name} does not allow migrating django_pglock on its "
                f"lock database alias {alias!r}: 'migrate' never creates the lock, run and "
                "schedule tables there, and every lock call fails without them.",
                hint="Make allow_migrate() return True or None for app_label 'django_pglock' "
                f"on db {alias!r}, or point DJANGO_PGLOCK['DATABASE'] at the alias where it "
                "migrates django_pglock.",
                id="django_pglock.W003",
            )
        ]
    return []


def _refusing_router(alias: str, model: type[Any]) -> object | None:
    """The router whose ``allow_migrate()`` decides against ``model`` on ``alias``, if any
    (the first router that answers decides, as in ``migrate``)."""
    from django.db import router

    hints = {"model_name": model._meta.model_name, "model": model}
    for candidate in router.routers:
        method = getattr(candidate, "allow_migrate", None)
        allowed = None if method is None else method(alias, model._meta.app_label, **hints)
        if allowed is not None:
            return None if allowed else candidate
    return None


def check_database(
    app_configs: Sequence[Any] | None = None,
    databases: Iterable[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """With ``--database``: the lock database can be reached and has the lock table."""
    if not databases:
        return []
    try:
        alias = read_setting().get("DATABASE", DEFAULTS["DATABASE"])
    except ImproperlyConfigured:
        return []  # check_settings reports it (E001)
    if not isinstance(alias, str) or alias not in databases or alias not in settings.DATABASES:
        return []  # not asked for, or check_settings reports it (E006)
    connection = connections[alias]
    if connection.vendor != "postgresql":
        return []
    try:
        with connection.cursor() as cursor:
            tables = connection.introspection.table_names(cursor)
    except DatabaseError as exc:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [
            Error(
                f"Cannot connect to the lock database alias {alias!r}: {redact(cause)}",
                hint=f"Check DATABASES[{alias!r}] and that the server is up.",
                id="django_pglock.E013",
            )
        ]
    if "django_pglock_joblock" not in tables and not _migrating():
        # A warning, not an error: `migrate` runs database checks too, and must be able
        # to create the table.
        return [
            Warning(
                f"The lock table is missing on database alias {alias!r}.",
                hint=f"Run 'manage.py migrate django_pglock --database {alias}'.",
                id="django_pglock.W002",
            )
        ]
    return []
