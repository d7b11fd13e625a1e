"""A purge in batches against the same purge as one transaction (issue 24).

    python -m benchmarks.batches [--rows 1000000] [--batch 1000] [--repeat 2] [--dsn DSN]

A table ``bench.keys (id bigint PRIMARY KEY, expires_at timestamptz, payload text)`` is filled
with ``--rows`` expired rows; then a ticklock job purges them (``run_now``), once as one
transaction (``DELETE ... WHERE expires_at < now()`` on ``ctx.db``) and once in batches
(``ctx.batches()``, ``--batch`` rows per batch, in id order), alternating, ``--repeat`` times
each. Meanwhile a concurrent writer updates a random row of the table every 5 ms
(``UPDATE ... SET payload = payload WHERE id = $1``, autocommit, its own connection): a row the
purge deleted but has not committed is locked until the purge's (or the batch's) commit, so the
longest of its statements is the longest lock wait a concurrent writer sees.

Measured per purge: wall time, the writer's longest and p99 statement time, the WAL written
(``pg_current_wal_lsn()`` before and after), and the write transactions (transaction ids
assigned, ``txid_current()`` before and after, less the writer's statements that updated a row;
the replica's heartbeat, one every few seconds, is not subtracted) and those per batch.
Without --dsn a throwaway server is started (as in ``benchmarks.postgres``). Results:
``benchmarks/results/batches.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from benchmarks.postgres import database  # noqa: E402
from ticklock import JobContext, Scheduler, every  # noqa: E402

STATS = "SELECT txid_current()"
"""Transaction ids assigned so far (each call takes one itself): every writing transaction
takes one, so their difference counts the write transactions in between (the statistics in
``pg_stat_database`` reach the view up to a second late)."""


async def fill(conn: Any, rows: int) -> None:
    await conn.execute("DROP SCHEMA IF EXISTS bench CASCADE; CREATE SCHEMA bench")
    await conn.execute(
        "CREATE TABLE bench.keys (id bigint PRIMARY KEY, expires_at timestamptz, payload text)"
    )
    await conn.execute(
        "INSERT INTO bench.keys SELECT i, now() - interval '1 day', md5(i::text) "
        f"FROM generate_series(1, {rows}) AS i"
    )
    await conn.execute("VACUUM ANALYZE bench.keys")


async def writer(
    dsn: str, rows: int, stop: asyncio.Event, times: list[float], wrote: list[bool]
) -> None:
    """Update a random row every 5 ms until ``stop``; each statement's time into ``times``,
    and whether it updated a row (then it took a transaction id) into ``wrote``."""
    conn = await asyncpg.connect(dsn)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            status = await conn.execute(
                "UPDATE bench.keys SET payload = payload WHERE id = $1", random.randint(1, rows)
            )
            times.append(time.perf_counter() - t0)
            wrote.append(status == "UPDATE 1")
            await asyncio.sleep(0.005)
    finally:
        await conn.close()


async def purge(dsn: str, schema: str, rows: int, batch: int, batched: bool) -> dict[str, Any]:
    admin = await asyncpg.connect(dsn)
    await fill(admin, rows)
    scheduler = Scheduler(dsn, schema=schema)
    batches_seen: list[int] = []

    @scheduler.job(every(86400, initial_delay=80000), id="purge", timeout=3600)
    async def job(ctx: JobContext) -> dict[str, int]:
        deleted = 0
        if not batched:
            status = await ctx.db.execute("DELETE FROM bench.keys WHERE expires_at < now()")
            return {"deleted": int(status.split()[-1])}
        async for b in ctx.batches():
            n = await b.db.fetchval(
                "WITH d AS (DELETE FROM bench.keys WHERE id IN (SELECT id FROM bench.keys "
                f"WHERE expires_at < now() ORDER BY id LIMIT {batch}) RETURNING 1) "
                "SELECT count(*) FROM d"
            )
            deleted += n
            batches_seen.append(b.number)
            if n < batch:
                break
        return {"deleted": deleted}

    async with scheduler:
        stop = asyncio.Event()
        times: list[float] = []
        wrote: list[bool] = []
        w = asyncio.create_task(writer(dsn, rows, stop, times, wrote))
        await asyncio.sleep(0.5)
        lsn0, x0 = await admin.fetchval("SELECT pg_current_wal_lsn()"), await admin.fetchval(STATS)
        n0, t0 = len(times), time.perf_counter()
        result = await scheduler.run_now("purge")
        elapsed = time.perf_counter() - t0
        lsn1, x1 = await admin.fetchval("SELECT pg_current_wal_lsn()"), await admin.fetchval(STATS)
        n1 = len(times)
        wal = await admin.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", lsn1, lsn0)
        stop.set()
        await w
    await admin.close()
    during = times[n0:n1]  # the writer's statements while the purge ran
    xacts = int(x1 - x0) - 1  # the second read took one
    own = xacts - sum(wrote[n0:n1])  # the writer's statements that updated a row took one
    return {
        "batched": batched,
        "outcome": result.outcome.value,
        "deleted": result.report["deleted"] if result.report else None,
        "batches": result.batches,
        "seconds": elapsed,
        "writer_max_ms": max(during) * 1000,
        "writer_p99_ms": statistics.quantiles(during, n=100, method="inclusive")[98] * 1000,
        "writer_statements": n1 - n0,
        "wal_mb": float(wal) / 1e6,
        "transactions": own,  # the purge's, and the replica's heartbeat (one a few seconds)
        "transactions_per_batch": own / result.batches if result.batches else None,
    }


async def main_async(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for i in range(args.repeat):
        for batched in (False, True):
            run = await purge(dsn, f"bench_tl_{i}_{int(batched)}", args.rows, args.batch, batched)
            print(json.dumps(run))
            runs.append(run)
    admin = await asyncpg.connect(dsn)
    version = await admin.fetchval("SHOW server_version")
    await admin.close()
    return {"rows": args.rows, "batch": args.batch, "postgresql": version, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    args = parser.parse_args()
    with database(args.dsn) as dsn:
        report = asyncio.run(main_async(args, dsn))
    out = HERE / "results" / "batches.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"written {out}")


if __name__ == "__main__":
    main()
