"""The types ``@singleton_job`` gives what it decorates: ``R | None`` where a call may be
skipped, the function's own type where every call runs its body."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar, overload

__all__ = ["MaySkip", "NeverSkips"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")
P = ParamSpec("P")


class MaySkip(Protocol):
    """What ``singleton_job(...)`` returns when a call may be skipped (the default,
    ``blocking=False``; or a ``timeout``; or a ``schedule``): the decorated function
    returns ``R | None`` (a coroutine function: a coroutine of ``R | None``)."""

    @overload
    def __call__(
        self, func: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R | None]: ...


class NeverSkips(Protocol):
    """What ``singleton_job(..., blocking=True)`` returns without a ``timeout`` or a
    ``schedule``: every call runs the body, so the function keeps its type."""

    def __call__(self, func: F) -> F: ...
