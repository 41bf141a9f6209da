"""``current_lease()``: the lease the innermost ``@singleton_job`` body runs under.

A :class:`contextvars.ContextVar` holds it while the body runs, so it follows the body
into ``await``, into the asyncio tasks the body creates and into ``asyncio.to_thread``
(each copies the context), and never leaks between concurrent tasks or threads. A plain
``threading.Thread`` started by the body starts with an empty context: there
``current_lease()`` is ``None``; pass the lease to the thread instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from .inherit import InheritedLease
    from .lease import Lease

__all__ = ["CurrentLease", "current_lease", "running_under"]

#: What :func:`current_lease` returns inside a job: the job's own lease, or the grant of
#: the ``locked_run`` that started this process.
CurrentLease = Union["Lease", "InheritedLease"]

_current: ContextVar[CurrentLease | None] = ContextVar("django_pglock_current_lease", default=None)


def current_lease() -> CurrentLease | None:
    """The lease of the innermost ``@singleton_job`` running in this thread or task.

    Inside a decorated function (sync or async) this is its :class:`~django_pglock.Lease`
    (``name``, the fencing ``token``, ``lost``, ``check()``, ``guard()``), or, when the
    job runs as ``locked_run``'s child under its parent's grant, an
    :class:`~django_pglock.InheritedLease` with the same attributes. Outside any job,
    in a plain thread the body started, and inside a raw ``with lock.acquire()`` block
    that no decorator wraps, it is ``None``.
    """
    return _current.get()


@contextlib.contextmanager
def running_under(lease: CurrentLease) -> Iterator[None]:
    """Make ``lease`` the current one for the duration of the block (then the outer one)."""
    token = _current.set(lease)
    try:
        yield
    finally:
        _current.reset(token)
