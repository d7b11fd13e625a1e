"""One replica of the fleet benchmarks (P7, P9): N ``every(INTERVAL)`` jobs ``job-<i>``.

python benchmarks/fleet_replica.py DSN SCHEMA JOBS OWNER POOL [INTERVAL [TIMEOUT [HANDLER]]]
(SIGTERM stops it)

POOL ``own``: ``Scheduler(dsn)``, the pool ticklock creates (the default). ``given``: an
asyncpg pool of 2-20 connections passed with ``pool=``, which keeps asyncpg's own session
reset (one more round trip, and transaction, a tick).

INTERVAL: seconds between runs (1 by default); TIMEOUT: each run's timeout (0.9 by default).
HANDLER ``empty`` (the default): does nothing. ``write``: inserts one row
``(job, slot, owner)`` into ``SCHEMA.writes`` through the run's connection (in the run's
transaction), then sleeps 50 ms; the table must exist before the replica starts.
"""

from __future__ import annotations

import signal
import sys

import anyio

from ticklock import JobContext, Scheduler, every


async def main(
    dsn: str,
    schema: str,
    jobs: int,
    owner: str,
    pool_kind: str,
    interval: float = 1.0,
    run_timeout: float = 0.9,
    handler: str = "empty",
) -> None:
    import asyncpg

    pool = None
    if pool_kind == "given":
        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=20)
        scheduler = Scheduler(pool=pool, schema=schema, owner=owner, shutdown_grace=2)
    else:
        scheduler = Scheduler(dsn, schema=schema, owner=owner, shutdown_grace=2)

    async def empty(ctx: JobContext) -> None:
        pass

    insert = f"INSERT INTO {schema}.writes (job, slot, owner) VALUES ($1, $2, $3)"

    async def write(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(insert, ctx.job_id, ctx.slot, ctx.owner)
        await anyio.sleep(0.05)

    handlers = {"empty": empty, "write": write}
    if handler not in handlers:
        raise SystemExit(f"unknown handler {handler!r}: one of {', '.join(handlers)}")
    for i in range(jobs):
        scheduler.add(handlers[handler], every(interval), id=f"job-{i}", timeout=run_timeout)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            async for _ in signals:
                break
    if pool is not None:
        await pool.close()


if __name__ == "__main__":
    if not 6 <= len(sys.argv) <= 9:
        raise SystemExit(__doc__)
    dsn, schema, jobs, owner, pool_kind = sys.argv[1:6]
    extra = sys.argv[6:]
    interval = float(extra[0]) if len(extra) > 0 else 1.0
    timeout = float(extra[1]) if len(extra) > 1 else 0.9
    handler = extra[2] if len(extra) > 2 else "empty"
    anyio.run(main, dsn, schema, int(jobs), owner, pool_kind, interval, timeout, handler)
