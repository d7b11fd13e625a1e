"""Schedules as data on PostgreSQL, with real replica processes (``ops_app``'s ``tasks``
scenarios): edits and deletes obeyed fleet-wide, a rolling deploy that adds a task, and a
schedule whose task no live replica has."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import Replicas, eventually
from ticklock import ScheduleError, Scheduler, every

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@asynccontextmanager
async def writer(dsn: str, schema: str) -> AsyncIterator[Scheduler]:
    """A scheduler of the test's own, with no jobs or tasks: it writes schedules."""
    scheduler = Scheduler(dsn, schema=schema, owner="writer", shutdown_grace=1)
    async with scheduler:
        yield scheduler


async def live_tasks(scheduler: Scheduler, owners: set[str], task: str) -> None:
    async def seen() -> bool:
        replicas = await scheduler.fleet.replicas()
        return owners <= {r.owner for r in replicas if task in r.tasks}

    await eventually(seen, 30, f"{owners} live with task {task!r}")


async def rows(conn: Any, schema: str, ids: list[str]) -> list[Any]:
    return list(
        await conn.fetch(
            f"SELECT job, owner, slot, tx, args::text FROM {schema}.log WHERE job = ANY($1) "
            "ORDER BY tx",
            ids,
        )
    )


async def test_an_edit_and_a_delete_are_obeyed_by_every_replica(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    for owner in ("r1", "r2"):
        ops.start(owner, "tasks")
    ids = [f"tenant-{i}:report" for i in range(12)]
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"r1", "r2"}, "report")
        for i, sid in enumerate(ids):
            await w.schedules.put(
                sid, task="report", trigger=every(0.4), args={"v": 1}, tenant=f"t{i % 3}"
            )

        async def ran(version: int, owners: set[str]) -> bool:
            found = [
                r for r in await rows(pg_conn, pg_schema, ids) if json.loads(r[4]) == {"v": version}
            ]
            return {r[0] for r in found} == set(ids) and {r[1] for r in found} == owners

        await eventually(lambda: ran(1, {"r1", "r2"}), 30, "every schedule ran on its owner")
        for i, sid in enumerate(ids):
            edited = await w.schedules.put(
                sid, task="report", trigger=every(0.4), args={"v": 2}, tenant=f"t{i % 3}"
            )
            assert edited.version == 2
        edited_at: datetime = await pg_conn.fetchval("SELECT now()")
        # every replica runs the new definition (both own some of the schedules)
        await eventually(lambda: ran(2, {"r1", "r2"}), 30, "the edit was obeyed")
        t1 = [await w.schedules.get(sid) for sid in sorted(ids[1::3])]  # by id, as text
        assert await w.schedules.list(tenant="t1", limit=1000) == t1
        tenant_status = await w.fleet.jobs(tenant="t1")
        assert [j.job_id for j in tenant_status] == [s.id for s in t1 if s is not None]
        assert {j.tenant for j in tenant_status} == {"t1"}
        deleted = ids[:6]
        for sid in deleted:
            assert await w.schedules.delete(sid, note="churned")
        deleted_at: datetime = await pg_conn.fetchval("SELECT now()")
        await anyio.sleep(2)
        after = await rows(pg_conn, pg_schema, ids)
        # no tick of the old definition began after the edit committed, whichever replica
        # had heard of it: the version is checked under the lock
        stale = [r for r in after if json.loads(r[4]) == {"v": 1} and r[3] > edited_at]
        assert stale == []
        # and none of a deleted schedule after the delete, while the others run on
        assert [r for r in after if r[0] in deleted and r[3] > deleted_at] == []
        late = {r[0] for r in after if r[3] > deleted_at + timedelta(seconds=1)}
        assert late == set(ids[6:])
        # no slot twice
        slots = Counter((r[0], r[2]) for r in after)
        assert max(slots.values()) == 1
        jobs = {j.job_id: j for j in await w.fleet.jobs()}
        assert set(ids[6:]) <= jobs.keys() and not set(deleted) & jobs.keys()
        assert {jobs[sid].owner for sid in ids[6:]} <= {"r1", "r2"}
        assert jobs[ids[6]].task == "report"
        audit = [(a.action, a.note) for a in await w.fleet.audit(ids[0])]
        assert audit == [("delete", "churned"), ("put", None), ("put", None)]
        history = await w.fleet.history(ids[0])
        assert history and {r.outcome for r in history} == {"success"}


async def test_a_rolling_deploy_that_adds_a_task(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    ops.start("old", "tasks")
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"old"}, "report")
        with pytest.raises(ScheduleError, match="task 'digest' is not declared") as caught:
            await w.schedules.put("acme:digest", task="digest", trigger=every(0.5))
        assert caught.value.field == "task"
        await w.schedules.put("acme:report", task="report", trigger=every(0.5))
        ops.start("new", "tasks+digest")  # the release with the new task joins
        await live_tasks(w, {"new"}, "digest")
        await w.schedules.put("acme:digest", task="digest", trigger=every(0.5), args={"d": 1})

        async def digested() -> bool:
            return len(await rows(pg_conn, pg_schema, ["acme:digest"])) >= 3

        await eventually(digested, 30, "the new task's schedule ran")
        found = await rows(pg_conn, pg_schema, ["acme:digest", "acme:report"])
        assert {r[1] for r in found if r[0] == "acme:digest"} == {"new"}  # only it has the task
        assert {r[0] for r in found} == {"acme:digest", "acme:report"}
        assert ops.stop("old") == 0 and ops.stop("new") == 0


async def test_an_import_of_thousands_of_schedules_is_no_storm_and_an_edit_after_it_runs(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    from ticklock import cron

    ops.start("r1", "tasks")
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"r1"}, "report")
        started = anyio.current_time()
        for i in range(2000):  # far more writes than other notifications a storm is made of
            trigger = cron(f"{i % 60} {i // 60 % 24} 1 1 *")  # once a year: none runs now
            await w.schedules.put(f"imported-{i:04}", task="report", trigger=trigger)
        took = anyio.current_time() - started
        await w.schedules.put("after", task="report", trigger=every(0.5))

        async def ran() -> bool:
            return bool(await rows(pg_conn, pg_schema, ["after"]))

        await eventually(ran, 30, "the schedule put after the import ran")
    assert ops.stop("r1") == 0
    if took < 10:  # 2,000 notifications within the storm's window
        assert "notifications on channel" not in ops.output("r1"), ops.output("r1")[-2000:]


async def test_a_replica_reads_the_states_of_its_own_jobs_not_of_every_stored_schedule(
    pg_dsn: str, pg_schema: str
) -> None:
    from datetime import timezone

    from ticklock import JobContext, cron

    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="solo", shutdown_grace=1)

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        pass

    @scheduler.job(every(3600), id="code")
    async def code(ctx: JobContext) -> None:
        pass

    async with scheduler:
        for i in range(50):
            await scheduler.schedules.put(f"stored-{i}", task="report", trigger=cron("0 0 1 1 *"))
        # what a replica reads at start (and after an outage): its jobs' states, so that its
        # memory does not grow with the schedules stored (P13 measures it at 100,000)
        job = scheduler.jobs["code"]
        states = await scheduler._crew.coordinator.load({"code": job}, datetime.now(timezone.utc))
    assert set(states) == {"code"}


async def test_a_schedule_whose_task_no_live_replica_has_is_missed_with_that_reason(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    ops.start("with", "tasks+digest")
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"with"}, "digest")
        await w.schedules.put("orphan", task="digest", trigger=every(1))

        async def ran() -> bool:
            return bool(await rows(pg_conn, pg_schema, ["orphan"]))

        await eventually(ran, 30, "the schedule ran")
        assert ops.stop("with") == 0  # the release that had the task is rolled back
        ops.start("without", "tasks")
        await live_tasks(w, {"without"}, "report")
        since: datetime = await pg_conn.fetchval("SELECT now()")
        await anyio.sleep(4)
        until: datetime = await pg_conn.fetchval("SELECT now()")
        jobs = {j.job_id: j for j in await w.fleet.jobs()}
        assert (jobs["orphan"].task, jobs["orphan"].owner) == ("digest", None)
        slots = await w.fleet.slots("orphan", since, until)
        missed = [s for s in slots if s.fate.value == "missed"]
        assert missed, slots
        assert {s.reason for s in missed} == {"no live replica has its task 'digest'"}, slots


async def test_retention_prunes_old_writes_but_the_last_and_old_deleted_schedules(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    from ticklock import JobContext, Outcome

    scheduler = Scheduler(pg_dsn, schema=pg_schema, retention=timedelta(days=1))

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None: ...

    s = pg_schema
    async with scheduler:
        for sid in ("gone-long-ago", "gone-now", "kept"):
            await scheduler.schedules.put(sid, task="report", trigger=every(3600))
        await scheduler.schedules.delete("gone-long-ago")
        await scheduler.schedules.delete("gone-now")
        # the first delete and the writes before it happened three days ago
        await pg_conn.execute(
            f"UPDATE {s}.jobs SET spec = jsonb_set(spec, '{{deleted_at}}', "
            "to_jsonb((now() - interval '3 days')::text)) WHERE job_id = 'gone-long-ago'; "
            f"UPDATE {s}.schedule_log SET at = now() - interval '3 days'"
        )
        last = await pg_conn.fetchval(f"SELECT max(seq) FROM {s}.schedule_log")
        assert (await scheduler.run_now("ticklock.retention")).outcome is Outcome.SUCCESS
        ids = {r[0] for r in await pg_conn.fetch(f"SELECT job_id FROM {s}.jobs")}
        assert {"gone-now", "kept"} <= ids and "gone-long-ago" not in ids
        log = [r[0] for r in await pg_conn.fetch(f"SELECT seq FROM {s}.schedule_log")]
        assert log == [last]  # the replicas' mark stays
        # a write after the prune is followed as any
        await scheduler.schedules.put("new", task="report", trigger=every(3600))
        assert [s.id for s in await scheduler.schedules.list()] == ["kept", "new"]


async def test_a_trigger_runs_a_stored_schedule_no_replica_holds_and_a_pause_stops_it(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    from ticklock import cron

    ops.start("r1", "tasks")
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"r1"}, "report")
        # due once a year: no replica holds a cycle for it until it is asked for
        await w.schedules.put("yearly", task="report", trigger=cron("0 0 1 1 *"), args={"y": 1})
        await w.schedules.put("often", task="report", trigger=every(0.3))
        at = await w.fleet.trigger("yearly", "a report now, please")

        async def served() -> bool:
            return bool(await rows(pg_conn, pg_schema, ["yearly"]))

        await eventually(served, 30, "the trigger request was served")
        (row,) = await rows(pg_conn, pg_schema, ["yearly"])
        assert (row[1], row[2], json.loads(row[4])) == ("r1", at, {"y": 1})
        assert await w.fleet.pause("often", "maintenance")
        paused_at: datetime = await pg_conn.fetchval("SELECT now()")
        await anyio.sleep(1.5)
        after = [r for r in await rows(pg_conn, pg_schema, ["often"]) if r[3] > paused_at]
        assert after == []  # refused under the lock once the pause committed
        assert await w.fleet.resume("often")
        resumed_at: datetime = await pg_conn.fetchval("SELECT now()")

        async def again() -> bool:
            found = await rows(pg_conn, pg_schema, ["often"])
            return any(r[3] > resumed_at for r in found)

        await eventually(again, 30, "the resumed schedule ran again")


async def test_concurrent_writes_of_one_schedule_each_get_a_version_of_their_own(
    pg_dsn: str, pg_schema: str
) -> None:
    from ticklock import JobContext

    writers = [Scheduler(pg_dsn, schema=pg_schema, owner=f"w{i}") for i in range(2)]
    for scheduler in writers:

        @scheduler.task("report")
        async def report(ctx: JobContext) -> None: ...

    versions: dict[int, int] = {}  # version -> the put that wrote it
    async with writers[0], writers[1]:

        async def put(i: int) -> None:
            w = writers[i % 2]
            s = await w.schedules.put("shared", task="report", trigger=every(3600), args={"i": i})
            versions[s.version] = i

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(put, i)
        final = await writers[1].schedules.get("shared")
    assert sorted(versions) == list(range(1, 21))  # none lost, none twice
    assert final is not None and final.version == 20
    assert final.args == {"i": versions[20]}  # the last write is the one stored


async def test_an_edit_is_in_the_ledger_from_the_first_slot_after_it(
    ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    ops.start("r1", "tasks")
    async with writer(pg_dsn, pg_schema) as w:
        await live_tasks(w, {"r1"}, "report")
        await w.schedules.put("edited", task="report", trigger=every(0.3), who="bob")

        async def ran(n: int) -> bool:
            return len(await rows(pg_conn, pg_schema, ["edited"])) >= n

        await eventually(lambda: ran(2), 20, "two runs under v1")
        await w.schedules.put("edited", task="report", trigger=every(0.4), who="alice")
        edited = await pg_conn.fetchval(
            f"SELECT max(at) FROM {pg_schema}.audit WHERE job_id = 'edited' AND action = 'put'"
        )
        await eventually(lambda: ran(5), 20, "runs under v2")
        ledger = await w.fleet.slots(
            "edited", edited - timedelta(minutes=1), edited + timedelta(minutes=1)
        )
    assert ops.stop("r1") == 0
    changed = [r for r in ledger if r.change]
    assert [r.change for r in changed] == ["definition v2 effective from this slot, by alice"]
    assert changed[0].slot > edited
    assert all(r.slot <= edited for r in ledger[: ledger.index(changed[0])])
