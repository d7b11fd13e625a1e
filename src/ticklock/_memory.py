"""In-process coordination: :class:`MemoryDatabase` keeps the fleet's state in this process.

Local mode gives each scheduler a database of its own. ``ticklock.testing`` ships the same
class for tests: several schedulers given one ``MemoryDatabase`` share it as replicas share
PostgreSQL (one lock per job, the fleet's state, pauses and triggers, the live replicas), so
sharing, failover, pause and trigger run on a ``ManualClock`` in milliseconds.
:meth:`MemoryDatabase.freeze` and :meth:`MemoryDatabase.kill` stand for a replica that was
paused (SIGSTOP) or died. What only PostgreSQL does (sessions, server-side timeouts, poolers)
is not modelled here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from ._caps import cut_text, shorten_report
from ._clock import Clock
from ._coordination import Control, Declared, FleetState
from ._errors import SlotAlreadyCommitted
from ._fleet import Fleet, JobDeclared, JobRecord, JobState, Replica, RunRecord
from ._job import Job, JobHealth, Outcome, RunResult, fingerprint
from ._sharing import Member

if TYPE_CHECKING:
    import asyncpg


class ReplicaLost(ConnectionError):
    """The replica's coordination is lost (:meth:`MemoryDatabase.freeze` or ``kill``)."""


@dataclass(eq=False)
class _Live:
    """A replica whose watch runs: what it declares, and when it last looked (its beat)."""

    declared: Callable[[], Declared]
    started_at: datetime
    seen_at: datetime
    poked: anyio.Event


class MemoryDatabase:
    """An in-memory stand-in for ticklock's database (see the module docstring)::

        db = MemoryDatabase()
        a = Scheduler(database=db, clock=clock, owner="a")
        b = Scheduler(database=db, clock=clock, owner="b")

    It keeps the last :data:`HISTORY` runs of each job.
    """

    HISTORY = 100

    def __init__(self) -> None:
        self.states: dict[str, FleetState] = {}
        self.history: dict[str, deque[RunResult]] = {}
        self._held: dict[str, _MemoryAttempt] = {}  # job id -> the attempt holding its lock
        self._live: dict[str, _Live] = {}
        self._frozen: dict[str, anyio.Event] = {}  # owner -> set when it thaws
        self._killed: set[str] = set()

    def coordinator(self, owner: str, clock: Clock) -> MemoryCoordinator:
        """The coordinator through which the replica ``owner`` uses this database."""
        return MemoryCoordinator(self, owner, clock)

    # -- faults --------------------------------------------------------------------------

    def freeze(self, owner: str) -> None:
        """Stand for ``owner`` paused (SIGSTOP): it stays in the others' view, its calls to
        the database wait until :meth:`thaw`, and the locks its runs hold are released, so
        that their commits fail (its session was ended)."""
        self._frozen.setdefault(owner, anyio.Event())
        for job_id, attempt in list(self._held.items()):
            if attempt.owner == owner:
                attempt.lost = True
                del self._held[job_id]

    def thaw(self, owner: str) -> None:
        """Let a frozen ``owner`` go on."""
        event = self._frozen.pop(owner, None)
        if event is not None:
            event.set()
        self.changed()

    def kill(self, owner: str) -> None:
        """Stand for ``owner`` dead: it leaves the view at once, the locks its runs hold are
        released, and each of its calls fails from now on."""
        self._killed.add(owner)
        self.freeze(owner)
        self._frozen.pop(owner).set()  # its waiting calls fail now
        self._live.pop(owner, None)
        self.changed()

    async def _gate(self, owner: str) -> None:
        event = self._frozen.get(owner)
        if event is not None:
            await event.wait()
        if owner in self._killed:
            raise ReplicaLost(f"replica {owner} was killed (MemoryDatabase.kill)")

    def silent_replica(
        self, owner: str, jobs: Iterable[Job], started_at: datetime, *, failing: Iterable[str] = ()
    ) -> None:
        """Add ``owner`` to the live replicas, declaring ``jobs`` (``failing``: those it gave
        up), as a replica that never runs, looks or beats: one frozen or dead before its
        heartbeat went stale. :meth:`beat` and :meth:`leave` change it."""
        jobs = tuple(jobs)
        declared = Declared(
            tuple(job.id for job in jobs if job.enabled),
            tuple(job.id for job in jobs if not job.enabled),
            tuple(fingerprint(job) for job in jobs if job.enabled),
            tuple(failing),
        )
        self._live[owner] = _Live(lambda: declared, started_at, started_at, anyio.Event())
        self.changed()

    def beat(self, owner: str, at: datetime) -> None:
        """A heartbeat of the silent replica ``owner`` at ``at``."""
        self._live[owner].seen_at = at
        self.changed()

    def leave(self, owner: str) -> None:
        """Take ``owner`` out of the live replicas (its heartbeat went stale)."""
        self._live.pop(owner, None)
        self.changed()

    # -- the replicas --------------------------------------------------------------------

    def changed(self) -> None:
        """Make every live replica's watch look again (operators' changes, a view change)."""
        for live in self._live.values():
            live.poked.set()

    def view(self) -> tuple[dict[str, Member], dict[str, datetime]]:
        """The live replicas as each sees the others, and when each last looked."""
        members, seen = {}, {}
        for owner, live in self._live.items():
            declared = live.declared()
            jobs = dict(zip(declared.enabled, declared.fingerprints, strict=True))
            members[owner] = Member(jobs, frozenset(declared.failing), live.started_at)
            seen[owner] = live.seen_at
        return members, seen

    def controls(self) -> dict[str, Control]:
        """Every paused or triggered job."""
        return {
            job_id: Control(state.paused_at, state.trigger_at)
            for job_id, state in self.states.items()
            if state.paused_at is not None or state.trigger_at is not None
        }

    def replicas(self) -> list[Replica]:
        """The live replicas, by owner."""
        replicas = []
        for owner, live in sorted(self._live.items()):
            declared = live.declared()
            jobs = declared.enabled + declared.disabled
            replicas.append(Replica(owner, live.started_at, live.seen_at, jobs, declared.failing))
        return replicas

    # -- the records ---------------------------------------------------------------------

    def steer(
        self, job_id: str, *, paused_at: datetime | None, trigger_at: datetime | None
    ) -> None:
        """Record what operators asked of the job, and tell every replica."""
        old = self.states.get(job_id, FleetState())
        self.states[job_id] = replace(old, paused_at=paused_at, trigger_at=trigger_at)
        self.changed()

    def recorded(self, result: RunResult) -> None:
        """Keep ``result`` in the job's history."""
        self.history.setdefault(result.job_id, deque(maxlen=self.HISTORY)).append(result)

    def keep_cursor(self, job_id: str, cursor: str | None) -> None:
        """Keep ``cursor`` (JSON text) as the job's, committed with a batch."""
        old = self.states.get(job_id, FleetState())
        self.states[job_id] = replace(old, cursor=cursor)

    def fold(self, result: RunResult) -> None:
        """Fold a run that executed into the job's state, and keep it in the history."""
        old = self.states.get(result.job_id, FleetState())
        if result.outcome is Outcome.SUCCESS:
            new = old.committed(result)
            if old.last_end is not None and old.last_end > result.finished_at:
                new = replace(new, last_end=old.last_end)  # as PostgreSQL's greatest()
        else:
            new = old.failed(result)
        self.states[result.job_id] = new
        self.recorded(result)


class _MemoryAttempt:
    __slots__ = ("_db", "acquired", "conn", "fence", "job_id", "lost", "owner", "state")

    def __init__(self, db: MemoryDatabase, owner: str, job_id: str) -> None:
        self._db = db
        self.owner = owner
        self.job_id = job_id
        self.acquired = job_id not in db._held
        if self.acquired:
            db._held[job_id] = self
        self.lost = False
        self.conn: asyncpg.Connection[Any] | None = None
        self.fence: int | None = None  # the lock is held for the whole run: no fence needed
        state = db.states.get(job_id)
        self.state = FleetState() if state is None else state

    async def commit(self, result: RunResult, job: Job, cursor: str | None = None) -> None:
        await self._hold()
        # as PostgreSQL's commit: a slot at or before the watermark is refused (a wall clock
        # stepped back, a manual run's "now" before a committed slot), so that no slot commits
        # twice and the watermark never goes back
        last = self._db.states.get(self.job_id, FleetState()).last_slot
        if last is not None and result.slot is not None and result.slot <= last:
            raise SlotAlreadyCommitted(f"slot {result.slot} of {self.job_id} is already committed")
        self._db.fold(result)
        if result.batches:
            self._db.keep_cursor(self.job_id, cursor)

    async def commit_batch(self, cursor: str | None) -> None:
        """Keep the batch's cursor (the lock is held for the whole run)."""
        await self._hold()
        self._db.keep_cursor(self.job_id, cursor)

    async def begin_batch(self, budget: float) -> None:
        """Nothing to begin in memory, once the replica is not frozen."""
        await self._hold()

    async def _hold(self) -> None:
        await self._db._gate(self.owner)
        if self.lost:
            raise ReplicaLost(f"replica {self.owner} lost the lock of {self.job_id} (frozen)")

    async def close(self) -> None:
        if self.acquired and self._db._held.get(self.job_id) is self:
            del self._db._held[self.job_id]
        self.acquired = False


class MemoryCoordinator:
    """One replica's coordination through a :class:`MemoryDatabase`."""

    def __init__(self, db: MemoryDatabase, owner: str, clock: Clock) -> None:
        self.db = db
        self.owner = owner
        self._clock = clock
        self.ready = True
        self.problem: str | None = None

    async def open(self) -> None:
        """Nothing to prepare in memory."""

    async def connect(self) -> None:
        """Wait until the database answers: at once, but never for a killed replica (the
        scheduler's reconnect loop would spin without ever yielding)."""
        if self.owner in self.db._killed:
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()

    async def close(self) -> None:
        """Nothing to release in memory."""

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """A copy of the fleet's states."""
        await self.db._gate(self.owner)
        return dict(self.db.states)

    async def attempt(self, job_id: str, budget: float, at: datetime) -> _MemoryAttempt:
        """Take the job's lock if it is free (one clock: nothing is ahead)."""
        await self.db._gate(self.owner)
        return _MemoryAttempt(self.db, self.owner, job_id)

    async def read(self, job_ids: Sequence[str]) -> tuple[dict[str, FleetState], frozenset[str]]:
        """The states of ``job_ids``, and those whose lock is held."""
        await self.db._gate(self.owner)
        db = self.db
        states = {i: db.states[i] for i in job_ids if i in db.states}
        return states, frozenset(db._held.keys() & set(job_ids))

    async def record_failure(self, result: RunResult, job: Job, fence: int | None = None) -> None:
        """Count the failure in the fleet's state."""
        await self.db._gate(self.owner)
        self.db.fold(result)

    async def watch(
        self,
        owner: str,
        declared: Callable[[], Declared],
        apply: Callable[[Mapping[str, Control]], None],
        members: Callable[[Mapping[str, Member], Mapping[str, datetime]], None],
    ) -> NoReturn:
        """Join the live replicas; at start and after every change, hand this replica the
        paused and triggered jobs and the view; leave when cancelled."""
        db = self.db
        try:
            await db._gate(owner)
        except ReplicaLost:  # killed before it started: a dead replica never joins the view
            await anyio.sleep_forever()
        now = self._clock.now()
        live = _Live(declared, now, now, anyio.Event())
        db._live[owner] = live
        db.changed()
        try:
            while True:
                try:
                    await db._gate(owner)
                except ReplicaLost:  # killed: a dead replica beats no more
                    await anyio.sleep_forever()
                live.poked = anyio.Event()
                live.seen_at = self._clock.now()
                apply(db.controls())
                if db._live.keys() == {owner}:  # alone: no work to share, no ranking to keep
                    members({}, {})
                else:
                    members(*db.view())
                await live.poked.wait()
        finally:
            if db._live.get(owner) is live:
                del db._live[owner]
                db.changed()

    def poke(self) -> None:
        """Something changed here (an operation, a job given up): every replica looks again."""
        self.db.changed()

    def classify(self, exc: BaseException) -> Outcome | None:
        """``ERROR`` for a replica frozen or killed, or a commit refused."""
        return Outcome.ERROR if isinstance(exc, (ReplicaLost, SlotAlreadyCommitted)) else None

    def explain(self, exc: BaseException) -> str:
        """In memory, only errors of ticklock's own fail the start."""
        return f"ticklock could not start: {type(exc).__name__}: {exc}"

    def fleet(
        self, jobs: Callable[[], Mapping[str, Job]], health: Callable[[], list[JobHealth]]
    ) -> Fleet:
        """The operators' view of this database, as the scheduler declaring ``jobs`` sees it."""
        return MemoryFleet(self.db, self._clock, jobs, health)


class MemoryFleet:
    """What operators see and steer of a :class:`MemoryDatabase`'s jobs."""

    namespace = "default"

    def __init__(
        self,
        db: MemoryDatabase,
        clock: Clock,
        jobs: Callable[[], Mapping[str, Job]],
        health: Callable[[], list[JobHealth]],
    ) -> None:
        self._db = db
        self._clock = clock
        self._jobs = jobs
        self._health = health

    def _declared(self) -> tuple[set[str], set[str]]:
        """The ids declared here or by a live replica: enabled by one, and only disabled."""
        enabled = {i for i, job in self._jobs().items() if job.enabled}
        disabled = {i for i, job in self._jobs().items() if not job.enabled}
        for live in self._db._live.values():
            declared = live.declared()
            enabled.update(declared.enabled)
            disabled.update(declared.disabled)
        return enabled, disabled - enabled

    async def jobs(self) -> list[JobRecord]:
        """Every job declared or with a state."""
        db = self._db
        enabled, disabled = self._declared()
        health = {h.job_id: h for h in self._health()}
        records = []
        for job_id in sorted(enabled | disabled | db.states.keys() | db.history.keys()):
            state = db.states.get(job_id) or FleetState()
            runs = db.history.get(job_id, ())
            failed = [r for r in runs if r.outcome is not Outcome.SUCCESS]
            seen = health.get(job_id)
            records.append(
                JobRecord(
                    job_id=job_id,
                    state=_state(job_id in enabled, job_id in disabled, state, seen),
                    last_success=state.last_success_at,
                    last_outcome=runs[-1].outcome.value if runs else None,
                    next_due=None if seen is None else seen.next_fire,
                    consecutive_failures=state.consecutive_failures,
                    last_error=failed[-1].error if failed else None,
                    last_owner=runs[-1].owner if runs else None,
                    paused_at=state.paused_at,
                    trigger_at=state.trigger_at,
                    last_batches=runs[-1].batches if runs else 0,
                    last_capped=runs[-1].capped if runs else False,
                )
            )
        return records

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs (of the last :data:`MemoryDatabase.HISTORY`)."""
        self._known(job_id)
        runs = list(self._db.history.get(job_id, ()))[::-1][:limit]
        return [_record(run, max_text) for run in runs]

    async def replicas(self) -> list[Replica]:
        """The live replicas."""
        return self._db.replicas()

    async def pause(self, job_id: str) -> None:
        """Pause the job for every replica of this database."""
        state = self._state(job_id)
        paused_at = state.paused_at or self._clock.now()
        self._db.steer(job_id, paused_at=paused_at, trigger_at=state.trigger_at)

    async def resume(self, job_id: str) -> None:
        """Resume the job for every replica of this database."""
        state = self._state(job_id)
        self._db.steer(job_id, paused_at=None, trigger_at=state.trigger_at)

    async def trigger(self, job_id: str) -> datetime:
        """Ask for one run of the job as soon as possible."""
        if job_id not in self._declared()[0]:
            raise KeyError(f"job {job_id!r} is not declared, or declared with enabled=False")
        state = self._state(job_id)
        at = state.trigger_at or self._clock.now()
        self._db.steer(job_id, paused_at=state.paused_at, trigger_at=at)
        return at

    async def forget(self, job_id: str) -> None:
        """Delete the state and history of a job no replica declares."""
        enabled, disabled = self._declared()
        if job_id in enabled or job_id in disabled:
            raise JobDeclared(f"job {job_id!r} is declared: remove it from the scheduler first")
        db = self._db
        state, runs = db.states.pop(job_id, None), db.history.pop(job_id, None)
        if state is None and runs is None:
            raise KeyError(f"no job {job_id!r}")

    def _known(self, job_id: str) -> None:
        db = self._db
        if job_id in db.states or job_id in db.history:
            return
        enabled, disabled = self._declared()
        if job_id not in enabled and job_id not in disabled:
            raise KeyError(f"no job {job_id!r}")

    def _state(self, job_id: str) -> FleetState:
        self._known(job_id)
        return self._db.states.get(job_id) or FleetState()


def _state(enabled: bool, disabled: bool, state: FleetState, health: JobHealth | None) -> JobState:
    if not enabled and not disabled:
        return JobState.UNDECLARED
    if not enabled:
        return JobState.DISABLED
    if state.paused_at is not None or (health is not None and health.paused):
        return JobState.PAUSED
    if health is not None and health.overdue:
        return JobState.OVERDUE
    return JobState.OK


def _record(run: RunResult, max_text: int | None) -> RunRecord:
    report, error = run.report, run.error
    if max_text is not None:  # what the runner kept is within the caps already
        report = shorten_report(report, max_text)
        error = None if error is None else cut_text(error, len(error), max_text)
    return RunRecord(
        job_id=run.job_id,
        slot=run.slot,
        started_at=run.started_at,
        finished_at=run.finished_at,
        outcome=run.outcome.value,
        owner=run.owner,
        report=report,
        error=error,
        manual=run.manual,
        batches=run.batches,
        capped=run.capped,
    )
