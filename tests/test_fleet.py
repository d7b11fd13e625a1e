"""G1, G2, G3, G4 and G5 with real replica processes against a real PostgreSQL.

Each replica is ``python -m ticklock run replica_app:scheduler --dsn ...``, stopped with a
real SIGTERM (and paused with SIGSTOP, killed with SIGKILL where the test says so).
"""

from __future__ import annotations

import signal
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import pytest

from helpers import Replicas, eventually
from ticklock._runtime.sharing import weight

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_three_replicas_commit_each_slot_once_without_overlap(
    fleet: Replicas, pg_conn: Any
) -> None:
    # shift the wall clock so that a cron minute boundary falls inside the run
    now = datetime.now(timezone.utc)
    boundary = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    # replicas' wall clock: 3 s before a minute, behind the database's (one ahead of it by more
    # than 2 s cannot commit)
    shift = (boundary - now).total_seconds() - 63.0
    for owner in ("r1", "r2", "r3"):
        fleet.start(owner, "fleet", shift=str(shift))
    await anyio.sleep(7)
    for owner in ("r1", "r2", "r3"):
        assert fleet.stop(owner) == 0, fleet.output(owner)
    s = fleet.schema
    rows = await pg_conn.fetch(f"SELECT * FROM {s}.log ORDER BY job, started")
    by_job: dict[str, list[Any]] = {}
    for row in rows:
        by_job.setdefault(row["job"], []).append(row)
    assert len(by_job["fast"]) >= 10 and len(by_job["slow"]) >= 5
    assert len(by_job["minute"]) == 1, by_job.get("minute")  # three replicas, one cron fire
    for job, interval in (("fast", 0.2), ("slow", 0.5), ("minute", None)):
        job_rows = by_job[job]
        slots = [r["slot"] for r in job_rows]
        assert len(slots) == len(set(slots)), f"{job}: a slot committed twice"
        for prev, cur in zip(job_rows, job_rows[1:], strict=False):
            assert cur["started"] >= prev["finished"], f"{job}: runs overlap"
            assert cur["slot"] > prev["slot"]
            assert cur["previous"] == prev["slot"]  # the watermark is the fleet's
            if interval is not None:
                gap = (cur["started"] - prev["finished"]).total_seconds()
                assert gap >= interval - 0.002, f"{job}: fixed delay broken ({gap:.3f} s)"
    owners = {r["owner"] for r in rows}
    assert len(owners) >= 2, "expected the fleet to share the work"
    runs = await pg_conn.fetchval(
        f"SELECT count(*) FROM {s}.runs WHERE outcome = 'success' AND job_id <> "
        "'ticklock.retention'"
    )
    assert runs == len(rows)


async def test_a_paused_holder_loses_its_lock_and_its_writes(fleet: Replicas, pg_conn: Any) -> None:
    s = fleet.schema
    a = fleet.start("A", "pause")
    for _ in range(3):
        await fleet.wait_marker("A", "replica A to hold the lock inside its handler")
        a.send_signal(signal.SIGSTOP)
        paused_at = datetime.now(timezone.utc)
        # stopped inside its tick (its write made, its transaction open)? On a loaded
        # machine the stop can come after the handler's 1.2 s and its commit: try its next run
        if await pg_conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
            "AND query LIKE $1",
            f"INSERT INTO {s}.log %",
        ):
            break
        a.send_signal(signal.SIGCONT)
        await pg_conn.execute(f"DELETE FROM {s}.log WHERE note = 'A'")
        fleet.marker("A").unlink()
    else:
        raise AssertionError("replica A was never stopped inside its tick")
    fleet.start("B", "pause")

    async def b_committed() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'B'"))

    try:
        await eventually(b_committed, 40, "replica B to run while A is paused")
    except AssertionError as exc:  # what each replica said, to tell a stall from a defect
        raise AssertionError(f"{exc}\nB said:\n{fleet.output('B')}") from None
    b_first = await pg_conn.fetchval(f"SELECT min(started) FROM {s}.log WHERE note = 'B'")
    # B could only start once the server had ended A's session (timeout 1.5 + grace 1.0)
    assert (b_first - paused_at).total_seconds() >= 2.0
    resumed_at = datetime.now(timezone.utc)
    a.send_signal(signal.SIGCONT)
    await anyio.sleep(2)  # A wakes up, finds its session gone, fails its late commit
    assert fleet.stop("A") == 0, fleet.output("A")
    assert fleet.stop("B") == 0
    # the run A was stopped in began before it was resumed (a later run of A's, on time after
    # it, may commit its own row)
    a_rows = await pg_conn.fetchval(
        f"SELECT count(*) FROM {s}.log WHERE note = 'A' AND started < $1", resumed_at
    )
    assert a_rows == 0, (
        "the paused holder's writes must never appear",
        await pg_conn.fetch(f"SELECT * FROM {s}.log ORDER BY started"),
        paused_at,
        resumed_at,
    )
    a_runs = await pg_conn.fetch(  # the run it was stopped in, and any after it
        f"SELECT outcome FROM {s}.runs WHERE owner = 'A' AND job_id = 'paused' "
        "AND finished_at > $1 ORDER BY id",
        paused_at,
    )
    assert a_runs and a_runs[0]["outcome"] in ("error", "timeout")
    assert "success" not in [r["outcome"] for r in a_runs[:1]]
    slots = await pg_conn.fetch(f"SELECT slot FROM {s}.log")
    assert len(slots) == len({r["slot"] for r in slots})


async def test_a_frozen_holder_that_switched_off_its_timeouts_is_ended_by_another_replica(
    fleet: Replicas, pg_conn: Any
) -> None:
    # A's handler sets transaction_timeout, statement_timeout and
    # idle_in_transaction_session_timeout to 0, then A is frozen holding the lock: B ends A's
    # session once A's transaction is older than its bound (timeout 1.5 + 1.0) plus 1.0.
    s = fleet.schema
    a = fleet.start("A", "unbounded")
    await fleet.wait_marker("A", "replica A to hold the lock inside its handler")
    a.send_signal(signal.SIGSTOP)
    paused_at = datetime.now(timezone.utc)
    fleet.start("B", "unbounded")

    async def b_committed() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'B'"))

    await eventually(b_committed, 15, "replica B to run while A is frozen")
    b_first = await pg_conn.fetchval(f"SELECT min(started) FROM {s}.log WHERE note = 'B'")
    waited = (b_first - paused_at).total_seconds()
    # B's first attempt that finds A's transaction past its bound and the grace (3.5 s from
    # A's start) ends it: at most a period (2 s) and a backup's grace (1 s) after that, with
    # up to 3 s for B's own process to start
    assert 2.0 <= waited <= 3.5 + 2.0 + 1.0 + 3.0, waited
    a.send_signal(signal.SIGCONT)
    await anyio.sleep(2)  # A wakes up, finds its session gone, fails its late commit
    assert fleet.stop("A") == 0, fleet.output("A")
    assert fleet.stop("B") == 0
    assert "ended the session of the replica holding the lock" in fleet.output("B")
    a_rows = await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'A'")
    assert a_rows == 0, "the frozen holder's writes must never appear"
    a_runs = await pg_conn.fetch(
        f"SELECT outcome FROM {s}.runs WHERE owner = 'A' AND job_id = 'unbounded'"
    )
    assert "success" not in [r["outcome"] for r in a_runs]


async def test_a_replica_that_finds_the_lock_held_takes_a_frozen_holder_over_in_its_bound(
    fleet: Replicas, pg_conn: Any
) -> None:
    # A cold start: H attempts the first slot and holds its lock, F starts meanwhile and
    # finds it held (locked); then H is frozen inside its run. Its session ends by its
    # server-side timeouts (timeout 6 + 1 s after its tick began); F attempts again once any
    # run must have ended (6 + 2 s after it found the lock held), not a period (20 s) later.
    s = fleet.schema
    follower, holder = sorted(("p", "q"), key=lambda o: weight(o, "cold"), reverse=True)
    h = fleet.start(holder, "cold", hold="1")  # F ranks first: it attempts, as owner or alone
    await fleet.wait_marker(holder, "the holder to be inside its first run")
    h.send_signal(signal.SIGSTOP)
    fleet.start(follower, "cold", log_level="DEBUG")
    tick = datetime.fromisoformat(fleet.marker(holder).read_text())

    async def taken_over() -> bool:
        return bool(
            await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = $1", follower)
        )

    await eventually(taken_over, 25, "the other replica to take the frozen run over")
    took = await pg_conn.fetchval(f"SELECT min(started) FROM {s}.log WHERE note = $1", follower)
    assert "outcome=locked" in fleet.output(follower)  # it found the lock held
    # it found the lock held before the holder's session ended (7 s after its tick began),
    # and attempted 8 s later at most: 15 s, with a second's slack (a period: 20 s and more)
    waited = (took - tick).total_seconds()
    assert 7.0 <= waited <= 16.0, waited
    h.send_signal(signal.SIGCONT)
    await anyio.sleep(1)
    assert fleet.stop(holder) == 0, fleet.output(holder)
    assert fleet.stop(follower) == 0, fleet.output(follower)
    notes = [r["note"] for r in await pg_conn.fetch(f"SELECT note FROM {s}.log")]
    assert notes == [follower], "the frozen holder's writes never appear, and the slot ran once"


async def test_a_replica_killed_mid_run_leaves_no_partial_write(
    fleet: Replicas, pg_conn: Any
) -> None:
    s = fleet.schema
    k = fleet.start("K", "crash")
    await fleet.wait_marker("K", "replica K to be inside its second run")
    k.send_signal(signal.SIGKILL)
    k.wait()
    first = await pg_conn.fetch(f"SELECT slot, note FROM {s}.log")
    assert [r["note"] for r in first] == ["K"], "only the first, committed run is there"
    fleet.start("R", "crash")

    async def recovered() -> bool:
        return bool(await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE note = 'R'"))

    await eventually(recovered, 20, "replica R to cover the slot")
    assert fleet.stop("R") == 0
    rows = await pg_conn.fetch(f"SELECT slot, previous, note FROM {s}.log ORDER BY slot")
    assert "partial" not in [r["note"] for r in rows]
    assert rows[1]["note"] == "R" and rows[1]["previous"] == rows[0]["slot"]


# -- failover: the replicas share the jobs, and the others take over a dead owner's ----------

SHARED = [f"job-{i}" for i in range(12)]
INTERVAL = 1.0
MISSED = INTERVAL + 4.0
"""A wait between two runs of a job longer than this counts as a missed slot: failover is
within the interval plus about 2.5 s (a grace and a look; benchmarks/fleet_scale.py measures
it); the rest is slack for a loaded machine."""


async def _top_owner(pg_conn: Any, schema: str, owners: list[str]) -> str:
    """The replica that ran the most jobs over the last 3 s (the owner of the most jobs)."""
    rows = await pg_conn.fetch(
        f"SELECT note, count(DISTINCT job) AS jobs FROM {schema}.log "
        "WHERE finished > clock_timestamp() - interval '3 s' GROUP BY note ORDER BY jobs DESC"
    )
    assert {r["note"] for r in rows} == set(owners), rows  # every replica owns some jobs
    return str(rows[0]["note"])


async def _shared_fleet(fleet: Replicas, pg_conn: Any) -> list[str]:
    owners = ["s1", "s2", "s3"]
    for owner in owners:
        fleet.start(owner, "share")
    s = fleet.schema

    async def sharing() -> bool:  # every replica runs some jobs, and their views agree
        rows = await pg_conn.fetch(
            f"SELECT note, count(*) FROM {s}.log WHERE finished > clock_timestamp() - "
            "interval '2 s' GROUP BY note"
        )
        return len(rows) == 3

    await eventually(sharing, 30, "the three replicas to share the jobs")
    await anyio.sleep(2)
    return owners


async def _check_fleet(pg_conn: Any, schema: str, since: datetime) -> dict[str, list[Any]]:
    """No slot committed twice, no overlap, no missed slot; the log by job."""
    rows = await pg_conn.fetch(f"SELECT * FROM {schema}.log ORDER BY job, started")
    by_job: dict[str, list[Any]] = {}
    for row in rows:
        by_job.setdefault(row["job"], []).append(row)
    assert sorted(by_job) == sorted(SHARED)
    missed = []
    for job, runs in by_job.items():
        slots = [r["slot"] for r in runs]
        assert len(slots) == len(set(slots)), f"{job}: a slot committed twice"
        for prev, cur in zip(runs, runs[1:], strict=False):
            assert cur["started"] >= prev["finished"], f"{job}: runs overlap"
            assert cur["previous"] == prev["slot"]  # the watermark is the fleet's
            if (cur["started"] - prev["finished"]).total_seconds() > MISSED:
                missed.append((job, prev["finished"], cur["started"]))
        assert runs[-1]["started"] > since, f"{job}: no run after the failure"
    assert missed == [], missed
    committed = await pg_conn.fetch(
        f"SELECT job_id, slot, owner FROM {schema}.runs WHERE outcome = 'success' "
        "AND job_id <> 'ticklock.retention'"
    )
    assert sorted((r["job_id"], r["slot"], r["owner"]) for r in committed) == sorted(
        (r["job"], r["slot"], r["note"]) for r in rows
    ), "every write has its run, and every run its write (G4)"
    return by_job


async def test_a_killed_owner_s_jobs_run_again_on_the_others(fleet: Replicas, pg_conn: Any) -> None:
    owners = await _shared_fleet(fleet, pg_conn)
    s = fleet.schema
    victim = await _top_owner(pg_conn, s, owners)
    fleet.procs[victim].send_signal(signal.SIGKILL)
    fleet.procs[victim].wait()
    killed_at = datetime.now(timezone.utc)
    await anyio.sleep(8)
    for owner in owners:
        if owner != victim:
            assert fleet.stop(owner) == 0, fleet.output(owner)
    by_job = await _check_fleet(pg_conn, s, killed_at)
    # the victim's jobs moved to the others: the backups ran the slots it missed
    taken = [job for job, runs in by_job.items() if runs[-1]["note"] != victim]
    assert len(taken) == len(SHARED)
    stand_ins = [o for o in owners if o != victim and f"{victim} missed it" in fleet.output(o)]
    assert stand_ins, "a backup should have stood in for the killed owner"


async def test_a_paused_owner_s_jobs_run_on_the_others_and_its_late_writes_vanish(
    fleet: Replicas, pg_conn: Any
) -> None:
    owners = await _shared_fleet(fleet, pg_conn)
    s = fleet.schema
    victim = await _top_owner(pg_conn, s, owners)
    marker = fleet.marker(victim)
    before = marker.stat().st_mtime_ns

    async def in_handler() -> bool:
        return marker.stat().st_mtime_ns != before

    await eventually(in_handler, 10, f"{victim} to start a run")  # polled every 50 ms
    fleet.procs[victim].send_signal(signal.SIGSTOP)  # inside the handler's 0.4 s
    paused_at = datetime.now(timezone.utc)
    await anyio.sleep(10)
    fleet.procs[victim].send_signal(signal.SIGCONT)
    await anyio.sleep(4)
    for owner in owners:
        assert fleet.stop(owner) == 0, fleet.output(owner)
    await _check_fleet(pg_conn, s, paused_at)
    # the run it was in when paused lost its session: it ended as a failure, and its write
    # is not in the log (checked above: every write has a committed run of the same owner)
    failed = await pg_conn.fetchval(
        f"SELECT count(*) FROM {s}.runs WHERE owner = $1 AND outcome <> 'success' "
        "AND started_at < $2",
        victim,
        paused_at,
    )
    assert failed >= 1, "the paused run should have failed when the replica woke"
