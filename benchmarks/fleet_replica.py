"""One replica of the P7 fleet benchmark: N ``every(1 s)`` jobs with an empty handler.

python benchmarks/fleet_replica.py DSN SCHEMA JOBS OWNER     (SIGTERM stops it)
"""

from __future__ import annotations

import signal
import sys

import anyio

from ticklock import JobContext, Scheduler, every


async def main(dsn: str, schema: str, jobs: int, owner: str) -> None:
    import asyncpg

    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=20)
    scheduler = Scheduler(pool=pool, schema=schema, owner=owner, shutdown_grace=2)

    async def empty(ctx: JobContext) -> None:
        pass

    for i in range(jobs):
        scheduler.add(empty, every(1), id=f"job-{i}", timeout=0.9)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            async for _ in signals:
                break
    await pool.close()


if __name__ == "__main__":
    dsn, schema, jobs, owner = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    anyio.run(main, dsn, schema, jobs, owner)
