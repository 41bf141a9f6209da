"""A project whose locks live on a database of their own, with no router.

``default`` is SQLite (the project's own data: users, sessions, the admin log) and
``locks`` the PostgreSQL test database, named by ``DJANGO_PGLOCK["DATABASE"]``: the
pattern of issue 13, item 1. ``PGLOCK_MULTIDB_SQLITE`` is the SQLite file (a temporary
one per test); ``PGLOCK_MULTIDB_ROUTER=refuse`` adds a router that keeps django_pglock's
tables off the lock database (what ``django_pglock.W003`` reports). Used by
tests/test_admin_multidb.py, in child processes (``tests.multidb_admin``, ``manage.py
check``) started with the ``child_env`` environment.
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES as _TEST_DATABASES

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("PGLOCK_MULTIDB_SQLITE", ":memory:"),
    },
    "locks": _TEST_DATABASES["default"],
}

DJANGO_PGLOCK = {"DATABASE": "locks"}

if os.environ.get("PGLOCK_MULTIDB_ROUTER") == "refuse":
    DATABASE_ROUTERS = ["tests.routers.DefaultOnlyRouter"]
