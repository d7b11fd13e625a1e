"""A ManualClock drives schedulers on a real PostgreSQL: the database follows its advance()."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import eventually
from ticklock import JobContext, Scheduler, cron
from ticklock.testing import ManualClock

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_catch_up_across_three_days_with_a_shared_manual_clock(
    pg_dsn: str, pg_schema: str, pg_conn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    runs: list[tuple[datetime, datetime | None]] = []
    ran = anyio.Event()

    def replica(owner: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner, clock=clock)

        @scheduler.job(cron("0 3 * * *"), id="nightly", timeout=600)
        async def nightly(ctx: JobContext) -> None:
            runs.append((ctx.slot, ctx.previous_success))
            ran.set()

        return scheduler

    async def committed() -> datetime | None:
        slot: datetime | None = await pg_conn.fetchval(
            f"SELECT last_slot FROM {pg_schema}.jobs WHERE job_id = 'nightly'"
        )
        return slot

    first = cron("0 3 * * *").next_fire(clock.now())
    assert first is not None
    caplog.set_level(logging.WARNING, logger="ticklock")
    async with replica("a"), replica("b"):  # two replicas, one clock
        await clock.advance(first - clock.now())  # to the first 03:00
        with anyio.fail_after(10):  # the tick's queries take real time: wait for them
            await ran.wait()
        await eventually(lambda: _equals(committed(), first), 10, "the first night's commit")
    assert runs == [(first, None)]  # once, on one of the two

    await clock.advance(timedelta(days=3))  # every replica down for the next three nights
    ran = anyio.Event()
    async with replica("c"):
        with anyio.fail_after(10):
            await ran.wait()  # at start: one run covers the nights missed
        latest = first + timedelta(days=3)
        await eventually(lambda: _equals(committed(), latest), 10, "the catch-up's commit")
    assert runs == [(first, None), (latest, first)]
    refused = [r.getMessage() for r in caplog.records if "clock" in r.getMessage()]
    assert refused == [], refused  # no slot refused as ahead, and no skew reported


async def _equals(value: Any, expected: object) -> bool:
    return bool(await value == expected)
