"""Who this process is, as recorded on the rows it holds; and redaction of secrets."""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys

__all__ = ["Identity", "current", "default_description", "redact"]


class Identity:
    """Host, pid and a per-process nonce; rebuilt in a forked child."""

    def __init__(self) -> None:
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self.holder = f"{self.host}:{self.pid}:{secrets.token_hex(4)}"[:255]


_identity: Identity | None = None


def current() -> Identity:
    """The identity of the calling process (a new one after a fork)."""
    global _identity
    if _identity is None or _identity.pid != os.getpid():
        _identity = Identity()
    return _identity


_SECRET_PATTERNS = [
    # scheme://user:password@host → scheme://user:***@host
    (
        re.compile(r"(?P<pre>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*:)[^@\s]*(?P<post>@)"),
        r"\g<pre>***\g<post>",
    ),
    # --password=x, --token x, -p x are not guessed; long options with secret-ish names are.
    (
        re.compile(
            r"(?P<pre>--?[\w-]*(?:password|passwd|secret|token|api[-_]?key|dsn)[\w-]*[= ])\S+",
            re.IGNORECASE,
        ),
        r"\g<pre>***",
    ),
    # NAME_TOKEN=x, DB_PASSWORD=x, password=x inside conninfo strings
    (
        re.compile(
            r"(?P<pre>\b[\w]*(?:password|passwd|secret|token|api_?key|dsn)[\w]*=)\S+",
            re.IGNORECASE,
        ),
        r"\g<pre>***",
    ),
]


def redact(text: str) -> str:
    """Replace passwords, tokens and DSN credentials in ``text`` with ``***``."""
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


_description: tuple[list[str], str] | None = None


def default_description() -> str:
    """The redacted command line of this process, used when a lock names no description."""
    global _description
    if _description is None or _description[0] != sys.argv:
        words = [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else []
        _description = (list(sys.argv), redact(" ".join(words))[:2000])
    return _description[1]
