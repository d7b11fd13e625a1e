"""A rolling deploy across a schema upgrade, against a real PostgreSQL: a run of the previous
release holds ticklock's tables while ``ticklock migrate`` (or a starting replica) upgrades
them. The upgrade waits for it without holding up the other sessions' statements, says so in
one line, and succeeds once the run ends."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import anyio
import asyncpg
import pytest

from ticklock import JobContext, Scheduler, every
from ticklock._backends.postgres.schema import VERSION, migrate

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

BOUND = 2.0
"""Seconds another session's statement on the jobs table may wait at most (a correctness
bound: a queued DDL must never hold the fleet up for long, whatever the run in flight does)."""
WAITING = (
    "ticklock: waiting for a run in flight to end before upgrading the schema (its "
    "transaction holds ticklock's tables; the running replicas are not held up) ...\n"
)


async def older_schema(conn: Any, schema: str) -> None:
    """ticklock's tables as a release of schema version 6 left them."""
    await migrate(conn, schema)
    await conn.execute(
        f"ALTER TABLE {schema}.jobs DROP COLUMN spec; DROP TABLE IF EXISTS {schema}.seals; "
        f"DROP FUNCTION IF EXISTS {schema}.seal_check(); "
        f"UPDATE {schema}.schema_version SET version = 6"
    )


async def old_tick(dsn: str, schema: str) -> Any:
    """A connection whose open transaction read the jobs table, as a tick in flight has."""
    holder = await asyncpg.connect(dsn)
    await holder.execute(f"BEGIN; SELECT count(*) FROM {schema}.jobs")
    return holder


async def probe(dsn: str, schema: str, latencies: list[float], stop: anyio.Event) -> None:
    """Another replica's statements on the jobs table, every 50 ms, each one's latency."""
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            began = time.monotonic()
            await conn.fetchval(f"SELECT count(*) FROM {schema}.jobs")
            latencies.append(time.monotonic() - began)
            await anyio.sleep(0.05)
    finally:
        await conn.close()


async def ticklock_migrate(dsn: str, schema: str, *extra: str) -> tuple[int, str, str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "ticklock", "migrate", "--dsn", dsn, "--schema", schema, *extra],
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_migrate_waits_for_a_run_in_flight_without_holding_up_the_fleet(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    await older_schema(pg_conn, pg_schema)
    holder = await old_tick(pg_dsn, pg_schema)
    latencies: list[float] = []
    stop = anyio.Event()
    outcome: list[tuple[int, str, str]] = []
    migrated = anyio.Event()

    async def run_migrate() -> None:
        outcome.append(await ticklock_migrate(pg_dsn, pg_schema))
        migrated.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe, pg_dsn, pg_schema, latencies, stop)
        tg.start_soon(run_migrate)
        await anyio.sleep(3)  # the old release's run goes on meanwhile
        assert not outcome, outcome  # migrate waits for it
        await holder.execute("ROLLBACK")
        with anyio.fail_after(10):
            await migrated.wait()
        await anyio.sleep(0.2)
        stop.set()
    await holder.close()
    assert max(latencies) < BOUND, f"a statement on jobs waited {max(latencies):.1f} s"
    code, out, err = outcome[0]
    assert (code, out, err) == (
        0,
        f"ticklock: upgraded ticklock's tables in schema {pg_schema!r} to version {VERSION}\n",
        WAITING,
    )
    version = await pg_conn.fetchval(f"SELECT version FROM {pg_schema}.schema_version")
    assert version == VERSION


async def test_migrate_gives_up_after_its_wait_with_one_clear_line(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    await older_schema(pg_conn, pg_schema)
    holder = await old_tick(pg_dsn, pg_schema)
    try:
        code, out, err = await ticklock_migrate(pg_dsn, pg_schema, "--wait", "1")
    finally:
        await holder.close()
    assert (code, out) == (2, "")
    assert err == WAITING + (
        f"ticklock: the upgrade of ticklock's tables in schema {pg_schema!r} waited 1 s for the "
        "runs in flight to end (a run's transaction holds the tables it read until it ends) "
        "and changed nothing; it can be run again: run 'ticklock migrate' again, or give "
        "--wait longer\n"
    )
    assert await pg_conn.fetchval(f"SELECT version FROM {pg_schema}.schema_version") == 6


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_starting_replica_reports_the_wait_as_a_warning_and_runs_once_it_ends(
    pg_dsn: str, pg_schema: str, pg_conn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    await older_schema(pg_conn, pg_schema)
    holder = await old_tick(pg_dsn, pg_schema)
    ran = anyio.Event()
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="new")

    @scheduler.job(every(0.5), id="quick", timeout=0.3)
    async def quick(ctx: JobContext) -> None:
        ran.set()

    with caplog.at_level(logging.INFO):
        async with scheduler:
            await anyio.sleep(3)  # its ticks meanwhile try to migrate too, within 0.3 s each
            assert not ran.is_set()
            await holder.execute("ROLLBACK")
            with anyio.fail_after(30):  # the database's backoff tries again
                await ran.wait()
    await holder.close()
    records = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    waits = [r for r in records if r[2].startswith("waiting for the runs in flight to end")]
    assert waits and waits[0][1] == "WARNING", records
    assert all(level in ("INFO", "WARNING") for _, level, _ in waits)
    # each tick meanwhile (the job's and the built-in retention's, which fires at start) is
    # recorded as an 'error' run, as during an outage; the wait is not reported as a problem
    states = [r for r in records if not r[2].startswith(("run quick ", "run ticklock.retention "))]
    assert not [r for r in states if r[1] in ("ERROR", "CRITICAL")], states
    assert not [r for r in records if "Resetting connection" in r[2]], records


async def test_the_upgrade_from_the_previous_release_never_waits_for_its_runs(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # Version 8 adds the seals table and touches no table a run of version 7 holds.
    await migrate(pg_conn, pg_schema)
    await pg_conn.execute(
        f"DROP TABLE {pg_schema}.seals; DROP FUNCTION {pg_schema}.seal_check(); "
        f"UPDATE {pg_schema}.schema_version SET version = 7"
    )
    holder = await old_tick(pg_dsn, pg_schema)
    try:
        with anyio.fail_after(10):
            code, out, err = await ticklock_migrate(pg_dsn, pg_schema, "--wait", "1")
    finally:
        await holder.close()
    assert (code, out, err) == (
        0,
        f"ticklock: upgraded ticklock's tables in schema {pg_schema!r} to version {VERSION}\n",
        "",
    )
