"""The app that replica-process tests run: ``python -m ticklock run replica_app:scheduler``.

Configured by environment variables: ``REPLICA_SCENARIO``, ``REPLICA_OWNER``,
``REPLICA_SCHEMA``, ``REPLICA_MARKER`` (a file touched when a handler holds its lock) and
``REPLICA_SHIFT`` (seconds added to the wall clock, to bring a cron minute close), and for
scenario "deploy" ``REPLICA_SIDE`` (the DSN of the connection each run records itself on).
Every handler writes one row to ``<schema>.log`` (:data:`LOG_TABLE`) through ``ctx.conn``.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta
from pathlib import Path

import anyio

from ticklock import JobContext, Scheduler, SystemClock, cron, every

SCENARIO = os.environ.get("REPLICA_SCENARIO", "fleet")
OWNER = os.environ.get("REPLICA_OWNER", "replica")
SCHEMA = os.environ.get("REPLICA_SCHEMA", "ticklock")
MARKER = Path(os.environ.get("REPLICA_MARKER", "/nonexistent/marker"))
SHIFT = float(os.environ.get("REPLICA_SHIFT", "0"))

DONE_TABLE = "CREATE TABLE {schema}.done (id int, owner text, batch int, at timestamptz)"
"""The items scenario "batches" marks done; the test creates it and ``<schema>.items``."""

LOG_TABLE = (
    "CREATE TABLE {schema}.log (job text, slot timestamptz, owner text, "
    "started timestamptz, finished timestamptz, previous timestamptz, note text)"
)
"""The table the handlers write to; a test creates it before it starts the replicas."""


class ShiftedClock(SystemClock):
    """The system clock moved by a fixed offset (the same in every replica)."""

    def now(self) -> datetime:
        return super().now() + timedelta(seconds=SHIFT)


scheduler = Scheduler(
    schema=SCHEMA, owner=OWNER, clock=ShiftedClock() if SHIFT else None, shutdown_grace=2
)
runs = 0


async def log(ctx: JobContext, started: datetime, note: str = "") -> None:
    assert ctx.conn is not None
    await ctx.conn.execute(
        f"INSERT INTO {SCHEMA}.log (job, slot, owner, started, finished, previous, note) "
        "VALUES ($1, $2, $3, $4, clock_timestamp(), $5, $6)",
        ctx.job_id,
        ctx.slot,
        ctx.owner,
        started,
        ctx.previous_success,
        note,
    )


async def begin(ctx: JobContext) -> datetime:
    assert ctx.conn is not None
    started: datetime = await ctx.conn.fetchval("SELECT clock_timestamp()")
    return started


if SCENARIO == "fleet":

    @scheduler.job(every(0.2), id="fast")
    async def fast(ctx: JobContext) -> None:
        await log(ctx, await begin(ctx))

    @scheduler.job(every(0.5, jitter=0.1), id="slow", timeout=0.4)
    async def slow(ctx: JobContext) -> None:
        started = await begin(ctx)
        await anyio.sleep(0.1)
        await log(ctx, started)

    @scheduler.job(cron("* * * * *"), id="minute")
    async def minute(ctx: JobContext) -> None:
        await log(ctx, await begin(ctx))

elif SCENARIO == "pause":

    @scheduler.job(every(2), id="paused", timeout=1.5)
    async def paused(ctx: JobContext) -> None:
        started = await begin(ctx)
        await log(ctx, started, note=OWNER)
        if OWNER == "A":
            await anyio.Path(MARKER).touch()
            await anyio.sleep(1.2)  # the test SIGSTOPs this process here

elif SCENARIO == "crash":

    @scheduler.job(every(1), id="crashy", timeout=0.9)
    async def crashy(ctx: JobContext) -> None:
        global runs
        runs += 1
        started = await begin(ctx)
        if OWNER == "K" and runs == 2:
            await log(ctx, started, note="partial")
            await anyio.Path(MARKER).touch()
            await anyio.sleep(0.8)  # the test SIGKILLs this process here
        await log(ctx, started, note=OWNER)

elif SCENARIO == "share":
    # a fleet that shares 12 jobs; each run is in its handler 0.4 s (the marker says when)
    async def shared(ctx: JobContext) -> None:
        started = await begin(ctx)
        await anyio.Path(MARKER).touch()
        await anyio.sleep(0.4)  # the test SIGSTOPs or SIGKILLs a replica in here
        await log(ctx, started, note=OWNER)

    for i in range(12):
        scheduler.add(shared, every(1), id=f"job-{i}", timeout=0.9)

elif SCENARIO == "unbounded":
    # A's handler switches off every server-side timeout of its tick, then is frozen
    @scheduler.job(every(2), id="unbounded", timeout=1.5)
    async def unbounded(ctx: JobContext) -> None:
        assert ctx.conn is not None
        started = await begin(ctx)
        await log(ctx, started, note=OWNER)
        if OWNER == "A":
            for setting in (
                "transaction_timeout",
                "statement_timeout",
                "idle_in_transaction_session_timeout",
            ):
                await ctx.conn.execute(f"SET LOCAL {setting} = 0")
            await anyio.Path(MARKER).touch()
            await anyio.sleep(1.2)  # the test SIGSTOPs this process here

elif SCENARIO == "cold":
    # a job whose lock a replica finds held at its first attempt: the holder's first run
    # (``REPLICA_HOLD`` set) writes its tick's start on the database's clock to the marker,
    # and the test SIGSTOPs it there; its server-side timeouts are the usual ones (6 + 1 s)
    @scheduler.job(every(20), id="cold", timeout=6)
    async def cold(ctx: JobContext) -> None:
        global runs
        runs += 1
        assert ctx.conn is not None
        started = await begin(ctx)
        await log(ctx, started, note=OWNER)
        if os.environ.get("REPLICA_HOLD") and runs == 1:
            tick: datetime = await ctx.conn.fetchval("SELECT now()")
            await anyio.Path(MARKER).write_text(tick.isoformat())
            await anyio.sleep(5)  # the test SIGSTOPs this process here

elif SCENARIO == "batches":
    # a sweep over <schema>.items, three per batch, from the cursor on, at most 4 batches a
    # run; A's second batch of its first run lasts 1.5 s (the test SIGSTOPs A in there)
    @scheduler.job(every(2), id="sweep", timeout=1.8, max_batches=4)
    async def sweep(ctx: JobContext) -> None:
        global runs
        runs += 1
        async for batch in ctx.batches():
            ids = await batch.db.fetch(
                f"INSERT INTO {SCHEMA}.done SELECT id, $2, $3, clock_timestamp() "
                f"FROM {SCHEMA}.items WHERE id > $1 ORDER BY id LIMIT 3 RETURNING id",
                batch.cursor or 0,
                OWNER,
                batch.number,
            )
            if ids:
                batch.cursor = ids[-1]["id"]
            if OWNER == "A" and runs == 1 and batch.number == 2:
                await anyio.Path(MARKER).touch()
                await anyio.sleep(1.5)  # the test SIGSTOPs this process here
            else:
                await anyio.sleep(0.1)
            if len(ids) < 3:
                break

elif SCENARIO == "deploy":
    # four jobs for a fleet of two releases; every run records when its handler ran through a
    # connection of its own (REPLICA_SIDE: a DSN), so a run that rolls back is recorded too
    import asyncpg

    SIDE = os.environ.get("REPLICA_SIDE", "")

    async def deployed(ctx: JobContext) -> None:
        side = await asyncpg.connect(SIDE)
        try:
            started = await side.fetchval(
                f"INSERT INTO {SCHEMA}.ran (job, slot, owner, started) "
                "VALUES ($1, $2, $3, clock_timestamp()) RETURNING started",
                ctx.job_id,
                ctx.slot,
                OWNER,
            )
            try:
                await anyio.sleep(0.3)
                await log(ctx, started, note=OWNER)
            finally:  # when the handler stopped, even cancelled: before its tick ends
                with anyio.CancelScope(shield=True):
                    await side.execute(
                        f"UPDATE {SCHEMA}.ran SET finished = clock_timestamp() "
                        "WHERE job = $1 AND owner = $2 AND started = $3",
                        ctx.job_id,
                        OWNER,
                        started,
                    )
        finally:
            with anyio.CancelScope(shield=True):
                await side.close()

    for i in range(4):
        scheduler.add(deployed, every(1), id=f"d{i}", timeout=0.8)

elif SCENARIO == "frozen-batches":
    # four batches a run, 0.7 s each; once the test creates the file "go" beside the
    # markers, the first replica to reach a fourth batch switches off its server-side timeouts
    # in there and is frozen (the test SIGSTOPs it)
    GO = MARKER.parent / "go"
    frozen = False

    @scheduler.job(every(4), id="sweep", timeout=3.5, max_batches=4)
    async def frozen_sweep(ctx: JobContext) -> None:
        global frozen, runs
        runs += 1
        async for batch in ctx.batches():
            await batch.db.execute(
                f"INSERT INTO {SCHEMA}.done VALUES ($1, $2, $3, clock_timestamp())",
                runs,
                OWNER,
                batch.number,
            )
            if batch.number == 4 and not frozen and GO.exists():
                frozen = True
                for setting in (
                    "transaction_timeout",
                    "statement_timeout",
                    "idle_in_transaction_session_timeout",
                ):
                    await batch.db.execute(f"SET LOCAL {setting} = 0")
                await anyio.Path(MARKER).touch()
                await anyio.sleep(30)  # the test SIGSTOPs this process here
            await anyio.sleep(0.7)

elif SCENARIO == "replace":
    # overlap="replace": a run of a slot before REPLICA_HOLD_BEFORE holds its lock and its
    # write for good (the test SIGSTOPs its replica there); the next fire replaces it
    HOLD_BEFORE = datetime.fromisoformat(os.environ["REPLICA_HOLD_BEFORE"])

    @scheduler.job(cron("* * * * *"), id="replaced", timeout=600, overlap="replace")
    async def replaced(ctx: JobContext) -> None:
        await log(ctx, await begin(ctx), note=OWNER)
        if ctx.slot < HOLD_BEFORE:
            await anyio.Path(MARKER).touch()
            await anyio.sleep(600)

elif SCENARIO == "ticks":
    # one short job, for a database cut off (a blackhole) or a clock ahead (REPLICA_SHIFT)
    @scheduler.job(every(1), id="tick", timeout=0.5)
    async def tick(ctx: JobContext) -> None:
        await log(ctx, await begin(ctx), note=OWNER)

elif SCENARIO == "blocked":
    # a job whose handler blocks the event loop 5 s of every 8, beside a one-second job
    @scheduler.job(every(3), id="blocker")
    async def blocker(ctx: JobContext) -> None:
        time.sleep(5)  # noqa: ASYNC251 (synchronous work on the event loop: every job waits)

    @scheduler.job(every(1), id="victim", timeout=0.5)
    async def victim(ctx: JobContext) -> None:
        await log(ctx, await begin(ctx), note=OWNER)
