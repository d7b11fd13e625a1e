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

With ``TICKLOCK_BENCH_PROBE`` set to a directory, a probe task writes ``OWNER.probe`` there: a
line ``unix-time wall-ms cpu-ms`` for each time the event loop woke it more than 5 ms late,
with the CPU this thread used meanwhile (the loop's own work, not waiting for a core).
"""

from __future__ import annotations

import os
import signal
import sys
import time

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
    probe_dir = os.environ.get("TICKLOCK_BENCH_PROBE")
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler, anyio.create_task_group() as tg:
            if probe_dir:
                tg.start_soon(probe, os.path.join(probe_dir, f"{owner}.probe"))
            async for _ in signals:
                break
            tg.cancel_scope.cancel()
    if pool is not None:
        await pool.close()


async def probe(path: str, period: float = 0.005) -> None:
    """Write each late wake-up of the event loop to ``path`` (see the module docstring)."""
    with open(path, "a", buffering=1) as out:  # noqa: ASYNC230 (once, before probing)
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await anyio.sleep(period)
            late = time.perf_counter() - wall - period
            if late > period:
                spent = time.thread_time() - cpu
                out.write(f"{time.time():.3f} {1e3 * late:.1f} {1e3 * spent:.1f}\n")


if __name__ == "__main__":
    if not 6 <= len(sys.argv) <= 9:
        raise SystemExit(__doc__)
    dsn, schema, jobs, owner, pool_kind = sys.argv[1:6]
    extra = sys.argv[6:]
    interval = float(extra[0]) if len(extra) > 0 else 1.0
    timeout = float(extra[1]) if len(extra) > 1 else 0.9
    handler = extra[2] if len(extra) > 2 else "empty"
    anyio.run(main, dsn, schema, int(jobs), owner, pool_kind, interval, timeout, handler)
