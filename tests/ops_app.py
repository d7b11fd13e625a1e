"""The app that the operations tests run as real replica processes (issue 16).

``python -m ticklock run ops_app:scheduler --dsn ...``, or ``uvicorn --factory ops_app:create_app``
(a FastAPI app whose lifespan runs the scheduler and that mounts its dashboard, with actions,
at ``/ticklock``; its DSN comes from ``OPS_DSN``). Configured by environment variables:
``OPS_SCENARIO`` (which jobs it declares), ``OPS_OWNER``, ``OPS_SCHEMA`` and ``OPS_DSN``.

Handlers write one row per run to ``<schema>.log`` through ``ctx.conn``: ``tx`` is the tick
transaction's start (``now()``) and ``started`` the handler's start (``clock_timestamp()``),
both from the database's clock, so that tests compare them with ``paused_at`` and
``trigger_at``, which the database stamps too.
"""

from __future__ import annotations

import json
import os
import random
from typing import TYPE_CHECKING, Any

import anyio

from ticklock import JobContext, Scheduler, cron, every

if TYPE_CHECKING:
    from fastapi import FastAPI

SCENARIO = os.environ.get("OPS_SCENARIO", "ops")
OWNER = os.environ.get("OPS_OWNER", "replica")
SCHEMA = os.environ.get("OPS_SCHEMA", "ticklock")

LOG_TABLE = (
    "CREATE TABLE {schema}.log (job text NOT NULL, owner text NOT NULL, slot timestamptz, "
    "tx timestamptz NOT NULL, started timestamptz NOT NULL, args jsonb)"
)
"""The table the handlers write to; a test creates it before it starts the replicas."""
HOSTILE_REPORT = "<script>alert(1)</script>"
HOSTILE_ERROR = "<img src=x onerror=alert(2)>"

scheduler = Scheduler(os.environ.get("OPS_DSN"), schema=SCHEMA, owner=OWNER, shutdown_grace=2)


async def log(ctx: JobContext) -> None:
    """One row for this run, in the tick's transaction."""
    assert ctx.conn is not None
    await ctx.conn.execute(
        f"INSERT INTO {SCHEMA}.log (job, owner, slot, tx, started) "
        "VALUES ($1, $2, $3, now(), clock_timestamp())",
        ctx.job_id,
        ctx.owner,
        ctx.slot,
    )


async def number(ctx: JobContext) -> int:
    """Which run of the job this is, fleet-wide (1 for the first), counted under its lock."""
    assert ctx.conn is not None
    done: int = await ctx.conn.fetchval(
        f"SELECT count(*) FROM {SCHEMA}.runs WHERE namespace = $1 AND job_id = $2",
        scheduler.namespace,
        ctx.job_id,
    )
    return done + 1


async def logged(ctx: JobContext) -> None:
    await log(ctx)


def rare_jobs() -> None:
    """A job that only an operator starts, and one that configuration switched off."""
    scheduler.add(logged, every(3600, initial_delay=3000), id="rare")
    scheduler.add(logged, every(60), id="off", enabled=False)


if SCENARIO in ("pause", "ops"):
    # ``steady`` is the job an operator pauses; ``canary`` shows that the replicas run
    # (its grace keeps it from ever being overdue while replicas restart on a loaded machine)
    scheduler.add(logged, every(0.3), id="steady")
    scheduler.add(logged, every(0.5), id="canary", overdue_grace=60)

if SCENARIO in ("trigger", "ops", "idle"):
    rare_jobs()

if SCENARIO in ("v1", "v2"):
    # v1 declares old.job; v2 is the release that renamed it away
    scheduler.add(logged, every(0.5), id="keep", overdue_grace=60)
    if SCENARIO == "v1":
        scheduler.add(logged, every(0.5), id="old.job")

if SCENARIO == "history":

    @scheduler.job(every(0.4), id="flaky")
    async def flaky(ctx: JobContext) -> dict[str, int]:
        n = await number(ctx)
        await log(ctx)
        if n % 2 == 0:
            raise RuntimeError(f"boom {n}")
        return {"n": n}


if SCENARIO == "web":
    scheduler.add(logged, every(0.3), id="reports.refresh-cache")
    scheduler.add(logged, every(3600, initial_delay=3000), id="maintenance.reindex")

    @scheduler.job(every(1, jitter=0.2), id="billing.sync-invoices", timeout=0.9)
    async def sync_invoices(ctx: JobContext) -> dict[str, Any]:
        n = await number(ctx)
        await anyio.sleep(random.uniform(0.05, 0.45))  # the invoice API's latency
        await log(ctx)
        if n % 5 == 3:
            raise RuntimeError("invoice API answered 503 Service Unavailable; will retry")
        fetched = random.randint(3, 40)
        created = random.randint(0, fetched)
        return {"fetched": fetched, "created": created, "updated": fetched - created}

    @scheduler.job(every(0.5), id="imports.parse-feed")
    async def parse_feed(ctx: JobContext) -> dict[str, str]:
        n = await number(ctx)
        await log(ctx)
        if n % 2 == 0:
            raise ValueError(f"unexpected markup in the feed: {HOSTILE_ERROR}")
        return {"html": HOSTILE_REPORT}


if SCENARIO == "faults":
    # ``OPS_JOBS`` jobs ``j<i>``, every ``OPS_INTERVAL`` seconds with ``OPS_TIMEOUT``
    for i in range(int(os.environ.get("OPS_JOBS", "10"))):
        scheduler.add(
            logged,
            every(float(os.environ.get("OPS_INTERVAL", "2"))),
            id=f"j{i}",
            timeout=float(os.environ.get("OPS_TIMEOUT", "1.5")),
            overdue_grace=60,
        )

if SCENARIO == "failing":
    # a host without the job's secret (``OPS_FAIL`` set) fails every run of it

    # every(2): the next replica hears of a failure at its look, a grace (1 s) after the slot,
    # and runs the retry then, before the next slot
    @scheduler.job(every(2), id="secret", timeout=0.5, retries=1, retry_backoff=0.2)
    async def secret(ctx: JobContext) -> None:
        if os.environ.get("OPS_FAIL"):
            raise RuntimeError("the secret is missing on this host")
        await log(ctx)


if SCENARIO == "secret":
    # the same host without the job's secret (``OPS_FAIL`` set), and a job with no retries:
    # no other replica runs a slot the owner failed, unless the owner gives the job up
    @scheduler.job(every(1), id="secret", timeout=0.5)
    async def secret_only(ctx: JobContext) -> None:
        if os.environ.get("OPS_FAIL"):
            raise RuntimeError("the secret is missing on this host")
        await log(ctx)


if SCENARIO.startswith("immediately-"):
    # a daily report declared immediately, its hour by release: ``immediately-9``, ...
    scheduler.add(
        logged,
        cron(f"0 {SCENARIO.split('-')[1]} * * *"),
        id="report",
        immediately=True,
        overdue_grace=60,
    )


if SCENARIO == "limit":
    # a job that may commit five scheduled runs fleet-wide, due every 0.2 s on every replica
    scheduler.add(logged, every(0.2), id="limited", limit=5, timeout=0.15, overdue_grace=60)


if SCENARIO == "backfill":
    # an hourly report whose backfilled runs log themselves with args {"backfill": true}
    async def hourly(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(
            f"INSERT INTO {SCHEMA}.log (job, owner, slot, tx, started, args) "
            "VALUES ($1, $2, $3, now(), clock_timestamp(), $4::text::jsonb)",
            ctx.job_id,
            ctx.owner,
            ctx.slot,
            json.dumps({"backfill": ctx.backfill}),
        )
        await anyio.sleep(0.2)  # long enough for the other replica to find the lock held

    scheduler.add(hourly, cron("0 * * * *"), id="hourly", catch_up=False, timeout=5)


if SCENARIO.startswith("declared-"):
    # one job whose interval differs between releases: ``declared-1``, ``declared-0.5``
    scheduler.add(logged, every(float(SCENARIO.split("-")[1])), id="j1", overdue_grace=60)


if SCENARIO.startswith("tasks"):
    # stored schedules: the task ``report`` (``tasks``), and also ``digest`` (``tasks+digest``,
    # the release that adds it); each run logs its schedule's args
    async def stored(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(
            f"INSERT INTO {SCHEMA}.log (job, owner, slot, tx, started, args) "
            "VALUES ($1, $2, $3, now(), clock_timestamp(), $4::text::jsonb)",
            ctx.job_id,
            ctx.owner,
            ctx.slot,
            json.dumps(dict(ctx.args)),
        )

    scheduler.task("report")(stored)
    if SCENARIO == "tasks+digest":
        scheduler.task("digest")(stored)


def create_app() -> FastAPI:
    """The web replica: its lifespan runs the scheduler, its dashboard is at ``/ticklock``."""
    from fastapi import FastAPI

    app = FastAPI(lifespan=scheduler.lifespan)

    @app.get("/")
    async def home() -> dict[str, str]:
        return {"app": "billing", "owner": OWNER}

    app.mount("/ticklock", scheduler.dashboard(actions=True))
    return app
