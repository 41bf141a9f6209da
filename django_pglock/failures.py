"""What a failed connection or statement means: is the database unavailable (worth a
retry by a waiter), and what did each host of a multi-host DSN answer."""

from __future__ import annotations

from typing import Any

import psycopg

__all__ = ["describe_hosts", "first_line", "hosts_of", "is_unavailable"]

# Connection exceptions (class 08), a server shutting down or starting up, too many
# connections, and a read-only server (a standby before its promotion).
_UNAVAILABLE_CLASSES = ("08",)
_UNAVAILABLE_STATES = {"57P01", "57P02", "57P03", "53300", "25006"}


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (libpq's never contain a password)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def is_unavailable(exc: psycopg.Error, conn: psycopg.Connection[Any] | None) -> bool:
    """Does ``exc`` say the database is unavailable, rather than the statement wrong?"""
    if conn is None or conn.broken or conn.closed:
        return True
    state = exc.sqlstate or ""
    return state.startswith(_UNAVAILABLE_CLASSES) or state in _UNAVAILABLE_STATES


def hosts_of(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The parameters of each host of a multi-host DSN (one entry for a single host).

    libpq's ``host``, ``hostaddr`` and ``port`` are comma-separated lists of the same
    length (a single port applies to every host).
    """
    hosts = str(params.get("host") or "").split(",")
    addrs = str(params.get("hostaddr") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    count = max(len(hosts), len(addrs))
    if count < 2:
        return [params]
    each = []
    for i in range(count):
        one = dict(params)
        for key, values in (("host", hosts), ("hostaddr", addrs), ("port", ports)):
            if params.get(key):
                one[key] = values[i] if len(values) == count else values[0]
        each.append(one)
    return each


def describe_hosts(params: dict[str, Any], connect: Any) -> str | None:
    """For a multi-host DSN that failed: what each host answered, on one line.

    ``connect(**params)`` is tried once per host (the failure path only; each attempt is
    bounded by ``connect_timeout``). ``None`` for a single host.
    """
    each = hosts_of(params)
    if len(each) < 2:
        return None
    answers = []
    for one in each:
        where = f"{one.get('host') or one.get('hostaddr')}:{one.get('port') or 5432}"
        try:
            connect(**one).close()
        except psycopg.Error as exc:
            answers.append(f"{where}: {_host_error(exc)}")
        else:
            answers.append(f"{where}: connected")
    return "; ".join(answers)


def _host_error(exc: psycopg.Error) -> str:
    text = first_line(exc)
    # psycopg prefixes "connection failed: connection to server at ... failed:"
    marker = "failed: "
    return text.rsplit(marker, 1)[-1] if marker in text else text
