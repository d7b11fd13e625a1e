"""The ledger for real: a fleet that stops, a database that stops, a pause, a disabled job and
``catch_up=False``, read back through ``fleet.slots``, ``ticklock slots`` and the counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import asyncpg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from helpers import eventually, run_log
from pgserver import TempPostgres
from ticklock import JobContext, Scheduler, cron, every
from ticklock._backends.postgres.fleet import PostgresFleet, from_connection
from ticklock._backends.postgres.schema import migrate
from ticklock._operators.fleet import Fate, SlotRecord
from ticklock._operators.ledger import walking
from ticklock._schedule.spec import Spec, to_json

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def declare(scheduler: Scheduler, *, enabled: bool) -> None:
    @scheduler.job(every(0.5), id="ok")
    async def ok(ctx: JobContext) -> None: ...

    @scheduler.job(every(0.5), id="bad")
    async def bad(ctx: JobContext) -> None:
        raise RuntimeError("upstream said no")

    @scheduler.job(every(0.5), id="slow", timeout=0.2)
    async def slow(ctx: JobContext) -> None:
        await anyio.sleep(5)

    @scheduler.job(every(60), id="rare", timeout=1, overdue_grace=300)
    async def rare(ctx: JobContext) -> None:
        raise RuntimeError("rarely works")

    @scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), id="nightly", timeout=60)
    async def nightly(ctx: JobContext) -> None: ...

    @scheduler.job(every(0.5), id="held")
    async def held(ctx: JobContext) -> None: ...

    @scheduler.job(every(0.5), id="off", enabled=enabled)
    async def off(ctx: JobContext) -> None: ...

    @scheduler.job(every(0.5), id="catch")
    async def catch(ctx: JobContext) -> None: ...

    @scheduler.job(every(0.5), id="nocatch", catch_up=False)
    async def nocatch(ctx: JobContext) -> None: ...


@pytest.fixture
def server() -> Iterator[TempPostgres]:
    server = TempPostgres()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def counter(reader: InMemoryMetricReader, name: str, job_id: str) -> int:
    data = reader.get_metrics_data()
    assert data is not None
    return sum(
        int(getattr(point, "value", 0))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
        if point.attributes == {"ticklock.job.id": job_id}
    )


def has(ledger: list[SlotRecord], fate: Fate, reason: str | None = None) -> bool:
    return any(
        s.fate is fate and (reason is None or (s.reason is not None and reason in s.reason))
        for s in ledger
    )


async def test_every_fate_and_reason_happens_for_real(server: TempPostgres) -> None:
    start = datetime.now(timezone.utc)
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])

    env = {**os.environ, "TICKLOCK_DSN": server.dsn}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ticklock", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    async def ledger(job_id: str) -> list[SlotRecord]:
        conn = await asyncpg.connect(server.dsn)
        try:
            fleet = PostgresFleet(from_connection(conn), schema="ticklock", namespace="default")
            return await fleet.slots(job_id, start, datetime.now(timezone.utc))
        finally:
            await conn.close()

    def replica(*, off: bool) -> Scheduler:
        scheduler = Scheduler(server.dsn, owner="a", meter_provider=meters)
        declare(scheduler, enabled=off)
        return scheduler

    with run_log() as log:

        async def runs(job_id: str, outcome: str, n: int) -> bool:
            return log.outcomes(job_id).count(outcome) >= n

        first = replica(off=True)  # then deployed with enabled=False
        async with first:
            assert await first.fleet.pause("held", "INC-42: upstream down", who="ops") is True
            assert await first.fleet.pause("held", "again", who="ops") is False  # no change
            await eventually(lambda: runs("catch", "success", 3), 10, "runs before the stop")
            await eventually(lambda: runs("slow", "timeout", 2), 10, "timeouts")
        # the fleet is stopped: the slots due meanwhile are missed, and say why
        await anyio.sleep(4)  # a slot is pending for timeout + grace + 1 s: 2.25 s
        stopped = await ledger("catch")
        assert has(stopped, Fate.MISSED, "no live replica declared the job"), stopped

        again = replica(off=False)
        async with again:
            await eventually(lambda: runs("catch", "success", 5), 10, "the catch-up run")
            await eventually(lambda: runs("nocatch", "success", 5), 10, "nocatch again")
            # status: a job whose last run failed is FAILING at once (not yet overdue)
            status = await anyio.to_thread.run_sync(cli, "status")
            assert status.returncode == 1, status
            [rare] = [line for line in status.stdout.splitlines() if line.startswith("rare")]
            assert "FAILING" in rare and "on a: RuntimeError: rarely works" in rare, rare
            assert "paused by ops at" in status.stdout and "INC-42" in status.stdout
            shown = await anyio.to_thread.run_sync(cli, "status", "--json")
            jobs = {job["job_id"]: job for job in json.loads(shown.stdout)["jobs"]}
            nightly = jobs["nightly"]  # never ran: next due from its trigger, and its owner
            due = cron("17 3 * * *", tz="Europe/Berlin").next_fire(datetime.now(timezone.utc))
            assert due is not None and nightly["next_due"] == due.isoformat(), nightly
            assert nightly["owner"] == "a"
            assert nightly["schedule"] == "cron '17 3 * * *' Europe/Berlin"
            assert jobs["held"]["last_action"]["note"] == "INC-42: upstream down"
            assert jobs["ticklock.retention"]["builtin"] is True
            bogus = await anyio.to_thread.run_sync(cli, "status", "--fail-on", "late")
            assert bogus.returncode == 2 and "--fail-on takes overdue, failing" in bogus.stderr
            # the database stops while the replica runs: ticks fail until it answers
            before = log.outcomes("catch").count("success")
            await anyio.to_thread.run_sync(server.stop, "immediate")
            await eventually(lambda: runs("catch", "error", 1), 10, "ticks failing")
            await anyio.sleep(1.5)
            await anyio.to_thread.run_sync(server.start)
            await eventually(lambda: runs("catch", "success", before + 3), 30, "ticks to resume")

    catch, nocatch = await ledger("catch"), await ledger("nocatch")
    assert has(catch, Fate.RAN)
    assert has(catch, Fate.COVERED, "no live replica declared the job"), catch
    assert has(catch, Fate.COVERED, "the database was unreachable (from a)"), catch
    covered = next(s for s in catch if s.fate is Fate.COVERED)
    assert covered.run is not None and covered.run.outcome == "success"  # names its run
    assert has(nocatch, Fate.SKIPPED, "catch_up=False"), nocatch
    assert has(await ledger("bad"), Fate.FAILED)
    assert has(await ledger("slow"), Fate.TIMED_OUT)
    assert has(await ledger("held"), Fate.SKIPPED, "paused by ops at"), await ledger("held")
    assert has(await ledger("held"), Fate.SKIPPED, "INC-42: upstream down")
    off = await ledger("off")
    assert has(off, Fate.RAN) and has(off, Fate.SKIPPED, "disabled: declared with enabled=False")

    # the counters: owed = committed + failed + missed, per job, from the runs' own replicas
    assert counter(reader, "ticklock.slots.missed", "catch") > 0
    assert counter(reader, "ticklock.slots.committed", "catch") > 0
    assert counter(reader, "ticklock.slots.failed", "bad") > 0
    assert counter(reader, "ticklock.slots.owed", "bad") >= counter(
        reader, "ticklock.slots.failed", "bad"
    )
    meters.shutdown()

    # the CLI gives the same ledger, as text and as JSON
    since = (start - timedelta(seconds=1)).isoformat()

    text = await anyio.to_thread.run_sync(cli, "slots", "catch", "--since", since)
    assert text.returncode == 0, text.stderr
    assert "covered" in text.stdout and "the database was unreachable (from a)" in text.stdout
    shown = await anyio.to_thread.run_sync(cli, "slots", "catch", "--since", since, "--json")
    body: dict[str, Any] = json.loads(shown.stdout)  # as /api/jobs/{id}/slots answers
    assert body["job_id"] == "catch" and set(body) == {"job_id", "since", "until", "slots"}
    slots: list[dict[str, Any]] = body["slots"]
    assert {"ran", "covered"} <= {s["fate"] for s in slots}
    assert all(s["job_id"] == "catch" for s in slots)
    assert all(s["run"]["job_id"] == "catch" for s in slots if s["run"] is not None)
    held = await anyio.to_thread.run_sync(cli, "slots", "held", "--since", since)
    assert "paused by ops" in held.stdout and "INC-42" in held.stdout


async def _aged(conn: asyncpg.Connection[Any], job_id: str, days: int) -> datetime:
    """Rows of a replica live for ``days`` declaring ``job_id`` (``every(1)``), paused for all
    but the first of them, with a run just before the pause; the server's now."""
    now: datetime = await conn.fetchval("SELECT now()")
    born, paused = now - timedelta(days=days), now - timedelta(days=days - 1)
    spec = Spec(
        every(1),
        timeout=0.5,
        retries=0,
        catch_up=True,
        overdue_grace=1.0,
        failure_threshold=1,
        enabled=True,
    )
    await conn.execute(
        "INSERT INTO ticklock.jobs (namespace, job_id, spec, paused_at) "
        "VALUES ('default', $1, $2::jsonb, $3)",
        job_id,
        json.dumps(to_json(spec)),
        paused,
    )
    await conn.execute(
        "INSERT INTO ticklock.audit (namespace, job_id, at, action, who, changed) "
        "VALUES ('default', $1, $2, 'pause', 'ops', true)",
        job_id,
        paused,
    )
    ran = paused - timedelta(seconds=1)
    await conn.execute(
        "INSERT INTO ticklock.runs (namespace, job_id, slot, started_at, finished_at, outcome, "
        "owner) VALUES ('default', $1, $2, $2, $2, 'success', 'old')",
        job_id,
        ran,
    )
    await conn.execute(
        "INSERT INTO ticklock.presence (namespace, owner, started_at, since, until, jobs, "
        "disabled) VALUES ('default', $1, $2, $2, $3, $4, '{}')",
        f"old-{job_id}",
        born,
        now,
        [job_id],
    )
    return now


async def test_a_days_ledger_on_postgres_costs_a_day_however_old_the_records(
    server: TempPostgres,
) -> None:
    # records kept for a year (a longer retention than the default): a replica live all
    # along, the job paused 364 days ago; the day's ledger is the same as on two days' records
    conn = await asyncpg.connect(server.dsn)
    try:
        await migrate(conn, "ticklock")
        fleet = PostgresFleet(from_connection(conn), schema="ticklock", namespace="default")
        ledgers: list[list[tuple[timedelta, Fate, str | None]]] = []
        steps: list[int] = []
        for job_id, age in (("year", 365), ("days", 2)):
            now = await _aged(conn, job_id, age)
            with walking() as walk:
                ledger = await fleet.slots(job_id, now - timedelta(days=1), now)
            ledgers.append([(s.slot - now, s.fate, s.reason) for s in ledger])
            steps.append(walk.steps)
    finally:
        await conn.close()
    year, days = ledgers
    assert len(year) == 1000 and [s[:2] for s in year] == [s[:2] for s in days]
    assert year[0][1] is Fate.SKIPPED and "paused by ops" in (year[0][2] or "")
    assert steps[0] <= 10_000 and steps[1] <= 10_000, steps  # the day's slots, not the year's


async def test_slots_says_a_run_was_late_and_gives_the_runs_reports(server: TempPostgres) -> None:
    # a resume after a pause on real PostgreSQL: the slot due while paused runs late, and
    # `ticklock slots` lists it with why; --json carries its lateness and each run's report
    env = {**os.environ, "TICKLOCK_DSN": server.dsn}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ticklock", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    start = datetime.now(timezone.utc) - timedelta(seconds=1)
    scheduler = Scheduler(server.dsn, owner="a")

    @scheduler.job(every(1), id="paused", timeout=0.5)  # overdue_grace: 1 s
    async def paused(ctx: JobContext) -> dict[str, int]:
        return {"n": 1}

    @scheduler.job(every(1), id="wordy", timeout=0.5)
    async def wordy(ctx: JobContext) -> dict[str, str]:
        return {"text": "x" * 1000}

    with run_log() as log:

        async def ran(job_id: str, n: int) -> bool:
            return log.outcomes(job_id).count("success") >= n

        async with scheduler:
            await eventually(lambda: ran("paused", 2), 10, "runs before the pause")
            await scheduler.fleet.pause("paused", "INC-5", who="ops")
            await anyio.sleep(3)
            before = log.outcomes("paused").count("success")
            await scheduler.fleet.resume("paused", who="ops")
            await eventually(lambda: ran("paused", before + 1), 10, "the run after the resume")
            await eventually(lambda: ran("wordy", 1), 10, "a wordy run")
    since = start.isoformat()

    shown = await anyio.to_thread.run_sync(cli, "slots", "paused", "--since", since, "--json")
    assert shown.returncode == 0, shown.stderr
    slots: list[dict[str, Any]] = json.loads(shown.stdout)["slots"]
    ran_slots = [s for s in slots if s["fate"] == "ran"]
    assert all(s["run"]["report"] == {"n": 1} for s in ran_slots), ran_slots
    [late] = [s for s in ran_slots if s["reason"] is not None]
    assert late["lateness"] > 1 and "paused by ops at" in late["reason"], late
    assert "INC-5" in late["reason"]
    assert all(0 <= s["lateness"] < 1 for s in ran_slots if s is not late)
    assert all(s["lateness"] is None for s in slots if s["run"] is None)

    text = await anyio.to_thread.run_sync(cli, "slots", "paused", "--since", since)
    assert text.returncode == 0, text.stderr
    [row] = [line for line in text.stdout.splitlines() if line.startswith(late["slot"][:19])]
    assert " ran " in row and "paused by ops at" in row and "INC-5" in row, text.stdout
    assert "ran (1 late)" in text.stdout.splitlines()[0], text.stdout

    wordy_json = await anyio.to_thread.run_sync(cli, "slots", "wordy", "--since", since, "--json")
    [report, *_] = [s["run"]["report"] for s in json.loads(wordy_json.stdout)["slots"] if s["run"]]
    assert report["cut_by_ticklock"] is True and report["characters"] > 1000, report
