"""pause, resume, trigger, forget and the fleet view in local mode, on asyncio and trio, driven by
a ManualClock; and in PostgreSQL mode, the pause and the trigger request checked under the lock."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from helpers import at
from ticklock import JobContext, Outcome, Scheduler, every
from ticklock._operators.fleet import JobDeclared, JobState
from ticklock.testing import ManualClock

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


def since(when: datetime) -> float:
    return (when - T0).total_seconds()


def scheduler_with(clock: ManualClock, starts: list[float], **options: Any) -> Scheduler:
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(10), id="work", timeout=5, **options)
    async def work(ctx: JobContext) -> None:
        starts.append(clock.monotonic())
        await clock.sleep_until(clock.monotonic() + 2)  # each run takes 2 s

    return scheduler


async def test_pause_stops_scheduled_runs_and_lets_the_run_in_flight_finish() -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts)
    async with scheduler:
        await clock.advance(1)  # the first run (0-2 s) is in flight
        await scheduler.pause("work")
        await clock.advance(100)
        (health,) = scheduler.health()
        assert health.paused and not health.overdue
        assert [job.state for job in await scheduler.fleet.jobs()] == [JobState.PAUSED]
    assert starts == [0]
    (run,) = await scheduler.fleet.history("work")
    assert run.outcome == "success" and since(run.finished_at) == 2  # it finished


@pytest.mark.parametrize(
    ("catch_up", "expected"), [(True, [0, 12, 300, 312]), (False, [0, 12, 304])]
)
async def test_resume_follows_the_catch_up_rule(catch_up: bool, expected: list[float]) -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts, catch_up=catch_up)
    async with scheduler:
        await clock.advance(20)  # runs at 0 and 12; the next is due at 24
        await scheduler.pause("work")
        await clock.advance(280)
        await scheduler.resume("work")  # at 300: 276 s of slots missed
        await clock.advance(15)
    # catch_up: one run at once covers them; else the next slot on the grid from the last
    # end (14 + 10 + 28 * 10)
    assert starts == expected


async def test_paused_time_does_not_count_toward_overdue() -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts, catch_up=False)
    async with scheduler:
        await clock.advance(3)
        await scheduler.pause("work")
        await clock.advance(3600)
        await scheduler.resume("work")
        await clock.advance(1)
        (health,) = scheduler.health()
        assert not health.overdue and not health.paused
        await scheduler.pause("work")  # paused again: stays not overdue however long
        await clock.advance(3600)
        assert not scheduler.health()[0].overdue
        await scheduler.resume("work")
        await clock.advance(0)
        later = clock.now() + timedelta(seconds=3600)
        assert scheduler.health(now=later)[0].overdue  # the alarm works again after resume


async def test_trigger_runs_once_as_a_manual_run_at_the_requests_instant() -> None:
    clock = ManualClock(T0)
    slots: list[tuple[float, int]] = []
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(3600, initial_delay=3000), id="rare")
    async def rare(ctx: JobContext) -> dict[str, str]:
        slots.append((since(ctx.slot), ctx.attempt))
        return {"ran": "yes"}

    async with scheduler:
        await clock.advance(7)
        at_ = await scheduler.trigger("rare")
        assert since(at_) == 7
        await clock.advance(5)
        await scheduler.trigger("rare")
        await scheduler.trigger("rare")  # asked again before it was served: one request
        await clock.advance(5)
    assert slots == [(7, 1), (12, 1)]
    runs = await scheduler.fleet.history("rare")
    assert [(since(r.slot or T0), r.manual, r.report) for r in runs] == [
        (12, True, {"ran": "yes"}),
        (7, True, {"ran": "yes"}),
    ]
    (job,) = await scheduler.fleet.jobs()
    assert job.trigger_at is None and job.last_outcome == "success"


async def test_a_trigger_runs_a_paused_job_which_stays_paused() -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts)
    async with scheduler:
        await clock.advance(3)
        await scheduler.pause("work")
        await clock.advance(50)
        await scheduler.trigger("work")
        await clock.advance(50)
        assert scheduler.health()[0].paused
    assert starts == [0, 53]


async def test_a_trigger_during_a_run_is_served_when_the_run_ends() -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts)
    async with scheduler:
        await clock.advance(1)  # the run of 0-2 s is in flight
        await scheduler.trigger("work")
        await clock.advance(5)
    assert starts == [0, 2]
    assert [r.manual for r in await scheduler.fleet.history("work")] == [True, False]


async def test_a_failed_manual_run_is_recorded_and_not_retried() -> None:
    clock = ManualClock(T0)
    seen: list[tuple[float, int]] = []
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(3600, initial_delay=3000), id="flaky", retries=3, retry_backoff=1)
    async def flaky(ctx: JobContext) -> None:
        seen.append((clock.monotonic(), ctx.attempt))
        raise RuntimeError("<b>boom</b>")

    async with scheduler:
        await scheduler.trigger("flaky")
        await clock.advance(100)
        (job,) = await scheduler.fleet.jobs()
    assert seen == [(0, 1)]
    assert job.last_error == "RuntimeError: <b>boom</b>" and job.consecutive_failures == 1
    assert job.trigger_at is None  # served, though it failed: not run again and again


async def test_trigger_and_pause_refuse_unknown_and_disabled_jobs() -> None:
    scheduler = Scheduler(clock=ManualClock(T0))

    @scheduler.job(every(60), id="off", enabled=False)
    async def off(ctx: JobContext) -> None: ...

    async with scheduler:
        with pytest.raises(KeyError, match="enabled=False"):
            await scheduler.trigger("off")
        with pytest.raises(KeyError, match="nope"):
            await scheduler.pause("nope")
        with pytest.raises(KeyError, match="nope"):
            await scheduler.fleet.history("nope")
        assert [(j.job_id, j.state) for j in await scheduler.fleet.jobs()] == [
            ("off", JobState.DISABLED)
        ]


async def test_a_removed_job_is_undeclared_and_can_be_forgotten() -> None:
    clock = ManualClock(T0)
    starts: list[float] = []
    scheduler = scheduler_with(clock, starts)
    async with scheduler:
        await clock.advance(3)
        with pytest.raises(JobDeclared):
            await scheduler.fleet.forget("work")
        scheduler.remove("work")
        assert [j.state for j in await scheduler.fleet.jobs()] == [JobState.UNDECLARED]
        (replica,) = await scheduler.fleet.replicas()
        assert replica.jobs == () and replica.owner == scheduler.owner
        await scheduler.fleet.forget("work")
        assert await scheduler.fleet.jobs() == []
        with pytest.raises(KeyError):
            await scheduler.fleet.forget("work")


async def test_run_now_is_a_manual_run_too() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(60), id="quick")
    async def quick(ctx: JobContext) -> None: ...

    async with scheduler:
        await clock.advance(3)
        result = await scheduler.run_now("quick")
    assert result.outcome is Outcome.SUCCESS and result.manual
    assert [r.manual for r in await scheduler.fleet.history("quick")] == [True, False]
