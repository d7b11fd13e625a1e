"""``pause(until=...)``: a pause that ends by itself at an instant, fleet-wide, once: the
replica that takes the pause's record resumes the job and the audit log says the pause
expired (by ``ticklock``). A resume before it, or a pause without ``until``, cancels it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from helpers import Replicas, at, eventually
from ticklock import JobContext, Scheduler, every
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-29T00:00Z")


async def test_a_pause_until_an_instant_resumes_by_itself_there_once_for_the_fleet() -> None:
    clock, db = ManualClock(T0), MemoryDatabase()
    replicas = [Scheduler(clock=clock, database=db, owner=o) for o in ("a", "b")]
    starts: list[float] = []

    async def work(ctx: JobContext) -> None:
        starts.append((clock.now() - T0).total_seconds())

    for scheduler in replicas:
        scheduler.add(work, every(60), id="work", timeout=5)
    async with replicas[0], replicas[1]:
        await clock.advance(1)
        until = T0 + timedelta(minutes=10, seconds=30)
        assert await replicas[0].pause("work", "maintenance", who="ops", until=until)
        await clock.advance(20 * 60)
        actions = await replicas[1].fleet.audit("work")
    assert [s for s in starts if 1 < s < 630] == []  # paused from 0:00:01 to 0:10:30
    assert 630 in starts  # resumed at its instant: the slot it owes runs at once
    assert [(a.action, a.who, a.note) for a in reversed(actions)] == [
        ("pause", "ops", "maintenance (until 2026-03-29T00:10:30+00:00)"),
        ("resume", "ticklock", "the pause until 2026-03-29T00:10:30+00:00 expired"),
    ]


async def test_a_resume_or_a_pause_without_until_cancels_the_end() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, database=MemoryDatabase())
    scheduler.add(_noop, every(60), id="a", timeout=5)
    scheduler.add(_noop, every(60), id="b", timeout=5)
    async with scheduler:
        await scheduler.pause("a", until=T0 + timedelta(minutes=5), who="ops")
        await scheduler.pause("b", until=T0 + timedelta(minutes=5), who="ops")
        await scheduler.resume("a", who="ops")  # resumed by hand: no pause left to end
        await scheduler.pause("b", who="ops")  # paused for good: the end is gone
        await clock.advance(600)
        records = {j.job_id: j for j in await scheduler.fleet.jobs()}
        actions = await scheduler.fleet.audit()
    assert records["a"].paused_at is None and records["b"].paused_at is not None
    assert not [a for a in actions if a.who == "ticklock"]


async def test_a_naive_until_is_refused() -> None:
    scheduler = Scheduler(clock=ManualClock(T0))
    scheduler.add(_noop, every(60), id="a", timeout=5)
    async with scheduler:
        with pytest.raises(ValueError, match="until must be an aware datetime"):
            await scheduler.pause("a", who="ops", until=datetime(2026, 3, 29, 1))
        assert (await scheduler.fleet.jobs())[0].paused_at is None


async def _noop(ctx: JobContext) -> None:
    pass


@pytest.mark.postgres
async def test_replica_processes_resume_a_job_paused_from_the_cli_until_an_instant(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema
    for owner in ("A", "B"):
        ops.start(owner, "pause")
    watcher = Scheduler(ops.dsn, schema=s, owner="watcher", shutdown_grace=1)
    async with watcher:

        async def live() -> bool:
            return {"A", "B"} <= {r.owner for r in await watcher.fleet.replicas()}

        await eventually(live, 30, "both replicas live")
        now = await pg_conn.fetchval("SELECT now()")
        until = now + timedelta(seconds=4)
        paused = await ops.cli("pause", "steady", "--until", until.isoformat())
        assert paused.code == 0, paused
        assert "until" in paused.out
        await anyio.sleep(2)
        during = await pg_conn.fetchval(
            f"SELECT count(*) FROM {s}.runs WHERE job_id = 'steady' AND started_at > $1",
            now + timedelta(seconds=1),
        )

        async def resumed() -> bool:
            runs = await pg_conn.fetchval(
                f"SELECT count(*) FROM {s}.runs WHERE job_id = 'steady' AND started_at > $1",
                until,
            )
            return bool(runs)

        await eventually(resumed, 10, "a run after the pause's end")
        first = await pg_conn.fetchval(
            f"SELECT min(started_at) FROM {s}.runs WHERE job_id = 'steady' AND started_at > $1",
            until,
        )
        resumes = await pg_conn.fetch(
            f"SELECT who, note FROM {s}.audit WHERE job_id = 'steady' AND action = 'resume'"
        )
    assert during == 0
    assert (first - until).total_seconds() < 1.5, (first, until)  # at its instant
    expected = f"the pause until {until.astimezone(timezone.utc).isoformat()} expired"
    assert [(r["who"], r["note"]) for r in resumes] == [("ticklock", expected)]  # once
    bad = await ops.cli("pause", "steady", "--until", "2026-12-24T08:00")
    assert bad.code == 2 and "--until: until must be an aware datetime" in bad.err, bad


@pytest.mark.postgres
async def test_a_heartbeat_ending_a_pause_and_an_operator_changing_it_take_turns(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # both take the job's row first, then the pause's: they queue, never deadlock
    import asyncpg

    from ticklock._backends.postgres.fleet import PostgresFleet, from_connection
    from ticklock._backends.postgres.schema import migrate
    from ticklock._backends.postgres.sql import Statements

    s = pg_schema
    await migrate(pg_conn, s)
    await pg_conn.execute(
        f"INSERT INTO {s}.jobs (namespace, job_id, paused_at) VALUES ('default', 'j', now())"
    )
    await pg_conn.execute(f"INSERT INTO {s}.pauses VALUES ('default', 'j', now() - interval '1 s')")
    sql = Statements(s)
    beat, op = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    fleet = PostgresFleet(from_connection(op), schema=s, namespace="default")
    errors: list[BaseException] = []
    try:
        tx = beat.transaction()  # the heartbeat's transaction, step by step
        await tx.start()
        [(job_id,)] = await beat.fetch(sql.pauses_ending, "default")
        await beat.execute(sql.lock_job, "default", job_id)

        async def operator() -> None:
            now = await pg_conn.fetchval("SELECT now()")
            try:
                await fleet.pause("j", "longer", now + timedelta(hours=1), who="ops")
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            await anyio.sleep(0.3)  # the operator waits for the job's row
            assert await beat.fetchval(sql.pause_ended, "default", job_id) is not None
            await beat.execute(sql.resume, "default", job_id)
            await tx.commit()
    finally:
        await beat.close()
        await op.close()
    assert errors == []
    row = await pg_conn.fetchrow(
        f"SELECT j.paused_at, p.until FROM {s}.jobs j JOIN {s}.pauses p USING (namespace, job_id)"
    )
    assert row["paused_at"] is not None and row["until"] is not None  # the operator's, after


async def test_forget_takes_a_pause_end_with_it_in_memory() -> None:
    clock, db = ManualClock(T0), MemoryDatabase()
    first = Scheduler(clock=clock, database=db, owner="a")
    first.add(_noop, every(60), id="gone", timeout=5)
    async with first:
        await first.pause("gone", who="ops", until=T0 + timedelta(minutes=5))
    other = Scheduler(clock=clock, database=db, owner="b")
    async with other:
        await other.fleet.forget("gone", who="ops")
        await clock.advance(600)
        ids = [j.job_id for j in await other.fleet.jobs()]
        actions = [a.action for a in await other.fleet.audit("gone")]
    assert "gone" not in ids and actions == ["forget", "pause"]
