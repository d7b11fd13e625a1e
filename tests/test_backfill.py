"""``fleet.backfill``: a window of a job's slots run after the fact, by the replicas that have
the job, one at a time under its lock, with ``ctx.slot`` each slot and ``ctx.backfill`` true;
only those the records do not show committed (unless ``rerun``); previewed by ``dry_run``;
paced; audited and recorded as backfilled by whom; the watermark never moves back. On a
:class:`ManualClock` here; across replica processes on PostgreSQL in
``tests/test_backfill_pg.py``."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from helpers import at, eventually
from ticklock import JobContext, ScheduleError, Scheduler, cron, every
from ticklock._operators.fleet import Fate
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


def hour(value: datetime) -> float:
    return (value - T0).total_seconds() / 3600


async def hourly(**options: Any) -> tuple[Scheduler, ManualClock, list[tuple[float, bool]]]:
    """An hourly job whose runs of 02:00 and 03:00 failed; it ran until 05:30."""
    clock = ManualClock(T0 - timedelta(minutes=30))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase(), owner="a")
    seen: list[tuple[float, bool]] = []
    broken = {2.0, 3.0}

    @scheduler.job(cron("0 * * * *"), id="report", catch_up=False, **options)
    async def report(ctx: JobContext) -> None:
        seen.append((hour(ctx.slot), ctx.backfill))
        if hour(ctx.slot) in broken and not ctx.backfill:
            raise RuntimeError("the warehouse was down")

    await scheduler.__aenter__()
    await clock.advance(6 * 3600)
    return scheduler, clock, seen


async def test_a_backfill_runs_only_the_slots_not_committed_in_order_and_marks_them() -> None:
    scheduler, clock, seen = await hourly()
    try:
        fleet = scheduler.fleet
        preview = await fleet.backfill("report", T0, T0 + timedelta(hours=5), dry_run=True)
        assert [(hour(r.slot), r.fate) for r in preview] == [
            (0, Fate.RAN),
            (1, Fate.RAN),
            (2, Fate.FAILED),
            (3, Fate.FAILED),
            (4, Fate.RAN),
        ]
        seen.clear()
        [before] = scheduler.health()
        done = await fleet.backfill(
            "report", T0, T0 + timedelta(hours=5), who="ops@example", note="warehouse back"
        )
        assert seen == [(2, True), (3, True)]  # in order, only those not committed
        assert [(hour(r.slot), r.fate) for r in done] == [
            (h, Fate.RAN) for h in (0.0, 1.0, 2.0, 3.0, 4.0)
        ]
        assert [r.reason for r in done[2:4]] == ["backfilled by ops@example"] * 2
        assert done[2].run is not None and done[2].run.backfilled_by == "ops@example"
        [after] = scheduler.health()
        assert after.last_success == before.last_success  # the watermark did not move back
        state = scheduler._roster.cycles.get("report")
        assert state is None or state.state is None or hour(state.state.last_slot or T0) == 5
        [action] = [a for a in await fleet.audit("report") if a.action == "backfill"]
        assert action.who == "ops@example" and action.note is not None
        assert "2 slots" in action.note and action.note.endswith("; warehouse back")
        # idempotent: nothing is left to run
        seen.clear()
        again = await fleet.backfill("report", T0, T0 + timedelta(hours=5))
        assert seen == [] and [r.fate for r in again] == [Fate.RAN] * 5
        # rerun: every slot of the window again
        await fleet.backfill("report", T0, T0 + timedelta(hours=2), rerun=True)
        assert seen == [(0, True), (1, True)]
    finally:
        await scheduler.__aexit__(None, None, None)


async def test_a_backfill_reaches_before_the_job_was_declared() -> None:
    scheduler, clock, seen = await hourly()
    try:
        seen.clear()
        done = await scheduler.fleet.backfill(
            "report", T0 - timedelta(hours=3), T0 - timedelta(hours=1), who="ops"
        )
        assert seen == [(-3, True), (-2, True)]
        assert [(hour(r.slot), r.fate, r.reason) for r in done] == [
            (-3, Fate.RAN, "backfilled by ops"),
            (-2, Fate.RAN, "backfilled by ops"),
        ]
        ledger = await scheduler.fleet.slots("report", T0 - timedelta(hours=4), clock.now())
        assert min(r.slot for r in ledger) >= T0 - timedelta(minutes=30)  # nothing more owed
    finally:
        await scheduler.__aexit__(None, None, None)


async def test_pace_spaces_the_slots_on_the_schedulers_clock() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    started: list[datetime] = []

    @scheduler.job(every(3600), id="sync")
    async def sync(ctx: JobContext) -> None:
        if ctx.backfill:
            started.append(clock.now())

    done = anyio.Event()

    async def backfill() -> None:
        await scheduler.fleet.backfill("sync", T0 - timedelta(hours=3), T0, pace=0.5, who="ops")
        done.set()

    async with scheduler, anyio.create_task_group() as tg:
        tg.start_soon(backfill)
        while not done.is_set():  # the clock moves on while the replica paces the slots
            await clock.advance(0.25)
            await anyio.sleep(0.005)
    assert len(started) == 3
    gaps = [(b - a).total_seconds() for a, b in zip(started, started[1:], strict=False)]
    assert all(gap >= 2.0 for gap in gaps), gaps


async def test_an_every_backfill_runs_one_slot_per_interval_from_since() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    slots: list[datetime] = []

    windows: list[tuple[datetime | None, datetime]] = []

    @scheduler.job(every(600), id="sync")
    async def sync(ctx: JobContext) -> None:
        if ctx.backfill:
            slots.append(ctx.slot)
            windows.append((ctx.previous_success, ctx.slot))

    @scheduler.job(cron("0 * * * *"), id="hourly")
    async def hourly(ctx: JobContext) -> None:
        if ctx.backfill:
            windows.append((ctx.previous_success, ctx.slot))

    async with scheduler:
        await clock.advance(1800)  # both ran: their watermarks are after the backfilled slots
        since = T0 - timedelta(hours=1)
        await scheduler.fleet.backfill("sync", since, since + timedelta(minutes=25))
        await scheduler.fleet.backfill("hourly", T0 - timedelta(hours=2), T0)
    assert slots == [since + timedelta(minutes=m) for m in (0, 10, 20)]
    # each covers its own interval of the schedule, not the watermark's window (backwards)
    assert windows == [(slot - timedelta(minutes=10), slot) for slot in slots] + [
        (T0 - timedelta(hours=3), T0 - timedelta(hours=2)),
        (T0 - timedelta(hours=2), T0 - timedelta(hours=1)),
    ]


@pytest.mark.parametrize(
    ("since", "until", "options", "field"),
    [
        (datetime(2026, 3, 28), T0, {}, "since"),  # naive
        (T0, T0 - timedelta(hours=1), {}, "until"),
        (T0, T0 + timedelta(days=1), {}, "until"),  # the future
        (T0 - timedelta(hours=2), T0, {"pace": 0}, "pace"),
    ],
)
async def test_bad_backfill_input_names_the_job_and_field(
    since: datetime, until: datetime, options: dict[str, Any], field: str
) -> None:
    clock = ManualClock(T0 + timedelta(hours=1))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())

    @scheduler.job(cron("0 * * * *"), id="report")
    async def report(ctx: JobContext) -> None:
        pass

    async with scheduler:
        with pytest.raises(ScheduleError) as caught:
            await scheduler.fleet.backfill("report", since, until, **options)
    assert caught.value.job_id == "report" and caught.value.field == field


async def test_an_edit_of_a_stored_schedule_is_in_the_ledger_from_the_first_slot_after_it() -> None:
    clock = ManualClock(T0 + timedelta(minutes=1))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        pass

    await scheduler.schedules.put("s1", task="report", trigger=cron("0 * * * *"), who="bob")
    async with scheduler:
        await clock.advance(2.5 * 3600)  # 01:00 and 02:00 ran under v1
        await scheduler.schedules.put(
            "s1", task="report", trigger=cron("30 * * * *"), who="alice", note="half past"
        )
        await clock.advance(2 * 3600)  # 03:30 and 04:30 under v2
        await scheduler.schedules.put(
            "s1", task="report", trigger=cron("30 * * * *"), who="carol"
        )  # changes nothing: no version
        ledger = await scheduler.fleet.slots("s1", T0, clock.now())
    changes = [(hour(r.slot), r.change) for r in ledger if r.change]
    assert changes == [(3.5, "definition v2 effective from this slot, by alice")]


@pytest.mark.parametrize(
    ("overlap", "ran", "passed"),
    [
        ("skip", [0, 3], [1, 2, 4]),  # due while the one before ran: passed over
        ("buffer_one", [0, 2, 4], [1, 3]),  # the latest of those runs once it ends
        (None, [0, 3], [1, 2, 4]),  # the default: skip
    ],
)
async def test_a_paced_backfill_honours_the_jobs_overlap(
    overlap: str | None, ran: list[int], passed: list[int]
) -> None:
    clock = ManualClock(T0 + timedelta(hours=1))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    started: list[int] = []

    async def slow(ctx: JobContext) -> None:  # a backfilled slot takes 2.5 s
        if ctx.backfill:
            started.append(int((ctx.slot - T0).total_seconds() // 60))
            await clock.sleep_until(clock.monotonic() + 2.5)

    options: dict[str, Any] = {} if overlap is None else {"overlap": overlap}
    scheduler.add(slow, cron("* * * * *"), id="job", timeout=30, **options)
    records: list[Any] = []

    async def backfill() -> None:  # five slots, one a second
        records.extend(await scheduler.fleet.backfill("job", T0, T0 + timedelta(minutes=5), pace=1))

    async with scheduler, anyio.create_task_group() as tg:
        tg.start_soon(backfill)
        while not records:
            await clock.advance(0.1)
            await anyio.sleep(0.002)
    assert started == ran
    assert [
        int((r.slot - T0).total_seconds() // 60) for r in records if r.fate is Fate.SKIPPED
    ] == (passed)


async def test_a_paced_backfill_under_replace_ends_each_run_when_the_next_slot_is_due() -> None:
    clock = ManualClock(T0 + timedelta(hours=1))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())

    @scheduler.job(cron("* * * * *"), id="job", timeout=30, overlap="replace")
    async def job(ctx: JobContext) -> None:
        if ctx.backfill:
            await clock.sleep_until(clock.monotonic() + 2.5)

    records: list[Any] = []

    async def backfill() -> None:
        records.extend(await scheduler.fleet.backfill("job", T0, T0 + timedelta(minutes=3), pace=1))

    async with scheduler, anyio.create_task_group() as tg:
        tg.start_soon(backfill)
        while not records:
            await clock.advance(0.1)
            await anyio.sleep(0.002)
        history = await scheduler.fleet.history("job", 10)
    filled = sorted((r for r in history if r.backfilled_by), key=lambda r: r.started_at)
    assert [(r.outcome, r.error) for r in filled] == [
        ("cancelled", "replaced by the run of slot 2026-03-29T00:01:00+00:00"),
        ("cancelled", "replaced by the run of slot 2026-03-29T00:02:00+00:00"),
        ("success", None),
    ]


async def test_the_dashboard_and_the_json_show_a_backfilled_slot() -> None:
    from test_dashboard import call, serve
    from ticklock._operators.dashboard import create_app

    # the dashboard's window is the last 24 h of the real clock: the job ran in it
    top = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    clock = ManualClock(top - timedelta(hours=6, minutes=30))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())

    @scheduler.job(cron("0 * * * *"), id="report", catch_up=False)
    async def report(ctx: JobContext) -> None:
        if ctx.slot == top - timedelta(hours=3) and not ctx.backfill:
            raise RuntimeError("the warehouse was down")

    async with scheduler:
        await clock.advance(6 * 3600)
        since = top - timedelta(hours=6)
        await scheduler.fleet.backfill("report", since, top - timedelta(hours=1), who="ops@x")
        with serve(create_app(scheduler.fleet)) as base:
            page = await anyio.to_thread.run_sync(call, base + "/jobs/report")
            slots = await anyio.to_thread.run_sync(call, base + "/api/jobs/report/slots")
    assert "backfilled by ops@x" in page.body
    filled = [s for s in slots.json()["slots"] if s["reason"] == "backfilled by ops@x"]
    assert [s["slot"] for s in filled] == [(top - timedelta(hours=3)).isoformat()]
    assert filled[0]["run"]["backfilled_by"] == "ops@x"


async def test_a_slot_whose_scheduled_run_commits_meanwhile_is_not_run_again() -> None:
    clock = ManualClock(T0 + timedelta(minutes=59))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    runs: list[tuple[float, bool]] = []

    @scheduler.job(cron("0 * * * *"), id="report", timeout=60)
    async def report(ctx: JobContext) -> None:
        runs.append((hour(ctx.slot), ctx.backfill))
        if not ctx.backfill:
            await clock.sleep_until(clock.monotonic() + 30)  # in flight when the backfill asks

    records: list[Any] = []

    async def backfill() -> None:  # 01:00 is not committed yet: chosen, then it commits
        since = T0 + timedelta(minutes=30)
        records.extend(await scheduler.fleet.backfill("report", since, clock.now()))

    async with scheduler:
        await clock.advance(70)  # 01:00:10, its run in flight
        async with anyio.create_task_group() as tg:
            tg.start_soon(backfill)
            while not records:
                await clock.advance(1)
                await anyio.sleep(0.005)
    assert runs == [(1, False)]  # the slot committed once, by its own run
    assert [(hour(r.slot), r.fate) for r in records] == [(1, Fate.RAN)]


async def test_a_stored_schedules_backfill_runs_though_no_cycle_holds_it() -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(clock=clock, database=db)
    slots: list[datetime] = []

    @scheduler.task("digest")
    async def digest(ctx: JobContext) -> None:
        if ctx.backfill:
            slots.append(ctx.slot)

    async with scheduler:
        await scheduler.schedules.put("tenant-1", task="digest", trigger=cron("0 6 * * *"))
        assert "tenant-1" not in scheduler._catalog.cycles  # due tomorrow: a row
        await scheduler.fleet.backfill("tenant-1", T0 - timedelta(days=3), T0)
    assert slots == [T0 - timedelta(days=d) + timedelta(hours=6) for d in (3, 2, 1)]


async def test_a_backfill_nobody_runs_is_given_up_and_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ticklock._operators import backfill as backfill_module

    monkeypatch.setattr(backfill_module, "STALL", 0.3)
    clock = ManualClock(T0 + timedelta(hours=3))
    db = MemoryDatabase()
    scheduler = Scheduler(clock=clock, database=db, shutdown_grace=0.1)
    started = anyio.Event()

    @scheduler.job(cron("0 * * * *"), id="stuck", timeout=1)
    async def stuck(ctx: JobContext) -> None:
        if ctx.backfill:
            started.set()
            await anyio.sleep_forever()  # hangs on a clock that never reaches its timeout

    async with scheduler:
        with pytest.raises(TimeoutError, match=r"no slot of it ran for 1\.3 s"):
            await scheduler.fleet.backfill("stuck", T0, T0 + timedelta(hours=2))
        assert started.is_set()
        [request] = db.backfills.values()
        assert request.finished and request.done == 0  # cancelled: 01:00 never runs


async def test_a_disabled_job_and_bad_options_are_refused() -> None:
    clock = ManualClock(T0 + timedelta(hours=3))
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())

    async def job(ctx: JobContext) -> None:
        pass

    scheduler.add(job, cron("0 * * * *"), id="off", enabled=False)
    scheduler.add(job, cron("* * * * *"), id="on")
    async with scheduler:
        with pytest.raises(KeyError, match="so none would run its backfill"):
            await scheduler.fleet.backfill("off", T0, T0 + timedelta(hours=2))
        with pytest.raises(ScheduleError) as pace:
            await scheduler.fleet.backfill("on", T0, T0 + timedelta(hours=1), pace="2")  # type: ignore[arg-type]
        with pytest.raises(ScheduleError) as window:
            await scheduler.fleet.backfill("on", T0, T0 + timedelta(hours=3))  # 180 slots: fine
            await scheduler.fleet.backfill("on", T0 - timedelta(days=1), T0)  # 1,440: too many
    assert (pace.value.job_id, pace.value.field) == ("on", "pace")
    assert (window.value.job_id, window.value.field) == ("on", "until")
    assert "more than 1000 slots" in str(window.value)


async def test_a_slot_cut_off_by_shutdown_is_left_for_the_next_replica() -> None:
    clock = ManualClock(T0 + timedelta(hours=3))
    db = MemoryDatabase()
    ran: list[tuple[str, float]] = []

    def replica(owner: str, hang: bool) -> Scheduler:
        scheduler = Scheduler(clock=clock, database=db, owner=owner, shutdown_grace=0.1)

        @scheduler.job(cron("0 * * * *"), id="long", timeout=600)
        async def long(ctx: JobContext) -> None:
            if ctx.backfill:
                ran.append((owner, hour(ctx.slot)))
                if hang:
                    await anyio.sleep_forever()

        return scheduler

    first = replica("a", hang=True)
    async with first:
        await first.fleet.request_backfill("long", [T0 + timedelta(hours=1)], None, None, who="ops")
        await eventually(lambda: _ran(ran), 5, "the slot to start on a")
    [request] = db.backfills.values()
    assert request.done == 0 and not request.finished  # cancelled by the shutdown, not lost
    async with replica("b", hang=False):
        await eventually(lambda: _finished(db), 5, "b to finish the backfill")
    assert ran == [("a", 1), ("b", 1)]
    history = [(r.owner, r.outcome.value) for r in db.history["long"] if r.backfilled_by]
    assert history == [("a", "cancelled"), ("b", "success")]


async def _ran(ran: list[tuple[str, float]]) -> bool:
    return bool(ran)


async def _finished(db: MemoryDatabase) -> bool:
    return all(b.finished for b in db.backfills.values())
