"""The fleet on the in-memory database: real schedulers sharing one MemoryDatabase on a
ManualClock share the jobs, fail over, and obey pauses and triggers, in milliseconds."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone

import anyio
import pytest

from ticklock import JobContext, Scheduler, every
from ticklock._runtime.sharing import LIVE
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
JOBS = [f"job-{i}" for i in range(12)]


class Fleet:
    """Replicas named ``owners`` sharing one MemoryDatabase and ManualClock, each declaring
    ``JOBS`` alike (``every(10)``, first slot at 10 s); ``runs`` has (job, slot s, owner,
    start s) of every run that started."""

    def __init__(self, *owners: str, gate: anyio.Event | None = None) -> None:
        self.clock = ManualClock(T0)
        self.db = MemoryDatabase()
        self.runs: list[tuple[str, float, str, float]] = []
        self.schedulers = {owner: self._replica(owner, gate) for owner in owners}

    def _replica(self, owner: str, gate: anyio.Event | None) -> Scheduler:
        scheduler = Scheduler(database=self.db, clock=self.clock, owner=owner)

        async def work(ctx: JobContext) -> None:
            seconds = (ctx.slot - T0).total_seconds()
            start = (ctx.started_at - T0).total_seconds()
            self.runs.append((ctx.job_id, seconds, owner, start))
            if gate is not None and ctx.job_id == "job-0":
                await gate.wait()

        for job_id in JOBS:
            scheduler.add(work, every(10, initial_delay=10), id=job_id, timeout=8)
        return scheduler

    def owners(self, since: float = 0.0) -> dict[str, set[str]]:
        """The replicas that ran each job's slots from ``since``."""
        seen: dict[str, set[str]] = {}
        for job_id, slot, owner, _ in self.runs:
            if slot >= since:
                seen.setdefault(job_id, set()).add(owner)
        return seen

    async def successes(self, job_id: str) -> Counter[datetime | None]:
        """How many successful runs each slot of ``job_id`` has, fleet-wide."""
        history = await next(iter(self.schedulers.values())).fleet.history(job_id)
        return Counter(run.slot for run in history if run.outcome == "success")


async def test_replicas_share_the_jobs_each_slot_runs_once_by_its_owner() -> None:
    fleet = Fleet("a", "b", "c")
    async with AsyncExitStack() as stack:
        for scheduler in fleet.schedulers.values():
            await stack.enter_async_context(scheduler)
        await fleet.clock.advance(65)
        replicas = await fleet.schedulers["a"].fleet.replicas()
    assert [r.owner for r in replicas] == ["a", "b", "c"]
    slots = Counter((job_id, slot) for job_id, slot, _, _ in fleet.runs)
    assert set(slots.values()) == {1}  # no slot ran twice
    # each slot ran on time (10, 20, ... 60 s), by one owner per job, and the jobs spread
    assert sorted(slots) == [(job, float(s)) for job in sorted(JOBS) for s in range(10, 61, 10)]
    assert all(start == slot for _, slot, _, start in fleet.runs)
    owners = fleet.owners()
    assert all(len(ran) == 1 for ran in owners.values()), owners
    assert len({next(iter(ran)) for ran in owners.values()}) == 3


async def test_a_replica_that_leaves_hands_its_jobs_over_for_the_next_slot() -> None:
    fleet = Fleet("a", "b")
    a, b = fleet.schedulers["a"], fleet.schedulers["b"]
    async with b:
        async with a:
            await fleet.clock.advance(25)
        mine = {job for job, ran in fleet.owners().items() if ran == {"a"}}
        assert mine  # a owned some jobs
        await fleet.clock.advance(20)
    assert {job for job, ran in fleet.owners(since=30).items() if ran == {"b"}} == set(JOBS)
    late = [start - slot for _, slot, _, start in fleet.runs if slot >= 30]
    assert late and max(late) == 0  # handed over at the leave: on time, no look needed


async def test_a_frozen_owner_is_stood_in_for_within_two_seconds_and_its_late_commit_fails() -> (
    None
):
    gate = anyio.Event()  # job-0's handler waits on it: its owner freezes mid-run
    fleet = Fleet("a", "b", gate=gate)
    async with fleet.schedulers["a"], fleet.schedulers["b"]:
        await fleet.clock.advance(10)  # slot 10 of job-0: its owner's run is in flight
        [(_, _, owner, _)] = [r for r in fleet.runs if r[0] == "job-0"]
        other = "b" if owner == "a" else "a"
        fleet.db.freeze(owner)  # SIGSTOP: its session ends, its lock frees
        await fleet.clock.advance(2)
        stand_in = [r for r in fleet.runs if r[0] == "job-0" and r[2] == other]
        assert [(slot, start) for _, slot, _, start in stand_in] == [(10.0, 11.0)]
        gate.set()  # the frozen run's handler returns once the replica goes on...
        fleet.db.thaw(owner)
        await fleet.clock.advance(1)
        # ... and its commit fails: the slot committed once, by the stand-in
        assert await fleet.successes("job-0") == Counter({T0 + timedelta(seconds=10): 1})
        history = await fleet.schedulers[other].fleet.history("job-0")
    # the stand-in's success, and the frozen owner's failed commit
    assert sorted((run.owner == owner, run.outcome) for run in history) == [
        (False, "success"),
        (True, "error"),
    ]


async def test_a_killed_replica_is_stood_in_for_a_grace_late_and_leaves_the_view_once_stale() -> (
    None
):
    # as on PostgreSQL, where a dead replica's row stays until its heartbeat is LIVE s old:
    # it owns its jobs until then, and their backup stands in a grace after the slot it missed
    fleet = Fleet("a", "b")
    async with fleet.schedulers["a"], fleet.schedulers["b"]:
        await fleet.clock.advance(15)
        fleet.db.kill("a")
        await fleet.clock.advance(30)
        dead = [r.owner for r in await fleet.schedulers["b"].fleet.replicas()]
        await fleet.clock.advance(LIVE)
        replicas = [r.owner for r in await fleet.schedulers["b"].fleet.replicas()]
    assert dead == ["a", "b"]  # still in the view 30 s after its last beat
    assert replicas == ["b"]  # and gone once that beat was LIVE seconds old
    theirs = {job for job, slot, owner, _ in fleet.runs if slot == 10 and owner == "a"}
    assert theirs  # a ran some jobs' slot 10
    assert {job for job, ran in fleet.owners(since=20).items() if ran == {"b"}} == set(JOBS)
    for job in theirs:  # its slot 20 ran a grace late; then b stood in for a, on time
        late = [(slot, start - slot) for j, slot, _, start in fleet.runs if j == job and slot > 10]
        assert late == [(20.0, 1.0)] + [(s + 1.0, 0.0) for s in range(30, 101, 10)]


async def test_a_replica_frozen_past_its_heartbeat_leaves_the_view_and_joins_it_when_it_thaws() -> (
    None
):
    fleet = Fleet("a", "b")
    async with fleet.schedulers["a"], fleet.schedulers["b"]:
        await fleet.clock.advance(15)
        fleet.db.freeze("a")
        await fleet.clock.advance(LIVE - 1)
        frozen = [r.owner for r in await fleet.schedulers["b"].fleet.replicas()]
        await fleet.clock.advance(1)
        stale = [r.owner for r in await fleet.schedulers["b"].fleet.replicas()]
        fleet.db.thaw("a")
        await fleet.clock.advance(1)
        thawed = [r.owner for r in await fleet.schedulers["b"].fleet.replicas()]
        ran = len(fleet.runs)
        await fleet.clock.advance(20)
        successes = [await fleet.successes(job_id) for job_id in JOBS]
    assert (frozen, stale, thawed) == (["a", "b"], ["b"], ["a", "b"])
    assert {owner for _, _, owner, _ in fleet.runs[ran:]} == {"a", "b"}  # a runs its own again
    assert all(set(counts.values()) == {1} for counts in successes)  # each slot once


async def test_a_pause_and_a_trigger_on_one_replica_reach_the_others() -> None:
    fleet = Fleet("a", "b")
    a, b = fleet.schedulers["a"], fleet.schedulers["b"]
    async with a, b:
        await a.pause("job-0")
        await fleet.clock.advance(35)
        assert [r for r in fleet.runs if r[0] == "job-0"] == []  # neither replica ran it
        at = await b.trigger("job-0")  # a manual run, paused or not: exactly one
        await fleet.clock.advance(1)
        assert [r[1] for r in fleet.runs if r[0] == "job-0"] == [(at - T0).total_seconds()]
        await b.resume("job-0")
        await fleet.clock.advance(10)
        jobs = {record.job_id: record for record in await a.fleet.jobs()}
    assert jobs["job-0"].paused_at is None
    assert len([r for r in fleet.runs if r[0] == "job-0"]) == 2  # resumed: its next slot ran


async def test_a_view_change_over_many_jobs_lets_the_loop_run_between_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica joining a fleet of many jobs: every job takes its role in the new view, but
    not in one go: other tasks (runs, timers) run between chunks of jobs."""
    from ticklock._runtime import cycle as _cycle
    from ticklock._runtime import service as _service

    clock, db = ManualClock(T0), MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock, owner="a")

    async def work(ctx: JobContext) -> None:
        pass

    n = 3 * _service.VIEW_CHUNK
    jobs = [scheduler.add(work, every(60), id=f"j{i}", timeout=8) for i in range(n)]
    swept = [0]
    view_changed = _cycle.Cycle.view_changed

    def counted(self: _cycle.Cycle) -> None:
        swept[0] += 1
        view_changed(self)

    monkeypatch.setattr(_cycle.Cycle, "view_changed", counted)
    seen: list[int] = []

    async def probe() -> None:
        while True:
            seen.append(swept[0])
            await anyio.lowlevel.checkpoint()

    async with scheduler, anyio.create_task_group() as tg:
        await clock.advance(1)
        tg.start_soon(probe)
        swept[0] = 0
        db.silent_replica("b", jobs, T0)
        while swept[0] < n:
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert any(0 < count < n for count in seen), "the sweep held the loop from start to end"
    # and the sweep reached every job: those "b" ranks first for wait for it as backups
    ranking = scheduler._crew.share.ranking
    cycles = [scheduler._roster.cycles[job.id] for job in jobs]
    assert {c.ahead for c in cycles} == {(), ("b",)}
    assert all(c.ahead == ranking(c.job.id)[: ranking(c.job.id).index("a")] for c in cycles)
