"""The coordination seam: how a tick takes its job's lock, reads and commits fleet state.

A :class:`Backend` is where the fleet's state lives; it gives each replica a
:class:`Coordinator`. ``MemoryDatabase`` keeps it in this process (local mode,
and the shared in-memory database of ``ticklock.testing``);
``ticklock._backends.postgres.coordinator.PostgresBackend`` keeps it in PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Protocol

from .._operators.fleet import Fleet
from .._runtime.clock import Clock
from .._runtime.sharing import Member
from .._schedule.job import Job, JobHealth, RunResult
from .._schedule.stored import ScheduleStore

if TYPE_CHECKING:
    import asyncpg

FUTURE_LIMIT = 2.0
"""Seconds a committed slot or end may lie ahead of the database's clock: a replica whose
clock runs further ahead cannot commit (its slots would stop the fleet until then)."""


@dataclass(frozen=True, slots=True)
class FleetState:
    """What the fleet knows of one job (frozen: a new state comes from an old one and a run)."""

    last_slot: datetime | None = None
    """The watermark: the slot of the last successful run."""
    last_end: datetime | None = None
    """When the last run that executed (any outcome) ended: fixed delay counts from here."""
    last_success_at: datetime | None = None
    consecutive_failures: int = 0
    failed_slot: datetime | None = None
    """The slot of the last run that executed and did not commit (``None`` once one commits)."""
    failed_attempts: int = 0
    """How many attempts of ``failed_slot`` did not commit: retries go by it."""
    paused_at: datetime | None = None
    """When an operator paused the job (``None``: not paused)."""
    trigger_at: datetime | None = None
    """The instant of a trigger request no run has served yet."""
    last_owner: str | None = None
    """The replica whose run executed last (the one that failed ``failed_slot``, if set)."""
    busy_until: datetime | None = None
    """Until when a batched run that committed a batch holds the job between its batches (the
    database's clock; ``None``: no batched run in progress). See :mod:`._batch`."""
    cursor: str | None = None
    """The JSON text of the cursor committed with the job's last committed batch."""
    version: int | None = None
    """A stored schedule's version as the records hold it (``None``: a job declared in code;
    0: the schedule was deleted)."""
    successes: int = 0
    """Scheduled runs that committed (manual ones aside), fleet-wide: a job's ``limit``
    counts them, with the watermark."""


FIRSTS = 16
"""How many declarations of a job declared ``immediately`` the records keep: none of them
runs it again (a release restarting beside another does not ask for a run at each start)."""

NO_STATE = FleetState()
"""Read-only: the state of a job the fleet has none for."""


class Control(NamedTuple):
    """What operators asked of one job: paused since, a trigger request not served yet, and
    its backfills not done yet (their ids, oldest first)."""

    paused_at: datetime | None
    trigger_at: datetime | None
    backfills: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Fill:
    """One slot of a backfill, as a tick runs it: the ``index``-th of request ``request``."""

    request: int
    index: int
    slot: datetime
    who: str
    replaced_by: datetime | None = None
    """The backfill's next slot, which ends this run when it comes due (``cut_at``, the
    scheduler's monotonic clock) under ``overlap="replace"``."""
    cut_at: float | None = None


class Declared(NamedTuple):
    """What a replica publishes of its jobs: the ids of those it declares, enabled and
    disabled, the fingerprint of each enabled one's declaration, and those it gave up."""

    enabled: tuple[str, ...]
    disabled: tuple[str, ...]
    fingerprints: tuple[str, ...] = ()
    """One per enabled job, in the same order."""
    failing: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    """The tasks it has (``@scheduler.task``): it runs their stored schedules."""


class Attempt(Protocol):
    """One tick's hold on its job: the lock (or not), the fleet state, the connection."""

    acquired: bool
    state: FleetState
    conn: asyncpg.Connection[Any] | None
    fence: int | None
    """The job's fence once this run committed a batch (``None`` before): see :mod:`._batch`."""

    turn: bool
    """For a backfill's slot (:class:`Fill`), with the lock: whether it is the slot the
    backfill runs next (another replica may have run it already)."""

    async def commit(self, result: RunResult, job: Job, cursor: str | None = None) -> None:
        """Write the watermark, the success and the run record (and, for a run with batches,
        the ``cursor`` of its last batch), and commit. A backfill's slot moves the watermark
        only forward, and its backfill on."""
        ...

    async def commit_batch(self, cursor: str | None) -> None:
        """Commit the batch in flight with ``cursor``, under the job's exclusion."""
        ...

    async def begin_batch(self, budget: float) -> None:
        """Begin the next batch, ``budget`` seconds left to the run, under the job's
        exclusion (raises :class:`~ticklock._errors.TakenOver` when it was lost)."""
        ...

    async def close(self) -> None:
        """Roll back what was not committed and release the connection."""
        ...

    async def record_failure(self, result: RunResult, job: Job) -> None:
        """Once closed: record this attempt's run, which did not commit, in a transaction of
        its own (a batched run's hold between batches ends with it)."""
        ...


class Diagnosis(NamedTuple):
    """What an error means for coordination."""

    lost: bool
    """Coordination was lost (an outage, a killed session): the run's outcome is ``error``."""
    text: str
    """One line for an error that waiting cannot fix: its cause, and the fix."""


class Views(Protocol):
    """What operators see and steer of the namespace, and its stored schedules."""

    @property
    def fleet(self) -> Fleet:
        """The namespace's jobs, history, replicas and operations (raises
        :class:`~ticklock._errors.SchedulerStateError` when that needs the scheduler running)."""
        ...

    @property
    def schedules(self) -> ScheduleStore:
        """The namespace's stored schedules (raises as :attr:`fleet` does)."""
        ...


class Session(Protocol):
    """A coordinator while it is open: what the replica tells it between its calls."""

    async def connected(self) -> None:
        """Return once coordination works (PostgreSQL: the database answers and the schema
        is migrated), trying again, with backoff, what opening could not do."""
        ...

    def poke(self) -> None:
        """Make :meth:`Coordinator.watch` look again now (a job steered or given up here)."""
        ...

    def stalled(self, job_id: str | None, seconds: float) -> None:
        """Keep, for the ledger, that this replica's event loop was blocked for ``seconds``
        until now by ``job_id``'s handler (``None``: by other code)."""
        ...


class Watcher(Protocol):
    """The runtime's side of :meth:`Coordinator.watch`: what this replica declares, and what
    it does with what the fleet says."""

    owner: str

    def declared(self) -> Declared:
        """The jobs and tasks this replica publishes now."""
        ...

    def apply(self, controls: Mapping[str, Control]) -> None:
        """Obey operators: every paused or triggered job of the namespace."""
        ...

    async def members(self, members: Mapping[str, Member], seen: Mapping[str, datetime]) -> None:
        """A new view of the live replicas and their last heartbeats (it may yield)."""
        ...


class Coordinator(Protocol):
    """Where the fleet's state lives and how a tick excludes the others: the seam between the
    runtime and a backend."""

    def session(self) -> AbstractAsyncContextManager[Session]:
        """Open (PostgreSQL: create the pool, migrate) for as long as the context lasts; a
        database that does not answer leaves :attr:`problem` set instead of raising."""
        ...

    @property
    def problem(self) -> str | None:
        """Why coordination does not work now (its error and the fix), ``None`` when it does."""
        ...

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """Register ``jobs`` (overdue from ``now`` until their first finished run, and from
        their last finished run on the schedule declared now) and return their fleet state
        (of those the fleet has one): not every job of the namespace, whose stored schedules
        can be many."""
        ...

    async def attempt(
        self,
        job_id: str,
        budget: float,
        at: datetime,
        replacing: datetime | None = None,
        fill: Fill | None = None,
    ) -> Attempt:
        """Begin a tick: try the job's lock and read its state under it. ``at`` (the slot, or
        the tick's start if later) in the database's future is refused before the lock is
        tried (PostgreSQL: :class:`~ticklock._errors.ClockAhead`). ``replacing``: the slot of
        a job whose ``overlap`` is "replace": a run of an older slot that holds the lock
        (its replica frozen) is ended, rolled back, and the lock taken. ``fill``: the tick
        runs a slot of a backfill (its :attr:`Attempt.turn` says whether that slot is next;
        its commit and failure record advance the backfill)."""
        ...

    async def read(self, job_ids: Sequence[str]) -> tuple[dict[str, FleetState], frozenset[str]]:
        """The fleet state of the jobs ``job_ids`` (of those the fleet has one), and those
        whose lock is held, in one read without taking the locks: a backup's look at slots
        its owner should have run."""
        ...

    async def watch(self, replica: Watcher) -> NoReturn:
        """Until cancelled: report ``replica`` as live, declaring ``replica.declared()``; hand
        ``replica.apply`` every paused or triggered job of the namespace when that may change,
        and ``replica.members`` the live replicas and the jobs each runs when they change."""
        ...

    def diagnose(self, exc: BaseException) -> Diagnosis:
        """What ``exc`` means: whether coordination was lost, and one line naming the fix."""
        ...

    def views(
        self, jobs: Callable[[], Mapping[str, Job]], health: Callable[[], list[JobHealth]]
    ) -> Views:
        """What operators see of the namespace (``jobs`` and ``health``: the scheduler's own,
        for a backend that keeps no declarations of its own)."""
        ...


class Backend(Protocol):
    """Where the fleet's state lives: it gives each replica its :class:`Coordinator`."""

    def coordinator(self, owner: str, clock: Clock) -> Coordinator:
        """The coordinator of the replica ``owner`` (a new one for each run of a scheduler)."""
        ...
