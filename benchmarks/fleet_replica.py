"""One replica of the P7 fleet benchmark: N ``every(1 s)`` jobs with an empty handler.

python benchmarks/fleet_replica.py DSN SCHEMA JOBS OWNER POOL     (SIGTERM stops it)

POOL ``own``: ``Scheduler(dsn)``, the pool ticklock creates (the default). ``given``: an
asyncpg pool of 2-20 connections passed with ``pool=``, which keeps asyncpg's own session
reset (one more round trip, and transaction, a tick).
"""

from __future__ import annotations

import signal
import sys

import anyio

from ticklock import JobContext, Scheduler, every


async def main(dsn: str, schema: str, jobs: int, owner: str, pool_kind: str) -> None:
    import asyncpg

    pool = None
    if pool_kind == "given":
        pool = await asyncpg.create_pool(dsn, min_size=2, max_size=20)
        scheduler = Scheduler(pool=pool, schema=schema, owner=owner, shutdown_grace=2)
    else:
        scheduler = Scheduler(dsn, schema=schema, owner=owner, shutdown_grace=2)

    async def empty(ctx: JobContext) -> None:
        pass

    for i in range(jobs):
        scheduler.add(empty, every(1), id=f"job-{i}", timeout=0.9)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            async for _ in signals:
                break
    if pool is not None:
        await pool.close()


if __name__ == "__main__":
    dsn, schema, jobs, owner, pool_kind = sys.argv[1:6]
    anyio.run(main, dsn, schema, int(jobs), owner, pool_kind)
