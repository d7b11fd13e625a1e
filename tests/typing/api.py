"""Typed example usage, checked by ``mypy --strict`` (not run): the README's API stays typed."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import asyncpg

from ticklock import Batch, JobContext, JobHealth, RunResult, Scheduler, cron, every, lock_key
from ticklock.testing import ManualClock, run_job

scheduler = Scheduler(
    None,
    namespace="app",
    shutdown_grace=timedelta(seconds=10),
    clock=ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc)),
    random=random.Random(1),
)


@scheduler.job(every(minutes=15, jitter=30), timeout=60, id="purge-expired")
async def purge(ctx: JobContext) -> dict[str, int]:
    if scheduler.postgres:
        deleted: int = await ctx.db.fetchval("SELECT 1")
        return {"deleted": deleted}
    legacy: asyncpg.Connection[Any] | None = ctx.conn  # deprecated, still typed
    return {"deleted": 0 if legacy is None else 1}


@scheduler.job(every(hours=1), id="postgres-only")
async def postgres_only(ctx: JobContext) -> int:
    conn: asyncpg.Connection[Any] = ctx.db  # never None: raises in local mode
    attempt: int = ctx.attempt
    return attempt + int(await conn.fetchval("SELECT 1"))


@scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"))
async def nightly(ctx: JobContext) -> None:
    since: datetime | None = ctx.previous_success
    key: str = ctx.idempotency_key
    del since, key


@scheduler.job(every(minutes=15), id="sweep", timeout=600, max_batches=100)
async def sweep(ctx: JobContext) -> dict[str, int]:
    deleted = 0
    async for batch in ctx.batches():
        number: int = batch.number
        conn: asyncpg.Connection[Any] = batch.db
        after: Any = batch.cursor
        n: int = await conn.fetchval("SELECT $1::int", number)
        deleted += n
        batch.cursor = {"after": after}
        if n < 1000:
            break
    return {"deleted": deleted}


def batches_of(result: RunResult, batch: Batch) -> tuple[int, bool, int]:
    return result.batches, result.capped, batch.number


async def test_purge(conn: asyncpg.Connection[Any]) -> None:
    report: dict[str, int] = await run_job(purge, conn=conn, commit=False)
    local: int = await run_job(postgres_only, slot=datetime.now(timezone.utc), attempt=2)
    del report, local


async def main() -> None:
    async with scheduler:
        result: RunResult = await scheduler.run_now("purge-expired")
        health: list[JobHealth] = scheduler.health()
        print(result.outcome, health[0].overdue)  # noqa: T201
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        tg.cancel_scope.cancel()


key: int = lock_key("app", "purge-expired")
fire: datetime | None = cron("@daily").next_fire(datetime.now(timezone.utc))
