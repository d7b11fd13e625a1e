"""The frozen-holder backstop: a replica whose attempt finds the lock held by a tick past its
deadline (its handler switched the server-side timeouts off, and it is frozen) ends that
tick's session, across roles too, and never a session that is not a ticklock tick."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import pytest

from helpers import Replicas, eventually, run_log
from ticklock import JobContext, Scheduler, every, lock_key

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


def as_role(dsn: str, role: str) -> str:
    """``dsn`` with ``role`` as its user (the test server trusts every local role)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


@pytest.fixture
async def roles(fleet: Replicas, pg_conn: Any) -> AsyncIterator[tuple[str, str]]:
    """Two login roles of this test's own, with what the docs grant a replica's role on the
    fleet's schema (migrated beforehand by a role that may create tables)."""
    r1, r2 = (f"{fleet.schema}_{n}" for n in ("r1", "r2"))
    migrated = await fleet.cli("migrate")
    assert migrated.code == 0, migrated
    s = fleet.schema
    for role in (r1, r2):
        await pg_conn.execute(f"CREATE ROLE {role} LOGIN")
        await pg_conn.execute(f"GRANT USAGE ON SCHEMA {s} TO {role}")
        await pg_conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {role}"
        )
        await pg_conn.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {role}")
    try:
        yield r1, r2
    finally:
        fleet.kill_all()
        for role in (r1, r2):
            await pg_conn.execute(f"DROP OWNED BY {role}")
            await pg_conn.execute(f"DROP ROLE {role}")


async def _frozen_holder(fleet: Replicas, pg_conn: Any, role: str) -> tuple[int, datetime]:
    """Replica A, as ``role``, frozen inside its handler after it set its three timeouts to 0:
    the pid of its session, and when it was stopped."""
    a = fleet.start("A", "unbounded", dsn=as_role(fleet.dsn, role))
    await fleet.wait_marker("A", "replica A to hold the lock inside its handler")
    a.send_signal(signal.SIGSTOP)
    paused_at = datetime.now(timezone.utc)
    pid = await pg_conn.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE usename = $1 AND application_name = $2 "
        "AND query LIKE 'SET LOCAL %'",
        role,
        fleet.schema,
    )
    assert pid is not None, "replica A was not stopped inside its handler"
    return pid, paused_at


async def test_a_replica_of_another_role_with_pg_signal_backend_ends_a_frozen_holder(
    fleet: Replicas, pg_conn: Any, roles: tuple[str, str]
) -> None:
    r1, r2 = roles
    await pg_conn.execute(f"GRANT pg_signal_backend TO {r2}")  # and not pg_read_all_stats
    s = fleet.schema
    pid, paused_at = await _frozen_holder(fleet, pg_conn, r1)
    fleet.start("B", "unbounded", dsn=as_role(fleet.dsn, r2))

    async def b_committed() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'B'"))

    await eventually(b_committed, 20, "replica B to run while A is frozen")
    b_first = await pg_conn.fetchval(f"SELECT min(started) FROM {s}.log WHERE note = 'B'")
    waited = (b_first - paused_at).total_seconds()
    # the documented bound: a period (2 s) after the holder's timeout (1.5 s) + 2 s, plus a
    # backup's grace (1 s), with up to 3 s for B's own process to start
    assert waited <= 3.5 + 2.0 + 1.0 + 3.0, waited
    ended = await pg_conn.fetchval("SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = $1", pid)
    assert ended, "A's session should have been ended"
    assert fleet.stop("A") == 0, fleet.output("A")
    assert fleet.stop("B") == 0, fleet.output("B")
    assert "ended the session of the replica holding the lock" in fleet.output("B")
    a_rows = await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'A'")
    assert a_rows == 0, "the frozen holder's writes must never appear"


@pytest.mark.parametrize("superuser", [False, True], ids=["without the grant", "a superuser's"])
async def test_a_replica_that_may_not_end_a_frozen_holder_says_so_once_naming_the_grant(
    fleet: Replicas, pg_conn: Any, roles: tuple[str, str], superuser: bool
) -> None:
    # B (role r2) may not end A's session: r2 has no pg_signal_backend, or A runs as a
    # superuser (the test server's own role), which pg_signal_backend does not reach
    r1, r2 = roles
    s = fleet.schema
    if superuser:
        await pg_conn.execute(f"GRANT pg_signal_backend TO {r2}")
        holder = await pg_conn.fetchval("SELECT current_user")
        assert await pg_conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = $1", holder)
        warning = (
            "it runs as a superuser, whose session only a superuser may end: no replica can run "
            "the job until it lets go. Run the replicas as a role that is not a superuser"
        )
    else:
        holder = r1
        warning = (
            f"this replica's role ({r2}) may not end its session: no replica can run the job "
            f"until it lets go. GRANT pg_signal_backend TO {r2}"
        )
    pid, _ = await _frozen_holder(fleet, pg_conn, holder)
    fleet.start("B", "unbounded", dsn=as_role(fleet.dsn, r2))

    async def warned() -> bool:
        return warning in fleet.output("B")

    await eventually(warned, 20, "replica B to say that it may not end A's session")
    await anyio.sleep(4.5)  # two more attempts of B's, which find the same
    assert await pg_conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)
    assert not await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'B'")
    assert fleet.stop("B") == 0, fleet.output("B")
    assert fleet.output("B").count(warning) == 1, fleet.output("B")
    assert "WARNING" in next(line for line in fleet.output("B").splitlines() if warning in line)
    assert fleet.stop("A") == 0, fleet.output("A")


@pytest.mark.parametrize("scoped", [False, True], ids=["the legacy key", "the schema's key"])
async def test_a_session_that_is_not_a_ticklock_tick_is_never_ended(
    pg_dsn: str, pg_schema: str, pg_conn: Any, scoped: bool
) -> None:
    # a plain session holds the job's key in a transaction for longer than any tick's bound
    # (0.3 s + 2 s): the replica's attempts find it locked and leave it alone
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    ran: list[datetime] = []

    @scheduler.job(every(0.5), id="held", timeout=0.3)
    async def held(ctx: JobContext) -> None:
        ran.append(ctx.slot)

    key = lock_key("default", "held", schema=pg_schema) if scoped else lock_key("default", "held")
    await pg_conn.execute("BEGIN")
    await pg_conn.execute("SELECT pg_advisory_xact_lock($1)", key)
    with run_log() as log:
        async with scheduler:
            await anyio.sleep(4)
            assert await pg_conn.fetchval("SELECT 1") == 1  # the session is still there
    await pg_conn.execute("ROLLBACK")
    assert not ran
    assert set(log.outcomes("held")) == {"locked"}, log.outcomes("held")


async def test_a_batched_holder_frozen_with_its_timeouts_off_is_taken_over_within_the_bound(
    fleet: Replicas, pg_conn: Any
) -> None:
    from replica_app import DONE_TABLE

    s = fleet.schema
    await pg_conn.execute(DONE_TABLE.format(schema=s))
    for owner in ("A", "B"):
        fleet.start(owner, "frozen-batches")
    await anyio.sleep(2.5)  # both live, each seeing the other
    (fleet.tmp / "go").touch()

    async def stopped() -> bool:
        return any(fleet.marker(owner).exists() for owner in ("A", "B"))

    await eventually(stopped, 10, "a replica to be inside a third batch, its timeouts off")
    x, y = ("A", "B") if fleet.marker("A").exists() else ("B", "A")
    fleet.procs[x].send_signal(signal.SIGSTOP)
    stopped_at = datetime.now(timezone.utc)
    started = await pg_conn.fetchval(  # the frozen run's start: its first batch
        f"SELECT at FROM {s}.done WHERE owner = $1 AND batch = 1 ORDER BY at DESC LIMIT 1", x
    )

    async def taken_over() -> bool:
        return bool(
            await pg_conn.fetchval(
                f"SELECT count(*) FROM {s}.done WHERE owner = $1 AND at > $2", y, stopped_at
            )
        )

    await eventually(taken_over, 20, "the other replica to take the job over")
    first = await pg_conn.fetchval(
        f"SELECT min(at) FROM {s}.done WHERE owner = $1 AND at > $2", y, stopped_at
    )
    took = (first - started).total_seconds()
    # the documented bound: at most a period (4 s) after the timeout (3.5 s) + 2 s from the
    # run's start, although the frozen batch began 2.1 s into the run; and a backup's grace
    assert took <= 3.5 + 2.0 + 4.0 + 1.0, took
    assert fleet.stop(x) == 0, fleet.output(x)
    assert fleet.stop(y) == 0, fleet.output(y)
    assert "ended the session of the replica holding the lock" in fleet.output(y)
    late = await pg_conn.fetchval(
        f"SELECT count(*) FROM {s}.done WHERE owner = $1 AND at >= $2 AND batch >= 4",
        x,
        started,
    )
    assert late == 0, "the frozen batch committed"
