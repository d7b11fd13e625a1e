"""Only ticklock's own COMMIT commits a tick, against a real PostgreSQL: a COMMIT injected
through asyncpg's COPY options, or sent by any other route, commits nothing of the tick's
transaction, and ``ctx.db`` refuses everything once that transaction is no longer open."""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from ticklock import JobContext, Outcome, Scheduler, every

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

INJECTED = "true) ; COMMIT; SELECT (1"
"""A ``header=`` value that asyncpg writes into its COPY statement as it is."""


def rare() -> Any:
    """A trigger that never fires during a test: runs come from run_now()."""
    return every(3600, initial_delay=3000)


async def held_key(conn: Any, pid: int) -> int:
    """The advisory lock key that session ``pid`` holds (the tick's job lock)."""
    return int(
        await conn.fetchval(
            "SELECT (classid::int8 << 32) | objid::int8 FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = $1",
            pid,
        )
    )


async def free(conn: Any, key: int) -> bool:
    """Whether another session could take lock ``key`` now (it gives it back at once)."""
    async with conn.transaction():
        return bool(await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", key))


async def rows(conn: Any, table: str) -> list[str]:
    return [r["note"] for r in await conn.fetch(f"SELECT note FROM {table} ORDER BY note")]


async def test_a_commit_injected_through_copy_options_commits_nothing_and_keeps_the_lock(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    freed: list[bool] = []

    @scheduler.job(rare(), id="copy")
    async def copy(ctx: JobContext) -> None:
        key = await held_key(pg_conn, await ctx.db.fetchval("SELECT pg_backend_pid()"))
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'before')", ctx.slot)
        try:
            await ctx.db.copy_from_table(
                "items",
                schema_name=pg_schema,
                output=io.BytesIO(),
                format="csv",
                header=cast(Any, INJECTED),
            )
        finally:  # G1: still the tick's lock, while the handler runs
            freed.append(await free(pg_conn, key))

    async with scheduler:
        result = await scheduler.run_now("copy")
    assert freed == [False]
    assert result.outcome is Outcome.FAILURE, result.error
    assert result.error == (
        f"StatementRefused: ctx.conn.copy_from_table(): header={INJECTED!r} is written into "
        "the COPY statement as it is, so it could end the statement and run another: refused "
        "before it reached the server. Give header a bool"
    )
    assert await rows(pg_conn, table) == []


async def test_copy_options_that_are_words_still_work(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    out = io.BytesIO()

    @scheduler.job(rare(), id="copy")
    async def copy(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'a;b')", ctx.slot)
        await ctx.db.copy_from_table(
            "items", schema_name=pg_schema, columns=["note"], output=out, format="csv",
            header=True, delimiter=";",
        )  # fmt: skip

    async with scheduler:
        result = await scheduler.run_now("copy")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert out.getvalue() == b'note\n"a;b"\n'


async def _copy_injection(raw: Any, schema: str) -> None:
    await raw.copy_from_table(
        "items", schema_name=schema, output=io.BytesIO(), format="csv", header=INJECTED
    )


# Routes by which a COMMIT (or a ROLLBACK) reaches the server past the lease's checks: the
# handler uses the raw connection under ctx.db, as a route the checks do not know would.
ROUTES: dict[str, Callable[[Any, str], Awaitable[object]]] = {
    "copy_injection": _copy_injection,
    "commit": lambda raw, schema: raw.execute("COMMIT"),
    "commit_and_chain": lambda raw, schema: raw.execute("COMMIT AND CHAIN"),
    "guessed_flag": lambda raw, schema: raw.execute("SET LOCAL ticklock.commit = on; COMMIT"),
    "seal_deleted": lambda raw, schema: raw.execute(f"DELETE FROM {schema}.seals; COMMIT"),
    "seal_replaced": lambda raw, schema: raw.execute(
        f"UPDATE {schema}.seals SET seal = sha256('x'); SET LOCAL ticklock.commit = x; COMMIT"
    ),
    "shadowed_sha256": lambda raw, schema: raw.execute(
        f"CREATE SCHEMA {schema}_x; CREATE FUNCTION {schema}_x.sha256(bytea) RETURNS bytea "
        f"LANGUAGE sql AS $$SELECT seal FROM {schema}.seals LIMIT 1$$; "
        f"SET LOCAL search_path = {schema}_x, pg_catalog; COMMIT"
    ),
    "shadowed_equality": lambda raw, schema: raw.execute(
        f"CREATE SCHEMA {schema}_x; CREATE FUNCTION {schema}_x.same(bytea, bytea) RETURNS bool "
        "LANGUAGE sql AS $$SELECT true$$; CREATE OPERATOR "
        f"{schema}_x.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = {schema}_x.same); "
        f"SET LOCAL search_path = {schema}_x, pg_catalog; COMMIT"
    ),
    "constraints_immediate": lambda raw, schema: raw.execute("SET CONSTRAINTS ALL IMMEDIATE"),
    "rollback": lambda raw, schema: raw.execute("ROLLBACK"),
}


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_commit_by_any_route_commits_none_of_the_ticks_writes(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, route: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    seen: list[BaseException | None] = []

    @scheduler.job(rare(), id="sneaky")
    async def sneaky(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'before')", ctx.slot)
        steps: list[Callable[[], Awaitable[object]]] = [
            lambda: ROUTES[route](cast(Any, ctx.db)._con, pg_schema),
            lambda: ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'after')", ctx.slot),
        ]
        for step in steps:
            try:
                await step()
                seen.append(None)
            except Exception as exc:  # the handler goes on, as a careless one would
                seen.append(exc)

    @scheduler.job(rare(), id="plain")
    async def plain(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'next')", ctx.slot)

    async with scheduler:
        result = await scheduler.run_now("sneaky")
        after_it = await scheduler.run_now("plain")  # the next tick commits as ever
    assert await rows(pg_conn, table) == ["next"]
    assert after_it.outcome is Outcome.SUCCESS, after_it.error
    assert result.outcome is Outcome.ERROR, result.error
    ended, after = seen[:2]
    if route == "rollback":
        assert ended is None
    else:
        assert "a COMMIT that is not ticklock's own reached a tick's transaction" in str(ended)
    if route != "constraints_immediate":  # there the transaction is aborted, still open
        assert str(after).startswith("ctx.conn.execute(): the tick's transaction has ended")
    watermark = await pg_conn.fetchval(
        f"SELECT last_slot FROM {pg_schema}.jobs WHERE job_id = 'sneaky'"
    )
    assert watermark is None  # the slot is not marked done
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {pg_schema}.seals") == 0


READ_ONLY = {
    "set_local": "SET LOCAL transaction_read_only = on",
    "set_config": "SELECT set_config('transaction_read_only', 'on', true)",
}


@pytest.mark.parametrize("how", list(READ_ONLY))
async def test_a_handler_that_makes_the_tick_read_only_gets_a_clear_failure(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, how: str
) -> None:
    # A read-only tick cannot record its run: ticklock's own writes after the handler (the
    # watermark, the run) would be refused as if the database were a read-only standby.
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="ro")
    async def ro(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'before')", ctx.slot)
        await ctx.db.execute(READ_ONLY[how])

    @scheduler.job(rare(), id="plain")
    async def plain(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, 'next')", ctx.slot)

    async with scheduler:
        result = await scheduler.run_now("ro")
        after_it = await scheduler.run_now("plain")
    if how == "set_local":  # refused before it reached the server
        assert result.outcome is Outcome.FAILURE
        assert (result.error or "").startswith(
            f"StatementRefused: ctx.conn.execute(): {READ_ONLY[how]!r} would end or change "
        ), result.error
    else:  # by a route the lease cannot read: the commit says what happened
        assert result.outcome is Outcome.ERROR
        assert result.error == (
            "TransactionChanged: the handler made the tick's transaction read-only "
            "(transaction_read_only), so ticklock could not record the run with the handler's "
            "writes: nothing was committed. For a read-only handler, just write nothing"
        )
    assert after_it.outcome is Outcome.SUCCESS, after_it.error
    assert await rows(pg_conn, table) == ["next"]


async def test_a_batch_has_a_seal_of_its_own(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="sweep", max_batches=3)
    async def sweep(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            await batch.db.execute(
                f"INSERT INTO {table} VALUES ($1, $2)", ctx.slot, f"b{batch.number}"
            )
            if batch.number == 2:  # the second batch's own transaction: a COMMIT past ctx.db
                await cast(Any, batch.db)._con.execute("COMMIT")

    async with scheduler:
        result = await scheduler.run_now("sweep")
    assert result.outcome is Outcome.FAILURE, result.error
    assert "a COMMIT that is not ticklock's own" in (result.error or "")
    assert result.batches == 1
    assert await rows(pg_conn, table) == ["b1"]  # the first batch committed as ever
