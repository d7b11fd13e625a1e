"""REVIEW: timing of the backups' read (pg_locks) with many jobs and many held locks."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

from ticklock._lock_key import lock_key
from ticklock._postgres.sql import Statements, migrate


@pytest.mark.anyio
@pytest.mark.postgres
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("jobs,held", [(10_000, 0), (10_000, 1_000), (10_000, 5_000)])
async def test_review_read_cost(pg_dsn: str, pg_schema: str, jobs: int, held: int) -> None:
    conn = await asyncpg.connect(pg_dsn)
    holder = await asyncpg.connect(pg_dsn)
    try:
        await migrate(conn, pg_schema)
        sql = Statements(pg_schema)
        ids = [f"job-{i}" for i in range(jobs)]
        keys = [lock_key("default", i) for i in ids]
        await conn.execute(
            f"INSERT INTO {pg_schema}.jobs (namespace, job_id) SELECT 'default', unnest($1::text[])", ids
        )
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT pg_advisory_xact_lock(k) FROM unnest($1::int8[]) k", keys[:held])
        for _ in range(2):
            t = time.perf_counter()
            rows = await conn.fetch(sql.read, "default", ids, keys)
            took = time.perf_counter() - t
        assert sum(r["held"] for r in rows) == held
        plan = await conn.fetch("EXPLAIN ANALYZE " + sql.read, "default", ids, keys)
        print(f"\n{jobs} jobs, {held} held: {took:.3f} s")
        print("\n".join(r[0] for r in plan if "Join" in r[0] or "Execution" in r[0] or "SubPlan" in r[0] or "Scan" in r[0]))
        await tx.rollback()
    finally:
        await holder.close()
        await conn.close()
