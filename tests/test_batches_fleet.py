"""Batched runs with real replica processes: a holder paused (SIGSTOP) in the middle of its
sweep, another replica finishing the sweep from the cursor, no item twice, none left out, and
nothing the paused replica did after it was stopped committed."""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from typing import Any

import anyio
import pytest

from helpers import Replicas, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ITEMS = 24


async def test_a_paused_holder_s_sweep_is_finished_elsewhere_from_its_cursor_exactly_once(
    fleet: Replicas, pg_conn: Any
) -> None:
    from replica_app import DONE_TABLE

    s = fleet.schema
    await pg_conn.execute(f"CREATE TABLE {s}.items (id int PRIMARY KEY)")
    await pg_conn.execute(f"INSERT INTO {s}.items SELECT generate_series(1, {ITEMS})")
    await pg_conn.execute(DONE_TABLE.format(schema=s))
    a = fleet.start("A", "batches")
    await fleet.wait_marker("A", "replica A to be inside its second batch")
    a.send_signal(signal.SIGSTOP)
    paused_at = datetime.now(timezone.utc)
    # stopped inside the second batch's transaction: its rows written, not committed
    assert await pg_conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
        "AND query LIKE $1",
        f"INSERT INTO {s}.done %",
    ), "replica A was not stopped inside its second batch"
    first = await pg_conn.fetch(f"SELECT id, owner FROM {s}.done ORDER BY id")
    assert [tuple(r) for r in first] == [(1, "A"), (2, "A"), (3, "A")]  # batch 1 committed
    hold = await pg_conn.fetchval(f"SELECT busy_until FROM {s}.jobs WHERE job_id = 'sweep'")
    assert hold is not None  # A holds the job between its batches
    fleet.start("B", "batches")

    async def swept() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) = {ITEMS} FROM {s}.done"))

    await eventually(swept, 30, "replica B to finish the sweep while A is paused")
    a.send_signal(signal.SIGCONT)
    await anyio.sleep(2.5)  # A wakes up, finds its session gone; it may run again after
    assert fleet.stop("A") == 0, fleet.output("A")
    assert fleet.stop("B") == 0, fleet.output("B")

    rows = await pg_conn.fetch(f"SELECT id, owner, batch, at FROM {s}.done ORDER BY id")
    assert [r["id"] for r in rows] == list(range(1, ITEMS + 1)), "an item twice or left out"
    late = [tuple(r) for r in rows if r["owner"] == "A" and r["at"] >= paused_at]
    assert not late, ("what the paused replica did after it was stopped committed", late)
    assert [r["owner"] for r in rows] == ["A"] * 3 + ["B"] * (ITEMS - 3)
    # B started the job only once A's hold had ended, from the cursor A's batch 1 committed
    b_first = min(r["at"] for r in rows if r["owner"] == "B")
    assert b_first >= hold, (b_first, hold)
    runs = await pg_conn.fetch(
        f"SELECT owner, outcome, batches, capped FROM {s}.runs WHERE job_id = 'sweep' ORDER BY id"
    )
    a_first = next(r for r in runs if r["owner"] == "A")
    assert a_first["outcome"] in ("timeout", "error") and a_first["batches"] == 1, runs
    b_runs = [tuple(r)[1:] for r in runs if r["owner"] == "B" and r["batches"]]
    # B's sweep: 4 batches (capped), then the last 3 batches and one that found none
    assert b_runs[:2] == [("success", 4, True), ("success", 4, False)], runs
