"""In PostgreSQL mode the pause and a trigger request are checked under the job's lock, in the
tick's transaction: a replica that has not heard of them yet still obeys."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import anyio
import pytest

from helpers import eventually, run_log
from ticklock import JobContext, Outcome, Scheduler, every

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_a_pause_the_replica_has_not_heard_of_is_obeyed_under_the_lock(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    starts: list[datetime] = []

    @scheduler.job(every(0.1), id="busy")
    async def busy(ctx: JobContext) -> None:
        starts.append(datetime.now(timezone.utc))

    with run_log() as log:
        async with scheduler:

            async def ran() -> bool:
                return len(starts) >= 3

            await eventually(ran, 10, "runs")
            # no NOTIFY: the replica hears of it at its next beat, 15 s away
            paused_at = await pg_conn.fetchval(
                f"UPDATE {pg_schema}.jobs SET paused_at = now() WHERE job_id = 'busy' "
                "RETURNING paused_at"
            )
            await anyio.sleep(1.5)
            health = {h.job_id: h for h in scheduler.health()}
    late = [s for s in starts if s > paused_at]
    assert len(late) <= 1, late  # at most the run that had the lock when the pause committed
    # its next tick found the pause under the lock, and it stopped planning the job
    assert log.outcomes("busy")[-1] == "skipped" and log.outcomes("busy").count("skipped") == 1
    assert health["busy"].paused  # learnt from the state read under the lock


async def test_a_request_served_elsewhere_is_not_served_twice(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    runs: list[datetime] = []

    @scheduler.job(every(3600, initial_delay=3000), id="rare")
    async def rare(ctx: JobContext) -> None:
        runs.append(ctx.slot)

    async with scheduler:
        at = await scheduler.trigger("rare")

        async def served() -> bool:  # committed, not only started: its lock is free again
            return bool(
                await pg_conn.fetchval(
                    f"SELECT count(*) FROM {pg_schema}.runs WHERE job_id = 'rare' AND manual"
                )
            )

        await eventually(served, 10, "the manual run")
        # a replica that heard of the request late attempts it now: under the lock it finds
        # the request served (trigger_at cleared by the manual run's commit)
        runner = scheduler._crew.runner
        assert runner is not None
        result, _ = await runner.execute(scheduler.jobs["rare"], at, manual=True)
    assert result.outcome is Outcome.SKIPPED
    assert runs == [at]
    count = await pg_conn.fetchval(
        f"SELECT count(*) FROM {pg_schema}.runs WHERE job_id = 'rare' AND manual"
    )
    assert count == 1


async def test_each_job_declared_otherwise_lists_its_own_replicas(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # two live replicas declare j1 and j2 otherwise than this one: theirs rules (most share it)
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="here", shutdown_grace=1)

    async def work(ctx: JobContext) -> None:
        pass

    for job_id in ("j1", "j2", "j3"):
        scheduler.add(work, every(3600, initial_delay=3000), id=job_id, timeout=5)
    async with scheduler:
        await pg_conn.execute(
            f"INSERT INTO {pg_schema}.replicas (namespace, owner, jobs, fingerprints) "
            "SELECT 'default', o, ARRAY['j1', 'j2'], ARRAY['other-1', 'other-2'] "
            "FROM unnest(ARRAY['web-1', 'web-2']) AS o"
        )

        async def seen() -> bool:
            return len(await scheduler.fleet.replicas()) == 3

        await eventually(seen, 10, "this replica and the two others")
        jobs = {job.job_id: job.declared_otherwise for job in await scheduler.fleet.jobs()}
    assert jobs["j1"] == jobs["j2"] == ("here",)
    assert jobs["j3"] == ()  # declared by this replica alone: its declaration rules


async def test_an_id_with_an_unpaired_surrogate_is_an_unknown_job_on_both_backends(
    pg_dsn: str, pg_schema: str
) -> None:
    # no job can have one (declaring it is refused): PostgreSQL answers as memory does, with
    # the unknown job's KeyError, not a driver's DataError
    bad = "nightly\udcff"
    since = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for scheduler in (Scheduler(pg_dsn, schema=pg_schema), Scheduler()):

        @scheduler.job(every(60), id="nightly")
        async def nightly(ctx: JobContext) -> None:
            pass

        async with scheduler:
            fleet = scheduler.fleet
            with pytest.raises(KeyError, match="nightly"):
                await fleet.pause(bad)
            with pytest.raises(KeyError, match="nightly"):
                await fleet.resume(bad)
            with pytest.raises(KeyError, match="nightly"):
                await fleet.trigger(bad)
            with pytest.raises(KeyError, match="nightly"):
                await fleet.forget(bad)
            with pytest.raises(KeyError, match="nightly"):
                await fleet.history(bad)
            with pytest.raises(KeyError, match="nightly"):
                await fleet.slots(bad, since, datetime.now(timezone.utc))
            assert await fleet.audit(bad) == []
