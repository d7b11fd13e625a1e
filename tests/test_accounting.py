"""What operators read of a job on a ManualClock: FAILING apart from OVERDUE, the audited
operations, the owner and next due, and the ledger of a fleet on a MemoryDatabase."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from ticklock import JobContext, Scheduler, cron, every
from ticklock._backends.seam import FleetState
from ticklock._operators.fleet import Action, Fate, JobState
from ticklock._operators.ledger import walking
from ticklock._schedule.job import Job, Outcome, RunResult
from ticklock._telemetry import unattempted
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("threshold", "outcomes", "after", "state", "failing", "overdue"),
    [
        # one failure of a 60 s job: FAILING at once (default threshold 1), not yet overdue
        (1, "F", 1, JobState.FAILING, True, False),
        # past its due instant + timeout 30 + grace 6 = 96 s, its runs go on failing: FAILING,
        # never OVERDUE (the absence alarm is for runs that do not finish)
        (1, "F", 97, JobState.FAILING, True, False),
        (3, "F", 1, JobState.OK, False, False),  # under its threshold: not failing
        (3, "FFF", 1, JobState.FAILING, True, False),
        (1, "FS", 1, JobState.OK, False, False),  # a success ends it
        (1, "S", 1, JobState.OK, False, False),
    ],
)
async def test_failing_is_apart_from_overdue(
    threshold: int, outcomes: str, after: float, state: JobState, failing: bool, overdue: bool
) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    plan = list(outcomes)

    @scheduler.job(every(60), id="j", failure_threshold=threshold, retries=0)
    async def j(ctx: JobContext) -> None:
        if plan.pop(0) == "F":
            raise RuntimeError("no")

    async with scheduler:
        for _ in outcomes[1:]:
            await clock.advance(1)  # a manual run's slot is now: one per instant
            await scheduler.run_now("j")
        await clock.advance(after)
        [record] = [r for r in await scheduler.fleet.jobs() if r.job_id == "j"]
        [health] = scheduler.health()
    assert (record.state, health.failing, health.overdue) == (state, failing, overdue)


async def test_operations_are_audited_and_say_whether_they_changed_anything() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)

    @scheduler.job(every(60), id="j")
    async def j(ctx: JobContext) -> None: ...

    async with scheduler:
        assert await scheduler.pause("j", "INC-42: upstream down", who="ops@laptop") is True
        await clock.advance(5)
        assert await scheduler.pause("j", who="ops@laptop") is False
        assert await scheduler.resume("j") is True
        assert await scheduler.resume("j") is False
        await scheduler.trigger("j", "once more")
        audit = await scheduler.fleet.audit("j")
        [record] = [r for r in await scheduler.fleet.jobs() if r.job_id == "j"]
    assert [(a.action, a.changed) for a in audit] == [
        ("trigger", True),
        ("resume", False),
        ("resume", True),
        ("pause", False),
        ("pause", True),
    ]
    first = audit[-1]
    assert (first.who, first.note, first.at) == ("ops@laptop", "INC-42: upstream down", T0)
    assert "@" in audit[0].who  # the default: this process's user@host
    assert record.last_action is not None and record.last_action.action == "trigger"
    with pytest.raises(KeyError):
        await scheduler.fleet.pause("nope")


async def test_a_job_shows_its_schedule_owner_and_next_due_before_its_first_run() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    a = Scheduler(database=db, clock=clock, owner="a")
    b = Scheduler(database=db, clock=clock, owner="b")
    for scheduler in (a, b):
        scheduler.add(_noop, cron("17 3 * * *", tz="Europe/Berlin"), id="nightly", timeout=60)
    async with a, b:
        await clock.advance(1)
        records = {r.job_id: r for r in await a.fleet.jobs()}
    nightly = records["nightly"]
    assert nightly.schedule == "cron '17 3 * * *' Europe/Berlin"
    assert (nightly.timeout, nightly.retries) == (60.0, 0)
    assert nightly.owner in ("a", "b") and nightly.last_owner is None
    assert nightly.next_due == datetime(2026, 1, 1, 2, 17, tzinfo=timezone.utc)
    assert not nightly.builtin


async def _noop(ctx: JobContext) -> None: ...


async def test_the_ledger_of_a_fleet_on_a_manual_clock() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()

    def replica(*, enabled: bool = True) -> Scheduler:
        scheduler = Scheduler(database=db, clock=clock, owner="a")
        scheduler.add(_noop, cron("* * * * *"), id="catch", timeout=10)
        scheduler.add(_noop, cron("* * * * *"), id="nocatch", timeout=10, catch_up=False)
        scheduler.add(_noop, cron("* * * * *"), id="held", timeout=10, enabled=enabled)
        return scheduler

    async with replica() as first:
        await clock.advance(150)  # runs at 1 and 2 min
        await first.pause("held", "INC-7", who="ops")
        await clock.advance(60)  # 3 min: held is paused
    await clock.advance(180)  # 4, 5, 6 min: the fleet is stopped
    async with replica(enabled=False) as again:  # held is now declared enabled=False
        await again.resume("held")
        await clock.advance(120)  # 6:30 the catch-up run of 6, then 7, 8 min
        since, until = T0, T0 + timedelta(minutes=8)

        async def fates(job_id: str) -> list[tuple[int, str, str | None]]:
            slots = await again.fleet.slots(job_id, since, until)
            return [
                (int((s.slot - T0).total_seconds() // 60), str(s.fate), s.reason) for s in slots
            ]

        catch, nocatch, held = await fates("catch"), await fates("nocatch"), await fates("held")
        ledger = await again.fleet.slots("catch", since, until)
    none = "no live replica declared the job"
    assert catch == [
        (1, "ran", None),
        (2, "ran", None),
        (3, "ran", None),
        (4, "covered", none),
        (5, "covered", none),
        (6, "ran", none),  # the catch-up run at 6:30: late, and why
        (7, "ran", None),
        (8, "ran", None),
    ]
    assert ledger[3].run is not None and ledger[3].run.slot == T0 + timedelta(minutes=6)
    assert ledger[5].late and ledger[5].lateness == timedelta(seconds=30)
    assert not ledger[6].late and ledger[6].lateness == timedelta(0)
    assert [f for _, f, _ in nocatch] == ["ran"] * 3 + ["skipped"] * 3 + ["ran"] * 2
    assert nocatch[3][2] == f"catch_up=False: the next run did not cover it ({none})"
    assert held[2] == (3, "skipped", "paused by ops at 2026-01-01T00:02:30+00:00: INC-7")
    assert held[6][1:] == ("skipped", "disabled: declared with enabled=False by every live replica")
    assert Fate(held[0][1]) is Fate.RAN


async def _paused_ledger(days: int) -> tuple[list[tuple[timedelta, str, str | None]], int]:
    """The last day's ledger of an ``every(1)`` job on a MemoryDatabase whose replica "old"
    has been live for ``days``, the job paused for all but the first of them; and the
    schedule steps it took."""
    now = T0 + timedelta(days=days)
    clock = ManualClock(now)
    db = MemoryDatabase()
    job = Job.declare(_noop, every(1), id="j0", timeout=0.5)
    db.silent_replica("old", [job], T0)
    paused = T0 + timedelta(days=1)
    before = paused - timedelta(seconds=1)
    db.recorded(RunResult("j0", Outcome.SUCCESS, before, before, before, "old"))
    db.steer("j0", paused_at=paused, trigger_at=None)
    db.actions.append(Action("j0", "pause", "ops", paused, None, True))
    scheduler = Scheduler(database=db, clock=clock, owner="a")
    scheduler.add(_noop, every(1), id="j0", timeout=0.5)
    async with scheduler:
        with walking() as walk:
            ledger = await scheduler.fleet.slots("j0", now - timedelta(days=1), now)
    return [(s.slot - now, s.fate.value, s.reason) for s in ledger], walk.steps


async def test_a_days_ledger_in_memory_costs_a_day_however_old_the_records() -> None:
    year, year_steps = await _paused_ledger(365)
    days, days_steps = await _paused_ledger(2)
    assert year == days and len(year) == 1000
    assert year[0][1:] == ("skipped", "paused by ops at 2026-01-02T00:00:00+00:00")
    assert year_steps == days_steps <= 10_000  # the day's slots, not each second since the pause


@pytest.mark.parametrize("trigger", [cron("* * * * *"), every(60)], ids=["cron", "every"])
async def test_a_run_late_after_a_resume_says_so_on_a_manual_clock(trigger: object) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, owner="a")
    scheduler.add(_noop, trigger, id="j", timeout=10)  # type: ignore[arg-type]
    async with scheduler:
        await clock.advance(90)  # ran at 0 (every) and 1 min
        await scheduler.pause("j", "INC-9", who="ops")
        await clock.advance(60 + 26)  # 2:56: resumed, the slot of 2 min runs now
        await scheduler.resume("j")
        await clock.advance(30)
        ledger = await scheduler.fleet.slots("j", T0, clock.now())
    [late] = [s for s in ledger if s.late]
    assert late.slot == T0 + timedelta(minutes=2) and late.fate is Fate.RAN
    assert late.lateness == timedelta(seconds=56)
    assert late.reason == "paused by ops at 2026-01-01T00:01:30+00:00: INC-9"
    assert all(s.lateness == timedelta(0) for s in ledger if s.slot < late.slot)


def test_status_fails_on_the_states_asked_for() -> None:
    from ticklock._operators.cli.errors import CommandError
    from ticklock._operators.cli.fleet import alarms

    assert alarms("overdue,failing") == {JobState.OVERDUE, JobState.FUTURE, JobState.FAILING}
    assert alarms("overdue") == {JobState.OVERDUE, JobState.FUTURE}  # a probe that never flaps
    assert alarms(" failing ") == {JobState.FAILING}
    with pytest.raises(CommandError, match="--fail-on takes overdue, failing"):
        alarms("late")


def _points(reader: InMemoryMetricReader, job_id: str) -> dict[str, int]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name.removeprefix("ticklock.slots."): int(getattr(point, "value", 0))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name.startswith("ticklock.slots.")
        for point in metric.data.data_points
        if point.attributes == {"ticklock.job.id": job_id}
    }


async def _failing(ctx: JobContext) -> None:
    raise RuntimeError("always")


async def test_the_slot_counters_count_each_slot_once_with_its_fate() -> None:
    reader = InMemoryMetricReader()
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, meter_provider=MeterProvider(metric_readers=[reader]))
    # retries that do not fit before the next slot (10 + 20 + 40 s > 60 s): the slot's last
    # attempt is its second, and it counts as failed
    scheduler.add(_failing, cron("* * * * *"), id="bad", timeout=5, retries=3, retry_backoff=10)
    scheduler.add(_noop, cron("* * * * *"), id="ok", timeout=5, catch_up=False)
    scheduler.add(_noop, every(60), id="steady", timeout=5)
    async with scheduler:
        await clock.advance(130)  # ok and steady: 2 slots each
        await scheduler.pause("ok")
        await scheduler.pause("steady")
        await clock.advance(600)  # paused: skipped, not missed
        await scheduler.resume("ok")
        await scheduler.resume("steady")
        await clock.advance(130)
        ledger = await scheduler.fleet.slots("bad", T0, clock.now())
    bad = _points(reader, "bad")
    # the last slot's retry is still to come: failed in the ledger, not yet in the counter
    assert sum(s.fate is Fate.FAILED for s in ledger) == 14 and bad["failed"] == 13
    assert bad["owed"] == 14 and "committed" not in bad and "missed" not in bad
    assert _points(reader, "ok").get("missed", 0) == 0
    assert _points(reader, "steady").get("missed", 0) == 0


def test_counting_a_long_gap_is_bounded() -> None:
    job = Job.declare(_noop, cron("* * * * *", tz="Europe/Berlin"), id="j", timeout=5)
    slot = T0 + timedelta(days=7)
    result = RunResult("j", Outcome.SUCCESS, slot, slot, slot, "a")
    state = FleetState(last_slot=T0)
    started = time.perf_counter()
    assert unattempted(job, state, result) == 7 * 24 * 60 - 1  # estimated past 60 fires
    assert time.perf_counter() - started < 1.0  # 60 fires, not 10,080
    assert unattempted(job, state, result, resumed=slot - timedelta(minutes=3)) == 2
    short = RunResult("j", Outcome.SUCCESS, T0 + timedelta(minutes=5), slot, slot, "a")
    assert unattempted(job, state, short) == 4


async def test_a_note_is_one_bounded_line_or_refused_before_anything_changes() -> None:
    scheduler = Scheduler(clock=ManualClock(T0))
    scheduler.add(_noop, every(60), id="j")
    async with scheduler:
        for bad in ("x" * 501, "evil\x1b[2J", "nul\x00"):
            with pytest.raises(ValueError, match="note"):
                await scheduler.pause("j", bad)
        assert [r.state for r in await scheduler.fleet.jobs()] == [JobState.OK]  # not paused
        assert await scheduler.pause("j", "  " + "ü" * 500 + "  ", who="ops") is True
        [action] = await scheduler.fleet.audit("j")
    assert action.note == "ü" * 500 and action.who == "ops"
    assert await scheduler.fleet.audit() == [action]
