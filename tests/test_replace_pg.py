"""``overlap="replace"`` on PostgreSQL with real replica processes: the run of an older slot
whose replica is frozen (SIGSTOP) mid-handler, its write made and its transaction open, is
ended by the replica that runs the newer slot: its session is terminated, its write rolled
back, and when it thaws it records its run as ``cancelled``, replaced; it never commits."""

from __future__ import annotations

import signal
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from helpers import Replicas, eventually
from ticklock import Scheduler
from ticklock._operators.fleet import Fate

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_a_frozen_replaced_run_never_commits(
    fleet: Replicas, pg_conn: Any, pg_dsn: str
) -> None:
    s = fleet.schema
    now = datetime.now(timezone.utc)
    boundary = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    # the replicas' wall clock: 6 s before a minute, behind the database's (ahead of it, their
    # slots would be refused)
    shift = (boundary - now).total_seconds() - 66.0
    fire = boundary - timedelta(minutes=1)  # the replicas' next minute: the newer slot
    older = fire - timedelta(minutes=1)  # the one a catch-up run at start runs
    async with Scheduler(dsn=pg_dsn, schema=s, owner="setup"):
        pass  # the schema, then a watermark from before: the replicas start with a slot owed
    await pg_conn.execute(
        f"INSERT INTO {s}.jobs (namespace, job_id, last_slot, last_end) "
        "VALUES ('default', 'replaced', $1, $1)",
        older - timedelta(minutes=2),
    )
    for owner in ("A", "B"):
        fleet.start(owner, "replace", shift=str(shift), hold_before=fire.isoformat())

    async def holding() -> bool:
        return any(fleet.marker(owner).exists() for owner in ("A", "B"))

    await eventually(holding, 20, "a replica to run the older slot")
    frozen = "A" if fleet.marker("A").exists() else "B"
    other = "B" if frozen == "A" else "A"
    fleet.procs[frozen].send_signal(signal.SIGSTOP)
    open_write = await pg_conn.fetchval(f"SELECT slot FROM {s}.log WHERE owner = $1", frozen)
    assert open_write is None  # its write is in its open transaction

    async def newer_committed() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE slot = $1", fire))

    try:
        await eventually(newer_committed, 30, "the newer slot to run beside the frozen run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{other} said:\n{fleet.output(other)}") from None
    assert "ended the session of the replica holding the lock" in fleet.output(other)
    fleet.procs[frozen].send_signal(signal.SIGCONT)

    async def recorded() -> bool:
        return bool(
            await pg_conn.fetchval(
                f"SELECT count(*) FROM {s}.runs WHERE job_id = 'replaced' AND owner = $1",
                frozen,
            )
        )

    await eventually(recorded, 20, "the thawed replica to record its replaced run")
    for owner in ("A", "B"):
        assert fleet.stop(owner) == 0, fleet.output(owner)
    logged = await pg_conn.fetch(f"SELECT slot, owner FROM {s}.log ORDER BY slot")
    assert [(r["slot"], r["owner"]) for r in logged if r["slot"] <= fire] == [(fire, other)]
    runs = await pg_conn.fetch(
        f"SELECT slot, owner, outcome, error FROM {s}.runs WHERE job_id = 'replaced' AND slot = $1",
        older,
    )
    assert runs and all(r["outcome"] != "success" for r in runs), runs
    mine = [r for r in runs if r["owner"] == frozen]
    assert [(r["outcome"], r["error"]) for r in mine] == [
        ("cancelled", f"replaced by the run of slot {fire.isoformat()}")
    ]
    async with Scheduler(dsn=pg_dsn, schema=s, owner="reader") as reader:
        ledger = await reader.fleet.slots("replaced", older, fire)
    by = {r.slot: r for r in ledger}
    assert by[older].fate is Fate.SKIPPED
    assert by[older].reason == f"replaced by the run of slot {fire.isoformat()}"
    assert by[fire].fate is Fate.RAN


async def test_every_batch_of_a_replaceable_run_names_its_slot(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # a frozen holder in its second batch is ended by the newer slot as in its first: each
    # batch's transaction holds the slot lock the take-over reads
    from ticklock import JobContext, cron
    from ticklock._backends.postgres.begin import unix32
    from ticklock._backends.postgres.sql import SLOT_TAG
    from ticklock.testing import ManualClock

    clock = ManualClock(datetime(2026, 1, 1, 0, 0, 30, tzinfo=timezone.utc))
    scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)
    named: list[list[int]] = []

    @scheduler.job(cron("* * * * *"), id="swept", timeout=30, overlap="replace")
    async def swept(ctx: JobContext) -> None:
        async for batch in ctx.batches():
            pid = await batch.db.fetchval("SELECT pg_backend_pid()")
            rows = await pg_conn.fetch(
                "SELECT objid::int8 FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND classid = $1 AND objsubid = 2 AND pid = $2",
                SLOT_TAG,
                pid,
            )
            named.append([r[0] for r in rows])
            if batch.number == 3:
                break

    async with scheduler:
        await clock.advance(30)
        await eventually(lambda: _done(named), 20, "three batches")
    slot = datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)
    assert named == [[unix32(slot)]] * 3


async def _done(named: list[list[int]]) -> bool:
    return len(named) >= 3
