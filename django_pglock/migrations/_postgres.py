"""A RunSQL that only runs on PostgreSQL, so migrating another alias never fails."""

from __future__ import annotations

from typing import Any

from django.db import migrations


class RunSQLOnPostgres(migrations.RunSQL):
    def database_forwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, *args)

    def database_backwards(self, app_label: str, schema_editor: Any, *args: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, *args)
