"""What ``@singleton_job`` does to a function's type; checked by mypy in
tests/test_typing.py, never imported. A trailing comment "E" and an error code is an
error mypy must report on that line, "N" and a text a note (a ``reveal_type``); no other
line may have any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.management.base import BaseCommand

from django_pglock import singleton_job

if TYPE_CHECKING:
    from typing_extensions import reveal_type


@singleton_job
def bare() -> int:
    return 1


@singleton_job("named")
def skips() -> int:
    return 1


@singleton_job("waits", blocking=True)
def waits(x: int, *, y: str = "") -> int:
    return x


@singleton_job("waits-a-while", blocking=True, timeout=5)
def times_out() -> int:
    return 1


@singleton_job("nightly", schedule="0 3 * * *", blocking=True)
def scheduled() -> int:
    return 1


@singleton_job("one-per-tenant", key=lambda tenant: f"t:{tenant}")
def per_tenant(tenant: int) -> str:
    return str(tenant)


@singleton_job
async def sync_bare() -> int:
    return 1


@singleton_job("async-waits", blocking=True)
async def async_waits() -> int:
    return 1


@singleton_job("async-skips")
async def async_skips() -> int:
    return 1


def unknown_blocking(flag: bool) -> None:
    @singleton_job("maybe", blocking=flag)
    def maybe() -> int:
        return 1

    reveal_type(maybe())  # N: Revealed type is "int | None"


class Command(BaseCommand):
    @singleton_job()
    def handle(self, *args: Any, **options: Any) -> None:
        pass


class BlockingCommand(BaseCommand):
    @singleton_job(blocking=True)
    def handle(self, *args: Any, **options: Any) -> None:
        pass


async def main() -> None:
    reveal_type(bare())  # N: Revealed type is "int | None"
    reveal_type(skips())  # N: Revealed type is "int | None"
    reveal_type(waits(1, y="a"))  # N: Revealed type is "int"
    reveal_type(times_out())  # N: Revealed type is "int | None"
    reveal_type(scheduled())  # N: Revealed type is "int | None"
    reveal_type(per_tenant(3))  # N: Revealed type is "str | None"
    reveal_type(await sync_bare())  # N: Revealed type is "int | None"
    reveal_type(await async_waits())  # N: Revealed type is "int"
    reveal_type(await async_skips())  # N: Revealed type is "int | None"
    a: int = skips()  # E: assignment
    b: int = waits(2)
    c: int = await async_skips()  # E: assignment
    d: int = await async_waits()
    waits("x")  # E: arg-type
    per_tenant()  # E: call-arg
    Command().handle()
    BlockingCommand().handle()
    print(a, b, c, d)
