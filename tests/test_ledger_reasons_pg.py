"""The ledger names what kept real replicas from their slots, as each recorded it of itself:
the database unreachable from every replica (a network that drops everything), a job that
blocks the event loop, a clock ahead of the database's. None of them is ``unknown``."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

import anyio
import pytest

from blackhole import blackhole
from helpers import Replicas, eventually
from ticklock._backends.postgres.fleet import PostgresFleet, from_connection
from ticklock._operators.fleet import Fate, SlotRecord

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

ANSWERS = "the database answers again"
PENDING = 2.6
"""Seconds a one-second job's slot stays pending (its timeout, grace and tolerance)."""


async def ledger(conn: Any, schema: str, job_id: str, since: datetime) -> list[SlotRecord]:
    fleet = PostgresFleet(from_connection(conn), schema=schema, namespace="default")
    return await fleet.slots(job_id, since, datetime.now(timezone.utc))


def not_run(slots: list[SlotRecord]) -> list[SlotRecord]:
    """The slots without a run of their own (covered by a later one, or missed)."""
    return [s for s in slots if s.fate in (Fate.COVERED, Fate.MISSED, Fate.SKIPPED)]


async def runs(conn: Any, schema: str, job_id: str) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {schema}.log WHERE job = $1", job_id))


async def test_a_database_cut_off_from_every_replica_is_named_from_each(
    fleet: Replicas, pg_conn: Any
) -> None:
    start = datetime.now(timezone.utc)
    s = fleet.schema
    async with blackhole(fleet.dsn) as proxy:
        for owner in ("A", "B"):
            fleet.start(owner, "ticks", dsn=proxy.dsn)

        async def live() -> bool:
            table = await pg_conn.fetchval("SELECT to_regclass($1)", f"{s}.replicas")
            return bool(table) and await pg_conn.fetchval(f"SELECT count(*) FROM {s}.replicas") == 2

        await eventually(live, 20, "both replicas live")
        done = await runs(pg_conn, s, "tick")
        await eventually(lambda: _more(pg_conn, s, done + 2), 20, "runs before the cut")
        proxy.drop()  # every packet of both replicas dropped: nothing refused, nothing answered
        await anyio.sleep(6)
        proxy.heal()
        done = await runs(pg_conn, s, "tick")
        await eventually(lambda: _more(pg_conn, s, done + 2), 30, "runs after the cut")

        async def said() -> bool:
            return all(ANSWERS in fleet.output(owner) for owner in ("A", "B"))

        # each saw the database answer again (the backup too, which only looks and beats)
        await eventually(said, 20, "both replicas to say the database answers again")

        async def recorded() -> bool:
            owners = await pg_conn.fetchval(f"SELECT count(DISTINCT owner) FROM {s}.outages")
            return bool(owners == 2)

        await eventually(recorded, 20, "both replicas to record the outage")
        for owner in ("A", "B"):  # in a thread: the proxy runs on this loop
            assert await anyio.to_thread.run_sync(fleet.stop, owner) == 0
    for owner in ("A", "B"):
        assert fleet.output(owner).count(ANSWERS) == 1, fleet.output(owner)
    rows = await pg_conn.fetch(f"SELECT owner, kind FROM {s}.outages")
    assert {(r["owner"], r["kind"]) for r in rows} == {
        ("A", "unreachable"),
        ("B", "unreachable"),
    }
    slots = await ledger(pg_conn, s, "tick", start)
    cut = not_run(slots)
    assert len(cut) >= 3, slots
    assert {s.reason for s in cut} == {"the database was unreachable (from A, B)"}, [
        (s.slot, s.reason) for s in cut
    ]


async def _more(conn: Any, schema: str, n: int) -> bool:
    return await runs(conn, schema, "tick") >= n


async def test_a_job_that_blocks_the_event_loop_is_named_for_the_slots_it_cost(
    fleet: Replicas, pg_conn: Any
) -> None:
    start = datetime.now(timezone.utc)
    fleet.start("B", "blocked")

    async def blocked_twice() -> bool:
        return fleet.output("B").count("the event loop was blocked for") >= 2

    await eventually(blocked_twice, 30, "the blocker to block the loop twice")
    assert fleet.stop("B") == 0
    await anyio.sleep(PENDING)
    slots = await ledger(pg_conn, fleet.schema, "victim", start)
    cost = not_run(slots)
    assert len(cost) >= 3, slots
    named = re.compile(r"^replica B's event loop was blocked by job 'blocker' for [45]\.\d s$")
    assert all(s.reason is not None and named.match(s.reason) for s in cost), cost
    assert "unreachable" not in fleet.output("B")  # a blocked loop is no outage


async def test_ticks_refused_for_a_clock_ahead_are_named(fleet: Replicas, pg_conn: Any) -> None:
    start = datetime.now(timezone.utc)
    fleet.start("C", "ticks", shift="5")

    async def refused() -> bool:
        return fleet.output("C").count("runs ahead of the database") >= 6

    await eventually(refused, 30, "ticks refused for the clock")
    assert fleet.stop("C") == 0
    await anyio.sleep(PENDING)
    assert await runs(pg_conn, fleet.schema, "tick") == 0  # no handler ever started
    slots = await ledger(pg_conn, fleet.schema, "tick", start)
    refusals = not_run(slots)
    named = re.compile(
        r"^replica C's clock is [45]\.\d s ahead of the database: its ticks were refused$"
    )
    named_at = [i for i, s in enumerate(refusals) if s.reason and named.match(s.reason)]
    assert len(named_at) >= 4, refusals
    # between the first refusal and the last, each slot is named; before C beat for the
    # first time and after it left, no live replica declared the job
    assert named_at == list(range(named_at[0], named_at[-1] + 1)), refusals
    edges = refusals[: named_at[0]] + refusals[named_at[-1] + 1 :]
    assert all(s.reason == "no live replica declared the job" for s in edges), refusals
