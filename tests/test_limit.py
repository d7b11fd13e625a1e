"""A job's ``limit``: how many scheduled runs may commit, fleet-wide, counted with the
watermark in the tick's own transaction, so that no replica overshoots. Then the job is
``completed``: it runs no more, is never overdue, and a replica keeps only its row; an
operator's manual run still runs and does not count."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import anyio
import pytest

from helpers import Replicas, at, eventually
from ticklock import JobContext, ScheduleError, Scheduler, every
from ticklock._operators.fleet import Fate, JobState
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


async def test_a_job_runs_its_limit_then_has_completed() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    slots: list[float] = []

    @scheduler.job(every(60), id="thrice", timeout=5, limit=3)
    async def thrice(ctx: JobContext) -> None:
        slots.append((ctx.slot - T0).total_seconds())

    async with scheduler:
        await clock.advance(600)
        [health] = scheduler.health()
        [record] = await scheduler.fleet.jobs()
        assert "thrice" not in scheduler._roster.cycles  # nothing to wait for: a row
        manual = await scheduler.run_now("thrice")  # an operator's run: runs, does not count
        ledger = await scheduler.fleet.slots("thrice", T0, clock.now())
    assert slots[:3] == [0, 60, 120] and len(slots) == 4
    assert manual.outcome.value == "success"
    assert health.completed and not health.overdue and health.next_fire is None
    assert record.state is JobState.COMPLETED
    after = [s for s in ledger if s.slot > T0 + timedelta(seconds=120)]
    assert after and {(s.fate, s.reason) for s in after} == {(Fate.SKIPPED, "limit reached")}


async def test_a_slot_that_succeeds_on_a_retry_counts_once() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    attempts: list[tuple[float, int]] = []

    @scheduler.job(every(60), id="flaky", timeout=5, retries=1, retry_backoff=5, limit=2)
    async def flaky(ctx: JobContext) -> None:
        attempts.append(((ctx.slot - T0).total_seconds(), ctx.attempt))
        if ctx.attempt == 1:
            raise RuntimeError("first attempts fail")

    async with scheduler:
        await clock.advance(600)
    # two slots committed, each on its retry; failures do not count
    assert attempts == [(0, 1), (0, 2), (65, 1), (65, 2)]


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "5"])
def test_a_bad_limit_is_refused_naming_job_and_field(value: object) -> None:
    async def report(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError) as caught:
        Scheduler().add(report, every(60), id="report", limit=value)  # type: ignore[arg-type]
    assert caught.value.field == "limit" and str(caught.value).startswith(
        "job 'report': limit must be a whole number of runs, 1 or more, or None, got "
    )


@pytest.mark.postgres
async def test_three_replica_processes_commit_the_limit_and_not_one_run_more(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    for owner in ("r1", "r2", "r3"):
        ops.start(owner, "limit")
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="watcher", shutdown_grace=1)
    async with scheduler:

        async def completed() -> bool:
            jobs = {j.job_id: j for j in await scheduler.fleet.jobs()}
            job = jobs.get("limited")
            return job is not None and job.state is JobState.COMPLETED

        await eventually(completed, 30, "the job to complete")
        await anyio.sleep(2)  # ten more slots' worth: nothing more commits
        rows = await pg_conn.fetch(
            f"SELECT owner, slot FROM {pg_schema}.log WHERE job = 'limited' ORDER BY slot"
        )
        successes = await pg_conn.fetchval(
            f"SELECT successes FROM {pg_schema}.counts WHERE job_id = 'limited'"
        )
        declared_here = [h for h in scheduler.health() if h.job_id == "limited"]
    assert len(rows) == 5 and len({r["slot"] for r in rows}) == 5, rows
    assert successes == 5
    assert declared_here == []  # the watcher declares no job of its own


@pytest.mark.postgres
async def test_a_forgotten_job_declared_again_runs_its_limit_again(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    ran: list[str] = []

    async def work(ctx: JobContext) -> None:
        ran.append(ctx.owner)

    def replica() -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a", shutdown_grace=1)
        scheduler.add(work, every(0.2), id="w", timeout=0.15, limit=2, overdue_grace=60)
        return scheduler

    async with replica():
        await anyio.sleep(1.5)
    first = len(ran)
    async with Scheduler(pg_dsn, schema=pg_schema, owner="ops", shutdown_grace=1) as ops:
        await ops.fleet.forget("w", who="ops")  # its state, history and count
    async with replica():
        await anyio.sleep(1.5)
    assert (first, len(ran) - first) == (2, 2)


@pytest.mark.postgres
async def test_the_ledger_of_a_completed_job_says_so_whatever_window_is_asked(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a", shutdown_grace=1)

    async def work(ctx: JobContext) -> None:
        pass

    scheduler.add(work, every(0.5), id="w", timeout=0.4, limit=3, overdue_grace=0)
    async with scheduler:
        t0 = await pg_conn.fetchval("SELECT now()")
        await anyio.sleep(4)
        now = await pg_conn.fetchval("SELECT now()")
        full = await scheduler.fleet.slots("w", t0 - timedelta(seconds=1), now)
        third = [s.slot for s in full if s.fate is Fate.RAN][2]
        late = await scheduler.fleet.slots("w", third + timedelta(seconds=1), now)
    after = [s for s in full if s.slot > third and s.fate is not Fate.PENDING]
    assert after and {(s.fate, s.reason) for s in after} == {(Fate.SKIPPED, "limit reached")}
    # asked from after the job completed: its runs are not in the window, its count is
    shown = {(s.fate, s.reason) for s in late if s.fate is not Fate.PENDING}
    assert shown == {(Fate.SKIPPED, "limit reached")}


async def test_a_stored_schedule_deleted_and_put_again_runs_its_limit_again() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    runs: list[int] = []

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        runs.append(ctx.args["n"])

    async with scheduler:
        put = scheduler.schedules.put
        await put("r", task="report", trigger=every(60), args={"n": 1}, limit=2, timeout=5)
        await clock.advance(600)
        await scheduler.schedules.delete("r")
        await put("r", task="report", trigger=every(60), args={"n": 2}, limit=2, timeout=5)
        await clock.advance(600)
    assert runs == [1, 1, 2, 2]


@pytest.mark.postgres
async def test_on_postgres_a_stored_schedule_put_again_after_a_delete_starts_afresh(
    pg_dsn: str, pg_schema: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a", shutdown_grace=1)
    runs: list[int] = []

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        runs.append(ctx.args["n"])

    async with scheduler:
        for n in (1, 2):
            await scheduler.schedules.put(
                "r", task="report", trigger=every(0.2), args={"n": n}, limit=2, timeout=0.15,
                overdue_grace=60,
            )  # fmt: skip
            await anyio.sleep(2)
            await scheduler.schedules.delete("r")
    assert runs == [1, 1, 2, 2]
