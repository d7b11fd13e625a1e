"""ticklock's own connection pool and the lease a handler gets as ``ctx.conn``, on a real server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import pytest

from ticklock import JobContext, Outcome, Scheduler, every

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


def closed(con: Any) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(con.is_closed())

    return check


class ResetCounter(asyncpg.Connection):  # type: ignore[type-arg,unused-ignore]
    """Counts the simple queries that carry asyncpg's session reset."""

    resets: list[str] = []

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        if "RESET ALL" in query:
            where = "ROLLBACK" if query.startswith("ROLLBACK") else "alone"
            ResetCounter.resets.append("COMMIT" if query.endswith("COMMIT") else where)
        return await super().execute(query, *args, **kwargs)


async def test_ctx_conn_is_a_connection_during_its_tick_and_unusable_after(
    pg_dsn: str, pg_schema: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    kept: list[Any] = []

    @scheduler.job(every(3600, initial_delay=3000), id="keeper")
    async def keeper(ctx: JobContext) -> int:
        assert ctx.conn is not None
        kept.append(ctx.conn)
        return int(await ctx.conn.fetchval("SELECT 41 + 1"))

    async with scheduler:
        result = await scheduler.run_now("keeper")
        assert result.outcome is Outcome.SUCCESS and result.report == 42
        # kept past its tick, the connection can't write into another tick's transaction
        with pytest.raises(asyncpg.InterfaceError, match="has ended"):
            await kept[0].fetchval("SELECT 1")
        assert "ended" in repr(kept[0])


@pytest.mark.parametrize("pool_kind", ["own", "given"])
async def test_ctx_conn_transaction_is_a_savepoint_of_the_tick(
    pg_dsn: str, pg_schema: str, pg_conn: Any, pool_kind: str
) -> None:
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    table = f"{pg_schema}.notes"
    await pg_conn.execute(f"CREATE TABLE {table} (note text)")
    pool = (
        await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2) if pool_kind == "given" else None
    )
    scheduler = (
        Scheduler(pool=pool, schema=pg_schema) if pool else Scheduler(pg_dsn, schema=pg_schema)
    )
    fail = [False]

    @scheduler.job(every(3600, initial_delay=3000), id="notes")
    async def notes(ctx: JobContext) -> None:
        conn = ctx.conn
        assert conn is not None
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {table} VALUES ('kept')")
            with pytest.raises(ValueError):
                async with conn.transaction():  # nested: a savepoint inside the savepoint
                    await conn.execute(f"INSERT INTO {table} VALUES ('undone')")
                    raise ValueError("undo this part")
        with pytest.raises(asyncpg.UniqueViolationError):
            async with conn.transaction():  # an error inside: the tick's transaction goes on
                await conn.execute("CREATE TEMP TABLE u (k int PRIMARY KEY) ON COMMIT DROP")
                await conn.execute("INSERT INTO u VALUES (1), (1)")
        manual = conn.transaction()
        await manual.start()
        await conn.execute(f"INSERT INTO {table} VALUES ('also undone')")
        await manual.rollback()
        with pytest.raises(asyncpg.InterfaceError, match="savepoint"):
            conn.transaction(isolation="serializable")
        if fail[0]:
            raise RuntimeError("the tick fails: its savepoints' work goes too")

    try:
        async with scheduler:
            assert (await scheduler.run_now("notes")).outcome is Outcome.SUCCESS
            fail[0] = True
            assert (await scheduler.run_now("notes")).outcome is Outcome.FAILURE
    finally:
        if pool is not None:
            await pool.close()
    assert [r[0] for r in await pg_conn.fetch(f"SELECT note FROM {table}")] == ["kept"]


async def test_the_reset_travels_only_when_the_handler_touched_the_connection(
    pg_dsn: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connect = asyncpg.connect

    async def counting(*args: Any, **kwargs: Any) -> Any:
        return await connect(*args, **{**kwargs, "connection_class": ResetCounter})

    monkeypatch.setattr(asyncpg, "connect", counting)
    monkeypatch.setattr(ResetCounter, "resets", [])
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    touch = [False]
    fail = [False]

    @scheduler.job(every(3600, initial_delay=3000), id="maybe")
    async def maybe(ctx: JobContext) -> None:
        if touch[0]:
            assert ctx.conn is not None
            await ctx.conn.fetchval("SELECT 1")
        if fail[0]:
            raise RuntimeError("after touching the connection")

    async with scheduler:
        expected = []
        for touched, failing in ((False, False), (True, False), (False, True), (True, True)):
            touch[0], fail[0] = touched, failing
            result = await scheduler.run_now("maybe")
            assert result.outcome is (Outcome.FAILURE if failing else Outcome.SUCCESS)
            if touched:  # with the COMMIT, or after the ROLLBACK
                expected.append("ROLLBACK" if failing else "COMMIT")
            assert ResetCounter.resets == expected, (touched, failing)


async def test_a_listener_a_handler_leaves_never_hears_a_later_tick(
    pg_dsn: str, pg_schema: str
) -> None:
    # asyncpg's pool dropped a released connection's listeners on the client side; no SQL
    # reset can, so a connection a handler left a callback on is closed instead of reused.
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    heard: list[str] = []
    first_heard = anyio.Event()
    pids: list[int] = []
    register = [True]

    def listener(_conn: Any, message: Any) -> None:
        heard.append(message.message)
        first_heard.set()

    @scheduler.job(every(3600, initial_delay=3000), id="noisy")
    async def noisy(ctx: JobContext) -> None:
        assert ctx.conn is not None
        pids.append(ctx.conn.get_server_pid())
        if register[0]:
            ctx.conn.add_log_listener(listener)
        await ctx.conn.execute("DO $$ BEGIN RAISE NOTICE 'tick'; END $$")

    async with scheduler:
        assert (await scheduler.run_now("noisy")).outcome is Outcome.SUCCESS
        with anyio.fail_after(5):  # log listeners are called soon after, not at once
            await first_heard.wait()
        assert heard == ["tick"]
        register[0] = False
        for _ in range(2):
            assert (await scheduler.run_now("noisy")).outcome is Outcome.SUCCESS
        await anyio.wait_all_tasks_blocked()  # a notice's callback would have run by now
    assert heard == ["tick"], "a later tick's notice reached the first tick's listener"
    assert pids[1] != pids[0] and pids[2] == pids[1]  # only the connection with a callback went
