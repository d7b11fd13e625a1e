"""The edges of a tick's connection against a real PostgreSQL: what a handler keeps or leaves
behind, how it may end the transaction, and what a replica with a lying clock may commit."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, cast

import anyio
import asyncpg
import pytest

from test_statements import ALLOWED, REFUSED
from ticklock import JobContext, Outcome, Scheduler, SystemClock, every, lock_key
from ticklock._backends.postgres.statements import transaction_control
from ticklock.testing import ManualClock

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


def rare() -> Any:
    """A trigger that never fires during a test: runs come from run_now()."""
    return every(3600, initial_delay=3000)


async def count(conn: Any, sql: str) -> int:
    return int(await conn.fetchval(sql))


# -- what a handler keeps from ctx.conn stops working when its tick ends ------------------


@pytest.mark.parametrize("kept", ["prepared statement", "bound method", "savepoint", "cursor"])
async def test_nothing_kept_from_ctx_conn_writes_in_a_later_tick(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, kept: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    insert = f"INSERT INTO {table} VALUES ($1, 'x')"
    cache: list[Any] = []

    async def keep(conn: Any) -> Any:
        if kept == "prepared statement":
            return await conn.prepare(insert)
        if kept == "bound method":
            return conn.execute
        if kept == "savepoint":
            return conn.transaction()
        return conn.cursor(f"SELECT * FROM {table}")

    async def use(thing: Any, slot: datetime) -> None:
        if kept == "prepared statement":
            await thing.fetch(slot)
        elif kept == "bound method":
            await thing(insert, slot)
        elif kept == "savepoint":
            async with thing:
                pass
        else:
            await (await thing).fetch(1)

    @scheduler.job(rare(), id="x")
    async def x(ctx: JobContext) -> None:
        assert ctx.conn is not None
        if not cache:  # the first run writes, and keeps something it got from ctx.conn
            await ctx.conn.execute(insert, ctx.slot)
            cache.append(await keep(ctx.conn))
        else:  # a later run uses what the first kept, instead of its own ctx.conn
            await use(cache[0], ctx.slot)

    async with scheduler:
        first = await scheduler.run_now("x")
        second = await scheduler.run_now("x")
    assert first.outcome is Outcome.SUCCESS, first.error
    assert second.outcome is not Outcome.SUCCESS, f"a {kept} worked after its tick"
    assert "InterfaceError" in (second.error or ""), second.error
    successes = await count(
        pg_conn, f"SELECT count(*) FROM {pg_schema}.runs WHERE job_id = 'x' AND outcome = 'success'"
    )
    assert successes == await count(pg_conn, f"SELECT count(*) FROM {table}") == 1


async def test_a_prepared_statement_made_in_a_tick_retires_its_connection(
    pg_dsn: str, pg_schema: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    pids: list[int] = []
    prepare = [True]

    @scheduler.job(rare(), id="p")
    async def p(ctx: JobContext) -> None:
        assert ctx.conn is not None
        pids.append(int(await ctx.conn.fetchval("SELECT pg_backend_pid()")))
        if prepare[0]:
            await ctx.conn.prepare("SELECT 1")

    async with scheduler:
        for _ in range(2):
            assert (await scheduler.run_now("p")).outcome is Outcome.SUCCESS
        prepare[0] = False
        for _ in range(2):
            assert (await scheduler.run_now("p")).outcome is Outcome.SUCCESS
    # each tick that prepared got a fresh connection after it; plain queries keep it
    assert pids[0] != pids[1] != pids[2] and pids[2] == pids[3]


# -- nothing a handler leaves in the session reaches the next tick --------------------------


async def test_a_temp_table_of_one_job_never_takes_another_jobs_writes(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(f"CREATE TABLE {pg_schema}.orders (x int)")
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    pids: set[int] = set()

    @scheduler.job(rare(), id="a")
    async def a(ctx: JobContext) -> None:
        assert ctx.conn is not None
        pids.add(await ctx.conn.fetchval("SELECT pg_backend_pid()"))
        await ctx.conn.execute("CREATE TEMP TABLE orders AS SELECT 1 AS x")

    @scheduler.job(rare(), id="b")
    async def b(ctx: JobContext) -> None:
        assert ctx.conn is not None
        pids.add(await ctx.conn.fetchval("SELECT pg_backend_pid()"))
        await ctx.conn.execute(f"SET LOCAL search_path = {pg_schema}")
        await ctx.conn.execute("INSERT INTO orders VALUES (2)")

    async with scheduler:
        assert (await scheduler.run_now("a")).outcome is Outcome.SUCCESS
        assert (await scheduler.run_now("b")).outcome is Outcome.SUCCESS
    assert len(pids) == 1, "the test needs both ticks on one pooled connection"
    assert await count(pg_conn, f"SELECT count(*) FROM {pg_schema}.orders") == 1


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TEMP TABLE scratch (x int)",
        "CREATE TEMP TABLE IF NOT EXISTS staging (x int); INSERT INTO staging VALUES (1)",
        "PREPARE mine AS SELECT 1",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
        "SELECT pg_advisory_lock(4242)",
        "LISTEN somewhere",
    ],
)
async def test_every_tick_starts_with_a_clean_session(
    pg_dsn: str, pg_schema: str, statement: str
) -> None:
    # Run twice on the same pooled connection: the second tick must not see the first's
    # leftovers (a plain CREATE TEMP TABLE or PREPARE would fail, a staging table would
    # carry rows from one tick to the next).
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    seen: list[int] = []

    @scheduler.job(rare(), id="leaver")
    async def leaver(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(statement)
        if "staging" in statement:
            seen.append(int(await ctx.conn.fetchval("SELECT count(*) FROM staging")))
        locks = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242"
        seen.append(int(await ctx.conn.fetchval(locks)))

    async with scheduler:
        first = await scheduler.run_now("leaver")
        second = await scheduler.run_now("leaver")
    assert first.outcome is Outcome.SUCCESS, first.error
    assert second.outcome is Outcome.SUCCESS, second.error
    if "staging" in statement:
        assert seen == [1, 0, 1, 0]
    elif "advisory" in statement:
        assert seen == [1, 1]


async def test_a_role_set_in_a_tick_does_not_outlive_it(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # RESET ALL keeps the role a handler set: the next tick would run as that role.
    role = f"{pg_schema}_role"
    await pg_conn.execute(f"CREATE ROLE {role}")
    try:
        scheduler = Scheduler(pg_dsn, schema=pg_schema)
        users: list[tuple[str, str]] = []

        @scheduler.job(rare(), id="who")
        async def who(ctx: JobContext) -> None:
            assert ctx.conn is not None
            row = await ctx.conn.fetchrow("SELECT current_user, session_user")
            assert row is not None
            users.append((row[0], row[1]))
            await ctx.conn.execute(f"SET ROLE {role}")

        async with scheduler:
            # the role may write ticklock's tables, so that the tick that set it commits
            await pg_conn.execute(
                f"GRANT USAGE ON SCHEMA {pg_schema} TO {role}; "
                f"GRANT ALL ON ALL TABLES IN SCHEMA {pg_schema} TO {role}; "
                f"GRANT ALL ON ALL SEQUENCES IN SCHEMA {pg_schema} TO {role}"
            )
            for _ in range(2):
                result = await scheduler.run_now("who")
                assert result.outcome is Outcome.SUCCESS, result.error
        assert users[1][0] == users[1][1], users
    finally:
        await pg_conn.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


# -- a handler that ends or loosens the tick's transaction never reports a success ---------


@pytest.mark.parametrize("ending", ["COMMIT AND CHAIN", "COMMIT; BEGIN", "ROLLBACK; BEGIN"])
async def test_a_handler_that_ends_the_transaction_around_the_lease_is_still_an_error(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, ending: str
) -> None:
    # The lease refuses such statements (below); a handler that reaches past it to the raw
    # connection frees the job's lock between the two transactions, and another replica runs
    # the job at the same time. The commit's own check keeps the first from reporting a
    # success for what it did unguarded.
    a = Scheduler(pg_dsn, schema=pg_schema, owner="a")
    b = Scheduler(pg_dsn, schema=pg_schema, owner="b")
    unlocked, b_done = anyio.Event(), anyio.Event()

    async def sneaky(ctx: JobContext) -> None:
        assert ctx.conn is not None
        if ctx.owner == "a":
            try:
                await cast(Any, ctx.conn)._con.execute(ending)  # around the lease
            finally:  # a COMMIT fails on the seal, and rolls back: the lock is free too
                unlocked.set()
            await b_done.wait()
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, $2)", ctx.slot, ctx.owner)

    for scheduler in (a, b):
        scheduler.add(sneaky, rare(), id="sneaky")
    async with a, b, anyio.create_task_group() as tg:
        results: dict[str, Any] = {}

        async def run_a() -> None:
            results["a"] = await a.run_now("sneaky")

        tg.start_soon(run_a)
        await unlocked.wait()
        results["b"] = await b.run_now("sneaky")
        b_done.set()
    assert results["b"].outcome is Outcome.SUCCESS
    if ending.startswith("COMMIT"):  # only ticklock's own COMMIT commits a tick (the seal)
        assert results["a"].outcome is Outcome.FAILURE
        assert "a COMMIT that is not ticklock's own" in results["a"].error
    else:
        assert results["a"].outcome is Outcome.ERROR
        assert "ended the tick's transaction" in results["a"].error
    owners = await pg_conn.fetch(
        f"SELECT owner FROM {pg_schema}.runs WHERE job_id = 'sneaky' AND outcome = 'success'"
    )
    assert [r["owner"] for r in owners] == ["b"]


async def _scs_off_then_commit(conn: Any) -> None:
    # With standard_conforming_strings off, \' is a quote: the COMMIT is a statement of its
    # own, which a reading with the setting on would take for part of a string.
    await conn.execute("SET LOCAL standard_conforming_strings = off")
    await conn.execute("SELECT 'a\\''; COMMIT AND CHAIN; SELECT 'b'")


async def _copy_out(conn: Any, query: str) -> None:
    await conn.copy_from_query(query, output=io.BytesIO())


ENDINGS = [
    pytest.param(
        lambda c: c.execute("COMMIT AND CHAIN"),
        "execute(): 'COMMIT AND CHAIN'",
        id="commit_and_chain",
    ),
    pytest.param(lambda c: c.execute("COMMIT; BEGIN"), "execute(): 'COMMIT'", id="commit_begin"),
    pytest.param(
        lambda c: c.execute("SELECT 1; ROLLBACK; BEGIN"),
        "execute(): 'ROLLBACK'",
        id="rollback_begin",
    ),
    pytest.param(lambda c: c.execute("/* done */ end"), "execute(): 'end'", id="end"),
    pytest.param(lambda c: c.execute("ABORT"), "execute(): 'ABORT'", id="abort"),
    pytest.param(
        lambda c: c.execute("PREPARE TRANSACTION 'x'"),
        "execute(): \"PREPARE TRANSACTION 'x'\"",
        id="prepare_transaction",
    ),
    pytest.param(
        lambda c: c.execute("SET TRANSACTION READ ONLY"),
        "execute(): 'SET TRANSACTION READ ONLY'",
        id="set_transaction",
    ),
    pytest.param(lambda c: c.fetch("COMMIT"), "fetch(): 'COMMIT'", id="fetch"),
    pytest.param(
        lambda c: c.fetchval(query="COMMIT"), "fetchval(): 'COMMIT'", id="fetchval_keyword"
    ),
    pytest.param(
        lambda c: c.executemany("COMMIT", [()]), "executemany(): 'COMMIT'", id="executemany"
    ),
    pytest.param(lambda c: c.prepare("COMMIT"), "prepare(): 'COMMIT'", id="prepare"),
    pytest.param(lambda c: c.cursor("COMMIT").fetch(1), "cursor(): 'COMMIT'", id="cursor"),
    pytest.param(
        lambda c: _copy_out(c, "SELECT 1) TO STDOUT; COMMIT; COPY (SELECT 1"),
        "copy_from_query(): 'COMMIT'",
        id="copy_from_query",
    ),
    pytest.param(_scs_off_then_commit, "execute(): 'COMMIT AND CHAIN'", id="backslash_quote"),
    pytest.param(lambda c: c.close(), "close() would end", id="close"),
    pytest.param(lambda c: c.terminate(), "terminate() would end", id="terminate"),
    pytest.param(lambda c: c.reset(), "reset() would end", id="reset"),
]


@pytest.mark.parametrize(("ending", "named"), ENDINGS)
async def test_a_statement_that_would_end_the_transaction_is_refused_and_the_lock_kept(
    pg_dsn: str,
    pg_schema: str,
    pg_conn: Any,
    table: str,
    ending: Callable[[Any], Any],
    named: str,
) -> None:
    a = Scheduler(pg_dsn, schema=pg_schema, owner="a")
    b = Scheduler(pg_dsn, schema=pg_schema, owner="b")
    refused, checked = anyio.Event(), anyio.Event()

    async def ender(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1, $2)", ctx.slot, ctx.owner)
        if ctx.owner == "a":
            try:
                await ending(ctx.db)
            finally:  # the handler goes on running: the lock must still be its own
                refused.set()
                await checked.wait()

    for scheduler in (a, b):
        scheduler.add(ender, rare(), id="ender")
    results: dict[str, Any] = {}
    async with a, b, anyio.create_task_group() as tg:

        async def run_a() -> None:
            results["a"] = await a.run_now("ender")

        tg.start_soon(run_a)
        await refused.wait()
        try:
            assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0  # nothing committed
            taken = await pg_conn.fetchval(
                "SELECT pg_try_advisory_xact_lock($1)", lock_key("default", "ender")
            )
            assert taken is False
            assert (await b.run_now("ender")).outcome is Outcome.LOCKED
        finally:
            checked.set()
    result = results["a"]
    assert result.outcome is Outcome.FAILURE
    assert result.error.startswith(f"StatementRefused: ctx.conn.{named}"), result.error
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0
    assert (
        await count(
            pg_conn,
            f"SELECT count(*) FROM {pg_schema}.runs WHERE job_id = 'ender' AND outcome = 'success'",
        )
        == 0
    )


async def test_savepoints_and_keywords_in_strings_reach_the_server(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="careful")
    async def careful(ctx: JobContext) -> None:
        await ctx.db.execute(
            "SAVEPOINT s; "
            f"INSERT INTO {table} VALUES (now(), 'undone'); "
            "ROLLBACK TO SAVEPOINT s; RELEASE SAVEPOINT s; "
            f"INSERT INTO {table} VALUES (now(), 'COMMIT; -- kept'); "
            f"INSERT INTO {table} VALUES (now(), $$ROLLBACK; BEGIN$$) /* ; END */"
        )
        await ctx.db.fetchval("SELECT $1::text", "END")

    async with scheduler:
        result = await scheduler.run_now("careful")
    assert result.outcome is Outcome.SUCCESS, result.error
    notes = await pg_conn.fetch(f"SELECT note FROM {table} ORDER BY note")
    assert [r["note"] for r in notes] == ["COMMIT; -- kept", "ROLLBACK; BEGIN"]


# -- the classifier against the server: what it refuses ends the transaction, what it allows
# keeps it (texts from test_statements.py) ---------------------------------------------------

# refused on purpose though the server keeps the transaction (or refuses the text itself)
_REFUSED_KEEPING = {
    "begin",  # a warning inside a transaction block, and what follows thinks it is alone
    "begin_isolation",
    "start_transaction",
    "set_transaction",  # READ ONLY would make ticklock's own commit fail
    "set_local_transaction",
    "set_session_transaction",
    "set_local_transaction_read_only",  # the same, by its setting
    "set_transaction_read_only",
    "commit_prepared",  # the server refuses it inside a transaction block
    "rollback_prepared",
    "begin_atomic_body",  # read as an END of its own
    "semicolon_in_parentheses",  # a syntax error for the server
}


_NO_STATEMENT = {"empty", "only_comments"}


async def ends_on_server(dsn: str, sql: str, setup: str | None = None) -> bool:
    """Whether ``sql``, sent in an open transaction, ends that transaction on the server."""
    con = await asyncpg.connect(dsn)
    try:
        if setup:
            await con.execute(setup)
        await con.execute("BEGIN")
        before = await con.fetchval("SELECT pg_current_xact_id()::text")
        with contextlib.suppress(asyncpg.PostgresError):
            await con.execute(sql)
        if not con.is_in_transaction():
            return True
        try:
            return bool(await con.fetchval("SELECT pg_current_xact_id()::text") != before)
        except asyncpg.InFailedSQLTransactionError:
            return False  # the text failed: the same transaction, aborted, lock kept
    finally:
        await con.close()


@pytest.mark.parametrize(
    ("sql", "refused"),
    [pytest.param(sql, True, id=name) for name, sql, _ in REFUSED if name not in _REFUSED_KEEPING]
    # asyncpg cannot send a text without a statement ("empty", "only_comments")
    + [pytest.param(sql, False, id=name) for name, sql in ALLOWED if name not in _NO_STATEMENT],
)
async def test_the_classifier_reads_a_text_as_the_server_does(
    pg_dsn: str, sql: str, refused: bool
) -> None:
    assert (transaction_control(sql) is not None) is refused
    assert await ends_on_server(pg_dsn, sql) is refused


@pytest.mark.parametrize(
    ("sql", "refused"),
    [("SELECT 'a\\'; COMMIT; --'", False), ("SELECT 'a\\''; COMMIT; SELECT 'b'", True)],
    ids=["hidden", "shown"],
)
async def test_with_standard_conforming_strings_off_too(
    pg_dsn: str, sql: str, refused: bool
) -> None:
    assert (transaction_control(sql, standard_strings=False) is not None) is refused
    setup = "SET standard_conforming_strings = off"
    assert await ends_on_server(pg_dsn, sql, setup) is refused


@pytest.mark.parametrize(
    "setting", ["transaction_timeout", "statement_timeout", "idle_in_transaction_session_timeout"]
)
async def test_a_handler_that_switches_off_the_paused_holder_bound_commits_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, setting: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    bounded_by_transaction = int(await pg_conn.fetchval("SHOW server_version_num")) >= 170000

    @scheduler.job(rare(), id="loose")
    async def loose(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'x')", ctx.slot)
        await ctx.conn.execute(f"SET LOCAL {setting} = 0")

    async with scheduler:
        result = await scheduler.run_now("loose")
    # what ticklock set is what must stay: transaction_timeout on 17+, the other two before
    if bounded_by_transaction == (setting == "transaction_timeout"):
        assert result.outcome is Outcome.ERROR
        assert result.error is not None and "server-side timeouts" in result.error
        assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0
    else:
        assert result.outcome is Outcome.SUCCESS


# -- a replica whose clock runs ahead cannot stop the fleet --------------------------------


async def test_a_replica_a_day_ahead_commits_nothing_and_the_fleet_runs_on(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    tomorrow = datetime.now(timezone.utc) + timedelta(days=1)
    ahead = Scheduler(pg_dsn, schema=pg_schema, owner="ahead", clock=ManualClock(tomorrow))
    healthy = Scheduler(pg_dsn, schema=pg_schema, owner="healthy")
    started: list[str] = []

    async def beat(ctx: JobContext) -> None:
        started.append(ctx.owner)  # a side effect outside the database (an email, say)

    for scheduler in (ahead, healthy):
        scheduler.add(beat, rare(), id="beat", timeout=5)
    async with ahead:
        result = await ahead.run_now("beat")
    assert result.outcome is Outcome.ERROR
    assert result.error is not None and "ahead of the database's" in result.error
    assert "the handler was not started" in result.error
    assert started == []  # refused where the lock is taken, before the handler
    row = await pg_conn.fetchrow(
        f"SELECT last_slot, last_end FROM {pg_schema}.jobs WHERE job_id = 'beat'"
    )
    # it moves neither the watermark nor the fixed delay
    assert row["last_slot"] is None and row["last_end"] is None, row
    async with healthy:
        assert (await healthy.run_now("beat")).outcome is Outcome.SUCCESS
        assert not any(h.overdue for h in healthy.health())


async def test_a_watermark_already_in_the_future_raises_the_alarm(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(every(60), id="stuck")
    async def stuck(ctx: JobContext) -> None:
        pass

    async with scheduler:  # creates the tables and the job's row
        pass
    await pg_conn.execute(
        f"UPDATE {pg_schema}.jobs SET last_slot = now() + interval '1 day', "
        "last_end = now() + interval '1 day', last_success_at = now() + interval '1 day' "
        "WHERE job_id = 'stuck'"
    )
    async with scheduler:
        health = {h.job_id: h for h in scheduler.health()}
    assert health["stuck"].overdue
    status = await anyio.run_process(
        [sys.executable, "-m", "ticklock", "status", "--dsn", pg_dsn, "--schema", pg_schema],
        check=False,
    )
    assert status.returncode == 1
    line = next(x for x in status.stdout.decode().splitlines() if x.startswith("stuck "))
    assert line.split()[1] == "FUTURE", line


# -- records that PostgreSQL would refuse are stored cleaned, or refused as a failure -------


async def test_a_failure_whose_text_postgres_cannot_store_is_still_recorded(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="odd")
    async def odd(ctx: JobContext) -> None:
        raise RuntimeError("nul\x00 and a lone \ud800 surrogate")

    async with scheduler:
        result = await scheduler.run_now("odd")
    assert result.outcome is Outcome.FAILURE
    row = await pg_conn.fetchrow(
        f"SELECT r.error, j.consecutive_failures FROM {pg_schema}.runs r "
        f"JOIN {pg_schema}.jobs j USING (namespace, job_id) WHERE job_id = 'odd'"
    )
    assert row["error"] == "RuntimeError: nul\\x00 and a lone \\ud800 surrogate"
    assert row["consecutive_failures"] == 1


@pytest.mark.parametrize(
    "report",
    [{"x": float("nan")}, {"x": float("inf")}, {"x": "nul\x00"}, {"x": "\udc00"}, ["\x00"]],
    ids=["nan", "infinity", "nul", "surrogate", "nul-in-list"],
)
async def test_a_report_jsonb_refuses_is_a_failure_of_the_handler(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, report: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="reporter")
    async def reporter(ctx: JobContext) -> Any:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'x')", ctx.slot)
        return report

    async with scheduler:
        result = await scheduler.run_now("reporter")
    assert result.outcome is Outcome.FAILURE
    assert result.error is not None and "not JSON-serialisable" in result.error
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0
    assert (
        await count(pg_conn, f"SELECT count(*) FROM {pg_schema}.runs WHERE outcome = 'failure'")
        == 1
    )


async def test_a_report_that_only_looks_like_an_escaped_nul_is_stored(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="literal")
    async def literal(ctx: JobContext) -> Any:
        return {"text": "\\u0000"}  # a backslash, then u0000: six plain characters

    async with scheduler:
        result = await scheduler.run_now("literal")
    assert result.outcome is Outcome.SUCCESS, result.error
    stored = await pg_conn.fetchval(f"SELECT report->>'text' FROM {pg_schema}.runs")
    assert stored == "\\u0000"


# -- found by review: what a careless handler can still do ---------------------------------


async def test_a_statement_made_in_one_tick_and_awaited_later_never_runs(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    # asyncpg sends a statement when its coroutine is awaited, not when it is made: one made
    # in a failing tick and awaited in the next would commit inside that tick's transaction.
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    kept: list[Any] = []

    @scheduler.job(rare(), id="a")
    async def a(ctx: JobContext) -> None:
        assert ctx.conn is not None
        kept.append(ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'a')", ctx.slot))
        raise RuntimeError("a fails: nothing of a may commit")

    @scheduler.job(rare(), id="b")
    async def b(ctx: JobContext) -> None:
        await kept[0]

    async with scheduler:
        assert (await scheduler.run_now("a")).outcome is Outcome.FAILURE
        result = await scheduler.run_now("b")
    assert result.outcome is not Outcome.SUCCESS
    assert "InterfaceError" in (result.error or ""), result.error
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0


@pytest.mark.parametrize("statement", ["DEALLOCATE ALL", "deallocate all", "COMMIT; DISCARD ALL"])
async def test_a_handler_that_drops_asyncpgs_statements_does_not_poison_the_pool(
    pg_dsn: str, pg_schema: str, statement: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="dropper")
    async def dropper(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.fetchval("SELECT $1::int", 1)  # a statement asyncpg caches
        await ctx.conn.execute(statement)

    @scheduler.job(rare(), id="after")
    async def after(ctx: JobContext) -> int:
        assert ctx.conn is not None
        return int(await ctx.conn.fetchval("SELECT $1::int", 2))

    async with scheduler:
        await scheduler.run_now("dropper")
        for _ in range(5):
            result = await scheduler.run_now("after")
            assert result.outcome is Outcome.SUCCESS, result.error


async def test_a_replica_a_few_seconds_ahead_does_not_stop_an_every_job(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    # The replica ahead fires each slot first (in the database's time), takes the lock and is
    # refused; its failure must not push the fixed delay of the healthy replica ahead of it.
    class Ahead(SystemClock):
        def now(self) -> datetime:
            return super().now() + timedelta(seconds=3)

    started: list[str] = []

    async def beat(ctx: JobContext) -> None:
        started.append(ctx.owner)  # a side effect outside the database (an HTTP call, say)
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, $2)", ctx.slot, ctx.owner)

    replicas = []
    for owner, clock in (("good", None), ("ahead", Ahead())):
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner, clock=clock)
        scheduler.add(beat, every(1), id="beat", timeout=0.5)
        replicas.append(scheduler)
    async with replicas[0], replicas[1]:
        await anyio.sleep(7)
    rows = await pg_conn.fetch(f"SELECT note FROM {table}")
    assert {r["note"] for r in rows} == {"good"}
    assert len(rows) >= 4, "the healthy replica stopped running the job"
    assert set(started) == {"good"}, "the replica ahead started its handler"


async def test_a_deeply_nested_report_is_a_failure(pg_dsn: str, pg_schema: str) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="deep")
    async def deep(ctx: JobContext) -> Any:
        report: Any = []
        for _ in range(5000):
            report = [report]
        return report

    async with scheduler:
        result = await scheduler.run_now("deep")
    assert result.outcome is Outcome.FAILURE
    assert result.error is not None and "not JSON-serialisable" in result.error


async def test_a_dropped_table_is_created_again_by_the_next_ticks(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(rare(), id="x")
    async def x(ctx: JobContext) -> None:
        pass

    async with scheduler:
        await pg_conn.execute(f"DROP TABLE {pg_schema}.runs")
        outcomes = [(await scheduler.run_now("x")).outcome for _ in range(3)]
    # the first tick fails on the missing table, unless the heartbeat created it again first
    assert outcomes[-1] is Outcome.SUCCESS, outcomes
    assert set(outcomes) <= {Outcome.ERROR, Outcome.SUCCESS}, outcomes
    assert await count(pg_conn, f"SELECT count(*) FROM {pg_schema}.runs") >= 1
