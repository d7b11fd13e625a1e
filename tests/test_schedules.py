"""Schedules as data on memory: local mode and schedulers sharing one MemoryDatabase, on a
ManualClock (PostgreSQL and real replica processes: test_schedules_pg.py)."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from ticklock import JobContext, Schedule, ScheduleError, Scheduler, cron, every
from ticklock._backends.seam import FleetState
from ticklock._runtime.plan import Run, Skip, admit
from ticklock._schedule.job import Job
from ticklock.testing import ManualClock, MemoryDatabase

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)

Ran = list[tuple[str, str, datetime, dict[str, Any]]]


def replica(
    db: MemoryDatabase | None, clock: ManualClock, owner: str, ran: Ran, task: str = "report"
) -> Scheduler:
    """A scheduler with the task ``task``, whose runs are appended to ``ran``."""
    scheduler = Scheduler(database=db, clock=clock, owner=owner)

    @scheduler.task(task)
    async def report(ctx: JobContext) -> None:
        ran.append((owner, ctx.job_id, ctx.slot, dict(ctx.args)))

    return scheduler


def seconds(ran: Ran, job_id: str) -> list[float]:
    return [(slot - T0).total_seconds() for _, j, slot, _ in ran if j == job_id]


@pytest.mark.anyio
async def test_a_stored_schedule_runs_with_its_args_follows_an_edit_and_stops_when_deleted() -> (
    None
):
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)
    s = await scheduler.schedules.put(
        "report:acme", task="report", trigger=every(60), args={"tenant": "acme"}, tenant="acme"
    )
    assert (s.version, s.task, dict(s.args), s.tenant) == (1, "report", {"tenant": "acme"}, "acme")
    async with scheduler:
        await clock.advance(150)
        assert seconds(ran, "report:acme") == [0, 60, 120]
        assert {tuple(sorted(args.items())) for *_, args in ran} == {(("tenant", "acme"),)}
        # an edit: from the first slot after it (fixed delay from the last run's end, 120 s:
        # the slot at 140 s is due at once); the watermark is kept (no slot runs again)
        edited = await scheduler.schedules.put(
            "report:acme", task="report", trigger=every(20), args={"tenant": "acme", "v": 2}
        )
        assert (edited.version, edited.created_at, edited.updated_at) == (2, T0, clock.now())
        await clock.advance(50)
        assert seconds(ran, "report:acme") == [0, 60, 120, 140, 170, 190]
        assert ran[-1][3] == {"tenant": "acme", "v": 2}
        # a delete: nothing starts after it; the history stays
        assert await scheduler.schedules.delete("report:acme", note="churned") is True
        assert await scheduler.schedules.delete("report:acme") is False
        await clock.advance(120)
        assert seconds(ran, "report:acme") == [0, 60, 120, 140, 170, 190]
        assert await scheduler.schedules.get("report:acme") is None
        history = await scheduler.fleet.history("report:acme")
        assert [r.outcome for r in history] == ["success"] * 6
        actions = [(a.action, a.note) for a in await scheduler.fleet.audit("report:acme")]
        assert actions == [("delete", "churned"), ("put", None), ("put", None)]
        assert "report:acme" not in {j.job_id for j in await scheduler.fleet.jobs()}


@pytest.mark.anyio
async def test_versions_count_changes_and_go_on_after_a_delete() -> None:
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)
    put = scheduler.schedules.put
    first = await put("s", task="report", trigger=cron("0 9 * * *"), timeout=60)
    same = await put("s", task="report", trigger=cron("0 9 * * *"), timeout=60.0)
    assert (first.version, same.version) == (1, 1)  # a put that changes nothing
    assert dict(first.options) == {"timeout": 60.0}
    assert (await put("s", task="report", trigger=cron("0 9 * * *"), timeout=30)).version == 2
    assert (await put("s", task="report", trigger=cron("0 9 * * *"), tenant="t")).version == 3
    await scheduler.schedules.delete("s")
    again = await put("s", task="report", trigger=cron("0 9 * * *"))
    assert again.version == 4  # a replica that missed the delete can tell
    assert await scheduler.schedules.get("s") == again


@pytest.mark.anyio
async def test_list_pages_by_id_and_filters_by_tenant_and_task() -> None:
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)

    @scheduler.task("other")
    async def other(ctx: JobContext) -> None: ...

    for i in range(25):
        tenant = f"t{i % 3}"
        task = "report" if i % 2 else "other"
        await scheduler.schedules.put(f"s{i:02}", task=task, trigger=every(60), tenant=tenant)
    listed = scheduler.schedules.list
    assert [s.id for s in await listed(limit=5)] == ["s00", "s01", "s02", "s03", "s04"]
    assert [s.id for s in await listed(after="s04", limit=3)] == ["s05", "s06", "s07"]
    t1 = [s.id for s in await listed(tenant="t1", limit=1000)]
    assert t1 == [f"s{i:02}" for i in range(25) if i % 3 == 1]
    status = [j.job_id for j in await scheduler.fleet.jobs(tenant="t1")]
    assert status == t1  # a tenant's status: its stored schedules only
    both = [s.id for s in await listed(tenant="t1", task="report")]
    assert both == [f"s{i:02}" for i in range(25) if i % 3 == 1 and i % 2]
    pages, after = [], None
    while page := await listed(tenant="t0", limit=2, after=after):
        pages.append([s.id for s in page])
        after = page[-1].id
    assert sum(pages, []) == [f"s{i:02}" for i in range(25) if i % 3 == 0]
    for bad in (0, 1001, True, 2.5):
        with pytest.raises(ScheduleError, match="limit"):
            await listed(limit=bad)  # type: ignore[arg-type]


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("an unknown task", {"task": "nope"}, "task", "task 'nope' is not declared"),
    ("an empty task", {"task": ""}, "task", "task must be a non-empty string"),
    ("a bad trigger", {"trigger": "0 9 * * *"}, "trigger", "trigger must be every"),
    ("a timeout too long", {"timeout": 90}, "timeout", "must be shorter than the interval"),
    ("an unknown keyword", {"timeut": 5}, "timeut", "unknown keyword timeut="),
    ("the id keyword", {"id": "x"}, "id", "unknown keyword id="),
    ("args not an object", {"args": [1, 2]}, "args", "args must be a JSON object"),
    ("args not JSON", {"args": {"when": T0}}, "args", "args must be a JSON object"),
    ("args too big", {"args": {"x": "y" * 70_000}}, "args", "at most 65536 bytes"),
    ("a NaN in args", {"args": {"x": float("nan")}}, "args", "args must be a JSON object"),
    ("an empty tenant", {"tenant": ""}, "tenant", "tenant must be a non-empty string"),
    ("a tenant too long", {"tenant": "t" * 201}, "tenant", "at most 200 characters"),
    ("retries not a number", {"retries": "2"}, "retries", "retries must be a whole number"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("case", "given", "field", "message"), BAD, ids=[b[0] for b in BAD])
async def test_a_put_that_could_not_run_is_refused_naming_the_schedule_and_the_field(
    case: str, given: dict[str, Any], field: str, message: str
) -> None:
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)
    keywords: dict[str, Any] = {"task": "report", "trigger": every(60), **given}
    with pytest.raises(ScheduleError) as caught:
        await scheduler.schedules.put("acme:report", **keywords)
    assert caught.value.field == field, caught.value
    assert str(caught.value).startswith("schedule 'acme:report': "), caught.value
    assert message in str(caught.value)
    assert await scheduler.schedules.list() == []  # nothing was stored


@pytest.mark.anyio
async def test_bad_ids_and_the_id_of_a_job_declared_in_code_are_refused() -> None:
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)

    @scheduler.job(every(60), id="purge")
    async def purge(ctx: JobContext) -> None: ...

    for bad in ("", "x" * 201, "tab\there", 7):
        with pytest.raises(ScheduleError) as caught:
            await scheduler.schedules.put(bad, task="report", trigger=every(60))  # type: ignore[arg-type]
        assert caught.value.field == "id"
    with pytest.raises(ScheduleError, match="a job declared in code has this id") as caught:
        await scheduler.schedules.put("purge", task="report", trigger=every(60))
    assert caught.value.field == "id"
    with pytest.raises(ScheduleError, match="already declared"):
        scheduler.task("report")(purge)


@pytest.mark.anyio
async def test_replicas_sharing_a_database_run_each_slot_once_and_only_those_with_the_task() -> (
    None
):
    clock, db, ran = ManualClock(T0), MemoryDatabase(), Ran()
    a, b = replica(db, clock, "a", ran), replica(db, clock, "b", ran)
    c = replica(db, clock, "c", ran, task="unrelated")
    writer = Scheduler(database=db, clock=clock, owner="writer")  # no tasks of its own
    async with AsyncExitStack() as stack:
        for s in (a, b, c, writer):
            await stack.enter_async_context(s)
        await clock.advance(1)
        for i in range(40):  # the writer may put them: live replicas have the task
            await writer.schedules.put(f"s{i}", task="report", trigger=every(10), tenant="t")
        await clock.advance(35)
        slots = Counter((job, slot) for _, job, slot, _ in ran)
        assert slots and max(slots.values()) == 1  # no slot twice
        assert {owner for owner, *_ in ran} == {"a", "b"}  # both share them, c never runs one
        assert {job for _, job, *_ in ran} == {f"s{i}" for i in range(40)}
        jobs = {j.job_id: j for j in await writer.fleet.jobs()}
        assert {jobs[f"s{i}"].owner for i in range(40)} == {"a", "b"}
        assert (jobs["s0"].task, jobs["s0"].tenant, jobs["s0"].state.value) == ("report", "t", "ok")
        # operators steer a stored schedule as any job
        assert await writer.fleet.pause("s0", "maintenance")
        paused = len([r for r in ran if r[1] == "s0"])
        await clock.advance(30)
        assert len([r for r in ran if r[1] == "s0"]) == paused
        await writer.fleet.resume("s0")
        await clock.advance(11)
        assert len([r for r in ran if r[1] == "s0"]) > paused


@pytest.mark.anyio
async def test_a_schedule_whose_task_no_live_replica_has_is_listed_and_does_not_run() -> None:
    clock, db, ran = ManualClock(T0), MemoryDatabase(), Ran()
    a = replica(db, clock, "a", ran)
    async with a:
        await a.schedules.put("orphan", task="report", trigger=every(10))
        await clock.advance(5)
    # the only replica with the task left: the schedule stays, listed, with no owner
    other = replica(db, clock, "b", ran, task="unrelated")
    async with other:
        await clock.advance(60)
        jobs = {j.job_id: j for j in await other.fleet.jobs()}
        assert jobs["orphan"].task == "report"
        assert jobs["orphan"].owner is None
        assert seconds(ran, "orphan") == [0]
        with pytest.raises(ScheduleError, match="task 'report' is not declared"):
            await other.schedules.put("orphan2", task="report", trigger=every(10))


@pytest.mark.anyio
async def test_a_replica_that_starts_later_runs_the_stored_schedules_it_finds() -> None:
    clock, db, ran = ManualClock(T0), MemoryDatabase(), Ran()
    first = replica(db, clock, "first", ran)
    await first.schedules.put("kept", task="report", trigger=every(30))
    async with first:
        await clock.advance(31)
    assert seconds(ran, "kept") == [0, 30]
    late = replica(db, clock, "late", ran)
    async with late:  # a restart: it loads the schedule, and the watermark is kept
        await clock.advance(30)
    assert seconds(ran, "kept") == [0, 30, 60]
    assert {owner for owner, *_ in ran} == {"first", "late"}


def test_a_tick_of_a_definition_the_records_no_longer_hold_is_refused_under_the_lock() -> None:
    async def handler(ctx: JobContext) -> None: ...

    job = replace(Job.declare(handler, every(60), id="s"), task="report", version=3)
    for state, expected in (
        (FleetState(version=3), Run(T0)),
        (FleetState(version=4), Skip("the schedule changed (version 4)")),
        (FleetState(version=0), Skip("the schedule was deleted")),
        (FleetState(), Skip("the schedule was deleted")),
    ):
        admission = admit(job, state, T0, 1, manual=False, started=T0)
        assert admission == expected, state
    # a job declared in code has no version: the records' never refuse it
    code = Job.declare(handler, every(60), id="code")
    assert admit(code, FleetState(version=9), T0, 1, manual=False, started=T0) == Run(T0)


def test_schedule_is_exported_with_its_fields() -> None:
    fields = Schedule.__dataclass_fields__
    assert list(fields) == [
        "id",
        "task",
        "trigger",
        "args",
        "tenant",
        "options",
        "version",
        "created_at",
        "updated_at",
    ]


@pytest.mark.anyio
async def test_a_replica_holds_only_the_schedules_due_within_the_horizon() -> None:
    # 600 daily schedules, one a minute from midnight, and one that runs every 10 s
    start = T0 - timedelta(seconds=20)
    clock, ran = ManualClock(start), Ran()
    scheduler = replica(None, clock, "a", ran)
    for i in range(600):
        trigger = cron(f"{i % 60} {i // 60} * * *")
        await scheduler.schedules.put(f"daily-{i:03}", task="report", trigger=trigger)
    await scheduler.schedules.put("often", task="report", trigger=every(10))
    held = []
    async with scheduler:
        for _ in range(40):  # 20 minutes
            await clock.advance(30)
            held.append(len(scheduler.health()))
        # a schedule held nowhere yet runs when triggered
        await scheduler.fleet.trigger("daily-599", "now, please")
        await clock.advance(1)
    daily = [(job, slot) for _, job, slot, _ in ran if job.startswith("daily-")]
    # each daily schedule due in those 20 minutes ran once, at its minute
    expected = [(f"daily-{i:03}", T0 + timedelta(minutes=i)) for i in range(20)]
    assert sorted(daily)[:20] == expected
    assert [job for job, _ in daily if job == "daily-599"] == ["daily-599"]
    assert len(daily) == 21
    assert len(seconds(ran, "often")) >= 115
    # what it held: the schedules due within a minute, never the 600
    assert max(held) <= 6, held


@pytest.mark.anyio
async def test_a_look_reads_every_window_of_the_schedules_due_and_runs_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # more schedules due at once than one read returns: the look reads the next window by
    # id (it neither reads the first window again and again nor leaves the rest for later)
    from ticklock._backends.memory_schedules import MemorySchedules
    from ticklock._runtime import catalog

    monkeypatch.setattr(catalog, "WINDOW", 5)
    reads: list[str | None] = []
    due = MemorySchedules.due

    async def counted(self: MemorySchedules, *args: Any) -> tuple[list[Schedule], str | None]:
        reads.append(args[-1] if len(args) == 5 else None)
        return await due(self, *args)

    monkeypatch.setattr(MemorySchedules, "due", counted)
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)
    for i in range(12):
        await scheduler.schedules.put(f"s{i:02}", task="report", trigger=every(3600))
    async with scheduler:
        await clock.advance(1)
        first = sorted(job for _, job, slot, _ in ran if slot == T0)
        looks = list(reads)
        await clock.advance(120)
    assert first == [f"s{i:02}" for i in range(12)]
    assert len(ran) == 12
    assert looks == [None, "s04", "s09"], looks  # three windows, each read once


@pytest.mark.anyio
async def test_an_edited_cron_schedule_owes_no_fire_of_its_new_trigger_before_the_edit() -> None:
    clock, ran = ManualClock(T0), Ran()
    scheduler = replica(None, clock, "a", ran)
    await scheduler.schedules.put("s", task="report", trigger=cron("0 * * * *"))
    async with scheduler:
        await clock.advance(105 * 60)  # ran at 01:00
        # at 01:45, moved to the half hours: 01:30 passed unrun under the new trigger, and
        # is not owed (catch_up would run it at once): the next fire is 02:30
        await scheduler.schedules.put("s", task="report", trigger=cron("30 * * * *"))
        await clock.advance(60 * 60)
    assert seconds(ran, "s") == [3600, 9000]


@pytest.mark.anyio
async def test_a_stored_schedule_this_release_refuses_is_logged_once_and_the_others_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, db, ran = ManualClock(T0), MemoryDatabase(), Ran()
    scheduler = replica(db, clock, "a", ran)
    good = await scheduler.schedules.put("good", task="report", trigger=every(10))
    bad = await scheduler.schedules.put("bad", task="report", trigger=every(10))
    # as another release could have written it: a timeout this one refuses
    db.schedules["bad"] = replace(bad, options={"timeout": 30.0}, version=2)
    async with scheduler:
        await clock.advance(95)
    assert len(seconds(ran, "good")) == 10 and seconds(ran, "bad") == []
    refused = [r for r in caplog.records if "'bad' cannot run here" in r.getMessage()]
    assert len(refused) == 1, refused
    assert "timeout (30 s) must be shorter than the interval" in refused[0].getMessage()
    assert good.version == 1
