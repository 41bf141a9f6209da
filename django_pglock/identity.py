"""Who this process is, as recorded on the rows it holds, and what it runs."""

from __future__ import annotations

import os
import secrets
import socket
import sys

from .redaction import redact, redact_argv

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


_description: tuple[list[str], str] | None = None


def default_description() -> str:
    """The redacted command line of this process, used when a lock names no description.

    Secrets are masked word by word (see :func:`.redaction.redact_argv`), non-UTF-8 bytes
    are shown as ``\\xff``, and the text is cut to 2000 characters.
    """
    global _description
    if _description is None or _description[0] != sys.argv:
        words = [os.path.basename(sys.argv[0]), *sys.argv[1:]] if sys.argv else []
        _description = (list(sys.argv), redact_argv(words))
    return _description[1]
