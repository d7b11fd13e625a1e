"""The jobs declared in code, held as rows until they come due (``_runtime/roster.py``): a job
whose slot lies beyond the horizon is no cycle and no timer on the replica, and everything a
user observes of it is what a held job gives: when it runs, its health, the gauge, pauses,
triggers, ``run_now`` and removal. Each scenario runs twice where it matters, once as shipped
and once with a horizon so wide that every job stays held, and the two must agree."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest

from helpers import SteppingClock, at, run_log
from ticklock import JobContext, JobHealth, Scheduler, cron, every
from ticklock._runtime import roster as _roster
from ticklock._runtime.cycle import HORIZON, LOOK
from ticklock.testing import ManualClock

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")
Scenario = Callable[[Scheduler, ManualClock], Awaitable[None]]


def declare(scheduler: Scheduler, clock: ManualClock, runs: list[tuple[str, float, float]]) -> None:
    """Hourly jobs at several offsets, a cron job, a daily one that fails, a short one."""

    def record(ctx: JobContext) -> None:
        runs.append(
            (ctx.job_id, (ctx.slot - T0).total_seconds(), (clock.now() - T0).total_seconds())
        )

    async def work(ctx: JobContext) -> None:
        record(ctx)

    async def fails(ctx: JobContext) -> None:
        record(ctx)
        raise RuntimeError("the report's source is down")

    for offset in (0, 90, 1799, 3599):
        scheduler.add(work, every(3600, initial_delay=offset), id=f"hourly-{offset}", timeout=5)
    scheduler.add(work, cron("7 * * * *"), id="cron", timeout=5)
    scheduler.add(fails, every(hours=2, initial_delay=600), id="fails", timeout=5)
    scheduler.add(work, every(10), id="short", timeout=5)
    scheduler.add(work, every(3600), id="disabled", enabled=False)


async def observe(
    monkeypatch: pytest.MonkeyPatch, *, held: bool, scenario: Scenario | None = None
) -> tuple[list[tuple[str, float, float]], list[list[JobHealth]], Scheduler]:
    """Run the jobs for 3 hours and 10 minutes; the runs and the health every 10 minutes."""
    if held:  # every job held from start to end, as before rows
        monkeypatch.setattr(_roster, "HORIZON", 1e9)
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, random=random.Random(7))
    runs: list[tuple[str, float, float]] = []
    healths: list[list[JobHealth]] = []
    declare(scheduler, clock, runs)
    healths.append(scheduler.health())
    async with scheduler:
        if scenario is not None:
            await scenario(scheduler, clock)
        for _ in range(19):
            await clock.advance(600)
            healths.append(scheduler.health())
    healths.append(scheduler.health())
    monkeypatch.undo()
    runs.sort(key=lambda run: (run[2], run[1], run[0]))  # runs at one instant: in any order
    return runs, healths, scheduler


async def test_a_job_due_beyond_the_horizon_is_a_row_until_it_comes_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    runs: list[tuple[str, float, float]] = []
    declare(scheduler, clock, runs)
    roster = scheduler._roster
    async with scheduler:
        assert set(roster.cycles) == {"hourly-0", "short"}  # due within the horizon
        await clock.advance(1)
        # a look builds a job's cycle at least a horizon less a look before its slot
        for _ in range(int(3 * 3600 / LOOK)):
            await clock.advance(LOOK)
            # held: due within the horizon, or run since the last look (the next drops it)
            horizon = clock.now() + timedelta(seconds=HORIZON + LOOK)
            ran = clock.now() - timedelta(seconds=LOOK)
            for job_id, cycle in roster.cycles.items():
                if job_id == "fails":
                    continue  # its failures on this replica are remembered (giving a job up)
                state, slot = cycle.state, cycle.slot
                assert slot is not None
                assert slot <= horizon or (state and state.last_end and state.last_end >= ran)
        # once run, an hourly job sleeps again until its next slot comes near
        held = set(roster.cycles)
    # at 3:00:01: hourly-0 ran at 3:00 (the next look drops it), the next slot is 1:29 away
    assert held == {"short", "fails", "hourly-0"}
    starts = {j: [(s, t) for i, s, t in runs if i == j] for j in {i for i, _, _ in runs}}
    assert starts["hourly-90"] == [(90, 90), (3690, 3690), (7290, 7290)]
    assert starts["hourly-3599"] == [(3599, 3599), (7199, 7199), (10799, 10799)]
    assert starts["cron"] == [(420, 420), (4020, 4020), (7620, 7620)]
    assert [s for s, _ in starts["fails"]] == [600, 7800]
    assert "disabled" not in starts


async def test_rows_run_and_report_exactly_as_held_cycles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = await observe(monkeypatch, held=False)
    held = await observe(monkeypatch, held=True)
    assert rows[0] == held[0]  # the same runs, at the same instants
    assert rows[1] == held[1]  # the same health (next fire, last success, failing, overdue)
    assert any(h.failing for h in rows[1][-1])
    assert all(h.next_fire is not None for h in rows[1][5] if h.job_id != "disabled")
    # the last-success gauge names every job that succeeded, sleeping or held
    assert dict(rows[2]._roster.successes()) == dict(held[2]._roster.successes())
    assert {j for j, _ in rows[2]._roster.successes()} >= {"hourly-0", "cron", "short"}


async def pause_trigger_and_run_now(scheduler: Scheduler, clock: ManualClock) -> None:
    """An operator steers sleeping jobs: pauses one, triggers one, runs one now."""
    await clock.advance(120)
    assert await scheduler.pause("hourly-1799", who="test")
    await scheduler.trigger("hourly-3599", who="test")
    result = await scheduler.run_now("cron")
    assert result.outcome.value == "success"


async def test_operators_steer_a_sleeping_job_as_a_held_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = await observe(monkeypatch, held=False, scenario=pause_trigger_and_run_now)
    held = await observe(monkeypatch, held=True, scenario=pause_trigger_and_run_now)
    assert rows[0] == held[0]
    assert rows[1] == held[1]
    runs = rows[0]
    assert not [r for r in runs if r[0] == "hourly-1799"]  # paused before its slot
    assert [r[1] for r in runs if r[0] == "hourly-3599"][:1] == [120]  # triggered: at once
    assert [r[1] for r in runs if r[0] == "cron"][:1] == [120]  # run_now: at once
    assert any(h.paused for h in rows[1][-1] if h.job_id == "hourly-1799")


async def test_a_removed_sleeping_job_never_runs_and_its_id_can_be_declared_again() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    runs: list[str] = []

    async def work(ctx: JobContext) -> None:
        runs.append(f"{ctx.job_id}@{(ctx.slot - T0).total_seconds():g}")

    scheduler.add(work, every(3600, initial_delay=600), id="report", timeout=5)
    async with scheduler:
        assert "report" not in scheduler._roster.cycles
        scheduler.remove("report")
        await clock.advance(700)
        assert runs == []
        scheduler.add(work, every(3600, initial_delay=300), id="report", timeout=5)
        await clock.advance(400)
    assert runs == ["report@1000"]  # the new declaration, from when it was added


async def test_a_wall_clock_step_forward_wakes_a_sleeping_job_at_the_next_look() -> None:
    clock = SteppingClock(T0)
    scheduler = Scheduler(clock=clock)
    starts: list[float] = []

    @scheduler.job(cron("0 12 * * *"), id="noon", timeout=5)
    async def noon(ctx: JobContext) -> None:
        starts.append((clock.now() - T0).total_seconds())

    async with scheduler:
        assert "noon" not in scheduler._roster.cycles
        clock.offset = (timedelta(hours=12) - timedelta(seconds=20)).total_seconds()  # NTP
        await clock.advance(LOOK + 30)
    # the next look after the step builds its cycle, which waits for noon on the wall clock
    assert starts == [12 * 3600]


async def test_a_sleeping_jobs_first_run_keeps_its_jitter() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, random=random.Random(3))
    late: list[float] = []

    async def work(ctx: JobContext) -> None:
        late.append((clock.now() - ctx.slot).total_seconds())

    for i in range(20):
        scheduler.add(work, every(3600, initial_delay=1800, jitter=30), id=f"j{i}", timeout=5)
    async with scheduler:
        assert scheduler._roster.cycles == {}
        await clock.advance(1900)
    assert len(late) == 20
    assert all(0 <= x <= 30 for x in late) and len(set(late)) > 1


async def test_ten_thousand_idle_jobs_hold_no_cycle_and_no_timer() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    async def work(ctx: JobContext) -> None:
        pass

    for i in range(10_000):
        scheduler.add(work, every(3600, initial_delay=600 + i * 0.3), id=f"j{i}", timeout=5)
    async with scheduler:
        assert len(scheduler._roster.cycles) == 0
        assert len(scheduler._crew.dispatcher._heap) <= 1
        await clock.advance(600 + 60)
        # held: those due within the horizon of now, and those that ran and wait for a look
        assert 0 < len(scheduler._roster.cycles) < 1_000
        assert len(scheduler.health()) == 10_000


async def test_run_now_of_a_sleeping_job_across_a_look_leaves_one_cycle() -> None:
    # a look during run_now() must not drop the cycle it runs on; after it, one tick a slot,
    # and remove() stops the job
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    gate = anyio.Event()
    slots: list[float] = []

    @scheduler.job(every(3600, initial_delay=1800), id="r", timeout=600)
    async def r(ctx: JobContext) -> None:
        slots.append((ctx.slot - T0).total_seconds())
        if len(slots) == 1:
            await gate.wait()

    with run_log() as log:
        async with scheduler:
            async with anyio.create_task_group() as tg:
                tg.start_soon(scheduler.run_now, "r")
                await clock.advance(1)
                held = scheduler._roster.cycles["r"]
                await clock.advance(LOOK + 10)  # a look while the manual run is in flight
                assert scheduler._roster.cycles.get("r") is held
                gate.set()
                await clock.advance(1)
            await clock.advance(2 * 3600)
            ticks = len(log.runs)
            scheduler.remove("r")
            await clock.advance(3 * 3600)
    assert ticks == 3 and len(log.runs) == 3  # the manual run, then one tick a slot
    assert log.outcomes("r") == ["success"] * 3


@pytest.mark.parametrize("step", [-1800.0, +400.0])
async def test_a_wall_clock_step_moves_a_sleeping_every_job_no_more_than_a_held_one(
    monkeypatch: pytest.MonkeyPatch, step: float
) -> None:
    # G8: every is on the monotonic clock, asleep as held
    async def starts(held: bool) -> list[float]:
        if held:
            monkeypatch.setattr(_roster, "HORIZON", 1e9)
        clock = SteppingClock(T0)
        scheduler = Scheduler(clock=clock)
        out: list[float] = []

        @scheduler.job(every(3600, initial_delay=600), id="e", timeout=5)
        async def e(ctx: JobContext) -> None:
            out.append(clock.monotonic())

        async with scheduler:
            await clock.advance(100)
            clock.offset = step  # NTP steps the wall clock
            await clock.advance(2 * 3600)
        monkeypatch.undo()
        return out

    assert await starts(held=False) == await starts(held=True) == [600, 4200]


async def test_a_sleeping_job_woken_again_and_again_keeps_one_place() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(days=300, initial_delay=3600), id="rare", timeout=5)
    async def rare(ctx: JobContext) -> None:
        pass

    async with scheduler:
        for _ in range(50):  # each woken by an operator, and dropped again by the next look
            scheduler._roster.wake("rare")
            await clock.advance(LOOK)
        places = sum(len(ids) for ids in scheduler._roster._asleep.values())
    assert places <= 1


@pytest.mark.parametrize("option", ["limit", "end"])
async def test_a_finished_job_is_a_row_again_after_a_pause_and_a_resume(option: str) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    finished: dict[str, Any] = (
        {"limit": 2} if option == "limit" else {"end": T0 + timedelta(seconds=90)}
    )

    @scheduler.job(every(60), id="w", timeout=5, **finished)
    async def w(ctx: JobContext) -> None:
        pass

    held = []
    async with scheduler:
        for step in ("run", "pause", "resume"):
            if step == "pause":
                await scheduler.pause("w", who="ops")
            elif step == "resume":
                await scheduler.resume("w", who="ops")
            await clock.advance(300)
            held.append("w" in scheduler._roster.cycles)
    assert held == [False, True, False]  # a paused job is held: it must hear of its resume
