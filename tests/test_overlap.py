"""``overlap``: what a cron slot does when the job's previous run is still running. ``"skip"``
(the default) skips it; ``"buffer_one"`` runs the latest fire that came during the run once
it ends, and skips the others; ``"replace"`` cancels the run at the next fire (outcome
``cancelled``, rolled back, never committed) and runs that slot at once. The rules on a
:class:`ManualClock`; the frozen replica on PostgreSQL is ``tests/test_replace_pg.py``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from helpers import at
from ticklock import JobContext, Scheduler, cron, every
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00:30Z")  # half a minute before the first fire


def minute(at_: datetime) -> float:
    """``at_`` in minutes after 00:00."""
    return (at_ - at("2026-03-29T00:00Z")).total_seconds() / 60


async def scenario(
    overlap: str | None, durations: dict[float, float], *, minutes: float = 8, **options: Any
) -> tuple[list[tuple[float, str]], list[Any], Scheduler]:
    """An every-minute cron job whose run of minute ``m`` takes ``durations.get(m, 1)``
    seconds; the runs (slot minute, outcome) and the ledger of the window."""
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    runs: list[tuple[float, str]] = []

    async def job(ctx: JobContext) -> None:
        took = durations.get(minute(ctx.slot), 1.0)
        try:
            await clock.sleep_until(clock.monotonic() + took)
        except BaseException:
            runs.append((minute(ctx.slot), "cancelled"))
            raise
        runs.append((minute(ctx.slot), "done"))

    if overlap is not None:
        options["overlap"] = overlap
    scheduler.add(job, cron("* * * * *"), id="job", timeout=600, **options)
    async with scheduler:
        await clock.advance(minutes * 60)
        ledger = await scheduler.fleet.slots("job", T0, clock.now())
    return runs, ledger, scheduler


def fates(ledger: list[Any]) -> dict[float, tuple[str, str | None]]:
    return {minute(s.slot): (s.fate.value, s.reason) for s in ledger}


async def test_skip_runs_the_next_fire_after_the_long_run_ends() -> None:
    # the run of minute 1 takes 150 s: the fires of minutes 2 and 3 come while it runs
    runs, ledger, _ = await scenario("skip", {1: 150})
    assert runs[:3] == [(1, "done"), (4, "done"), (5, "done")]
    by = fates(ledger)
    for skipped in (2, 3):  # the run of 4 covers them (catch_up), and says why they did not run
        fate, reason = by[skipped]
        assert fate == "covered" and reason == (
            "the run before was still running (the run of 2026-03-29T00:01:00+00:00)"
        )


async def test_skip_without_catch_up_leaves_the_fires_in_the_run_skipped() -> None:
    runs, ledger, _ = await scenario("skip", {1: 150}, catch_up=False)
    assert runs[:2] == [(1, "done"), (4, "done")]
    fate, reason = fates(ledger)[2]
    assert fate == "skipped" and "the run before was still running" in str(reason)


async def test_a_long_cron_timeout_needs_an_explicit_overlap() -> None:
    async def job(ctx: JobContext) -> None:
        pass

    scheduler = Scheduler()
    scheduler.add(job, cron("* * * * *"), id="a", timeout=3600, overlap="skip")
    scheduler.add(job, cron("* * * * *"), id="b", timeout=86400, overlap="replace")
    scheduler.add(job, every(60), id="c", overlap="skip")  # every takes only "skip"
    assert scheduler.jobs["b"].timeout == 86400


async def test_buffer_one_runs_the_latest_fire_once_the_run_ends_and_skips_the_rest() -> None:
    runs, ledger, _ = await scenario("buffer_one", {1: 150})
    # minutes 2 and 3 came during the run of 1: 3 runs at once when it ends (3:30), 2 is
    # skipped; then 4, 5... on time
    assert runs[:4] == [(1, "done"), (3, "done"), (4, "done"), (5, "done")]
    by = fates(ledger)
    assert by[2][0] == "covered" and str(by[2][1]).startswith("the run before was still running")
    assert by[3][0] == "ran"
    assert by[4] == ("ran", None)


async def test_buffer_one_chains_while_each_run_overruns() -> None:
    # each of minutes 1 and 3 takes 90 s: 1 ends at 2:30 (2 buffered, runs until 2:31),
    # 3 runs 3:00-4:30 (4 buffered)
    runs, _, _ = await scenario("buffer_one", {1: 90, 3: 90})
    assert runs[:5] == [(1, "done"), (2, "done"), (3, "done"), (4, "done"), (5, "done")]


async def test_replace_cancels_the_run_at_the_next_fire_and_runs_it_at_once() -> None:
    clock_runs, ledger, scheduler = await scenario("replace", {1: 150, 2: 30})
    # 1 is cancelled at 2:00, 2 runs at once and finishes (30 s), 3 on time
    assert clock_runs[:4] == [(1, "cancelled"), (2, "done"), (3, "done"), (4, "done")]
    history = await scheduler.fleet.history("job", 20)
    [first] = [r for r in history if r.slot is not None and minute(r.slot) == 1]
    assert first.outcome == "cancelled"
    assert first.error == "replaced by the run of slot 2026-03-29T00:02:00+00:00"
    by = fates(ledger)
    fate, reason = by[1]
    assert fate == "skipped" and reason == "replaced by the run of slot 2026-03-29T00:02:00+00:00"
    assert by[2][0] == "ran"
    [health] = scheduler.health()
    assert not health.failing and health.consecutive_failures == 0


async def test_replace_never_commits_the_replaced_run_writes() -> None:
    # the handler's state change happens after its long wait: a replaced run never reaches it
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    committed: list[float] = []

    @scheduler.job(cron("* * * * *"), id="job", timeout=600, overlap="replace")
    async def job(ctx: JobContext) -> dict[str, float]:
        await clock.sleep_until(clock.monotonic() + (150 if minute(ctx.slot) == 1 else 1))
        return {"minute": minute(ctx.slot)}

    async with scheduler:
        await clock.advance(300)
        history = await scheduler.fleet.history("job", 20)
    committed = [r.report["minute"] for r in history if r.outcome == "success"]
    assert 1 not in committed and committed[-1] == 2  # newest first


async def test_a_manual_run_is_never_replaced_and_the_fire_waits_for_it() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    seen: list[tuple[float, bool]] = []

    @scheduler.job(cron("* * * * *"), id="job", timeout=600, overlap="replace")
    async def job(ctx: JobContext) -> None:
        seen.append((minute(ctx.slot), ctx.attempt == 1))
        if not seen[1:]:  # the first run (the operator's) takes 100 s
            await clock.sleep_until(clock.monotonic() + 100)

    async with scheduler:
        await scheduler.fleet.trigger("job")
        await clock.advance(240)
        history = await scheduler.fleet.history("job", 20)
    manual = [r for r in history if r.manual]
    assert manual and manual[0].outcome == "success"
    assert all(r.outcome == "success" for r in history)


async def test_overlap_is_a_keyword_of_a_stored_schedule() -> None:
    db = MemoryDatabase()
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=db)
    runs: list[tuple[float, str]] = []

    @scheduler.task("slow")
    async def slow(ctx: JobContext) -> None:
        took = 150 if minute(ctx.slot) == 1 else 1
        try:
            await clock.sleep_until(clock.monotonic() + took)
        except BaseException:
            runs.append((minute(ctx.slot), "cancelled"))
            raise
        runs.append((minute(ctx.slot), "done"))

    async with scheduler:
        stored = await scheduler.schedules.put(
            "s1", task="slow", trigger=cron("* * * * *"), timeout=600, overlap="replace"
        )
        await clock.advance(300)
    assert stored.options["overlap"] == "replace"
    assert runs[:3] == [(1, "cancelled"), (2, "done"), (3, "done")]
