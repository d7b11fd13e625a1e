"""The contract suite: the same fleet scenarios on the in-memory double and on PostgreSQL,
asserting what a user observes (which slots ran, their outcomes, who ran them, how late).

Each scenario is written once against :class:`Backend`; the ``backend`` fixture gives it
``memory`` (replicas in this process sharing one ``MemoryDatabase`` on a ``ManualClock``) or
``postgres`` (replica processes of ``contract_app.py`` on the session's server, in real time,
SIGKILLed or SIGSTOPped for the faults). The jobs are ``contract_jobs.py``'s. A new backend
is a class with :class:`Backend`'s methods and a row in the fixture; a new scenario is a test
that takes ``backend``.

What a user's test on the double may rely on is what these tests assert on both: a slot its
owner missed (dead or frozen) runs on another replica between :data:`GRACE` and
:data:`FAILOVER` seconds after its slot, and on time from then on; pauses, resumes and
triggers reach every replica; a batched sweep goes on from its cursor, capped; a slot already
committed is skipped, and a paused job starts no scheduled run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import anyio
import pytest

from contract_jobs import BACKLOG, CAP, CHUNK, INTERVAL, declare
from helpers import EACH_BACKEND, Replicas, eventually
from ticklock import Scheduler
from ticklock._operators.fleet import RunRecord
from ticklock._runtime.sharing import GRACE, weight
from ticklock.testing import ManualClock, MemoryDatabase

pytestmark = [
    pytest.mark.anyio,
    EACH_BACKEND,
]

FAILOVER = 2.0
"""Seconds after its slot by which a slot its owner missed has started elsewhere (G2b)."""
ON_TIME = 0.5
"""Seconds after its slot within which a run counts as on time (PostgreSQL's round trips)."""
RESUMED = 1.0
"""Seconds after a resume within which the job's run it owes has started (heard at once)."""
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Attempt:
    """One tick attempt, as its log line tells it (``skipped`` and ``locked`` included)."""

    job_id: str
    slot: str
    outcome: str
    owner: str


class Backend(Protocol):
    """A fleet of replicas on one backend, as a scenario drives and observes it."""

    async def start(self, scenario: str, *owners: str) -> None:
        """Start replicas ``owners``, each declaring the jobs of ``scenario``."""
        ...

    @property
    def operator(self) -> Scheduler:
        """A running scheduler of the fleet that declares no job: pause, resume, trigger and
        the history, as an operator's process would use them."""
        ...

    def now(self) -> datetime:
        """The fleet's clock."""
        ...

    async def wait(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        ...

    async def until(self, check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
        """Let time pass until ``check()`` holds; fail after ``within`` seconds."""
        ...

    def kill(self, owner: str) -> None:
        """Replica ``owner`` dies (SIGKILL)."""
        ...

    def freeze(self, owner: str) -> None:
        """Replica ``owner`` is paused (SIGSTOP)."""
        ...

    def thaw(self, owner: str) -> None:
        """Replica ``owner`` goes on (SIGCONT)."""
        ...

    def attempts(self, job_id: str) -> list[Attempt]:
        """Every tick attempt of ``job_id`` so far, in order."""
        ...


class Memory:
    """Replicas in this process sharing one :class:`MemoryDatabase` and one
    :class:`ManualClock`."""

    STEP = 0.05
    """Seconds of the manual clock between two checks of :meth:`until`."""

    def __init__(self, stack: AsyncExitStack, log: list[logging.LogRecord]) -> None:
        self.clock = ManualClock(T0)
        self.db = MemoryDatabase()
        self._stack = stack
        self._log = log
        self._operator: Scheduler | None = None

    async def start(self, scenario: str, *owners: str) -> None:
        for owner in owners:
            scheduler = Scheduler(database=self.db, clock=self.clock, owner=owner, shutdown_grace=1)
            declare(scheduler, scenario)
            await self._stack.enter_async_context(scheduler)
        self._operator = Scheduler(database=self.db, clock=self.clock, owner="operator")
        await self._stack.enter_async_context(self._operator)

    @property
    def operator(self) -> Scheduler:
        assert self._operator is not None
        return self._operator

    def now(self) -> datetime:
        return self.clock.now()

    async def wait(self, seconds: float) -> None:
        await self.clock.advance(seconds)

    async def until(self, check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
        deadline = self.clock.monotonic() + within
        while not await check():
            if self.clock.monotonic() >= deadline:
                raise AssertionError(f"timed out after {within} s waiting for {what}")
            await self.clock.advance(self.STEP)

    def kill(self, owner: str) -> None:
        self.db.kill(owner)

    def freeze(self, owner: str) -> None:
        self.db.freeze(owner)

    def thaw(self, owner: str) -> None:
        self.db.thaw(owner)

    def attempts(self, job_id: str) -> list[Attempt]:
        fields = [r.__dict__ for r in self._log]
        return [
            Attempt(f["job_id"], f["slot"], f["outcome"], f["owner"])
            for f in fields
            if f.get("job_id") == job_id and "outcome" in f
        ]


class Postgres:
    """Replica processes (``ticklock run contract_app:scheduler``) in a schema of the test's
    own, in real time; the operator is a scheduler in this process."""

    def __init__(self, stack: AsyncExitStack, dsn: str, schema: str, tmp: Path) -> None:
        self.replicas = Replicas(dsn, schema, tmp, "contract_app")
        self._stack = stack
        self._dsn, self._schema, self._tmp = dsn, schema, tmp
        self._operator: Scheduler | None = None

    async def start(self, scenario: str, *owners: str) -> None:
        self._operator = Scheduler(
            self._dsn, schema=self._schema, owner="operator", shutdown_grace=1
        )
        await self._stack.enter_async_context(self._operator)  # it migrates the schema
        self._stack.callback(self.replicas.kill_all)
        for owner in owners:
            attempts = str(self._tmp / f"{owner}.attempts")
            self.replicas.start(owner, scenario, log_level="DEBUG", attempts=attempts)
        fleet = self._operator.fleet

        async def live() -> bool:
            return {r.owner for r in await fleet.replicas()} >= set(owners)

        await eventually(live, 20, f"replicas {owners} to be live")

    @property
    def operator(self) -> Scheduler:
        assert self._operator is not None
        return self._operator

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    async def wait(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    async def until(self, check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
        await eventually(check, within, what)

    def _signal(self, owner: str, sig: signal.Signals) -> None:
        os.kill(self.replicas.procs[owner].pid, sig)

    def kill(self, owner: str) -> None:
        self._signal(owner, signal.SIGKILL)

    def freeze(self, owner: str) -> None:
        self._signal(owner, signal.SIGSTOP)

    def thaw(self, owner: str) -> None:
        self._signal(owner, signal.SIGCONT)

    def attempts(self, job_id: str) -> list[Attempt]:
        found = []
        for owner in self.replicas.procs:
            path = self._tmp / f"{owner}.attempts"
            lines = path.read_text().splitlines() if path.exists() else []
            found += [Attempt(**json.loads(line)) for line in lines]
        return [a for a in found if a.job_id == job_id]


@contextmanager
def _records() -> Iterator[list[logging.LogRecord]]:
    """Every record of the ``ticklock`` logger (the run lines at DEBUG too)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("ticklock")
    handler, level = Keep(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
async def backend(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Backend]:
    """The scenario's fleet on the backend ``kind`` names; stopped after the test."""
    async with AsyncExitStack() as stack:
        if kind == "memory":
            yield Memory(stack, stack.enter_context(_records()))
        else:
            dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema")
            yield Postgres(stack, dsn, schema, tmp_path)


# -- what a user observes ----------------------------------------------------------------------


async def runs(backend: Backend, job_id: str) -> list[RunRecord]:
    """The job's runs that executed, oldest first (none before a replica declared it)."""
    try:
        history = await backend.operator.fleet.history(job_id)
    except KeyError:
        return []
    return history[::-1]


async def successes(backend: Backend, job_id: str) -> list[RunRecord]:
    """The job's successful runs, oldest first."""
    return [run for run in await runs(backend, job_id) if run.outcome == "success"]


def lateness(run: RunRecord) -> float:
    """Seconds from the run's slot to its start."""
    assert run.slot is not None
    return (run.started_at - run.slot).total_seconds()


def ranking(job_id: str, *owners: str) -> list[str]:
    """The replicas ``owners`` in the order they rank for ``job_id``: its owner first."""
    return sorted(owners, key=lambda owner: weight(owner, job_id), reverse=True)


def committed_once(records: list[RunRecord]) -> bool:
    """No slot succeeded twice."""
    return max(Counter(run.slot for run in records).values(), default=1) == 1


async def owner_runs_it(backend: Backend, job_id: str, owner: str) -> None:
    """Wait until ``owner`` ran the job's last two slots (the replicas' views agree), and
    return just after the last one's commit."""

    async def steady() -> bool:
        done = await successes(backend, job_id)
        return len(done) >= 2 and done[-1].owner == done[-2].owner == owner

    await backend.until(steady, 20, f"{owner} to run {job_id}'s slots")


async def more(backend: Backend, job_id: str, n: int, seen: int | None = None) -> list[RunRecord]:
    """Wait for ``n`` successes of the job after its first ``seen`` (default: those it has
    now); those ``n``."""
    if seen is None:
        seen = len(await successes(backend, job_id))

    async def enough() -> bool:
        return len(await successes(backend, job_id)) >= seen + n

    await backend.until(enough, 4 * n * INTERVAL, f"{n} more successes of {job_id}")
    return (await successes(backend, job_id))[seen : seen + n]


# -- failover ----------------------------------------------------------------------------------


async def test_a_dead_owners_slot_runs_on_its_first_backup_a_grace_late(backend: Backend) -> None:
    owners = ranking("tick", "a", "b", "c")
    await backend.start("tick", *owners)
    await owner_runs_it(backend, "tick", owners[0])
    backend.kill(owners[0])
    first, second = await more(backend, "tick", 2)
    # the backup waited a grace for the owner, then stood in; from then on, on time
    assert (first.owner, second.owner) == (owners[1], owners[1])
    assert GRACE <= lateness(first) <= FAILOVER, lateness(first)
    assert 0 <= lateness(second) <= ON_TIME, lateness(second)
    assert committed_once(await successes(backend, "tick"))


async def test_a_frozen_owners_slot_runs_elsewhere_and_its_late_attempt_is_skipped(
    backend: Backend,
) -> None:
    owners = ranking("tick", "a", "b", "c")
    await backend.start("tick", *owners)
    await owner_runs_it(backend, "tick", owners[0])
    backend.freeze(owners[0])
    first, second = await more(backend, "tick", 2)
    assert (first.owner, second.owner) == (owners[1], owners[1])
    assert GRACE <= lateness(first) <= FAILOVER, lateness(first)
    assert 0 <= lateness(second) <= ON_TIME, lateness(second)
    before = len([a for a in backend.attempts("tick") if a.owner == owners[0]])
    backend.thaw(owners[0])

    async def woke() -> bool:
        return len([a for a in backend.attempts("tick") if a.owner == owners[0]]) > before

    await backend.until(woke, 2 * INTERVAL, f"{owners[0]}'s attempt once it thawed")
    # it went on with the slot it waited for, which the backup had committed: refused; or,
    # when a look of its own read the fleet's state first (its role changed as it thawed),
    # it re-aligned and ran a later slot: never the committed one again
    late = [a for a in backend.attempts("tick") if a.owner == owners[0]][before]
    assert second.slot is not None
    later = datetime.fromisoformat(late.slot) > second.slot
    assert late.outcome == "skipped" or (late.outcome == "success" and later), (late, second)
    await more(backend, "tick", 2)  # the job goes on, each slot once
    assert committed_once(await successes(backend, "tick"))


# -- operators ---------------------------------------------------------------------------------


async def test_a_pause_stops_every_replica_and_a_resume_runs_the_job_at_once(
    backend: Backend,
) -> None:
    await backend.start("tick", "a", "b")
    await more(backend, "tick", 1)
    seen = len(backend.attempts("tick"))
    assert await backend.operator.pause("tick")
    paused = backend.now()
    await backend.wait(2 * INTERVAL)
    # no scheduled run started once the pause was recorded, on any replica (a run in flight
    # may finish: it started before); an attempt that did not hear of it yet is refused
    assert [r for r in await runs(backend, "tick") if r.started_at > paused] == []
    assert {a.outcome for a in backend.attempts("tick")[seen:]} <= {"skipped"}
    [job] = [j for j in await backend.operator.fleet.jobs() if j.job_id == "tick"]
    assert job.paused_at is not None
    seen = len(await successes(backend, "tick"))
    assert await backend.operator.resume("tick")
    resumed = backend.now()
    # its slot passed during the pause: one run, at once (catch_up), then on schedule
    first, second = await more(backend, "tick", 2, seen)
    assert (first.started_at - resumed).total_seconds() <= RESUMED
    assert first.slot is not None and first.slot < resumed
    assert (second.started_at - first.finished_at).total_seconds() >= INTERVAL
    assert 0 <= lateness(second) <= ON_TIME, lateness(second)


async def test_a_trigger_runs_the_job_once_on_one_replica_paused_or_not(
    backend: Backend,
) -> None:
    await backend.start("rare", "a", "b")
    await backend.until(lambda: _declared(backend, "rare"), 10, "the replicas to declare the job")
    at = await backend.operator.trigger("rare")
    [run] = await more(backend, "rare", 1, seen=0)
    assert (run.slot, run.manual) == (at, True)  # slot: the request's instant
    assert run.owner in ("a", "b")
    await backend.wait(1)
    assert len(await runs(backend, "rare")) == 1  # once, not once per replica
    assert await backend.operator.pause("rare")
    again = await backend.operator.trigger("rare")  # a manual run runs paused too
    await more(backend, "rare", 1, seen=1)
    await backend.wait(1)
    assert [(r.slot, r.manual) for r in await runs(backend, "rare")] == [(at, True), (again, True)]


async def _declared(backend: Backend, job_id: str) -> bool:
    return any(j.job_id == job_id for j in await backend.operator.fleet.jobs())


# -- batched runs ------------------------------------------------------------------------------


async def test_a_batched_sweep_is_capped_and_goes_on_from_its_cursor(backend: Backend) -> None:
    await backend.start("sweep", "a", "b")
    done = await more(backend, "sweep", 4, seen=0)
    backlog = list(range(BACKLOG))
    per_run = CAP * CHUNK
    expected = [
        (CAP, True, backlog[:per_run]),  # capped: a backlog is left for the next run
        (CAP, True, backlog[per_run : 2 * per_run]),  # which goes on from the cursor
        (1, False, backlog[2 * per_run :]),  # the rest: the loop ends before the cap
        (1, False, []),  # nothing left
    ]
    assert [(r.batches, r.capped, r.report["swept"]) for r in done] == expected
    assert committed_once(await successes(backend, "sweep"))
