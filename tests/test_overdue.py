"""OVERDUE is the absence alarm only: a finished run of any outcome resets its clock, failures
and timeouts make a job FAILING, never OVERDUE, and a job that stopped running is OVERDUE once
the first fire due after its last finished run, plus its timeout and grace, has passed.

A table on a ManualClock (``health()`` and the fleet view agree), and one live probe on
PostgreSQL: ``ticklock status --fail-on overdue`` after a failed run, then after the job
stopped."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import at, eventually, run_log
from ticklock import JobContext, Outcome, Scheduler, cron, every
from ticklock._operators.fleet import JobState
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = pytest.mark.anyio

T0 = at("2026-03-02T00:00Z")  # a Monday, on a whole minute
TIMEOUT, GRACE = 10.0, 5.0
"""Every job of the table: a run finished at E leaves it overdue after the first fire due after
E, plus 15 s (every(60): E + 75 s)."""


@dataclass(frozen=True)
class Row:
    """One scenario: the job's ``trigger`` (``every`` 60 s from T0, or ``cron`` every minute,
    first fire at T0 + 60), what its runs do in turn (``S`` succeed, ``F`` fail, ``T`` time out,
    ``H`` hang past their timeout and never end; the last letter repeats), a ``fault`` made
    at ``fault_at`` seconds (``pause``, ``stop``: the scheduler leaves, ``cut``: the replica
    loses the database, its ticks end ``error`` before the handler), and what ``health()``
    and the fleet view say ``at`` seconds."""

    trigger: str
    runs: str
    at: float
    overdue: bool
    failing: bool
    state: JobState
    threshold: int = 1
    fault: str | None = None
    fault_at: float = 1.0


ROWS = {
    # a run that fails resets the absence clock as a success does: overdue after 120 + 15 s
    "every_one_failure": Row("every", "SF", 100, False, True, JobState.FAILING),
    "every_one_failure_then_success": Row("every", "SFS", 130, False, False, JobState.OK),
    "every_failures_in_a_row": Row("every", "SF", 3600, False, True, JobState.FAILING),
    # timeouts: runs at 0, 60 (ends at 70), 130, 200, ...: each one finished
    "every_timeouts": Row("every", "ST", 3600, False, True, JobState.FAILING),
    "cron_one_failure": Row("cron", "SF", 170, False, True, JobState.FAILING),
    "cron_failures_in_a_row": Row("cron", "F", 3600, False, True, JobState.FAILING),
    "cron_timeouts": Row("cron", "T", 3590, False, True, JobState.FAILING),  # none in flight
    # failure_threshold=3: failures at 60 and 120 are under it, the third at 180 reaches it
    "threshold_3_two_failures": Row("every", "SF", 150, False, False, JobState.OK, 3),
    "threshold_3_three_failures": Row("every", "SF", 200, False, True, JobState.FAILING, 3),
    "threshold_3_failures_in_a_row": Row("every", "SF", 3600, False, True, JobState.FAILING, 3),
    # paused: never overdue, however long
    "paused": Row("every", "S", 3600, False, False, JobState.PAUSED, fault="pause"),
    "paused_after_failures": Row("every", "SF", 3600, False, True, JobState.PAUSED, 1, "pause", 61),
    # the job stopped running: overdue once the first fire after its last end + 15 s passed
    "every_hung_before_the_bound": Row("every", "SH", 75, False, False, JobState.OK),
    "every_hung_past_the_bound": Row("every", "SH", 76, True, False, JobState.OVERDUE),
    "every_failed_then_hung": Row("every", "SFH", 136, True, True, JobState.OVERDUE),
    "cron_hung_past_the_bound": Row("cron", "SH", 136, True, False, JobState.OVERDUE),
    "every_stopped_before_the_bound": Row("every", "S", 75, False, False, JobState.OK, 1, "stop"),
    "every_stopped_past_the_bound": Row("every", "S", 76, True, False, JobState.OVERDUE, 1, "stop"),
    "every_stopped_after_a_failure": Row(
        "every", "SF", 136, True, True, JobState.OVERDUE, 1, "stop", 61
    ),
    "cron_stopped_past_the_bound": Row(
        "cron", "S", 136, True, False, JobState.OVERDUE, 1, "stop", 61
    ),
    # ticks that never reach the handler finish no run
    "every_cut_off_before_the_bound": Row("every", "S", 75, False, False, JobState.OK, fault="cut"),
    "every_cut_off_past_the_bound": Row(
        "every", "S", 76, True, False, JobState.OVERDUE, fault="cut"
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
async def test_overdue_is_the_absence_alarm_only(row: Row) -> None:
    clock = ManualClock(T0)
    db = MemoryDatabase()
    scheduler = Scheduler(database=db, clock=clock, owner="a")
    trigger = every(60) if row.trigger == "every" else cron("* * * * *")
    plan = list(row.runs)
    release = anyio.Event()  # ends the hung runs once the test has looked

    @scheduler.job(
        trigger, id="j", timeout=TIMEOUT, overdue_grace=GRACE, failure_threshold=row.threshold
    )
    async def j(ctx: JobContext) -> None:
        step = plan.pop(0) if len(plan) > 1 else plan[0]
        if step == "F":
            raise RuntimeError("it fails")
        if step == "T":
            await anyio.sleep_forever()  # cancelled by its timeout: the run ends `timeout`
        if step == "H":
            with anyio.CancelScope(shield=True):  # deaf to its timeout: the run never ends
                await release.wait()

    def look() -> tuple[bool, bool]:
        [health] = scheduler.health()
        return health.overdue, health.failing

    async def state() -> JobState:
        [record] = [r for r in await scheduler.fleet.jobs() if r.job_id == "j"]
        return record.state

    seen, shown = None, None
    with run_log():
        async with scheduler:
            await clock.advance(row.fault_at)
            if row.fault == "pause":
                await scheduler.pause("j")
            elif row.fault == "cut":
                db.kill("a")
            if row.fault != "stop":
                await clock.advance(row.at - row.fault_at)
                seen, shown = look(), await state()
            release.set()
        if row.fault == "stop":  # health() and the fleet view still judge
            await clock.advance(row.at - row.fault_at)
            seen, shown = look(), await state()
    assert (seen, shown) == ((row.overdue, row.failing), row.state)


# -- the probe on PostgreSQL ---------------------------------------------------------------

PERIOD, PROBE_TIMEOUT = 900.0, 60.0  # every(minutes=15), timeout=60: the default grace is 90 s
BOUND = PERIOD + PROBE_TIMEOUT + 90.0
LEAD = 12.0  # the margin for two `status` runs before the bound passes, on a loaded machine
"""Seconds from the test's first read of the database's clock to the failed run's bound."""


async def status(dsn: str, schema: str, *args: str) -> tuple[int, str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "ticklock", "status", "--dsn", dsn, "--schema", schema, *args],
        check=False,
    )
    return done.returncode, done.stdout.decode()


def line(out: str, job_id: str) -> str:
    return next(x for x in out.splitlines() if x.startswith(job_id + " "))


@pytest.mark.postgres
async def test_status_fail_on_overdue_passes_a_failed_run_and_fails_once_the_job_stopped(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    async with Scheduler(pg_dsn, schema=pg_schema):  # the tables, before the clock starts
        pass
    now: datetime = await pg_conn.fetchval("SELECT now()")
    # the first run succeeds at S; the second, due at S + 15 min, fails and ends LEAD seconds
    # before its bound, and its success 15 min before the last success's bound
    start = now - timedelta(seconds=PERIOD + BOUND - LEAD)
    clock = ManualClock(start)
    scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)
    outcomes: list[str] = []

    @scheduler.job(every(minutes=15), id="purge", timeout=PROBE_TIMEOUT)
    async def purge(ctx: JobContext) -> None:
        if ctx.slot > start:
            raise RuntimeError("the second run fails")

    with run_log() as log:

        async def ran(outcome: str) -> bool:
            outcomes[:] = log.outcomes("purge")
            return outcome in outcomes

        async with scheduler:
            await eventually(lambda: ran("success"), 10, "the first run")
            await clock.advance(PERIOD)
            await eventually(lambda: ran("failure"), 10, "the second run")
        # the scheduler stopped: the job runs no more
    assert outcomes == ["success", "failure"]
    # the built-in retention job stopped with the scheduler too, and is overdue once its run
    # on the manual clock is old: out of this probe's question
    await pg_conn.execute(f"DELETE FROM {pg_schema}.jobs WHERE job_id = 'ticklock.retention'")
    code, out = await status(pg_dsn, pg_schema, "--fail-on", "overdue")
    assert code == 0, out  # one failed run: not the absence alarm
    assert "FAILING" in line(out, "purge"), out
    row = await pg_conn.fetchrow(
        f"SELECT overdue_at, last_end FROM {pg_schema}.jobs WHERE job_id = 'purge'"
    )
    failed_at = start + timedelta(seconds=PERIOD)
    assert row["last_end"] == failed_at
    assert row["overdue_at"] == failed_at + timedelta(seconds=BOUND)
    code, out = await status(pg_dsn, pg_schema)  # the default, overdue,failing: it is failing
    assert code == 1 and "FAILING" in line(out, "purge"), out
    # no run finishes any more: past the bound of the failed run's end, the alarm
    left = (row["overdue_at"] - await pg_conn.fetchval("SELECT now()")).total_seconds()
    await anyio.sleep(max(0.0, left) + 0.2)
    code, out = await status(pg_dsn, pg_schema, "--fail-on", "overdue")
    assert code == 1 and "OVERDUE" in line(out, "purge"), out


@pytest.mark.postgres
async def test_the_instant_status_reads_follows_a_failed_run_and_a_changed_schedule(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # the instant is stored with every finished run, and a replica that starts with another
    # schedule moves it from the job's last end: a failure's too
    start = at("2020-01-01T00:00:00Z")
    clock = ManualClock(start)

    async def tidy(ctx: JobContext) -> None:
        raise RuntimeError("it fails")

    def build(period: float) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)
        scheduler.add(
            tidy, every(period, initial_delay=3600), id="tidy", timeout=5, overdue_grace=1
        )
        return scheduler

    async def stored() -> Any:
        return await pg_conn.fetchval(
            f"SELECT overdue_at FROM {pg_schema}.jobs WHERE job_id = 'tidy'"
        )

    hourly = build(3600)
    async with hourly:
        await clock.advance(600)
        assert (await hourly.run_now("tidy")).outcome is Outcome.FAILURE  # at 00:10:00
    assert await stored() == at("2020-01-01T01:10:06Z")  # + 1 h + timeout + grace
    async with build(86400):  # deployed as a daily job; it does not run here
        pass
    assert await stored() == at("2020-01-02T00:10:06Z")
