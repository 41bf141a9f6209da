"""How a decorated management command ends when its lease was lost.

``locked_run`` exits with status 75 (``EX_TEMPFAIL``) when the lease was lost; a
``@singleton_job`` command does the same: the :class:`LockNotHeld` that its body or the
release raised becomes :class:`LockLost`, a ``CommandError`` with return code 75, which
Django's ``manage.py`` turns into one line on stderr and that exit status (no
traceback; ``--traceback`` shows it). ``call_command`` callers get the exception, which
is a :class:`LockNotHeld` as before. A decorated plain function keeps raising
:class:`LockNotHeld`. (Imported only when a command's lease is lost, so that importing
``django_pglock`` does not import Django's management machinery.)
"""

from __future__ import annotations

from typing import NoReturn

from django.core.management.base import CommandError

from .exceptions import LockNotHeld

__all__ = ["EXIT_LOST", "LockLost", "end_command"]

#: Exit status of a command whose lease was lost (``EX_TEMPFAIL``, as ``locked_run``'s).
EXIT_LOST = 75


class LockLost(CommandError, LockNotHeld):
    """A decorated management command's lease was lost: one line on stderr, exit 75."""


def end_command(exc: LockNotHeld) -> NoReturn:
    """Raise what a decorated command raises for ``exc``: a :class:`LockLost` with its
    message on one line (``exc`` itself if it is one already: a command called by one)."""
    if isinstance(exc, CommandError):
        raise exc
    raise LockLost(" ".join(str(exc).split()), returncode=EXIT_LOST) from exc
