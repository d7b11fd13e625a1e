"""Through a real PgBouncer in transaction-pooling mode: the transaction-level lock still holds.

Runs when the ``pgbouncer`` binary is installed (``.ci/run`` installs Debian's package).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import anyio
import asyncpg
import pytest

from helpers import PGBOUNCER, Replicas, eventually
from replica_app import LOG_TABLE
from ticklock import JobContext, Outcome, Scheduler, every

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.postgres,
    pytest.mark.skipif(PGBOUNCER is None, reason="pgbouncer is not installed"),
]


async def test_two_replicas_through_pgbouncer_transaction_pooling(
    bouncer: str, pg_dsn: str, pg_schema: str
) -> None:
    direct = await asyncpg.connect(pg_dsn)
    await direct.execute(f"CREATE SCHEMA {pg_schema}")
    await direct.execute(f"CREATE TABLE {pg_schema}.log (slot timestamptz, owner text)")
    pools = [
        await asyncpg.create_pool(bouncer, statement_cache_size=0, min_size=1, max_size=4)
        for _ in range(2)
    ]
    gate, holding = anyio.Event(), anyio.Event()

    def build(owner: str, pool: Any) -> Scheduler:
        scheduler = Scheduler(pool=pool, schema=pg_schema, owner=owner)

        @scheduler.job(every(0.2), id="beat")
        async def beat(ctx: JobContext) -> None:
            assert ctx.conn is not None
            await ctx.conn.execute(
                f"INSERT INTO {pg_schema}.log VALUES ($1, $2)", ctx.slot, ctx.owner
            )

        @scheduler.job(every(3600), id="hold")
        async def hold(ctx: JobContext) -> None:
            holding.set()
            await gate.wait()

        return scheduler

    try:
        a, b = build("a", pools[0]), build("b", pools[1])
        async with a, b:

            async def held() -> bool:
                return holding.is_set()

            await eventually(held, 10, "a run to hold the lock through pgbouncer")
            assert (await a.run_now("hold")).outcome is Outcome.LOCKED
            assert (await b.run_now("hold")).outcome is Outcome.LOCKED
            gate.set()
            await anyio.sleep(2)
        rows = await direct.fetch(f"SELECT slot, owner FROM {pg_schema}.log")
        assert len(rows) >= 5
        assert len(rows) == len({r["slot"] for r in rows}), "a slot committed twice"
    finally:
        for pool in pools:
            await pool.close()
        await direct.close()


async def poison(bouncer: str, sessions: int = 10) -> None:
    """Leave asyncpg's first named statement in every server session behind the bouncer, as
    any asyncpg client with its statement cache on does (the next one to name a statement
    the same way on that session fails)."""
    conns = [await asyncpg.connect(bouncer) for _ in range(sessions)]
    try:
        trs = [conn.transaction() for conn in conns]
        for tr in trs:  # all open at once: each holds a server session of its own
            await tr.start()
        for conn in conns:
            await conn.fetchval("SELECT $1::int", 1)
        for tr in trs:
            await tr.commit()
    finally:
        for conn in conns:
            conn.terminate()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ticklock", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_replicas_and_the_cli_work_through_pgbouncer_from_a_plain_dsn(
    bouncer: str, pg_schema: str, pg_conn: Any, tmp_path: Path
) -> None:
    # What a user writes first: the bouncer's address as the DSN, no pool, no options.
    await poison(bouncer)
    migrated = cli("migrate", "--dsn", bouncer, "--schema", pg_schema)
    assert migrated.returncode == 0, migrated.stderr
    await pg_conn.execute(LOG_TABLE.format(schema=pg_schema))
    fleet = Replicas(bouncer, pg_schema, tmp_path, "replica_app")
    try:
        for owner in ("r1", "r2", "r3"):
            fleet.start(owner, "fleet")
        await anyio.sleep(5)
        for owner in ("r1", "r2", "r3"):
            assert fleet.stop(owner) == 0, fleet.output(owner)
            output = fleet.output(owner)
            assert "outcome=error" not in output and "Traceback" not in output, output
    finally:
        fleet.kill_all()
    rows = await pg_conn.fetch(f"SELECT job, slot FROM {pg_schema}.log WHERE job = 'fast'")
    assert len(rows) >= 10
    assert len(rows) == len({r["slot"] for r in rows}), "a slot committed twice"
    errors = await pg_conn.fetchval(
        f"SELECT count(*) FROM {pg_schema}.runs WHERE outcome IN ('error', 'failure')"
    )
    assert errors == 0
    status = cli("status", "--dsn", bouncer, "--schema", pg_schema)
    assert status.returncode in (0, 1), status.stderr  # 1: a job overdue, not an error
    assert "fast" in status.stdout, status.stdout


async def test_a_prepare_a_handler_leaves_behind_the_bouncer_reaches_no_later_tick(
    bouncer: str, pg_schema: str
) -> None:
    # Retiring the client connection does not end the bouncer's server session: the reset
    # deallocates there (ticklock prepares nothing by name behind a pooler).
    scheduler = Scheduler(bouncer, schema=pg_schema)

    @scheduler.job(every(3600, initial_delay=3000), id="prepares")
    async def prepares(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute("PREPARE p1 AS SELECT 1")

    async with scheduler:
        for _ in range(4):
            result = await scheduler.run_now("prepares")
            assert result.outcome is Outcome.SUCCESS, result.error


async def test_only_ticklocks_own_commit_commits_a_tick_through_pgbouncer(
    bouncer: str, pg_schema: str, pg_conn: Any
) -> None:
    # The seal's token is set with SET LOCAL in the transaction that COMMITs it: the same
    # server session behind a transaction-mode pooler, for a batch's commit as for a tick's.
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(f"CREATE TABLE {pg_schema}.log (slot timestamptz, note text)")
    scheduler = Scheduler(bouncer, schema=pg_schema)
    insert = f"INSERT INTO {pg_schema}.log VALUES ($1, $2)"

    @scheduler.job(every(3600, initial_delay=3000), id="sneaky")
    async def sneaky(ctx: JobContext) -> None:
        await ctx.db.execute(insert, ctx.slot, "sneaky")
        await cast(Any, ctx.db)._con.execute("COMMIT")  # past ctx.db's checks

    @scheduler.job(every(3600, initial_delay=3000), id="batched", max_batches=2)
    async def batched(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            await batch.db.execute(insert, ctx.slot, f"batch {batch.number}")

    async with scheduler:
        refused = await scheduler.run_now("sneaky")
        committed = await scheduler.run_now("batched")
    assert refused.outcome is Outcome.FAILURE
    assert "a COMMIT that is not ticklock's own" in (refused.error or "")
    assert (committed.outcome, committed.batches) == (Outcome.SUCCESS, 2), committed.error
    notes = await pg_conn.fetch(f"SELECT note FROM {pg_schema}.log ORDER BY note")
    assert [r["note"] for r in notes] == ["batch 1", "batch 2"]
