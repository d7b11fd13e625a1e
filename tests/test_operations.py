"""Issue 16 end to end: pause, resume, trigger, forget, history and status, as an operator uses
them, against real replica processes, a real PostgreSQL and a real PgBouncer.

Each replica is ``python -m ticklock run ops_app:scheduler --dsn ...`` (stopped with a real
SIGTERM); each command is ``python -m ticklock ...`` in a subprocess. Every bound is measured
on the database's own timestamps: a handler logs its tick transaction's start (``now()``),
and the database stamps ``paused_at`` and ``trigger_at`` too.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import Replicas, Result, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

MARGIN = timedelta(seconds=0.5)
"""How long after ``paused_at`` a tick transaction may still have started without seeing the
pause: the pause commits within milliseconds of its ``now()`` (longer only while a tick's
commit holds the job's row), and a tick reads it under the job's lock."""
BOUND = timedelta(seconds=5)
"""The contract: a pause, resume or trigger is honoured by every replica within 5 s."""


# --- what the database says --------------------------------------------------------------------


async def db_now(conn: Any) -> datetime:
    now: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return now


async def wait_live(
    conn: Any, schema: str, owners: set[str], since: datetime | None = None
) -> None:
    """Wait until every one of ``owners`` has a heartbeat row (started after ``since``)."""

    async def live() -> bool:
        if await conn.fetchval("SELECT to_regclass($1)", f"{schema}.replicas") is None:
            return False  # no replica has migrated yet
        rows = await conn.fetch(
            f"SELECT owner FROM {schema}.replicas WHERE seen_at > now() - interval '60 s' "
            "AND started_at > coalesce($1::timestamptz, '-infinity')",
            since,
        )
        return owners <= {row["owner"] for row in rows}

    await eventually(live, 20, f"replicas {sorted(owners)} to report in")


async def wait_run(
    conn: Any, schema: str, job: str, after: datetime, what: str, within: float = 20
) -> datetime:
    """Wait for a logged run of ``job`` whose tick began after ``after``; the first one's start."""

    async def ran() -> bool:
        return bool(await first_run(conn, schema, job, after))

    await eventually(ran, within, what)
    first = await first_run(conn, schema, job, after)
    assert first is not None
    return first


async def first_run(conn: Any, schema: str, job: str, after: datetime) -> datetime | None:
    first: datetime | None = await conn.fetchval(
        f"SELECT min(tx) FROM {schema}.log WHERE job = $1 AND tx > $2", job, after
    )
    return first


async def last_run(conn: Any, schema: str, job: str) -> datetime | None:
    last: datetime | None = await conn.fetchval(
        f"SELECT max(tx) FROM {schema}.log WHERE job = $1", job
    )
    return last


async def sessions(conn: Any, schema: str, listening: bool = False) -> int:
    """The replicas' sessions (tagged with the schema, see :meth:`Replicas.tagged`), or those
    of them whose last statement was a LISTEN (a replica's listener does nothing else)."""
    count: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
        "AND (NOT $2 OR query LIKE 'LISTEN %')",
        schema,
        listening,
    )
    return count


async def count_beats(conn: Any, schema: str) -> None:
    """Log every beat of the replicas table in ``<schema>.beats`` (a trigger), so that the
    beats are counted exactly: ``SELECT count(*) FROM <schema>.beats WHERE at > ...``."""
    await conn.execute(
        f"""
CREATE TABLE {schema}.beats (owner text, at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION {schema}.beat() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO {schema}.beats (owner) VALUES (NEW.owner); RETURN NULL; END $$;
CREATE TRIGGER beat AFTER INSERT OR UPDATE ON {schema}.replicas
    FOR EACH ROW EXECUTE FUNCTION {schema}.beat();"""
    )


async def job_row(conn: Any, schema: str, job: str) -> Any:
    return await conn.fetchrow(
        f"SELECT * FROM {schema}.jobs WHERE namespace = 'default' AND job_id = $1", job
    )


def state_of(status: Result, job: str) -> str:
    """The status column of ``job`` in ``ticklock status``'s table."""
    for line in status.out.splitlines():
        fields = line.split()
        if fields and fields[0] == job:
            return fields[1]
    raise AssertionError(f"{job} is not in the status:\n{status}")


def json_job(status: Result, job: str) -> dict[str, Any]:
    jobs = {j["job_id"]: j for j in status.json()["jobs"]}
    assert job in jobs, status
    found: dict[str, Any] = jobs[job]
    return found


# --- pause, resume -----------------------------------------------------------------------------


async def test_a_pause_from_the_cli_stops_every_replica_survives_restarts_and_resume_undoes_it(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema
    for owner in ("A", "B"):
        ops.start(owner, "pause")
    await wait_live(pg_conn, s, {"A", "B"})
    start = await db_now(pg_conn)
    await wait_run(pg_conn, s, "steady", start, "steady to run")

    async def both_listen() -> bool:  # the path under test here is NOTIFY, not the poll
        return await sessions(pg_conn, s, listening=True) == 2

    await eventually(both_listen, 20, "both replicas to LISTEN")

    paused = await ops.cli("pause", "steady")
    assert paused.code == 0, paused
    assert "paused 'steady'" in paused.out
    paused_at = (await job_row(pg_conn, s, "steady"))["paused_at"]
    assert paused_at is not None
    # the fleet goes on running its other job for longer than the contract's bound
    await wait_run(pg_conn, s, "canary", paused_at + BOUND + MARGIN, "canary to run on")
    last = await last_run(pg_conn, s, "steady")
    assert last is not None and last <= paused_at + MARGIN, (last, paused_at)
    late = await pg_conn.fetchval(
        f"SELECT count(*) FROM {s}.runs WHERE job_id = 'steady' AND started_at > $1",
        paused_at + MARGIN,
    )
    assert late == 0, "a run recorded after the pause"

    # it would be overdue by now; paused, it is not, and status says so with exit 0
    assert (await job_row(pg_conn, s, "steady"))["overdue_at"] < await db_now(pg_conn)
    status = await ops.cli("status")
    assert status.code == 0, status
    assert state_of(status, "steady") == "PAUSED", status
    as_json = await ops.cli("status", "--json")
    assert as_json.code == 0, as_json
    steady = json_job(as_json, "steady")
    assert steady["state"] == "paused"
    assert steady["paused_at"] == paused_at.isoformat()

    # a deploy: both replicas stop and start again; the pause holds
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)
    restarted = await db_now(pg_conn)
    for owner in ("A", "B"):
        ops.start(owner, "pause")
    await wait_live(pg_conn, s, {"A", "B"}, since=restarted)
    up = await db_now(pg_conn)
    await wait_run(pg_conn, s, "canary", up + timedelta(seconds=2), "the new replicas to run")
    last = await last_run(pg_conn, s, "steady")
    assert last is not None and last <= paused_at + MARGIN, "a replica ran it after a restart"
    status = await ops.cli("status")
    assert status.code == 0 and state_of(status, "steady") == "PAUSED", status

    before = await db_now(pg_conn)
    resumed = await ops.cli("resume", "steady")
    assert resumed.code == 0, resumed
    assert (await job_row(pg_conn, s, "steady"))["paused_at"] is None
    back = await wait_run(pg_conn, s, "steady", before, "steady to run again after resume")
    assert back - before <= BOUND, f"resumed after {back - before}"
    status = await ops.cli("status", "--json")
    assert status.code == 0, status
    assert json_job(status, "steady")["state"] == "ok"
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)


# --- trigger -----------------------------------------------------------------------------------


async def manual_runs(conn: Any, schema: str, job: str) -> list[Any]:
    rows: list[Any] = await conn.fetch(
        f"SELECT * FROM {schema}.runs WHERE job_id = $1 ORDER BY id", job
    )
    assert all(row["manual"] for row in rows), rows  # the job has no scheduled run in the test
    return rows


async def trigger_once(
    ops: Replicas, conn: Any, job: str, done: int, dsn: str | None = None
) -> Any:
    """``ticklock trigger JOB``; wait for the run it asked for (the ``done + 1``-th) and check
    that it is the one the command announced, served within the contract's bound."""
    s = ops.schema
    before = await db_now(conn)
    asked = await ops.cli("trigger", job, dsn=dsn)
    after = await db_now(conn)
    assert asked.code == 0, asked
    printed = re.search(r"\(slot (\S+)\)", asked.out)
    assert printed is not None, asked

    async def served() -> bool:
        return len(await manual_runs(conn, s, job)) > done

    await eventually(served, 20, f"the fleet to serve the trigger of {job}")
    run = (await manual_runs(conn, s, job))[done]
    assert run["manual"] and run["outcome"] == "success", run
    assert before <= run["slot"] <= after, (before, run["slot"], after)  # the request's instant
    assert run["slot"].isoformat(timespec="seconds") == printed.group(1)
    assert run["started_at"] - run["slot"] <= BOUND, run
    return run


async def trigger_once_any(ops: Replicas, conn: Any, job: str) -> Any:
    """:func:`trigger_once` for a job that also has scheduled runs."""
    s = ops.schema
    done = await conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = $1 AND manual", job)
    asked = await ops.cli("trigger", job)
    assert asked.code == 0, asked

    async def served() -> bool:
        n = await conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = $1 AND manual", job)
        return bool(n > done)

    await eventually(served, 20, f"the fleet to serve the trigger of {job}")


async def test_a_trigger_from_the_cli_runs_the_job_once_on_one_of_the_replicas(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema
    for owner in ("A", "B"):
        ops.start(owner, "trigger", log_level="DEBUG")  # the log shows the race
    await wait_live(pg_conn, s, {"A", "B"})
    assert await job_row(pg_conn, s, "rare") is not None

    first = await trigger_once(ops, pg_conn, "rare", 0)
    # both replicas heard the request and raced for it: one ran it; the other found the lock
    # held, or took it after the run and found the request served
    await anyio.sleep(2)
    assert len(await manual_runs(pg_conn, s, "rare")) == 1
    assert (await job_row(pg_conn, s, "rare"))["trigger_at"] is None

    # later requests each run once more (and race again)
    slots = [first["slot"]]
    for done in (1, 2):
        slots.append((await trigger_once(ops, pg_conn, "rare", done))["slot"])
    assert slots == sorted(set(slots))

    off = await ops.cli("trigger", "off")
    assert off.code == 1, off
    assert "'off'" in off.err and "enabled=False" in off.err, off
    unknown = await ops.cli("trigger", "no-such-job")
    assert unknown.code == 1, unknown
    assert "'no-such-job'" in unknown.err, unknown

    await anyio.sleep(1)
    runs = await manual_runs(pg_conn, s, "rare")
    assert len(runs) == 3, runs
    logged = await pg_conn.fetch(f"SELECT slot FROM {s}.log WHERE job = 'rare' ORDER BY tx")
    assert [r["slot"] for r in logged] == slots  # each committed once
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = 'off'") == 0
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)


# --- through PgBouncer in transaction mode -----------------------------------------------------


async def test_behind_pgbouncer_the_replicas_poll_and_still_obey_within_five_seconds(
    ops: Replicas, pg_conn: Any, bouncer: str
) -> None:
    # The replicas and the commands all go through the bouncer, which forwards no
    # notification: the replicas cannot LISTEN and fall back to polling.
    s = ops.schema
    for owner in ("A", "B"):
        ops.start(owner, "ops", dsn=bouncer)
    await wait_live(pg_conn, s, {"A", "B"})
    start = await db_now(pg_conn)
    await wait_run(pg_conn, s, "steady", start, "steady to run through the bouncer")
    assert await sessions(pg_conn, s) > 0  # the replicas' sessions are there to be seen
    listening = await sessions(pg_conn, s, listening=True)
    assert listening == 0, "a replica listens: the poll would not be under test"

    paused = await ops.cli("pause", "steady", dsn=bouncer)
    assert paused.code == 0, paused
    paused_at = (await job_row(pg_conn, s, "steady"))["paused_at"]
    await wait_run(pg_conn, s, "canary", paused_at + BOUND + MARGIN, "canary to run on")
    last = await last_run(pg_conn, s, "steady")
    assert last is not None and last <= paused_at + MARGIN, (last, paused_at)

    # a trigger is only seen by a poll: served within the bound all the same
    await trigger_once(ops, pg_conn, "rare", 0, dsn=bouncer)
    await anyio.sleep(1)
    assert len(await manual_runs(pg_conn, s, "rare")) == 1

    before = await db_now(pg_conn)
    resumed = await ops.cli("resume", "steady", dsn=bouncer)
    assert resumed.code == 0, resumed
    back = await wait_run(pg_conn, s, "steady", before, "steady to run again after resume")
    assert back - before <= BOUND, f"resumed after {back - before}"
    status = await ops.cli("status", dsn=bouncer)
    assert status.code == 0, status
    assert state_of(status, "steady") == "ok" and state_of(status, "rare") == "ok", status
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)
        assert "outcome=error" not in ops.output(owner), ops.output(owner)


# --- a renamed job: UNDECLARED, then forget ----------------------------------------------------


async def test_a_job_no_live_replica_declares_is_undeclared_not_overdue_and_can_be_forgotten(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema
    # release 1 runs old.job; release 2 renamed it away
    ops.start("V1", "v1")
    await wait_live(pg_conn, s, {"V1"})
    await wait_run(pg_conn, s, "old.job", await db_now(pg_conn), "release 1 to run old.job")
    assert ops.stop("V1") == 0, ops.output("V1")
    history = await pg_conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = 'old.job'")
    assert history >= 1

    async def overdue() -> bool:
        row = await job_row(pg_conn, s, "old.job")
        return bool(row["overdue_at"] < await db_now(pg_conn))

    await eventually(overdue, 20, "old.job to be overdue")
    # no replica is live: nobody can say it was removed, so it is an overdue job
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.replicas") == 0
    status = await ops.cli("status")
    assert status.code == 1, status
    assert state_of(status, "old.job") == "OVERDUE" and state_of(status, "keep") == "ok", status
    assert "none reported" in status.out, status

    for owner in ("A", "B"):
        ops.start(owner, "v2")
    await wait_live(pg_conn, s, {"A", "B"})
    status = await ops.cli("status")
    assert status.code == 0, status
    assert state_of(status, "old.job") == "UNDECLARED", status
    assert state_of(status, "keep") == "ok", status
    assert "live replicas (2)" in status.out, status
    as_json = await ops.cli("status", "--json")
    assert as_json.code == 0, as_json
    assert json_job(as_json, "old.job")["state"] == "undeclared"
    assert sorted(r["owner"] for r in as_json.json()["replicas"]) == ["A", "B"]

    refused = await ops.cli("forget", "keep")
    assert refused.code == 1, refused
    assert "'keep'" in refused.err and "declares" in refused.err, refused
    assert await job_row(pg_conn, s, "keep") is not None
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = 'keep'") > 0

    forgotten = await ops.cli("forget", "old.job")
    assert forgotten.code == 0, forgotten
    assert await job_row(pg_conn, s, "old.job") is None
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = 'old.job'") == 0
    status = await ops.cli("status", "--json")
    assert status.code == 0, status
    assert "old.job" not in {j["job_id"] for j in status.json()["jobs"]}
    again = await ops.cli("forget", "old.job")
    assert again.code == 1 and "'old.job'" in again.err, again
    for owner in ("A", "B"):
        assert ops.stop(owner) == 0, ops.output(owner)


# --- history -----------------------------------------------------------------------------------


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


async def test_history_shows_the_last_runs_newest_first_with_outcome_error_and_manual_flag(
    ops: Replicas, pg_conn: Any
) -> None:
    s = ops.schema
    ops.start("A", "history")
    await wait_live(pg_conn, s, {"A"})

    async def mixed() -> bool:
        n: int = await pg_conn.fetchval(f"SELECT count(*) FROM {s}.runs WHERE job_id = 'flaky'")
        return n >= 3

    await eventually(mixed, 20, "flaky to run three times")
    # stop the schedule so that the manual run is the newest, then ask for one
    assert (await ops.cli("pause", "flaky")).code == 0
    await trigger_once_any(ops, pg_conn, "flaky")
    rows = await pg_conn.fetch(
        f"SELECT * FROM {s}.runs WHERE job_id = 'flaky' ORDER BY finished_at DESC, id DESC"
    )
    assert rows[0]["manual"] and not any(r["manual"] for r in rows[1:]), rows
    assert {r["outcome"] for r in rows} == {"success", "failure"}, rows

    # --json, the DSN from TICKLOCK_DSN: every field as the database has it, newest first
    as_json = await ops.cli("history", "flaky", "--json", env={"TICKLOCK_DSN": ops.dsn})
    assert as_json.code == 0, as_json
    expected = [
        {
            "job_id": "flaky",
            "slot": iso(r["slot"]),
            "started_at": iso(r["started_at"]),
            "finished_at": iso(r["finished_at"]),
            "duration": (r["finished_at"] - r["started_at"]).total_seconds(),
            "outcome": r["outcome"],
            "owner": "A",
            "manual": r["manual"],
            "batches": r["batches"],
            "capped": r["capped"],
            "backfilled_by": None,
            "report": None if r["report"] is None else json.loads(r["report"]),
            "error": r["error"],
        }
        for r in rows
    ]
    assert as_json.json() == {"job_id": "flaky", "runs": expected}  # /api/jobs/{id}/runs's
    failures = [run for run in as_json.json()["runs"] if run["outcome"] == "failure"]
    assert failures and all(re.fullmatch(r"RuntimeError: boom \d+", f["error"]) for f in failures)
    successes = [run for run in as_json.json()["runs"] if run["outcome"] == "success"]
    assert successes and all(run["report"]["n"] % 2 == 1 for run in successes)

    limited = await ops.cli("history", "flaky", "--limit", "2")
    assert limited.code == 0, limited
    lines = limited.out.splitlines()
    assert lines[0].split()[:3] == ["finished", "slot", "outcome"], limited
    assert len(lines) == 3, limited  # the header and two runs
    for line, row in zip(lines[1:], rows[:2], strict=True):
        assert line.split()[2] == row["outcome"], (line, row)
        assert ("manual" in line) == row["manual"], (line, row)
        note = row["error"] or json.dumps(json.loads(row["report"]))
        assert line.endswith(note), (line, note)
    limited_json = await ops.cli("history", "flaky", "--limit", "2", "--json")
    assert limited_json.json()["runs"] == expected[:2]

    unknown = await ops.cli("history", "no-such-job")
    assert unknown.code == 1 and "'no-such-job'" in unknown.err, unknown
    zero = await ops.cli("history", "flaky", "--limit", "0")
    assert zero.code == 2 and "--limit" in zero.err, zero
    assert ops.stop("A") == 0, ops.output("A")


# --- the idle cost of listening ----------------------------------------------------------------


async def test_an_idle_replica_that_listens_beats_only_every_fifteen_seconds(
    ops: Replicas, pg_conn: Any
) -> None:
    # Every beat of the replicas table lands in a log of its own (a trigger), so that the
    # beats are counted exactly. Load only makes beats later, never more frequent.
    s = ops.schema
    migrated = await ops.cli("migrate")
    assert migrated.code == 0, migrated
    await count_beats(pg_conn, s)
    ops.start("I", "idle")
    await wait_live(pg_conn, s, {"I"})

    async def listening() -> bool:
        return await sessions(pg_conn, s, listening=True) == 1

    await eventually(listening, 20, "the replica to LISTEN")
    await anyio.sleep(1)  # the beat that follows the LISTEN
    since = await db_now(pg_conn)
    await anyio.sleep(16)
    beats = await pg_conn.fetch(f"SELECT at FROM {s}.beats WHERE at > $1 ORDER BY at", since)
    # every 15 s: at most 2 in 16 s (the 3 s poll would make at least 5)
    assert len(beats) <= 2, [b["at"] for b in beats]
    assert len(beats) >= 1, "the replica stopped beating"
    assert ops.stop("I") == 0, ops.output("I")
