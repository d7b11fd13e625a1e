"""The connections a replica holds: one per tick in flight and its LISTEN connection; one it
no longer uses closes after ``IDLE_SECONDS``, so that it does not keep the most it ever had in
flight at once (P10), directly and through a transaction-mode PgBouncer."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from helpers import eventually
from ticklock import JobContext, Scheduler, every
from ticklock._backends.postgres import connection

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
AT_ONCE = 6


async def held(conn: Any, app: str) -> int:
    """The server sessions of ``application_name`` ``app``, whichever client holds them."""
    sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    return int(await conn.fetchval(sql, app))


async def runs_at_once(dsn: str, schema: str, watch: Any, bound: int) -> tuple[int, int]:
    """Run ``AT_ONCE`` jobs at once, each holding its tick until all have started; the
    connections ``watch`` counts while they run, and once they all ended (within a few seconds
    down to ``bound``, if they get there)."""
    scheduler = Scheduler(dsn, schema=schema, owner="me")
    started, gate = [0], anyio.Event()

    async def hold(ctx: JobContext) -> None:
        started[0] += 1
        await gate.wait()

    for i in range(AT_ONCE):
        scheduler.add(hold, every(3600, initial_delay=3000), id=f"j{i}", timeout=30)

    async def all_started() -> bool:
        return started[0] == AT_ONCE

    async with scheduler:
        async with anyio.create_task_group() as tg:
            for i in range(AT_ONCE):
                tg.start_soon(scheduler.run_now, f"j{i}")
            await eventually(all_started, 10, "every run to start")
            busy = await watch()
            gate.set()
        idle = [0]

        async def settled() -> bool:  # a closed session leaves the server's view at once
            idle[0] = await watch()
            return idle[0] <= bound

        with contextlib.suppress(AssertionError):  # the caller asserts, with the count
            await eventually(settled, 5, "the connections no longer used to close")
    return busy, idle[0]


@pytest.mark.asyncio_only
async def test_after_runs_at_once_a_replica_closes_the_connections_it_no_longer_uses(
    pg_dsn: str, pg_schema: str, pg_conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "IDLE_SECONDS", 0.5)
    app = f"p10-{pg_schema}"

    async def watch() -> int:
        return await held(pg_conn, app)

    busy, idle = await runs_at_once(f"{pg_dsn}?application_name={app}", pg_schema, watch, 2)
    assert busy >= AT_ONCE  # one per tick in flight
    # its LISTEN connection, and one for a heartbeat at most
    assert idle <= 2, f"{idle} connections left after the runs"


def sockets_to(port: int) -> int:
    """This process's established TCP connections to ``port`` on 127.0.0.1 (Linux)."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                mine.add(target[8:-1])
    count = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and int(remote.split(":")[1], 16) == port and inode in mine:
            count += 1
    return count


@pytest.mark.asyncio_only
@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="counts sockets in /proc")
async def test_through_pgbouncer_a_replica_closes_the_client_connections_it_no_longer_uses(
    bouncer: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "IDLE_SECONDS", 0.5)
    port = urlsplit(bouncer).port
    assert port is not None

    async def watch() -> int:
        return sockets_to(port)

    busy, idle = await runs_at_once(bouncer, pg_schema, watch, 1)
    assert busy >= AT_ONCE
    # no LISTEN connection through a transaction pooler: one for a heartbeat at most
    assert idle <= 1, f"{idle} client connections left after the runs"
