"""Django settings for the test suite (not for the example project)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from tests.pgserver import ensure_database_url

# Set by the `child_env` fixture: lets worker processes reach pytest-django's test database.
ENV_TEST_DB_NAME = "PGLOCK_TEST_DB_NAME"


def parse_database_url(url: str) -> dict[str, Any]:
    """Turn a libpq-style URL into a Django DATABASES entry for the PostgreSQL backend.

    ``postgres://`` and ``postgresql://`` (also with a ``+driver`` suffix) are accepted.
    ``host`` and ``port`` query parameters (a socket directory; or libpq's comma-separated
    lists of a multi-host DSN, such as ``?host=h1,h2&port=5432,5433``) override the network
    location's; every other query parameter goes into OPTIONS, where libpq receives it as is.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme not in ("postgres", "postgresql"):
        raise ValueError(
            f"Database URL scheme {parts.scheme!r} is not supported; "
            "use postgres:// or postgresql://."
        )
    options: dict[str, str] = {}
    host = unquote(parts.hostname or "")
    port = str(parts.port or "")
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "host":
            host = value
        elif key == "port":
            if not all(p.strip().isdigit() for p in value.split(",")):
                raise ValueError(f"Database URL port {value!r} is not a port or list of ports.")
            port = value
        else:
            options[key] = value
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": port,
        "OPTIONS": options,
    }


SECRET_KEY = "django-pglock-tests-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # pytest-django's live_server serves the admin's CSS and JS only with staticfiles
    # installed (tests/test_browser.py).
    "django.contrib.staticfiles",
    "django_pglock",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_default = parse_database_url(ensure_database_url())
_test_db_name = os.environ.get(ENV_TEST_DB_NAME)
if _test_db_name:
    # A worker process: connect straight to the test database the parent pytest created.
    _default["NAME"] = _test_db_name
    _default["TEST"] = {"NAME": _test_db_name}
else:
    _default["TEST"] = {"NAME": f"test_{_default['NAME']}"}

DATABASES = {
    "default": _default,
    # Not PostgreSQL: used to check that such aliases are refused.
    "sqlite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
