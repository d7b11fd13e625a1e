"""``ticklock.testing``: ``run_job`` (one handler, once, with a real context and no scheduler)
and ``ManualClock``'s cost in real time.

Local mode runs on asyncio and trio; with a connection (asyncio, as asyncpg), against a real
PostgreSQL: the transaction is rolled back unless ``commit=True``, and always on an error.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from ticklock import JobContext, ScheduleError, Scheduler, SchedulerStateError, every
from ticklock.testing import ManualClock, run_job

pytestmark = pytest.mark.anyio

SLOT = datetime(2026, 3, 29, 1, 17, tzinfo=timezone.utc)
BERLIN = timezone(timedelta(hours=2))


async def test_local_mode_gives_the_context_asked_for_and_returns_the_report() -> None:
    seen: list[JobContext] = []

    async def handler(ctx: JobContext) -> dict[str, int]:
        seen.append(ctx)
        return {"n": 3}

    before = datetime.now(timezone.utc)
    report = await run_job(
        handler,
        slot=datetime(2026, 3, 29, 3, 17, tzinfo=BERLIN),
        previous_success=SLOT - timedelta(days=1),
        attempt=2,
        job_id="nightly",
        timeout=30,
    )
    assert report == {"n": 3}
    (ctx,) = seen
    assert ctx.job_id == "nightly"
    assert ctx.slot == SLOT and ctx.slot.tzinfo is timezone.utc
    assert ctx.previous_success == SLOT - timedelta(days=1)
    assert ctx.attempt == 2
    assert ctx.conn is None
    assert before <= ctx.started_at <= datetime.now(timezone.utc)
    assert ctx.deadline == ctx.started_at + timedelta(seconds=30)
    assert (
        ctx.idempotency_key
        == JobContext(
            "nightly", SLOT, None, ctx.started_at, ctx.deadline, "x", None
        ).idempotency_key
    )


async def test_the_defaults_slot_now_first_attempt_no_watermark() -> None:
    seen: list[JobContext] = []

    async def handler(ctx: JobContext) -> None:
        seen.append(ctx)

    await run_job(handler)
    (ctx,) = seen
    assert (ctx.job_id, ctx.slot, ctx.previous_success, ctx.attempt, ctx.namespace) == (
        "test",
        ctx.started_at,
        None,
        1,
        "default",
    )
    assert ctx.deadline == ctx.started_at + timedelta(seconds=60)


async def test_ctx_db_in_local_mode_names_the_job() -> None:
    async def handler(ctx: JobContext) -> None:
        await ctx.db.execute("SELECT 1")

    message = (
        "job 'purge-expired': ctx.db is the tick's PostgreSQL connection, and this run has "
        "none: the scheduler is in local mode (no dsn or pool). Give the Scheduler a dsn, or "
        "use ctx.conn, which is None in local mode"
    )
    with pytest.raises(SchedulerStateError, match=f"^{re.escape(message)}$"):
        await run_job(handler, job_id="purge-expired")


async def test_the_handlers_exception_propagates() -> None:
    async def handler(ctx: JobContext) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="^boom$"):
        await run_job(handler)


async def test_a_handler_past_its_timeout_raises_timeout_error() -> None:
    async def handler(ctx: JobContext) -> None:
        await anyio.sleep_forever()

    with pytest.raises(TimeoutError):
        await run_job(handler, timeout=0.01)


async def test_a_report_the_scheduler_could_not_store_is_an_error() -> None:
    async def handler(ctx: JobContext) -> dict[str, datetime]:
        return {"at": ctx.slot}

    with pytest.raises(
        ValueError,
        match=r"^run_job: job 'test': the report is not JSON-serialisable \(Object of type "
        r"datetime is not JSON serializable\); the scheduler would record the run as a failure$",
    ):
        await run_job(handler)


async def _noop(ctx: JobContext) -> None:
    pass


def _sync(ctx: JobContext) -> None:
    pass


BAD = [
    pytest.param(
        {"slot": datetime(2026, 1, 1)},
        r"^run_job: slot must be an aware datetime, got datetime\.datetime\(2026, 1, 1, 0, 0\)$",
        id="naive_slot",
    ),
    pytest.param(
        {"previous_success": "2026-01-01"},
        r"^run_job: previous_success must be an aware datetime, got '2026-01-01'$",
        id="previous_success_a_string",
    ),
    pytest.param(
        {"attempt": 0}, r"^run_job: attempt must be an int of at least 1, got 0$", id="attempt_0"
    ),
    pytest.param(
        {"commit": True},
        r"^run_job: commit=True needs conn or dsn \(local mode has no transaction\)$",
        id="commit_without_a_connection",
    ),
    pytest.param(
        {"commit": "yes"}, r"^run_job: commit must be True or False, got 'yes'$", id="commit_str"
    ),
    pytest.param(
        {"dsn": "postgresql://db/x", "conn": object()},
        r"^run_job: give conn or dsn, not both$",
        id="conn_and_dsn",
    ),
    pytest.param(
        {"timeout": 0}, r"^timeout must be positive and finite, got 0 s$", id="timeout_zero"
    ),
    pytest.param(
        {"job_id": ""},
        r"^job_id must be a non-empty string of at most 200 characters, got ''$",
        id="empty_job_id",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
async def test_bad_input_is_refused_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await run_job(_noop, **kwargs)


async def test_a_plain_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^run_job: handler must be an async function, got "):
        await run_job(_sync)  # type: ignore[arg-type]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_connection_on_trio_is_refused_with_the_fix() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"^run_job: conn and dsn need asyncio, as asyncpg does, and this test runs on "
        r"another event loop \(trio\?\): pin it to asyncio, e\.g\. with a fixture "
        r'\'anyio_backend\' that returns "asyncio"$',
    ):
        await run_job(_noop, dsn="postgresql://u@db/x")


async def test_a_bad_dsn_is_refused_before_connecting() -> None:
    with pytest.raises(ScheduleError, match=r"^dsn has the SQLAlchemy form"):
        await run_job(_noop, dsn="postgresql+asyncpg://u@db/x")


# -- with PostgreSQL -------------------------------------------------------------------------


@pytest.fixture
async def table(pg_conn: Any, pg_schema: str) -> str:
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(f"CREATE TABLE {pg_schema}.items (slot timestamptz)")
    return f"{pg_schema}.items"


def writer(table: str) -> Any:
    async def write(ctx: JobContext) -> dict[str, bool]:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1)", ctx.slot)
        return {"in_transaction": ctx.db.is_in_transaction()}

    return write


async def count(conn: Any, table: str) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {table}"))


@pytest.mark.postgres
async def test_on_a_connection_the_write_is_rolled_back_by_default(
    pg_conn: Any, table: str
) -> None:
    report = await run_job(writer(table), conn=pg_conn, slot=SLOT)
    assert report == {"in_transaction": True}
    assert await count(pg_conn, table) == 0
    assert not pg_conn.is_in_transaction()


@pytest.mark.postgres
async def test_commit_true_keeps_the_write(pg_conn: Any, table: str) -> None:
    await run_job(writer(table), conn=pg_conn, slot=SLOT, commit=True)
    assert await pg_conn.fetchval(f"SELECT slot FROM {table}") == SLOT


@pytest.mark.postgres
async def test_a_failing_handler_is_rolled_back_even_with_commit(pg_conn: Any, table: str) -> None:
    async def write_then_fail(ctx: JobContext) -> None:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1)", ctx.slot)
        raise RuntimeError("after the write")

    with pytest.raises(RuntimeError, match="^after the write$"):
        await run_job(write_then_fail, conn=pg_conn, commit=True)
    assert await count(pg_conn, table) == 0
    assert not pg_conn.is_in_transaction()


@pytest.mark.postgres
async def test_from_a_dsn_it_connects_and_closes(pg_dsn: str, pg_conn: Any, table: str) -> None:
    async def write(ctx: JobContext) -> int:
        await ctx.db.execute(f"INSERT INTO {table} VALUES ($1)", ctx.slot)
        return int(await ctx.db.fetchval("SELECT pg_backend_pid()"))

    pid = await run_job(write, dsn=pg_dsn)
    assert await count(pg_conn, table) == 0
    pid = await run_job(write, dsn=pg_dsn, commit=True)
    assert await count(pg_conn, table) == 1
    alive = await pg_conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)
    assert alive == 0


# -- ManualClock ----------------------------------------------------------------------------


async def test_a_virtual_day_of_minutely_runs_takes_no_real_time() -> None:
    """Settling after each deadline must not sleep: anyio's asyncio wait_all_tasks_blocked()
    naps 0.1 s a try, which would make this take 144 s instead of well under a second."""
    clock = ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc))
    scheduler = Scheduler(clock=clock, shutdown_grace=1)
    slots: list[datetime] = []

    @scheduler.job(every(60), id="minutely")
    async def minutely(ctx: JobContext) -> None:
        slots.append(ctx.slot)

    started = time.perf_counter()
    async with scheduler:
        await clock.advance(timedelta(days=1))
    assert time.perf_counter() - started < 10
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert slots == [start + timedelta(minutes=m) for m in range(24 * 60 + 1)]
