"""SQLAlchemy 2.0 (asyncio) in the tick's transaction, against a real PostgreSQL (G4 for
``ticklock.sqlalchemy.session`` and ``connection``)."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import weakref
from datetime import datetime
from typing import Any

import anyio
import pytest
from sqlalchemy import String, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import ticklock.sqlalchemy
from helpers import PGBOUNCER
from ticklock import JobContext, Outcome, Scheduler, SchedulerStateError, every
from ticklock.testing import run_job

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

HOURLY = every(3600, initial_delay=3000)  # runs only when run_now() asks
HELD = (  # the job's lock in its schema: the one advisory lock a tick holds exclusively
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
    "AND objsubid = 1 AND mode = 'ExclusiveLock'"
)


async def notes(pg_conn: Any, table: str) -> list[str]:
    return [r["note"] for r in await pg_conn.fetch(f"SELECT note FROM {table} ORDER BY note")]


async def last_slot(pg_conn: Any, schema: str, job_id: str) -> datetime | None:
    value = await pg_conn.fetchval(f"SELECT last_slot FROM {schema}.jobs WHERE job_id = $1", job_id)
    return value  # type: ignore[no-any-return]


async def test_a_write_through_the_session_commits_with_the_watermark(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="writer")
    async def writer(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(
                text(f"INSERT INTO {table} VALUES (:slot, 'sa')"), {"slot": ctx.slot}
            )
            # the same transaction as ctx.db: the session sees the tick's lock
            assert await session.scalar(text(HELD)) == 1

    async with scheduler:
        result = await scheduler.run_now("writer")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert await notes(pg_conn, table) == ["sa"]
    assert await last_slot(pg_conn, pg_schema, "writer") == result.slot


async def test_a_handler_that_raises_after_writing_through_the_session_leaves_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="crashy")
    async def crashy(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'sa')"))
        # the block committed the session: into the tick, which this failure rolls back
        raise RuntimeError("after the write")

    async with scheduler:
        result = await scheduler.run_now("crashy")
    assert result.outcome is Outcome.FAILURE
    assert result.error == "RuntimeError: after the write"
    assert await notes(pg_conn, table) == []
    assert await last_slot(pg_conn, pg_schema, "crashy") is None


async def test_session_commit_then_raise_commits_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="committer")
    async def committer(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'sa')"))
            await session.commit()
            raise RuntimeError("after the commit")

    async with scheduler:
        result = await scheduler.run_now("committer")
    assert result.outcome is Outcome.FAILURE
    assert result.error == "RuntimeError: after the commit"
    assert await notes(pg_conn, table) == []
    assert await last_slot(pg_conn, pg_schema, "committer") is None


async def test_a_timeout_leaves_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(every(3600, initial_delay=3000), id="slow", timeout=0.5)
    async def slow(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'sa')"))
            await session.commit()
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'sa 2')"))
            await anyio.sleep(5)

    @scheduler.job(every(3600, initial_delay=3000), id="stuck", timeout=0.5)
    async def stuck(ctx: JobContext) -> None:  # cut off inside a statement
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'stuck')"))
            await session.execute(text("SELECT pg_sleep(5)"))

    with caplog.at_level(logging.WARNING, logger="sqlalchemy"):
        async with scheduler:
            result = await scheduler.run_now("slow")
            stuck_result = await scheduler.run_now("stuck")
    assert result.outcome is Outcome.TIMEOUT
    assert stuck_result.outcome is Outcome.TIMEOUT
    assert await notes(pg_conn, table) == []
    assert await last_slot(pg_conn, pg_schema, "slow") is None
    assert [r.getMessage() for r in caplog.records if r.name.startswith("sqlalchemy")] == []


async def test_session_rollback_does_not_end_the_tick(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="undo")
    async def undo(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES (now(), 'db before')")
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'kept')"))
            await session.commit()
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'undone')"))
            await session.rollback()  # back to the last commit; the tick goes on
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'after')"))
        await ctx.db.execute(f"INSERT INTO {table} VALUES (now(), 'db after')")

    async with scheduler:
        result = await scheduler.run_now("undo")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert await notes(pg_conn, table) == ["after", "db after", "db before", "kept"]
    assert await last_slot(pg_conn, pg_schema, "undo") == result.slot


async def test_a_commit_in_sql_through_the_session_is_refused_and_ends_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="sneaky")
    async def sneaky(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'sa')"))
            await session.execute(text("COMMIT"))

    async with scheduler:
        result = await scheduler.run_now("sneaky")
    assert result.outcome is Outcome.FAILURE
    assert result.error is not None and "StatementRefused" in result.error
    assert await notes(pg_conn, table) == []


class Base(DeclarativeBase):
    pass


def report_model(schema: str) -> type[Any]:
    class Report(Base):
        __tablename__ = "reports"
        __table_args__ = {"schema": schema}
        id: Mapped[int] = mapped_column(primary_key=True)
        name: Mapped[str] = mapped_column(String(50))
        runs: Mapped[int]

    return Report


def key_model(schema: str) -> type[Any]:
    class Key(Base):
        __tablename__ = "keys"
        __table_args__ = {"schema": schema}
        k: Mapped[str] = mapped_column(primary_key=True)

    return Key


async def test_an_orm_model_round_trip(pg_dsn: str, pg_schema: str, pg_conn: Any) -> None:
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(
        f"CREATE TABLE {pg_schema}.reports (id serial PRIMARY KEY, name varchar(50), runs int)"
    )
    Report = report_model(pg_schema)
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="orm")
    async def orm(ctx: JobContext) -> dict[str, int]:
        async with ticklock.sqlalchemy.session(ctx) as session:
            report = await session.scalar(select(Report).where(Report.name == "nightly"))
            if report is None:
                report = Report(name="nightly", runs=0)
                session.add(report)
            report.runs += 1
            await session.flush()
            return {"id": report.id, "runs": report.runs}

    async with scheduler:
        first = await scheduler.run_now("orm")
        second = await scheduler.run_now("orm")
    assert first.outcome is Outcome.SUCCESS, first.error
    assert second.outcome is Outcome.SUCCESS, second.error
    assert first.report["runs"] == 1 and second.report == {"id": first.report["id"], "runs": 2}
    rows = await pg_conn.fetch(f"SELECT name, runs FROM {pg_schema}.reports")
    assert [tuple(r) for r in rows] == [("nightly", 2)]
    Base.metadata.remove(Report.__table__)


async def test_the_core_connection_commits_and_rolls_back_within_the_tick(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="core")
    async def core(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.connection(ctx) as conn:
            await conn.execute(text(f"INSERT INTO {table} VALUES (now(), 'undone')"))
            await conn.rollback()
            await conn.execute(text(f"INSERT INTO {table} VALUES (now(), 'kept')"))
            await conn.commit()
            await conn.execute(text(f"INSERT INTO {table} VALUES (now(), 'at the end')"))

    async with scheduler:
        result = await scheduler.run_now("core")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert await notes(pg_conn, table) == ["at the end", "kept"]


async def test_a_session_used_after_its_tick_fails_clearly(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    kept: list[AsyncSession] = []

    @scheduler.job(HOURLY, id="keeper")
    async def keeper(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'in the tick')"))
            kept.append(session)

    message = (
        r"^job 'keeper': this SQLAlchemy session was bound to one tick by "
        r"ticklock\.sqlalchemy\.session\(ctx\), and its 'async with' block has ended: use it "
        r"only inside the block, and open a new one in each run$"
    )
    async with scheduler:
        result = await scheduler.run_now("keeper")
        assert result.outcome is Outcome.SUCCESS, result.error
        with pytest.raises(SchedulerStateError, match=message):
            await kept[0].execute(text(f"INSERT INTO {table} VALUES (now(), 'after')"))
        assert (await scheduler.run_now("keeper")).outcome is Outcome.SUCCESS
    assert await notes(pg_conn, table) == ["in the tick", "in the tick"]


async def test_nothing_of_sqlalchemy_outlives_its_tick(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    made: list[weakref.ref[Any]] = []

    @scheduler.job(HOURLY, id="many")
    async def many(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'x')"))
            made.extend(weakref.ref(o) for o in (session, session.bind, session.sync_session))

    async with scheduler:
        for _ in range(20):
            assert (await scheduler.run_now("many")).outcome is Outcome.SUCCESS
        gc.collect()
        assert len(made) == 60 and [ref() for ref in made] == [None] * 60
        sessions = await pg_conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        assert sessions <= 2  # the scheduler's own: none kept per tick
    assert len(await notes(pg_conn, table)) == 20


@pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed")
async def test_through_a_transaction_mode_pgbouncer(
    bouncer: str, pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(bouncer, schema=pg_schema)

    @scheduler.job(HOURLY, id="bounced")
    async def bounced(ctx: JobContext) -> int:
        async with ticklock.sqlalchemy.session(ctx) as session:
            for n in range(3):  # the same statement again: SQLAlchemy's cache of statements
                await session.execute(
                    text(f"INSERT INTO {table} VALUES (:slot, :note)"),
                    {"slot": ctx.slot, "note": f"{ctx.slot:%S.%f} {n}"},
                )
            await session.commit()
            count = await session.scalar(
                text(f"SELECT count(*) FROM {table} WHERE slot = :slot"), {"slot": ctx.slot}
            )
            return int(count or 0)

    async with scheduler:
        results = [await scheduler.run_now("bounced") for _ in range(4)]
    assert [(r.outcome, r.report) for r in results] == [(Outcome.SUCCESS, 3)] * 4
    assert len(await notes(pg_conn, table)) == 12


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_local_mode_gives_a_clear_error() -> None:
    scheduler = Scheduler()

    @scheduler.job(HOURLY, id="local")
    async def local(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx):
            pass

    async with scheduler:
        result = await scheduler.run_now("local")
    assert result.outcome is Outcome.FAILURE
    assert result.error == (
        "SchedulerStateError: job 'local': ticklock.sqlalchemy.session() binds to the tick's "
        "PostgreSQL transaction, and this run has none: the scheduler is in local mode (no "
        "dsn or pool). Give the Scheduler a dsn"
    )


def test_without_sqlalchemy_the_error_names_the_extra() -> None:
    code = (
        "import sys, anyio, datetime as d\n"
        "sys.modules['sqlalchemy'] = None\n"
        "import ticklock, ticklock.sqlalchemy\n"
        "now = d.datetime.now(d.timezone.utc)\n"
        "ctx = ticklock.JobContext('j', now, None, now, now, 'me', None)\n"
        "async def main():\n"
        "    async with ticklock.sqlalchemy.session(ctx): pass\n"
        "try:\n"
        "    anyio.run(main)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("install it with pip install 'ticklock[sqlalchemy]'")


def test_importing_ticklock_sqlalchemy_does_not_load_sqlalchemy() -> None:
    code = "import sys, ticklock.sqlalchemy; print('sqlalchemy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_begin_nested_and_a_different_isolation_level(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="nested")
    async def nested(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'outer')"))
            async with session.begin_nested():
                await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'nested')"))
            inner = await session.begin_nested()
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'undone')"))
            await inner.rollback()

    @scheduler.job(HOURLY, id="serializable")
    async def serializable(ctx: JobContext) -> None:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.connection(execution_options={"isolation_level": "SERIALIZABLE"})
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'serializable')"))

    async with scheduler:
        result = await scheduler.run_now("nested")
        refused = await scheduler.run_now("serializable")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert await notes(pg_conn, table) == ["nested", "outer"]
    assert refused.outcome is Outcome.FAILURE
    assert refused.error is not None and "takes no isolation" in refused.error


async def test_run_job_gives_the_session_its_transaction(
    pg_dsn: str, pg_conn: Any, table: str
) -> None:
    async def handler(ctx: JobContext) -> int:
        async with ticklock.sqlalchemy.session(ctx) as session:
            await session.execute(text(f"INSERT INTO {table} VALUES (now(), 'tested')"))
            await session.commit()
            return int(await session.scalar(text(f"SELECT count(*) FROM {table}")) or 0)

    assert await run_job(handler, dsn=pg_dsn) == 1
    assert await notes(pg_conn, table) == []  # run_job rolled its transaction back
    assert await run_job(handler, dsn=pg_dsn, commit=True) == 1
    assert await notes(pg_conn, table) == ["tested"]


async def test_a_commit_that_fails_as_the_block_ends_rolls_back_to_its_savepoint_only(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(f"CREATE TABLE {pg_schema}.keys (k text PRIMARY KEY)")
    Key = key_model(pg_schema)
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="dup")
    async def dup(ctx: JobContext) -> str:
        await ctx.db.execute(f"INSERT INTO {pg_schema}.keys VALUES ('first')")
        try:
            async with ticklock.sqlalchemy.session(ctx) as session:
                session.add_all([Key(k="second"), Key(k="first")])  # flushed by the commit
        except IntegrityError as exc:
            caught = "unique" if "duplicate key" in str(exc) else str(exc)
        # the tick's transaction is usable again: only the session's savepoint was undone
        await ctx.db.execute(f"INSERT INTO {pg_schema}.keys VALUES ('third')")
        return caught

    async with scheduler:
        result = await scheduler.run_now("dup")
    assert result.outcome is Outcome.SUCCESS, result.error
    assert result.report == "unique"
    keys = [r["k"] for r in await pg_conn.fetch(f"SELECT k FROM {pg_schema}.keys ORDER BY k")]
    assert keys == ["first", "third"]
    Base.metadata.remove(Key.__table__)


async def test_a_session_per_batch_commits_with_its_batch(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(HOURLY, id="batched", max_batches=3)
    async def batched(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            async with ticklock.sqlalchemy.session(ctx) as session:
                await session.execute(
                    text(f"INSERT INTO {table} VALUES (now(), :note)"),
                    {"note": f"batch {batch.number}"},
                )
            if batch.number == 3:
                raise RuntimeError("the third batch fails")

    async with scheduler:
        result = await scheduler.run_now("batched")
    assert result.outcome is Outcome.FAILURE and result.batches == 2
    assert await notes(pg_conn, table) == ["batch 1", "batch 2"]
