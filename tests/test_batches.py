"""Batched runs in local mode, on asyncio and trio, on a ManualClock: the cursor, the cap, a
failure or a timeout mid-run, misuse, and the declaration."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from helpers import at
from ticklock import Batch, JobContext, Outcome, ScheduleError, Scheduler, every
from ticklock._schedule.job import Job, declaration
from ticklock.testing import ManualClock, MemoryDatabase, run_job

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")
ITEMS = list(range(10))


def sweep(seen: list[tuple[int, int]], fail_at: int | None = None) -> Any:
    """A handler that takes two items per batch from the cursor on, until none are left."""

    async def handler(ctx: JobContext) -> dict[str, int]:
        done = 0
        async for batch in ctx.batches():
            start = batch.cursor or 0
            chunk = ITEMS[start : start + 2]
            if fail_at is not None and start >= fail_at:
                raise RuntimeError(f"item {start} is bad")
            seen.extend((batch.number, item) for item in chunk)
            done += len(chunk)
            batch.cursor = start + len(chunk)
            if len(chunk) < 2:
                break
        return {"done": done}

    return handler


async def test_a_sweep_commits_its_cursor_per_batch_stops_at_the_cap_and_resumes_from_it() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[tuple[int, int]] = []
    scheduler.add(sweep(seen), every(3600, initial_delay=1800), id="sweep", max_batches=3)
    async with scheduler:
        first = await scheduler.run_now("sweep")
        assert (first.outcome, first.batches, first.capped) == (Outcome.SUCCESS, 3, True)
        assert first.report == {"done": 6}
        assert seen == [(1, 0), (1, 1), (2, 2), (2, 3), (3, 4), (3, 5)]
        seen.clear()
        await clock.advance(1)  # a manual run's slot is its "now": a later one
        second = await scheduler.run_now("sweep")  # from the cursor the first run left
        assert (second.outcome, second.batches, second.capped) == (Outcome.SUCCESS, 3, False)
        assert seen == [(1, 6), (1, 7), (2, 8), (2, 9)]  # batch 3 found none and broke
        history = await scheduler.fleet.history("sweep")
    assert [(r.batches, r.capped) for r in history] == [(3, False), (3, True)]


async def test_a_failing_batch_rolls_back_alone_and_the_next_run_resumes_after_its_commit() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock)
    seen: list[tuple[int, int]] = []
    scheduler.add(sweep(seen, fail_at=4), every(3600, initial_delay=1800), id="sweep")
    async with scheduler:
        failed = await scheduler.run_now("sweep")
        assert (failed.outcome, failed.batches, failed.capped) == (Outcome.FAILURE, 2, False)
        assert failed.error == "RuntimeError: item 4 is bad"
        assert db.states["sweep"].cursor == "4"  # batch 2's, committed before batch 3 failed
        (record,) = await scheduler.fleet.history("sweep")
        assert (record.outcome, record.batches) == ("failure", 2)
    seen.clear()
    fixed = Scheduler(database=db, clock=clock)  # another replica, the bug fixed
    fixed.add(sweep(seen), every(3600, initial_delay=1800), id="sweep")
    async with fixed:
        result = await fixed.run_now("sweep")
    assert (result.outcome, result.batches) == (Outcome.SUCCESS, 4)  # the fourth found none
    assert [item for _, item in seen] == [4, 5, 6, 7, 8, 9]  # none twice, none left out


async def test_the_last_batch_commits_only_with_the_run_s_success() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock)

    @scheduler.job(every(3600, initial_delay=1800), id="tail")
    async def tail(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            batch.cursor = batch.number
            if batch.number == 2:
                break
        raise RuntimeError("after the loop")

    async with scheduler:
        result = await scheduler.run_now("tail")
    assert (result.outcome, result.batches) == (Outcome.FAILURE, 1)
    assert db.states["tail"].cursor == "1"  # batch 2 left the loop: it went with the failure


async def test_a_timeout_rolls_back_the_batch_in_flight_and_keeps_the_earlier_ones() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock)

    @scheduler.job(every(3600, initial_delay=1800), id="slow", timeout=10)
    async def slow(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            batch.cursor = batch.number
            await clock.sleep_until(clock.monotonic() + 4)  # the third overruns the 10 s

    async with scheduler:
        results: list[Any] = []
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                results.append(await scheduler.run_now("slow"))

            tg.start_soon(run)
            await clock.advance(11)
    (result,) = results
    assert (result.outcome, result.batches) == (Outcome.TIMEOUT, 2)
    assert db.states["slow"].cursor == "2"


async def test_a_cursor_that_is_not_json_fails_its_batch_naming_the_cursor() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock)
    errors: list[str] = []

    @scheduler.job(every(3600, initial_delay=1800), id="odd")
    async def odd(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            if batch.number == 1:
                batch.cursor = {"after": 1}
                continue
            try:
                batch.cursor = {"after": object()}  # refused where it is written
            except ValueError as exc:
                errors.append(str(exc))
            batch.cursor["after"] = {1, 2}  # changed in place: refused at the commit

    async with scheduler:
        result = await scheduler.run_now("odd")
    assert errors and errors[0].startswith("job 'odd': batch.cursor is not JSON-serialisable")
    assert result.outcome is Outcome.FAILURE and result.batches == 1
    assert result.error is not None
    assert result.error.startswith("ValueError: job 'odd': batch.cursor is not JSON-serialisable")
    assert db.states["odd"].cursor == '{"after": 1}'


async def test_entering_the_batches_twice_in_a_run_fails_clearly() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(3600, initial_delay=1800), id="twice")
    async def twice(ctx: JobContext) -> None:
        async for _ in ctx.batches():
            break
        async for _ in ctx.batches():
            break

    async with scheduler:
        result = await scheduler.run_now("twice")
    assert result.outcome is Outcome.FAILURE and result.batches == 0
    assert result.error == (
        "BatchesEntered: job 'twice': ctx.batches() was entered a second time in this run; a "
        "run has one sequence of batches: loop over it once (keep the loop's state in "
        "variables, or in batch.cursor)"
    )


async def test_a_run_without_batches_records_none_and_batch_db_says_local_mode() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    said: list[str] = []

    @scheduler.job(every(3600, initial_delay=1800), id="plain")
    async def plain(ctx: JobContext) -> None:
        pass

    @scheduler.job(every(3600, initial_delay=1800), id="local")
    async def local(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            assert isinstance(batch, Batch) and batch.conn is None
            try:
                batch.db  # noqa: B018
            except Exception as exc:
                said.append(str(exc))
            break

    async with scheduler:
        result = await scheduler.run_now("plain")
        assert (result.batches, result.capped) == (0, False)
        assert (await scheduler.run_now("local")).batches == 1
    assert said and "batch.db is the batch's PostgreSQL connection" in said[0]


async def test_run_job_runs_a_batched_handler_in_one_go() -> None:
    seen: list[tuple[int, int]] = []
    assert await run_job(sweep(seen)) == {"done": 10}
    assert [item for _, item in seen] == ITEMS


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "3"], ids=repr)
def test_max_batches_must_be_a_positive_int_or_none(bad: Any) -> None:
    scheduler = Scheduler()

    async def handler(ctx: JobContext) -> None: ...

    with pytest.raises(ScheduleError, match=r"^job 'j': max_batches must be a whole number") as e:
        scheduler.add(handler, every(60), id="j", max_batches=bad)
    assert e.value.field == "max_batches"


def test_the_declaration_of_a_job_without_max_batches_is_unchanged() -> None:
    async def handler(ctx: JobContext) -> None: ...

    plain = Job.declare(handler, every(60), id="j")
    capped = Job.declare(handler, every(60), id="j", max_batches=100)
    assert declaration(plain) == (
        "every 60s jitter 0s delay 0s, timeout 30s, retries 0 (backoff 10s), catch_up True, "
        "overdue_grace 6s"
    )
    assert declaration(capped) == declaration(plain) + ", max_batches 100"
