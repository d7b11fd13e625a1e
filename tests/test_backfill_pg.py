"""``ticklock backfill`` on PostgreSQL with two real replica processes that both run the
backfill: each slot runs once, in order, under the job's lock, recorded as backfilled by the
CLI's operator; the watermark does not move back; a second backfill runs nothing, ``--rerun``
runs again; ``--dry-run`` lists each slot's fate and runs nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from helpers import Replicas, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_two_replicas_run_a_backfill_once_in_order(ops: Replicas, pg_conn: Any) -> None:
    s = ops.schema
    for owner in ("A", "B"):
        ops.start(owner, "backfill")

    async def declared() -> bool:
        return bool(
            await pg_conn.fetchval(
                f"SELECT count(*) = 2 FROM {s}.replicas WHERE 'hourly' = ANY(jobs)"
            )
            if await pg_conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{s}.replicas")
            else False
        )

    await eventually(declared, 30, "both replicas to declare the job")
    top = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    since, until = top - timedelta(hours=6), top - timedelta(hours=2)
    window = ["--since", since.isoformat(), "--until", until.isoformat()]
    watermark = await pg_conn.fetchval(f"SELECT last_slot FROM {s}.jobs WHERE job_id = 'hourly'")

    preview = await ops.cli("backfill", "hourly", *window, "--dry-run")
    assert preview.code == 0, preview
    assert "would run 4 of its 4 slots (a dry run: nothing ran)" in preview.out
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log") == 0

    done = await ops.cli("backfill", "hourly", *window, "--note", "INC-7: warehouse back")
    assert done.code == 0, done
    assert done.out.count("backfilled by ") == 4, done.out
    rows = await pg_conn.fetch(f"SELECT slot, owner, args FROM {s}.log ORDER BY started")
    slots = [since + timedelta(hours=h) for h in range(4)]
    assert [r["slot"] for r in rows] == slots  # each once, in order
    assert all(r["args"] == '{"backfill": true}' for r in rows)
    marked = await pg_conn.fetch(
        f"SELECT r.slot, b.who FROM {s}.runs AS r JOIN {s}.backfilled AS b ON b.run_id = r.id "
        "ORDER BY r.slot"
    )
    assert [m["slot"] for m in marked] == slots and all(m["who"].endswith("(cli)") for m in marked)
    last = f"SELECT last_slot FROM {s}.jobs WHERE job_id = 'hourly'"
    assert watermark is None and await pg_conn.fetchval(last) == slots[-1]  # forward only
    [audit] = await pg_conn.fetch(f"SELECT who, note FROM {s}.audit WHERE action = 'backfill'")
    assert audit["note"].endswith("4 slots; INC-7: warehouse back")

    again = await ops.cli("backfill", "hourly", *window)
    assert again.code == 0, again
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log") == 4  # nothing left to run
    one = ["--since", since.isoformat(), "--until", (since + timedelta(hours=1)).isoformat()]
    rerun = await ops.cli("backfill", "hourly", *one, "--rerun")
    assert rerun.code == 0, rerun
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE slot = $1", since) == 2
    assert await pg_conn.fetchval(last) == slots[-1]  # an older slot: the watermark stays
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)


async def test_a_backfill_in_the_future_is_a_usage_error(ops: Replicas, pg_conn: Any) -> None:
    ops.start("A", "backfill")

    async def live() -> bool:  # started (a SIGTERM before its handler is set kills it)
        table = await pg_conn.fetchval("SELECT to_regclass($1)", f"{ops.schema}.replicas")
        return table is not None and bool(
            await pg_conn.fetchval(f"SELECT count(*) FROM {ops.schema}.replicas")
        )

    await eventually(live, 30, "the replica to start")
    later = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    result = await ops.cli("backfill", "hourly", "--since", "2h", "--until", later)
    assert result.code == 2 and "is in the future" in result.err, result
    assert ops.stop("A") == 0


async def test_a_failed_slot_moves_the_backfill_on_before_its_lock_goes(
    pg_dsn: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two replicas on one backfill: the first slot fails; its record is slowed down (as a
    # full pool or a GC pause would), yet the other replica never takes that slot's turn
    import anyio

    from ticklock import JobContext, Scheduler, cron
    from ticklock._backends.postgres import tick

    original = tick.Tick.record_failure

    async def slow(self: tick.Tick, result: Any, job: Any) -> None:
        if self.fill is not None:
            await anyio.sleep(1.5)
        await original(self, result, job)

    monkeypatch.setattr(tick.Tick, "record_failure", slow)
    top = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    since = top - timedelta(hours=3)
    runs: list[tuple[datetime, str]] = []

    def replica(owner: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner)

        @scheduler.job(cron("0 * * * *"), id="report", catch_up=False)
        async def report(ctx: JobContext) -> None:
            runs.append((ctx.slot, owner))
            await anyio.sleep(0.2)
            if ctx.slot == since:
                raise RuntimeError("the warehouse is still down")

        return scheduler

    a, b = replica("A"), replica("B")
    async with a, b:
        await eventually(lambda: _both(a), 20, "both replicas live")
        with anyio.fail_after(60):
            done = await a.fleet.backfill("report", since, since + timedelta(hours=2))
    assert [s for s, _ in runs].count(since) == 1, runs
    assert [(r.slot, r.fate.value) for r in done] == [
        (since, "failed"),
        (since + timedelta(hours=1), "ran"),
    ]


async def _both(scheduler: Any) -> bool:
    return len([r for r in await scheduler.fleet.replicas() if "report" in r.jobs]) == 2
