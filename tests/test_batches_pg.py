"""Batched runs against a real PostgreSQL: each batch its own transaction, the cursor across
runs and replicas, a timeout mid-batch, the hold between batches and its fence, PgBouncer."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from helpers import eventually
from ticklock import JobContext, Outcome, Scheduler, every
from ticklock._backends.postgres import tick
from ticklock._backends.postgres.schema import VERSION

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ITEMS = 10


async def items(conn: Any, schema: str) -> str:
    """A table ``<schema>.items`` of ITEMS ids, and an empty ``<schema>.done``."""
    await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
    await conn.execute(f"CREATE TABLE {schema}.items (id int PRIMARY KEY)")
    await conn.execute(f"INSERT INTO {schema}.items SELECT generate_series(1, {ITEMS})")
    await conn.execute(f"CREATE TABLE {schema}.done (id int, owner text, batch int)")
    return schema


def add_sweep(
    scheduler: Scheduler, schema: str, *, fail_at: int | None = None, **options: Any
) -> None:
    """Job "sweep": each batch records the next two items after the cursor in ``done``."""

    async def sweep(ctx: JobContext) -> dict[str, int]:
        n = 0
        async for batch in ctx.batches():
            after = batch.cursor or 0
            ids = await batch.db.fetch(
                f"INSERT INTO {schema}.done SELECT id, $2, $3 FROM {schema}.items "
                "WHERE id > $1 ORDER BY id LIMIT 2 RETURNING id",
                after,
                ctx.owner,
                batch.number,
            )
            if fail_at is not None and any(r["id"] >= fail_at for r in ids):
                raise RuntimeError(f"item {fail_at} is bad")
            n += len(ids)
            if ids:
                batch.cursor = ids[-1]["id"]
            if len(ids) < 2:
                break
        return {"n": n}

    scheduler.add(sweep, every(3600, initial_delay=3000), id="sweep", **options)


async def done(conn: Any, schema: str) -> list[tuple[int, str, int]]:
    rows = await conn.fetch(f"SELECT id, owner, batch FROM {schema}.done ORDER BY id, owner")
    return [tuple(r) for r in rows]


async def test_each_batch_commits_alone_and_a_failing_one_rolls_back_alone(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    data = await items(pg_conn, pg_schema + "_data")
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a")
    add_sweep(scheduler, data, fail_at=5)
    async with scheduler:
        result = await scheduler.run_now("sweep")
    assert (result.outcome, result.batches) == (Outcome.FAILURE, 2)
    assert result.error == "RuntimeError: item 5 is bad"
    # batches 1 and 2 stayed committed; batch 3 (items 5 and 6) rolled back with the failure
    assert await done(pg_conn, data) == [(1, "a", 1), (2, "a", 1), (3, "a", 2), (4, "a", 2)]
    job = await pg_conn.fetchrow(
        f"SELECT batch_cursor, busy_until, last_slot FROM {pg_schema}.jobs WHERE job_id = 'sweep'"
    )
    assert json.loads(job["batch_cursor"]) == 4
    assert job["busy_until"] is None  # the failure record ended the hold: a retry need not wait
    assert job["last_slot"] is None
    run = await pg_conn.fetchrow(
        f"SELECT outcome, batches, capped FROM {pg_schema}.runs WHERE job_id = 'sweep'"
    )
    assert tuple(run) == ("failure", 2, False)


async def test_the_cursor_goes_from_run_to_run_and_replica_to_replica_and_the_cap_says_so(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    data = await items(pg_conn, pg_schema + "_data")
    a = Scheduler(pg_dsn, schema=pg_schema, owner="a")
    b = Scheduler(pg_dsn, schema=pg_schema, owner="b")
    add_sweep(a, data, max_batches=2)
    add_sweep(b, data, max_batches=2)
    async with a, b:
        first = await a.run_now("sweep")
        second = await b.run_now("sweep")
        third = await a.run_now("sweep")
        history = await b.fleet.history("sweep")
        (job,) = [j for j in await b.fleet.jobs() if j.job_id == "sweep"]
    assert [(r.outcome, r.batches, r.capped) for r in (first, second, third)] == [
        (Outcome.SUCCESS, 2, True),
        (Outcome.SUCCESS, 2, True),
        (Outcome.SUCCESS, 2, False),  # items 9 and 10, then none: the body broke out
    ]
    assert [r.report for r in (first, second, third)] == [{"n": 4}, {"n": 4}, {"n": 2}]
    ids = [row[0] for row in await done(pg_conn, data)]
    assert ids == list(range(1, ITEMS + 1))  # none twice, none left out
    assert [r[1] for r in await done(pg_conn, data)] == ["a"] * 4 + ["b"] * 4 + ["a"] * 2
    assert [(r.batches, r.capped) for r in history] == [(2, False), (2, True), (2, True)]
    assert (job.last_batches, job.last_capped) == (2, False)


async def test_a_timeout_rolls_back_the_batch_in_flight_and_the_next_run_starts_at_once(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    data = await items(pg_conn, pg_schema + "_data")
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="a")

    @scheduler.job(every(3600, initial_delay=3000), id="slow", timeout=1.5)
    async def slow(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            await batch.db.execute(f"INSERT INTO {data}.done VALUES ($1, 'a', $1)", batch.number)
            batch.cursor = batch.number
            if batch.number == 2:
                await anyio.sleep(3)  # past the timeout, inside batch 2

    async with scheduler:
        result = await scheduler.run_now("slow")
        assert (result.outcome, result.batches) == (Outcome.TIMEOUT, 1)
        assert await done(pg_conn, data) == [(1, "a", 1)]
        hold = await pg_conn.fetchval(
            f"SELECT busy_until FROM {pg_schema}.jobs WHERE job_id = 'slow'"
        )
        assert hold is None
        again = await scheduler.run_now("slow")  # no hold to wait for: it runs
    assert again.outcome is Outcome.TIMEOUT and again.batches == 1
    cursor = await pg_conn.fetchval(
        f"SELECT batch_cursor FROM {pg_schema}.jobs WHERE job_id = 'slow'"
    )
    assert json.loads(cursor) == 1


async def test_a_holder_paused_between_batches_commits_nothing_once_another_took_over(
    pg_dsn: str, pg_schema: str, pg_conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A commits batch 1, then stops between batches (no transaction open, the lock free),
    # past its hold. B may not start the job while A's hold lasts; after it, B takes the job
    # over from A's cursor. When A goes on, its next batch finds the fence moved: it commits
    # nothing, and its failure record leaves B's state as it is.
    data = await items(pg_conn, pg_schema + "_data")
    paused, go = anyio.Event(), anyio.Event()
    begin = tick.Tick.begin_batch

    async def pausing(self: tick.Tick, budget: float) -> None:
        with anyio.CancelScope(shield=True):  # frozen: not even its own timeout runs
            if not paused.is_set():  # A's first pause; B's batches go on
                paused.set()
                await go.wait()
            await begin(self, budget)

    monkeypatch.setattr(tick.Tick, "begin_batch", pausing)
    a = Scheduler(pg_dsn, schema=pg_schema, owner="a")
    b = Scheduler(pg_dsn, schema=pg_schema, owner="b")
    add_sweep(a, data, timeout=1.0)
    add_sweep(b, data, timeout=1.0)
    async with a, b:
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def run_a() -> None:
                results.append(await a.run_now("sweep"))

            tg.start_soon(run_a)
            with anyio.fail_after(10):
                await paused.wait()
            hold = await pg_conn.fetchval(
                f"SELECT busy_until - clock_timestamp() FROM {pg_schema}.jobs "
                "WHERE job_id = 'sweep'"
            )
            # the run's start + timeout 1 + SERVER_GRACE 1 + HOLD_GRACE 1
            assert 2.0 < hold.total_seconds() <= 3.0
            locked = await b.run_now("sweep")
            assert locked.outcome is Outcome.LOCKED  # the lock is free, the job is not

            async def hold_ended() -> bool:
                return bool(
                    await pg_conn.fetchval(
                        f"SELECT busy_until < clock_timestamp() FROM {pg_schema}.jobs "
                        "WHERE job_id = 'sweep'"
                    )
                )

            await eventually(hold_ended, 10, "A's hold to end")
            took = await b.run_now("sweep")
            go.set()  # A goes on: its next batch

        (late,) = results
    assert took.outcome is Outcome.SUCCESS and took.batches == 5  # the fifth found none
    assert late.outcome is Outcome.ERROR, late
    assert late.error is not None and "another replica took the job over" in late.error
    assert late.batches == 1
    rows = await done(pg_conn, data)
    assert [r[0] for r in rows] == list(range(1, ITEMS + 1))
    assert [r[1] for r in rows] == ["a", "a"] + ["b"] * 8
    job = await pg_conn.fetchrow(
        f"SELECT last_owner, last_outcome, busy_until FROM {pg_schema}.jobs WHERE job_id = 'sweep'"
    )
    assert job["busy_until"] is None


async def test_batches_through_a_transaction_mode_pgbouncer(
    bouncer: str, pg_schema: str, pg_conn: Any
) -> None:
    data = await items(pg_conn, pg_schema + "_data")
    scheduler = Scheduler(bouncer, schema=pg_schema, owner="a")
    add_sweep(scheduler, data, max_batches=3)
    async with scheduler:
        first = await scheduler.run_now("sweep")
        second = await scheduler.run_now("sweep")
    assert (first.outcome, first.batches, first.capped) == (Outcome.SUCCESS, 3, True)
    assert (second.outcome, second.batches, second.capped) == (Outcome.SUCCESS, 3, False)
    assert [r[0] for r in await done(pg_conn, data)] == list(range(1, ITEMS + 1))


async def test_a_schema_of_version_5_is_upgraded_in_place_and_runs_batches(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    from ticklock._backends.postgres.schema import migrate

    s = pg_schema
    assert await migrate(pg_conn, s) == "created"
    await pg_conn.execute(
        f"ALTER TABLE {s}.jobs DROP COLUMN batch_cursor, DROP COLUMN fence, "
        f"DROP COLUMN busy_until; ALTER TABLE {s}.runs DROP COLUMN batches, DROP COLUMN capped; "
        f"UPDATE {s}.schema_version SET version = 5"
    )
    assert await migrate(pg_conn, s) == "upgraded"
    assert await pg_conn.fetchval(f"SELECT version FROM {s}.schema_version") == VERSION
    data = await items(pg_conn, s + "_data")
    scheduler = Scheduler(pg_dsn, schema=s, owner="a")
    add_sweep(scheduler, data, max_batches=2)
    async with scheduler:
        result = await scheduler.run_now("sweep")
    assert (result.outcome, result.batches, result.capped) == (Outcome.SUCCESS, 2, True)


async def test_a_batch_commit_that_stalls_is_the_database_s_error_not_the_handler_s_failure(
    pg_dsn: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server stalls while a batch commits (its backend stopped): ticklock's own bound on
    # the commit raises a TimeoutError through the handler's loop. That is the database's
    # error, as for a plain tick's commit; a handler's own OSError is a failure.
    import os
    import signal

    from ticklock._backends.postgres import database

    monkeypatch.setattr(database, "CLEANUP_SECONDS", 0.5)
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="me")
    stopped: list[int] = []

    @scheduler.job(every(3600, initial_delay=3000), id="stall", timeout=20)
    async def stall(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            if batch.number == 1:
                stopped.append(await batch.db.fetchval("SELECT pg_backend_pid()"))
                os.kill(stopped[0], signal.SIGSTOP)  # the next batch's commit stalls

    try:
        async with scheduler:
            result = await scheduler.run_now("stall")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert result.outcome is Outcome.ERROR, result
    assert result.error is not None and "did not finish within" in result.error
