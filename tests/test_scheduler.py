"""The scheduler in local mode, on asyncio and trio, driven by a ManualClock (no real sleeps)."""

from __future__ import annotations

import contextvars
import gc
import random
import weakref
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import UTC, at, run_log
from ticklock import JobContext, Outcome, Scheduler, SchedulerStateError, cron, every
from ticklock._backends.memory import MemoryCoordinator
from ticklock.testing import ManualClock

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


def elapsed(clock: ManualClock, when: datetime) -> float:
    return (when - T0).total_seconds()


async def test_every_is_fixed_delay_from_the_end_of_the_previous_run() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    starts: list[float] = []
    slots: list[float] = []

    @scheduler.job(every(10), id="work", timeout=5)
    async def work(ctx: JobContext) -> None:
        starts.append(clock.monotonic())
        slots.append(elapsed(clock, ctx.slot))
        await clock.sleep_until(clock.monotonic() + 3)  # the run takes 3 s

    async with scheduler:
        await clock.advance(45)
    assert starts == [0, 13, 26, 39]
    assert slots == [0, 13, 26, 39]


async def test_initial_delay_and_catch_up_window() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[tuple[float, float | None]] = []

    @scheduler.job(every(minutes=1, initial_delay=5), id="work")
    async def work(ctx: JobContext) -> None:
        prev = ctx.previous_success
        seen.append((elapsed(clock, ctx.slot), None if prev is None else elapsed(clock, prev)))

    async with scheduler:
        await clock.advance(130)
    assert seen == [(5, None), (65, 5), (125, 65)]


async def test_the_first_slot_is_planned_from_when_the_fleet_state_was_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Loading the fleet's state takes a round trip (and, as replicas start together, waits on
    # their registrations): a first slot planned before it would start late by that time.
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    slots: list[float] = []

    @scheduler.job(every(60, initial_delay=5), id="work")
    async def work(ctx: JobContext) -> None:
        slots.append(elapsed(clock, ctx.slot))

    load = MemoryCoordinator.load

    async def slow_load(self: MemoryCoordinator, jobs: Any, now: datetime) -> Any:
        await clock.advance(2)  # the load took 2 s
        return await load(self, jobs, now)

    monkeypatch.setattr(MemoryCoordinator, "load", slow_load)
    async with scheduler:
        assert [h.next_fire for h in scheduler.health()] == [T0 + timedelta(seconds=7)]
        await clock.advance(10)
    assert slots == [7]


async def test_jitter_is_drawn_from_the_injected_random() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, random=random.Random(7))
    late: list[float] = []
    slots: list[float] = []

    @scheduler.job(every(10, jitter=4), id="work")
    async def work(ctx: JobContext) -> None:
        late.append(round((ctx.started_at - ctx.slot).total_seconds(), 6))
        slots.append(round(elapsed(clock, ctx.slot), 6))

    async with scheduler:
        await clock.advance(60)
    draws = random.Random(7)
    expected = [round(draws.uniform(0, 4), 6) for _ in late]
    assert late == expected
    assert all(0 <= x <= 4 for x in late)
    # fixed delay: each slot is the previous run's end (start, the body takes no time) + 10 s
    for previous, slot, jitter in zip(slots, slots[1:], late, strict=False):
        assert slot == pytest.approx(previous + jitter + 10)


async def test_cron_runs_in_its_zone_across_spring_forward() -> None:
    clock = ManualClock(at("2026-03-28T23:50Z"))
    scheduler = Scheduler(clock=clock)
    slots: list[str] = []

    @scheduler.job(cron("*/30 * * * *", tz="Europe/Berlin"), id="half-hourly")
    async def work(ctx: JobContext) -> None:
        assert clock.now() == ctx.slot  # fires at its instant, never early
        slots.append(ctx.slot.strftime("%H:%MZ"))

    async with scheduler:
        await clock.advance(2 * 3600)
    # 01:00 CET=00:00Z, 01:30 CET, then 03:00 CEST=01:00Z: local 02:00 and 02:30 do not exist
    assert slots == ["00:00Z", "00:30Z", "01:00Z", "01:30Z"]


async def test_a_failing_a_hanging_and_a_garbage_job_do_not_disturb_the_others() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    healthy: list[float] = []

    @scheduler.job(every(10), id="healthy")
    async def ok(ctx: JobContext) -> dict[str, int]:
        healthy.append(clock.monotonic())
        return {"n": 1}

    @scheduler.job(every(10), id="raises")
    async def raises(ctx: JobContext) -> None:
        raise RuntimeError("boom")

    @scheduler.job(every(10), id="hangs", timeout=2)
    async def hangs(ctx: JobContext) -> None:
        await anyio.sleep_forever()

    @scheduler.job(every(10), id="garbage")
    async def garbage(ctx: JobContext) -> object:
        return {"when": object()}

    with run_log() as log:
        async with scheduler:
            await clock.advance(35)
    assert healthy == [0, 10, 20, 30]
    assert log.outcomes("raises") == ["failure"] * 4
    assert log.outcomes("hangs") == ["timeout"] * 3  # at 0, 12, 24 (+2 s each)
    assert log.outcomes("garbage") == ["failure"] * 4
    garbage_error = next(r.error for r in log.runs if r.job_id == "garbage")
    assert garbage_error is not None and "not JSON-serialisable" in garbage_error
    health = {h.job_id: h for h in scheduler.health()}
    assert health["raises"].consecutive_failures == 4
    assert health["healthy"].consecutive_failures == 0


async def test_health_flags_a_job_overdue_once_its_run_is_late_not_when_it_fails() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    fail = False

    @scheduler.job(every(60), id="work", timeout=10, overdue_grace=5)
    async def work(ctx: JobContext) -> None:
        if fail:
            raise RuntimeError("down")

    async with scheduler:
        await clock.advance(1)
        (h,) = scheduler.health()
        assert h.last_success == T0 and not h.overdue
        fail = True
        await clock.advance(60 + 10 + 5 - 1)  # the run at 60 failed
        await clock.advance(1.5)  # past the last success's due + timeout + grace
        (h,) = scheduler.health()
        # that run finished: the job is failing, and the absence clock runs from its end
        assert h.failing and not h.overdue and h.consecutive_failures == 1
        ended = T0 + timedelta(seconds=60)
        limit = ended + timedelta(seconds=60 + 10 + 5)  # its next due + timeout + grace
        assert scheduler.health(now=limit)[0].overdue is False
        assert scheduler.health(now=limit + timedelta(seconds=0.5))[0].overdue is True
        assert scheduler.health(now=T0 + timedelta(seconds=30))[0].overdue is False


async def test_add_and_remove_while_running_take_effect_at_once() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    runs: list[tuple[str, float]] = []

    async def handler(ctx: JobContext) -> None:
        runs.append((ctx.job_id, clock.monotonic()))

    scheduler.add(handler, every(100), id="slow")
    async with scheduler:
        await clock.advance(5)
        scheduler.add(handler, every(10), id="fast")
        await clock.advance(25)
        scheduler.remove("fast")
        await clock.advance(50)
    assert runs == [("slow", 0), ("fast", 5), ("fast", 15), ("fast", 25)]
    assert "fast" not in scheduler.jobs


async def test_a_stopped_scheduler_still_says_when_its_jobs_are_overdue() -> None:
    # A scheduler that stopped while the process lives on (left early, or its run() task
    # died) runs nothing: its health() must not keep saying every job is fine.
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(60), id="work", timeout=10, overdue_grace=5)
    async def work(ctx: JobContext) -> None:
        pass

    (h,) = scheduler.health()
    assert not h.overdue  # never started: nothing was due
    async with scheduler:
        await clock.advance(1)
    await clock.advance(60 + 10 + 5 - 1)
    (h,) = scheduler.health()
    assert h.last_success == T0 and h.next_fire is None and not h.overdue
    await clock.advance(1.5)
    assert scheduler.health()[0].overdue


async def test_removed_and_rescheduled_jobs_do_not_pile_up_in_memory() -> None:
    # A job set that follows configuration adds and removes jobs while running, and run_now()
    # re-plans a job before its deadline. Neither may leave the superseded deadlines (and
    # the removed handlers they hold) waiting until they come due, a day later here.
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    handlers: list[weakref.ref[Any]] = []

    async def kept(ctx: JobContext) -> None:
        pass

    scheduler.add(kept, every(hours=24), id="kept")
    async with scheduler:
        for i in range(1000):

            async def handler(ctx: JobContext) -> None:
                pass

            handlers.append(weakref.ref(handler))
            scheduler.add(handler, every(hours=24, initial_delay=3600), id=f"dynamic-{i}")
            scheduler.remove(f"dynamic-{i}")
            del handler
        for _ in range(1000):
            await scheduler.run_now("kept")
        gc.collect()
        alive = sum(ref() is not None for ref in handlers)
        assert alive < 100, f"{alive} of 1,000 removed handlers are still held"
        await clock.advance(24 * 3600)
    assert scheduler.jobs.keys() == {"kept"}


async def test_disabled_job_is_declared_but_never_runs() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    ran = []

    @scheduler.job(every(1), id="off", enabled=False)
    async def off(ctx: JobContext) -> None:
        ran.append(1)

    async with scheduler:
        await clock.advance(10)
        (h,) = scheduler.health()
    assert ran == [] and h.next_fire is None and not h.overdue


async def test_run_now_runs_under_the_same_lock_and_reports() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    gate = anyio.Event()
    calls: list[datetime] = []

    @scheduler.job(every(3600), id="work")
    async def work(ctx: JobContext) -> dict[str, str]:
        calls.append(ctx.slot)
        if len(calls) == 3:  # the scheduled run, the first run_now, then this one waits
            await gate.wait()
        return {"slot": ctx.slot.isoformat()}

    with pytest.raises(SchedulerStateError, match="run_now\\(\\) needs a running scheduler"):
        await scheduler.run_now("work")
    async with scheduler:
        await clock.advance(60)
        result = await scheduler.run_now("work")
        assert result.outcome is Outcome.SUCCESS
        assert result.slot == T0 + timedelta(seconds=60)
        assert result.report == {"slot": result.slot.isoformat()}
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run_now, "work")
            await clock.settle()
            second = await scheduler.run_now("work")  # the first is still in flight
            assert second.outcome is Outcome.LOCKED
            gate.set()
        with pytest.raises(KeyError, match="no job with id 'nope'"):
            await scheduler.run_now("nope")


async def test_entering_twice_is_a_precise_error() -> None:
    scheduler = Scheduler(clock=ManualClock(T0))
    async with scheduler:
        with pytest.raises(SchedulerStateError, match="^this scheduler is already running"):
            async with scheduler:
                pass
    async with scheduler:  # a stopped scheduler may be started again
        pass


async def test_run_as_a_sidecar_with_task_group_start() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    ran: list[float] = []

    @scheduler.job(every(5), id="work")
    async def work(ctx: JobContext) -> None:
        ran.append(clock.monotonic())

    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await clock.advance(12)
        tg.cancel_scope.cancel()
    assert ran == [0, 5, 10]
    async with scheduler:  # cancelled cleanly: it can start again
        pass


async def test_a_timeout_on_the_system_clock_respects_shields_in_the_handler() -> None:
    # The timeout is an anyio cancel scope (not a bare task.cancel()): a handler's shielded
    # cleanup runs to its end, then the run is recorded as a timeout.
    scheduler = Scheduler()
    finished: list[str] = []

    @scheduler.job(every(3600, initial_delay=3000), id="careful", timeout=0.05)
    async def careful(ctx: JobContext) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(0.2)  # the deadline passes in here
            finished.append("shielded part")
        await anyio.sleep(5)  # cancelled at once: the deadline has passed
        finished.append("after the shield")

    async with scheduler:
        with anyio.fail_after(5):
            result = await scheduler.run_now("careful")
    assert result.outcome is Outcome.TIMEOUT
    assert finished == ["shielded part"]


async def test_timeouts_on_the_system_clock_each_fire_at_their_own_deadline() -> None:
    # On asyncio all run timeouts share one loop timer, armed for the earliest deadline.
    # A run with a shorter timeout started after a longer one must still be cut at its own
    # deadline; a run that finished leaves a stale entry that must not hold up the next one.
    scheduler = Scheduler()
    order: list[str] = []
    later = every(3600, initial_delay=3000)

    async def hang(ctx: JobContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            order.append(ctx.job_id)

    async def quick(ctx: JobContext) -> None:
        order.append(ctx.job_id)

    scheduler.add(hang, later, id="long", timeout=30)
    scheduler.add(quick, later, id="quick", timeout=0.05)
    scheduler.add(hang, later, id="short", timeout=0.3)
    results = {}

    async def run(job_id: str) -> None:
        results[job_id] = await scheduler.run_now(job_id)

    async with scheduler, anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            tg.start_soon(run, "long")
            await anyio.wait_all_tasks_blocked()
            await run("quick")  # its deadline, the earliest, is reached after it finished
            await run("short")
            assert order == ["quick", "short"]  # "long" is still running
            tg.cancel_scope.cancel()
    assert results["quick"].outcome is Outcome.SUCCESS
    assert results["short"].outcome is Outcome.TIMEOUT


async def test_each_run_has_its_own_task_and_context() -> None:
    # Runs due together start in one pass of the dispatcher (eagerly on Python 3.12+, where a
    # run that never suspends finishes inside that pass): each must still run in a task of
    # its own, with its own copy of the context variables.
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    seen: list[tuple[str, str, str | None]] = []

    async def handler(ctx: JobContext) -> None:
        seen.append((ctx.job_id, var.get(), anyio.get_current_task().name))
        var.set(ctx.job_id)  # never awaits: on 3.12+ it finishes in its eager first step

    for job_id in ("a", "b", "c"):
        scheduler.add(handler, every(10), id=job_id)
    async with scheduler:
        await clock.advance(0)
        await clock.advance(10)
    values = [(job, value) for job, value, _ in seen]
    assert (
        sorted(values[:3]) == sorted(values[3:]) == [("a", "unset"), ("b", "unset"), ("c", "unset")]
    )
    assert {name for *_, name in seen} == {f"ticklock.run {job}" for job in "abc"}
    assert var.get() == "unset"


async def test_shutdown_waits_for_runs_in_flight_within_the_grace() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, shutdown_grace=5)
    finished = []

    @scheduler.job(every(60), id="work")
    async def work(ctx: JobContext) -> None:
        await anyio.sleep(0.05)  # real time: shutdown grace is real time
        finished.append(ctx.slot)

    with run_log() as log:
        async with scheduler:
            await clock.settle()
    assert finished == [T0]
    assert log.outcomes("work") == ["success"]


async def test_shutdown_cancels_runs_past_the_grace_and_records_them() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, shutdown_grace=0.1)
    cleaned = []

    @scheduler.job(every(60), id="stuck", timeout=30)
    async def stuck(ctx: JobContext) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cleaned.append(True)

    with run_log() as log:
        with anyio.fail_after(5):
            async with scheduler:
                await clock.settle()
    assert cleaned == [True]
    assert log.outcomes("stuck") == ["cancelled"]


async def test_a_restarted_local_scheduler_catches_up_from_its_watermark() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[tuple[str, str | None]] = []

    @scheduler.job(cron("0 * * * *"), id="hourly")
    async def hourly(ctx: JobContext) -> None:
        prev = ctx.previous_success
        seen.append((ctx.slot.strftime("%H:%M"), prev.strftime("%H:%M") if prev else None))

    async with scheduler:
        await clock.advance(3600)
    await clock.advance(3 * 3600 + 60)  # down across 02:00, 03:00 and 04:00
    async with scheduler:
        await clock.settle()
    assert seen == [("01:00", None), ("04:00", "01:00")]


async def test_without_catch_up_missed_slots_are_skipped() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[str] = []

    @scheduler.job(cron("0 * * * *"), id="hourly", catch_up=False)
    async def hourly(ctx: JobContext) -> None:
        seen.append(ctx.slot.strftime("%H:%M"))

    async with scheduler:
        await clock.advance(3600)
    await clock.advance(3 * 3600 + 60)
    async with scheduler:
        await clock.advance(3600)
    assert seen == ["01:00", "05:00"]


async def test_context_fields() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, namespace="app", owner="replica-1")
    got: list[JobContext] = []

    @scheduler.job(every(60), id="work", timeout=7)
    async def work(ctx: JobContext) -> None:
        got.append(ctx)

    async with scheduler:
        await clock.advance(61)
    first, second = got
    assert first.job_id == "work" and first.owner == "replica-1" and first.conn is None
    assert first.slot.tzinfo is UTC and first.started_at == T0
    assert first.deadline == T0 + timedelta(seconds=7)
    assert first.idempotency_key != second.idempotency_key
    assert len(first.idempotency_key) == 32
    # the key is stable: derived from namespace, job id and slot only
    from ticklock._schedule.job import idempotency_key

    assert first.idempotency_key == idempotency_key("app", "work", T0)
    assert idempotency_key("other", "work", T0) != first.idempotency_key


async def test_a_handler_that_blocks_the_event_loop_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import time

    scheduler = Scheduler()  # the real clock: blocking is about real time
    beats: list[float] = []

    @scheduler.job(every(0.1), id="beat")
    async def beat(ctx: JobContext) -> None:
        beats.append((ctx.started_at - ctx.slot).total_seconds())

    @scheduler.job(every(60, initial_delay=0.3), id="blocker")
    async def blocker(ctx: JobContext) -> None:
        time.sleep(1.3)  # noqa: ASYNC251 - the mistake this test is about

    async with scheduler:
        await anyio.sleep(2.0)
    warnings = [r.getMessage() for r in caplog.records if "event loop was blocked" in r.message]
    assert warnings and "anyio.to_thread.run_sync" in warnings[0]
    assert max(beats) > 1.0  # the lateness of the other job shows it too


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_handler_that_lets_a_cancelled_error_out_fails_and_keeps_its_schedule() -> None:
    # Awaiting a task or future that something cancelled raises CancelledError in the
    # handler, though nobody cancelled the run. That was taken for a shutdown: the run was
    # logged "cancelled by shutdown" at INFO and the job was never scheduled again.
    import asyncio

    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    slots: list[float] = []

    @scheduler.job(every(10), id="awaits-a-cancelled-task")
    async def awaits_a_cancelled_task(ctx: JobContext) -> None:
        slots.append(elapsed(clock, ctx.slot))
        helper = asyncio.create_task(asyncio.sleep(60))
        await asyncio.sleep(0)
        helper.cancel()
        await helper

    with run_log() as log:
        async with scheduler:
            await clock.advance(25)
    assert slots == [0, 10, 20]
    runs = [r for r in log.runs if r.job_id == "awaits-a-cancelled-task"]
    assert [r.outcome for r in runs] == ["failure"] * 3
    assert "CancelledError" in (runs[0].error or "")
    (health,) = scheduler.health()
    assert health.consecutive_failures == 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_runs_come_from_the_loops_task_factory_when_it_has_one() -> None:
    # Instrumentation sets a task factory; runs must not bypass it (eager start on 3.12+
    # builds tasks directly, so it is used only without a factory).
    import asyncio

    loop = asyncio.get_running_loop()
    made: list[asyncio.Task[Any]] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    ran: list[str] = []

    @scheduler.job(every(10), id="instrumented")
    async def instrumented(ctx: JobContext) -> None:
        ran.append(ctx.job_id)

    loop.set_task_factory(factory)
    try:
        async with scheduler:
            await clock.advance(0)
    finally:
        loop.set_task_factory(None)
    assert ran == ["instrumented"]
    assert "ticklock.run instrumented" in [task.get_name() for task in made]
