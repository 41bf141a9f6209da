"""The lock sessions step aside when Django creates, clones or drops a database.

Django's test runner (and pytest-django) creates the test database, then switches
``DATABASES[alias]["NAME"]`` to it, and drops it at the end; ``DROP DATABASE`` (and the
parallel runner's ``CREATE DATABASE ... TEMPLATE``) fails while another session is
connected to that database, and a lock session opened before the switch would go on
using the database the project named. Django sends those statements on a connection to
the maintenance database (alias ``NO_DB_ALIAS``), opened just before: when it opens,
what ended ``TestCase`` transactions left is removed (:mod:`.testcases`), then every lock
session of this process that holds no lease is closed. The next lock statement opens a
new session with the current ``NAME``. A session that holds a lease is left open (closing
it would lose the lease): a test that leaves a lease held outside a ``TestCase`` keeps
the test database in use, and Django's teardown reports it.

Outside tests nothing opens such a connection; if something does, an idle lock session
is merely opened again by its next statement.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.signals import connection_created

from . import connection as lock_connection
from . import testcases
from .heartbeat import current_registry

__all__ = ["connect", "step_aside"]


def step_aside() -> None:
    """Remove what ended TestCase transactions left, then close every lock session of
    this process that holds no lease."""
    testcases.settle(everything=True)
    registry = current_registry()
    for conn in list(lock_connection._registry.values()):
        with conn.lock:  # no statement in flight; no grant between statement and registry
            if registry is None or not registry.leases(conn.alias):
                conn.close()


def _on_connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    if connection.alias == NO_DB_ALIAS:
        step_aside()


def connect() -> None:
    """Watch Django's connections for one to the maintenance database (idempotent)."""
    connection_created.connect(_on_connection_created, dispatch_uid="django_pglock.testdb")
