"""The fold, written once: :func:`ticklock._runtime.plan.fold` is what a recorded run does to
the fleet's state, and each backend is held to it.

One sequence of runs (successes, failures and timeouts of a slot and its retries, a manual
failure, a long run that ends after a later slot committed, a failure that arrives after a
later slot committed) is recorded through a backend's own coordinator (``attempt``, then
``commit`` or ``record_failure``, as the runner does), and after each run the state the backend
reads back must be the fold of the one before: on ``MemoryDatabase`` and on PostgreSQL, whose
statements fold in SQL.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from random import Random

import pytest

from helpers import EACH_BACKEND
from ticklock import JobContext, every
from ticklock._backends.seam import NO_STATE, Coordinator
from ticklock._runtime.clock import SystemClock
from ticklock._runtime.plan import fold
from ticklock._schedule.job import Job, Outcome, RunResult
from ticklock.testing import MemoryDatabase

pytestmark = [
    pytest.mark.anyio,
    EACH_BACKEND,
]


async def handler(ctx: JobContext) -> None:
    """Never run: the runs are recorded directly."""


JOB = Job.declare(handler, every(60), id="folded", timeout=5)
BASE = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(hours=1)


def at(minutes: float) -> datetime:
    return BASE + timedelta(minutes=minutes)


def run(
    outcome: Outcome,
    slot: float,
    ended: float,
    *,
    owner: str = "A",
    manual: bool = False,
) -> RunResult:
    """A run of slot ``BASE + slot`` minutes, from its slot to ``BASE + ended`` minutes."""
    return RunResult(
        job_id=JOB.id,
        outcome=outcome,
        slot=at(slot),
        started_at=at(slot),
        finished_at=at(ended),
        owner=owner,
        error=None if outcome is Outcome.SUCCESS else f"{outcome.value} on purpose",
        manual=manual,
    )


SEQUENCE = [
    run(Outcome.SUCCESS, 0, 0.5),
    run(Outcome.FAILURE, 1, 1.5),  # the slot's first attempt fails
    run(Outcome.TIMEOUT, 1, 2.0, owner="B"),  # its retry times out elsewhere
    run(Outcome.SUCCESS, 1, 2.5),  # the next retry commits it: failures cleared
    run(Outcome.FAILURE, 3, 3.5, manual=True),  # a manual run that fails: never retried
    run(Outcome.ERROR, 7, 20),  # a long run that lost the database, ending late
    run(Outcome.SUCCESS, 8, 9),  # commits, and the later end above stays the last end
    run(Outcome.FAILURE, 2, 25, owner="B"),  # a slot already passed: changes nothing
    run(Outcome.FAILURE, 10, 26),
    run(Outcome.FAILURE, 10, 27),
    run(Outcome.SUCCESS, 11, 28, owner="B"),
]


@asynccontextmanager
async def coordinator(kind: str, pg_dsn: str) -> AsyncIterator[Coordinator]:
    clock = SystemClock()
    async with AsyncExitStack() as stack:
        if kind == "memory":
            c: Coordinator = MemoryDatabase().coordinator("A", clock)
        else:
            from ticklock._backends.postgres.coordinator import PostgresBackend

            schema = f"t_{uuid.uuid4().hex[:12]}"
            backend = PostgresBackend(pg_dsn, None, "fold", schema, Random(0))
            c = backend.coordinator("A", clock)
        await stack.enter_async_context(c.session())
        assert c.problem is None
        yield c


@pytest.mark.parametrize("limit", [None, 100], ids=["no-limit", "a-limit"])
async def test_each_backend_folds_every_run_as_plan_fold_does(
    kind: str, limit: int | None, request: pytest.FixtureRequest
) -> None:
    pg_dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    job = replace(JOB, limit=limit)  # a limit counts the scheduled successes
    async with coordinator(kind, pg_dsn) as c:
        states = await c.load({job.id: job}, BASE)
        expected = states.get(JOB.id, NO_STATE)
        assert expected == NO_STATE
        for i, result in enumerate(SEQUENCE):
            attempt = await c.attempt(job.id, job.timeout, result.slot or result.started_at)
            assert attempt.acquired, i
            assert attempt.state == expected, i  # what the tick reads under the lock
            if result.outcome is Outcome.SUCCESS:
                await attempt.commit(result, job)
                await attempt.close()
            else:
                await attempt.close()
                await attempt.record_failure(result, job)
            expected = fold(expected, result, counted=limit is not None)
            read, held = await c.read([job.id])
            assert held == frozenset(), i
            assert read[job.id] == expected, (i, result)
        # the sequence reached every branch of the fold
        assert expected.last_slot == at(11) and expected.last_end == at(28)
        assert expected.consecutive_failures == 0 and expected.failed_slot is None
        assert expected.successes == (0 if limit is None else 4)


async def test_a_manual_failure_of_a_slot_already_passed_still_serves_its_trigger(
    kind: str, request: pytest.FixtureRequest
) -> None:
    # A manual run whose slot is not after the watermark (its replica's clock behind the one
    # that committed) cannot commit; its failure must still serve the trigger request, or
    # every beat would serve it again, run the handler and fail again.
    pg_dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    async with coordinator(kind, pg_dsn) as c:
        await c.load({JOB.id: JOB}, BASE)
        now = datetime.now(timezone.utc)
        ahead = now + timedelta(seconds=1.5)  # within the database's bound for its future
        attempt = await c.attempt(JOB.id, JOB.timeout, ahead)
        await attempt.commit(RunResult(JOB.id, Outcome.SUCCESS, ahead, now, now, "B"), JOB)
        await attempt.close()
        await c.views(lambda: {JOB.id: JOB}, list).fleet.trigger(JOB.id, who="test")
        before = (await c.read([JOB.id]))[0][JOB.id]
        assert before.trigger_at is not None and before.trigger_at <= ahead
        slot = before.trigger_at  # the request's instant: at or before the watermark
        failed = RunResult(
            JOB.id, Outcome.ERROR, slot, slot, datetime.now(timezone.utc), "A", manual=True
        )
        attempt = await c.attempt(JOB.id, JOB.timeout, slot)
        assert attempt.acquired
        await attempt.close()
        await attempt.record_failure(failed, JOB)
        after = (await c.read([JOB.id]))[0][JOB.id]
        assert after == fold(before, failed, counted=False)
        assert after.trigger_at is None  # served
        assert after.last_slot == ahead and after.consecutive_failures == 0  # nothing else
