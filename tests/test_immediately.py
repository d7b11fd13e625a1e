"""``immediately=True``: one run as soon as a job's declaration is new or changed, once
fleet-wide (a trigger request, slot: its instant, audited as asked by ``ticklock``); never on
an unchanged restart, a replica joining or a failover."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from helpers import Replicas, at, eventually
from ticklock import JobContext, ScheduleError, Scheduler, cron
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


async def test_a_new_or_changed_declaration_runs_once_and_an_unchanged_restart_never() -> None:
    clock, db = ManualClock(T0), MemoryDatabase()
    runs: list[tuple[str, bool]] = []

    def replica(owner: str, hour: int) -> Scheduler:
        scheduler = Scheduler(clock=clock, database=db, owner=owner)

        async def report(ctx: JobContext) -> None:
            runs.append((owner, ctx.slot == clock.now()))

        scheduler.add(report, cron(f"0 {hour} * * *"), id="report", immediately=True)
        return scheduler

    async with replica("a", 9), replica("b", 9):  # new: one run, on one replica
        await clock.advance(60)
    assert len(runs) == 1 and runs[0][1]  # at once, with the request's instant as slot
    async with replica("a", 9):  # an unchanged restart
        await clock.advance(60)
        async with replica("b", 9):  # a replica joining
            await clock.advance(60)
    assert len(runs) == 1
    async with replica("a", 10):  # the release that moves it to 10:00
        await clock.advance(60)
    assert len(runs) == 2
    actions = [(a.action, a.who) for a in await replica("c", 10).fleet.audit("report")]
    assert actions == [("trigger", "ticklock"), ("trigger", "ticklock")]


def test_immediately_must_be_a_flag() -> None:
    async def report(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError, match="immediately must be True or False, got 'yes'"):
        Scheduler().add(report, cron("0 9 * * *"), id="report", immediately="yes")  # type: ignore[arg-type]


@pytest.mark.postgres
async def test_replica_processes_run_a_new_declaration_once_and_a_restart_never(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema

    async def runs() -> int:
        return int(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE job = 'report'"))

    async def once(scenario: str, expected: int) -> None:
        for owner in ("A", "B"):
            ops.start(owner, scenario)

        async def ran() -> bool:
            return await runs() >= expected

        await eventually(ran, 30, f"{expected} runs of the report")
        await anyio.sleep(2)  # both replicas are up: nothing more runs
        assert await runs() == expected
        for owner in ("A", "B"):
            assert ops.stop(owner) == 0, ops.output(owner)

    await once("immediately-9", 1)  # new
    for owner in ("A", "B"):  # an unchanged restart of the fleet: no run
        ops.start(owner, "immediately-9")
    await anyio.sleep(4)
    assert await runs() == 1
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)
    await once("immediately-10", 2)  # changed: one more
    who = await pg_conn.fetch(
        f"SELECT who FROM {s}.audit WHERE job_id = 'report' AND action = 'trigger'"
    )
    assert [r["who"] for r in who] == ["ticklock", "ticklock"]


async def test_a_stored_schedule_written_new_or_changed_runs_once() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    runs: list[str] = []

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        runs.append(ctx.args["tenant"])

    async with scheduler:
        put = scheduler.schedules.put
        await put("r", task="report", trigger=cron("0 9 * * *"), args={"tenant": "a"},
                  immediately=True)  # fmt: skip
        await clock.advance(5)
        await put("r", task="report", trigger=cron("0 9 * * *"), args={"tenant": "a"},
                  immediately=True)  # fmt: skip
        await clock.advance(5)  # the same definition: no version, no run
        await put("r", task="report", trigger=cron("0 9 * * *"), args={"tenant": "b"},
                  immediately=True)  # fmt: skip
        await clock.advance(5)
    assert runs == ["a", "b"]


@pytest.mark.postgres
async def test_on_postgres_a_stored_schedule_written_new_runs_once(
    pg_dsn: str, pg_schema: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a", shutdown_grace=1)
    runs: list[str] = []

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        runs.append(ctx.args["tenant"])

    async with scheduler:
        for _ in range(2):  # the second put changes nothing: no run
            await scheduler.schedules.put(
                "r", task="report", trigger=cron("0 9 * * *"), args={"tenant": "a"},
                immediately=True,
            )  # fmt: skip

        async def ran() -> bool:
            return bool(runs)

        await eventually(ran, 10, "the schedule's first run")
        await anyio.sleep(2)
        audit = [(a.action, a.who) for a in await scheduler.fleet.audit("r")]
    assert runs == ["a"]
    assert ("trigger", "ticklock") in audit


async def test_two_releases_restarting_in_turn_run_it_once_each_not_at_every_start() -> None:
    # a rolling deploy whose old replicas restart beside the new ones: the two declarations
    # take turns, each already run for: no run at each start (the bug of a repeating fire)
    clock, db = ManualClock(T0), MemoryDatabase()
    runs: list[int] = []

    def replica(hour: int) -> Scheduler:
        scheduler = Scheduler(clock=clock, database=db, owner=f"r{hour}")

        async def report(ctx: JobContext) -> None:
            runs.append(hour)

        scheduler.add(report, cron(f"0 {hour} * * *"), id="report", immediately=True)
        return scheduler

    for hour in (9, 10, 9, 10, 9, 10):
        async with replica(hour):
            await clock.advance(30)
    assert runs == [9, 10]
