"""The job cycle after its move into ``_cycle``/``_crew``/``_service`` and the shared
``MemoryDatabase``, under what a review tried to break: wall-clock steps during and between
cron runs, a replica killed before its scheduler starts, a ``run_now`` that ends while the
scheduler drains."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from helpers import SteppingClock
from ticklock import JobContext, Scheduler, cron, every
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio
UTC = timezone.utc


# -- wall-clock steps with cron jobs ---------------------------------------------------------


async def test_a_backward_wall_step_during_a_cron_run_never_commits_its_slot_twice() -> None:
    # The 12:01 run starts on time; while it runs, NTP steps the wall clock back a minute, so
    # the run ends at 12:00:02 and the next fire after its end is 12:01 again. The planner
    # plans that slot once more (its handler runs again, on PostgreSQL too); PostgreSQL then
    # refuses the commit (the watermark is at the slot already), and so must the in-memory
    # database: G2, a slot is committed at most once, and the watermark never goes back.
    clock = SteppingClock(datetime(2026, 1, 1, 12, 0, 59, tzinfo=UTC))
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock, owner="a")
    watermarks: list[datetime | None] = []

    @scheduler.job(cron("* * * * *"), id="minutely", timeout=30)
    async def minutely(ctx: JobContext) -> None:
        watermarks.append(ctx.previous_success)
        await clock.sleep_until(clock.monotonic() + 2)

    async with scheduler:
        await clock.advance(1.5)  # the 12:01 run is in its handler
        clock.offset = -60.0  # the wall clock steps back a minute
        await clock.advance(125)
        history = await scheduler.fleet.history("minutely")
    slot = datetime(2026, 1, 1, 12, 1, tzinfo=UTC)
    successes = Counter(run.slot for run in history if run.outcome == "success")
    assert successes[slot] == 1, history
    assert db.states["minutely"].last_slot is not None
    assert db.states["minutely"].last_slot >= slot  # the watermark did not go back


async def test_a_backward_wall_step_during_a_cron_run_does_not_run_its_slot_again() -> None:
    # The same step: the next fire after the run's end is the slot it just committed. G2: a
    # replica that wakes for a slot already committed skips it; better, it never plans it
    # (a cron slot at or before the watermark is never owed again). Before, the handler ran
    # the slot a second time (its side effects outside the database twice; its commit refused
    # on PostgreSQL).
    clock = SteppingClock(datetime(2026, 1, 1, 12, 0, 59, tzinfo=UTC))
    scheduler = Scheduler(database=MemoryDatabase(), clock=clock, owner="a")
    slots: list[datetime] = []

    @scheduler.job(cron("* * * * *"), id="minutely", timeout=30)
    async def minutely(ctx: JobContext) -> None:
        slots.append(ctx.slot)
        await clock.sleep_until(clock.monotonic() + 2)

    async with scheduler:
        await clock.advance(1.5)
        clock.offset = -60.0
        await clock.advance(125)  # wall 12:02:06.5
    minute = timedelta(minutes=1)
    assert slots == [
        datetime(2026, 1, 1, 12, 1, tzinfo=UTC),
        datetime(2026, 1, 1, 12, 1, tzinfo=UTC) + minute,
    ]


async def test_run_now_after_a_backward_wall_step_does_not_move_the_watermark_back() -> None:
    clock = SteppingClock(datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC))
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock, owner="a")

    @scheduler.job(every(3600, initial_delay=3600), id="hourly", timeout=30)
    async def hourly(ctx: JobContext) -> None:
        pass

    async with scheduler:
        await clock.advance(10)
        first = await scheduler.run_now("hourly")
        clock.offset = -300.0  # five minutes back: "now" is before the committed slot
        second = await scheduler.run_now("hourly")
    assert first.outcome.value == "success"
    assert second.outcome.value == "error"  # as on PostgreSQL: the slot is already committed
    assert db.states["hourly"].last_slot == first.slot


async def test_a_cron_retry_waits_its_backoff_on_the_monotonic_clock_across_a_wall_step() -> None:
    # Before the refactor a cron retry's deadline was re-derived from its slot's wall instant
    # on every wall-clock step: a step back held the retry until the wall clock reached its
    # slot again (here 45 s late), a step forward fired it at once, without its backoff. Only
    # an on-time cron plan carries a wall instant now; this pins that (and attempt numbers).
    clock = SteppingClock(datetime(2026, 1, 1, 12, 0, 59, tzinfo=UTC))
    scheduler = Scheduler(clock=clock)
    attempts: list[tuple[int, float, datetime]] = []

    @scheduler.job(cron("* * * * *"), id="flaky", timeout=10, retries=2, retry_backoff=5)
    async def flaky(ctx: JobContext) -> None:
        attempts.append((ctx.attempt, clock.monotonic(), ctx.slot))
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")

    async with scheduler:
        await clock.advance(3)  # 12:01 failed at m=1; its retry is due at m=6
        clock.offset = -50.0
        await clock.advance(4)
    slot = datetime(2026, 1, 1, 12, 1, tzinfo=UTC)
    assert attempts == [(1, 1.0, slot), (2, 6.0, slot)]


# -- a killed replica --------------------------------------------------------------------------


def _replica(db: MemoryDatabase, clock: ManualClock, owner: str, runs: list[str]) -> Scheduler:
    scheduler = Scheduler(database=db, clock=clock, owner=owner, shutdown_grace=1)

    @scheduler.job(every(10, initial_delay=10), id="job", timeout=5)
    async def job(ctx: JobContext) -> None:
        runs.append(ctx.owner)

    return scheduler


@pytest.mark.asyncio_only  # a spinning task ignores trio's SIGALRM: the whole run would stop
@pytest.mark.timeout(20)
async def test_a_killed_replica_started_again_neither_spins_nor_rejoins_the_view() -> None:
    # kill() is for good: a scheduler started again under a killed replica's name (its
    # process restarted by a test, say) must not hang its event loop (the first load fails,
    # and the reconnect loop retried without ever waiting), nor appear live to the others.
    clock = ManualClock(datetime(2026, 1, 1, tzinfo=UTC))
    db = MemoryDatabase()
    runs: list[str] = []
    a, b = _replica(db, clock, "a", runs), _replica(db, clock, "b", runs)
    async with b:
        db.kill("a")
        async with a:
            await clock.advance(35)
            replicas = await b.fleet.replicas()
    assert [r.owner for r in replicas] == ["b"]
    assert runs == ["b", "b", "b"]  # slots 10, 20 and 30, each once, by the live replica


# -- run_now and shutdown ----------------------------------------------------------------------


async def test_a_run_now_that_ends_while_the_scheduler_drains_starts_no_new_tick() -> None:
    # G7: leaving 'async with' stops new ticks. A run_now() in flight when the scheduler
    # stops planned the job's next slot when it returned, and the dispatcher, which runs on
    # through the drain (it times the runs out), started that tick during the drain.
    clock = ManualClock(datetime(2026, 1, 1, tzinfo=UTC))
    scheduler = Scheduler(clock=clock, shutdown_grace=5)
    slow_release, now_release = anyio.Event(), anyio.Event()
    ticks: list[str] = []

    @scheduler.job(every(60), id="slow", timeout=50)
    async def slow(ctx: JobContext) -> None:  # in flight at shutdown: the drain waits for it
        await slow_release.wait()

    @scheduler.job(every(10, initial_delay=1000), id="quick", timeout=5)
    async def quick(ctx: JobContext) -> None:
        ticks.append("manual" if not ticks else "scheduled")
        if len(ticks) == 1:
            await now_release.wait()

    async def run_now() -> None:
        await scheduler.run_now("quick")

    async def during_the_drain() -> None:
        # the scheduler stops: nothing is planned any more (no event says so)
        while any(h.next_fire is not None for h in scheduler.health()):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        now_release.set()  # run_now() returns while the runs drain ...
        await clock.advance(11)  # ... and its job's next slot comes
        slow_release.set()

    async with anyio.create_task_group() as tg, scheduler:  # the scheduler stops first
        await clock.advance(0)  # slow runs, and waits
        tg.start_soon(run_now)
        await clock.settle()
        assert ticks == ["manual"]
        tg.start_soon(during_the_drain)
    assert ticks == ["manual"]


# -- a backup's look that waits behind its own replica's runs ----------------------------------


async def two_replicas_whose_reads_time_out(
    monkeypatch: pytest.MonkeyPatch, *, runs_in_flight: int | None
) -> dict[str, int]:
    """Two replicas of one ``every(10)`` job whose backups' first 3 reads time out (with
    ``runs_in_flight``: while the replica has that many runs in flight): each replica's
    attempts over a minute."""
    from ticklock._backends.memory import MemoryCoordinator
    from ticklock._runtime.loop import Runs

    attempts: Counter[str] = Counter()
    attempt, read = MemoryCoordinator.attempt, MemoryCoordinator.read
    timeouts = [3]

    async def counted(
        self: MemoryCoordinator,
        job_id: str,
        budget: float,
        at: datetime,
        *rest: Any,
    ) -> object:
        attempts[self.owner] += 1
        return await attempt(self, job_id, budget, at, *rest)

    async def queued(self: MemoryCoordinator, job_ids: list[str]) -> object:
        if timeouts[0]:
            timeouts[0] -= 1
            raise TimeoutError  # as anyio.fail_after raises it
        return await read(self, job_ids)

    monkeypatch.setattr(MemoryCoordinator, "attempt", counted)
    monkeypatch.setattr(MemoryCoordinator, "read", queued)
    if runs_in_flight is not None:
        monkeypatch.setattr(Runs, "in_flight", property(lambda self: runs_in_flight))
    clock, db = ManualClock(datetime(2030, 1, 1, tzinfo=UTC)), MemoryDatabase()
    replicas = []
    for owner in ("a", "b"):
        scheduler = Scheduler(database=db, clock=clock, owner=owner)

        async def tick(ctx: JobContext) -> None:
            pass

        scheduler.add(tick, every(10), id="tick")
        replicas.append(scheduler)
    async with replicas[0], replicas[1]:
        await clock.advance(2)  # the view: each knows the other
        before = dict(attempts)
        await clock.advance(65)
        return {owner: attempts[owner] - before.get(owner, 0) for owner in attempts}


async def test_a_look_that_timed_out_behind_the_replicas_own_runs_looks_again_not_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In a burst a backup's read queues for a connection behind its own runs until it times
    # out: attempting then would queue beside the owner's runs and lose to them. The backup
    # looks again a grace later instead; only the owner attempts.
    attempts = await two_replicas_whose_reads_time_out(monkeypatch, runs_in_flight=5)
    assert sorted(attempts.values()) == [0, 6], attempts


async def test_a_look_that_timed_out_with_no_run_in_flight_attempts_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # nothing of its own to wait behind: the database is slow or gone, and the backup
    # attempts, as for any read that failed (the attempt reports the error)
    attempts = await two_replicas_whose_reads_time_out(monkeypatch, runs_in_flight=None)
    assert sorted(attempts.values()) == [3, 6], attempts
