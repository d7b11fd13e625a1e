"""In-process coordination: :class:`MemoryDatabase` keeps the fleet's state in this process.

Local mode gives each scheduler a database of its own. ``ticklock.testing`` ships the same
class for tests: several schedulers given one ``MemoryDatabase`` share it as replicas share
PostgreSQL (one lock per job, the fleet's state, pauses and triggers, the live replicas), so
sharing, failover, pause and trigger run on a ``ManualClock`` in milliseconds.
:meth:`MemoryDatabase.freeze` and :meth:`MemoryDatabase.kill` stand for a replica that was
paused (SIGSTOP) or died. Either stays in the others' view, as on PostgreSQL, until its last
beat is :data:`~ticklock._runtime.sharing.LIVE` seconds old: until then it still owns its jobs, and
their backups stand in for it a grace after each slot it leaves open (the planner's rule, see
:mod:`._sharing`), not at the slot. What only PostgreSQL does (sessions, server-side timeouts,
poolers) is not modelled here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .._errors import SlotAlreadyCommitted
from .._operators.fleet import (
    BY_TICKLOCK,
    IMMEDIATELY,
    Action,
    Backfill,
    Fleet,
    Replica,
    expired,
)
from .._operators.ledger import STALLED, Incident
from .._runtime.clock import Clock, until
from .._runtime.plan import fold
from .._runtime.sharing import LIVE, Member
from .._schedule.job import Job, JobHealth, Outcome, RunResult, fingerprint, shut_down
from .._schedule.stored import Schedule
from .memory_fleet import MemoryFleet, Presence
from .memory_schedules import MemorySchedules
from .seam import FIRSTS, NO_STATE, Control, Declared, Diagnosis, Fill, FleetState, Watcher

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
    clock: Clock | None = None
    """The replica's clock (``None``: a silent replica, which the test moves itself)."""


class MemoryDatabase:
    """An in-memory stand-in for ticklock's database (see the module docstring)::

        db = MemoryDatabase()
        a = Scheduler(database=db, clock=clock, owner="a")
        b = Scheduler(database=db, clock=clock, owner="b")

    It keeps the last :data:`HISTORY` runs of each job.
    """

    HISTORY = 100
    RECORDS = 1000
    """How many departed replicas and operators' actions it keeps (for the ledger)."""

    def __init__(self) -> None:
        self.states: dict[str, FleetState] = {}
        self.history: dict[str, deque[RunResult]] = {}
        self.declared: dict[str, Job] = {}
        """Each job as the replica that loaded it last declared it (its spec: :mod:`._spec`)."""
        self.actions: deque[Action] = deque(maxlen=self.RECORDS)
        self.firsts: dict[str, list[str]] = {}
        """The declarations (fingerprints, the latest first) each job declared
        ``immediately`` ran for."""
        self.pauses: dict[str, datetime] = {}
        """The instant each job paused until an instant resumes by itself."""
        self.past: deque[Presence] = deque(maxlen=self.RECORDS)
        """The replicas that were live and left (or died)."""
        self.incidents: deque[Incident] = deque(maxlen=self.RECORDS)
        """What kept replicas from their slots, as they recorded it (their loops' stalls)."""
        self.since: datetime | None = None
        """When the first replica joined: the presence records reach back to here."""
        self.schedules: dict[str, Schedule] = {}
        """The stored schedules, by id (see :mod:`.memory_schedules`)."""
        self.deleted: dict[str, int] = {}
        """The last version of each deleted schedule (a schedule put again goes on from it)."""
        self.schedule_log: list[str] = []
        """The id of each write of a schedule, in order: its number is its index plus one."""
        self.backfills: dict[int, Backfill] = {}
        """The backfills operators asked for, by id."""
        self._held: dict[str, _MemoryAttempt] = {}  # job id -> the attempt holding its lock
        self._live: dict[str, _Live] = {}
        self._frozen: dict[str, anyio.Event] = {}  # owner -> set when it thaws
        self._killed: set[str] = set()

    def coordinator(self, owner: str, clock: Clock) -> MemoryCoordinator:
        """The coordinator through which the replica ``owner`` uses this database."""
        return MemoryCoordinator(self, owner, clock)

    # -- faults --------------------------------------------------------------------------

    def freeze(self, owner: str) -> None:
        """Stand for ``owner`` paused (SIGSTOP): its calls to the database wait until
        :meth:`thaw`, and the locks its runs hold are released, so that their commits fail
        (its session was ended). It beats no more: it stays in the others' view until its
        last beat (now) is :data:`~ticklock._runtime.sharing.LIVE` seconds old, and joins it again
        when it thaws."""
        if owner not in self._frozen:  # frozen again: its last beat stays the first freeze's
            self._frozen[owner] = anyio.Event()
            self._stopped(owner)
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
        """Stand for ``owner`` dead (SIGKILL, OOM): the locks its runs hold are released and
        each of its calls fails from now on. As on PostgreSQL, where its row stays, it stays
        in the others' view until its last beat (now) is :data:`~ticklock._runtime.sharing.LIVE`
        seconds old: until then its backups stand in for it a grace after each slot it
        leaves open, not at the slot."""
        self._killed.add(owner)
        self.freeze(owner)
        self._frozen.pop(owner).set()  # its waiting calls fail now

    def _stopped(self, owner: str) -> None:
        """``owner`` stopped beating: its last beat is now."""
        live = self._live.get(owner)
        if live is not None and live.clock is not None:
            live.seen_at = live.clock.now()
        self.changed()  # the others wait for it to go stale

    def _stale_at(self) -> datetime | None:
        """When the first frozen or killed replica of the view leaves it (its beat is
        :data:`~ticklock._runtime.sharing.LIVE` seconds old), if any."""
        stopped = self._frozen.keys() | self._killed
        ats = [
            live.seen_at
            for owner, live in self._live.items()
            if owner in stopped and live.clock is not None
        ]
        return min(ats) + timedelta(seconds=LIVE) if ats else None

    def _expire(self, now: datetime) -> None:
        """Take out of the view the frozen or killed replicas whose beat is stale at ``now``."""
        stopped = self._frozen.keys() | self._killed
        for owner, live in list(self._live.items()):
            stale = live.seen_at + timedelta(seconds=LIVE) <= now
            if owner in stopped and live.clock is not None and stale:
                self.depart(owner)

    async def _gate(self, owner: str) -> None:
        event = self._frozen.get(owner)
        if event is not None:
            # as in a process stopped by SIGSTOP, where no timeout fires before SIGCONT: a
            # call made while frozen goes on when it thaws (a tick's attempt, then, finds
            # what the others did meanwhile), however long that took
            with anyio.CancelScope(shield=True):
                await event.wait()
        if owner in self._killed:
            raise ReplicaLost(f"replica {owner} was killed (MemoryDatabase.kill)")

    def silent_replica(
        self,
        owner: str,
        jobs: Iterable[Job],
        started_at: datetime,
        *,
        failing: Iterable[str] = (),
        tasks: Iterable[str] = (),
    ) -> None:
        """Add ``owner`` to the live replicas, declaring ``jobs`` (``failing``: those it gave
        up) and ``tasks``, as a replica that never runs, looks or beats: one frozen or dead
        before its heartbeat went stale. :meth:`beat` and :meth:`leave` change it."""
        jobs = tuple(jobs)
        declared = Declared(
            tuple(job.id for job in jobs if job.enabled),
            tuple(job.id for job in jobs if not job.enabled),
            tuple(fingerprint(job) for job in jobs if job.enabled),
            tuple(failing),
            tuple(tasks),
        )
        self._join(owner, _Live(lambda: declared, started_at, started_at, anyio.Event()))

    def _join(self, owner: str, live: _Live) -> None:
        if self.since is None:
            self.since = live.started_at
        self._live[owner] = live
        self.changed()

    def beat(self, owner: str, at: datetime) -> None:
        """A heartbeat of the silent replica ``owner`` at ``at``."""
        self._live[owner].seen_at = at
        self.changed()

    def leave(self, owner: str) -> None:
        """Take ``owner`` out of the live replicas (its heartbeat went stale)."""
        self.depart(owner)

    def depart(self, owner: str, at: datetime | None = None) -> None:
        """``owner`` is no longer live, since ``at`` (default: its last beat): the
        presence records keep when it was."""
        live = self._live.pop(owner, None)
        if live is not None:
            until = live.seen_at if at is None else at
            self.past.append(
                Presence(owner, live.started_at, until, live.declared(), at is not None)
            )
        self.changed()

    def presence(self) -> list[Presence]:
        """The replicas live now (``until`` ``None``) and those that were."""
        now = [
            Presence(o, live.started_at, None, live.declared()) for o, live in self._live.items()
        ]
        return [*self.past, *now]

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
            members[owner] = Member(
                jobs, frozenset(declared.failing), live.started_at, frozenset(declared.tasks)
            )
            seen[owner] = live.seen_at
        return members, seen

    def controls(self) -> dict[str, Control]:
        """Every paused or triggered job, and every one with a backfill not done."""
        filling: dict[str, list[int]] = {}
        for request in self.backfills.values():
            if not request.finished:
                filling.setdefault(request.job_id, []).append(request.id)
        controls = {
            job_id: Control(state.paused_at, state.trigger_at, tuple(filling.get(job_id, ())))
            for job_id, state in self.states.items()
            if state.paused_at is not None or state.trigger_at is not None
        }
        for job_id, requests in filling.items():
            if job_id not in controls:
                state = self.states.get(job_id, NO_STATE)
                controls[job_id] = Control(state.paused_at, state.trigger_at, tuple(requests))
        return controls

    def declarations(self) -> list[Declared]:
        """What each live replica declares."""
        return [live.declared() for live in self._live.values()]

    def replicas(self) -> list[Replica]:
        """The live replicas, by owner."""
        replicas = []
        for owner, live in sorted(self._live.items()):
            declared = live.declared()
            jobs = declared.enabled + declared.disabled
            replicas.append(
                Replica(
                    owner, live.started_at, live.seen_at, jobs, declared.failing, declared.tasks
                )
            )
        return replicas

    # -- the records ---------------------------------------------------------------------

    def immediately(self, jobs: Sequence[Job], now: datetime, *, keyed: bool = True) -> None:
        """Ask for one run of each of ``jobs`` whose declaration is not the one a run was
        last asked for (audited, as PostgreSQL's load does); ``keyed=False``: of each (a
        stored schedule written new or changed)."""
        for job in jobs:
            declared = fingerprint(job)
            known = self.firsts.setdefault(job.id, [])
            if keyed and declared in known:
                continue  # an unchanged restart, a replica joining, or a release beside
            known.insert(0, declared)
            del known[FIRSTS:]
            state = self.states.get(job.id, NO_STATE)
            self.steer(job.id, paused_at=state.paused_at, trigger_at=state.trigger_at or now)
            self.actions.append(Action(job.id, "trigger", BY_TICKLOCK, now, IMMEDIATELY, True))

    def expire(self, now: datetime) -> datetime | None:
        """Resume the jobs whose pause ends by ``now``, audited; when the next one ends."""
        for job_id, ends in sorted(self.pauses.items(), key=lambda item: item[1]):
            if ends <= now:
                del self.pauses[job_id]
                state = self.states.get(job_id, NO_STATE)
                self.steer(job_id, paused_at=None, trigger_at=state.trigger_at)
                self.actions.append(Action(job_id, "resume", BY_TICKLOCK, now, expired(ends), True))
        return min(self.pauses.values(), default=None)

    def steer(
        self, job_id: str, *, paused_at: datetime | None, trigger_at: datetime | None
    ) -> None:
        """Record what operators asked of the job, and tell every replica."""
        old = self.states.get(job_id, FleetState())
        self.states[job_id] = replace(old, paused_at=paused_at, trigger_at=trigger_at)
        self.changed()

    def recorded(self, result: RunResult) -> None:
        """Keep ``result`` in the job's history."""
        runs = self.history.get(result.job_id)
        if runs is None:  # not setdefault: that would build a deque every run
            runs = self.history[result.job_id] = deque(maxlen=self.HISTORY)
        runs.append(result)

    def keep_cursor(self, job_id: str, cursor: str | None) -> None:
        """Keep ``cursor`` (JSON text) as the job's, committed with a batch."""
        old = self.states.get(job_id, FleetState())
        self.states[job_id] = replace(old, cursor=cursor)

    def fold(self, result: RunResult, job: Job) -> None:
        """Fold a run of ``job`` that executed into its state, and keep it in the history."""
        state = self.states.get(result.job_id, NO_STATE)
        self.states[result.job_id] = fold(state, result, counted=job.limit is not None)
        self.recorded(result)

    def filled(self, fill: Fill, result: RunResult) -> None:
        """A slot of a backfill ran (``result``): kept in the history; a success moves the
        watermark forward only; the backfill goes on to its next slot."""
        self.recorded(result)
        state = self.states.get(result.job_id, NO_STATE)
        slot = result.slot
        forward = slot is not None and (state.last_slot is None or state.last_slot < slot)
        if result.outcome is Outcome.SUCCESS and forward:
            self.states[result.job_id] = replace(state, last_slot=slot)
        request = self.backfills[fill.request]
        if request.done != fill.index or shut_down(result):  # left for the next replica
            return
        done = request.done + 1
        self.backfills[fill.request] = replace(
            request, done=done, finished=done >= len(request.slots)
        )

    def turn(self, fill: Fill) -> bool:
        """Whether ``fill`` is the slot its backfill runs next (unless it reruns: one no
        run committed)."""
        request = self.backfills.get(fill.request)
        if request is None or request.finished or request.done != fill.index:
            return False
        runs = self.history.get(request.job_id, ())
        committed = any(r.slot == fill.slot and r.outcome is Outcome.SUCCESS for r in runs)
        return request.rerun or not committed


class _MemoryAttempt:
    __slots__ = (
        "_db",
        "acquired",
        "conn",
        "fence",
        "fill",
        "job_id",
        "lost",
        "owner",
        "state",
        "turn",
    )

    def __init__(
        self, db: MemoryDatabase, owner: str, job_id: str, fill: Fill | None = None
    ) -> None:
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
        self.fill = fill
        self.turn = self.acquired and fill is not None and db.turn(fill)

    async def commit(self, result: RunResult, job: Job, cursor: str | None = None) -> None:
        await self._hold()
        if self.fill is not None:
            self._db.filled(self.fill, result)
            return
        # as PostgreSQL's commit: a slot at or before the watermark is refused (a wall clock
        # stepped back, a manual run's "now" before a committed slot), so that no slot commits
        # twice and the watermark never goes back
        last = self._db.states.get(self.job_id, FleetState()).last_slot
        if last is not None and result.slot is not None and result.slot <= last:
            raise SlotAlreadyCommitted(f"slot {result.slot} of {self.job_id} is already committed")
        self._db.fold(result, job)
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

    async def record_failure(self, result: RunResult, job: Job) -> None:
        """Count the failure in the fleet's state (a backfill's slot: go on to the next)."""
        await self._db._gate(self.owner)
        if self.fill is not None:
            self._db.filled(self.fill, result)
            return
        self._db.fold(result, job)


class MemoryCoordinator:
    """One replica's coordination through a :class:`MemoryDatabase`."""

    def __init__(self, db: MemoryDatabase, owner: str, clock: Clock) -> None:
        self.db = db
        self.owner = owner
        self._clock = clock

    @property
    def problem(self) -> str | None:
        """Nothing keeps a database in this process from answering."""
        return None

    @asynccontextmanager
    async def session(self) -> AsyncIterator[MemorySession]:
        """Nothing to prepare or release in memory."""
        yield MemorySession(self)

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """Keep the jobs' declarations (one declared ``immediately`` whose declaration is new
        or changed asks for a run); a copy of the fleet's states."""
        await self.db._gate(self.owner)
        self.db.declared.update(jobs)
        self.db.immediately([job for job in jobs.values() if job.immediately], now)
        return {i: s for i, s in self.db.states.items() if i in jobs}

    async def attempt(
        self,
        job_id: str,
        budget: float,
        at: datetime,
        replacing: datetime | None = None,
        fill: Fill | None = None,
    ) -> _MemoryAttempt:
        """Take the job's lock if it is free (one clock: nothing is ahead). ``replacing`` needs
        nothing here: a frozen replica's locks go when it freezes (:meth:`~MemoryDatabase.freeze`),
        and a live one ends its replaced run itself, at the newer slot."""
        await self.db._gate(self.owner)
        return _MemoryAttempt(self.db, self.owner, job_id, fill)

    async def read(self, job_ids: Sequence[str]) -> tuple[dict[str, FleetState], frozenset[str]]:
        """The states of ``job_ids``, and those whose lock is held."""
        await self.db._gate(self.owner)
        db = self.db
        states = {i: db.states[i] for i in job_ids if i in db.states}
        return states, frozenset(db._held.keys() & set(job_ids))

    async def watch(self, replica: Watcher) -> NoReturn:
        """Join the live replicas; at start and after every change, hand this replica the
        paused and triggered jobs and the view; leave when cancelled."""
        db, owner, apply, members = self.db, replica.owner, replica.apply, replica.members
        try:
            await db._gate(owner)
        except ReplicaLost:  # killed before it started: a dead replica never joins the view
            await anyio.sleep_forever()
        clock = self._clock
        now = clock.now()
        live = _Live(replica.declared, now, now, anyio.Event(), clock)
        db._join(owner, live)
        try:
            while True:
                try:
                    await db._gate(owner)
                except ReplicaLost:  # killed: a dead replica beats no more
                    await anyio.sleep_forever()
                if db._live.get(owner) is not live:  # thawed after it went stale: back
                    db._join(owner, live)
                live.poked = anyio.Event()
                live.seen_at = now = clock.now()
                db._expire(now)
                resumes = db.expire(now)  # pauses that ended: this replica resumes them
                apply(db.controls())
                if db._live.keys() == {owner}:  # alone: no work to share, no ranking to keep
                    await members({}, {})
                else:
                    await members(*db.view())
                # look again when a replica that stopped beating goes stale, or a pause ends
                next_at = min((t for t in (db._stale_at(), resumes) if t is not None), default=None)
                if next_at is None:
                    await live.poked.wait()
                else:
                    wait = max(0.0, (next_at - clock.now()).total_seconds())
                    await until(live.poked, clock, clock.monotonic() + wait)
        finally:
            if db._live.get(owner) is live and owner not in db._killed:  # the dead never leave
                db.depart(owner, clock.now())

    def diagnose(self, exc: BaseException) -> Diagnosis:
        """Lost for a replica frozen or killed, or a commit refused; in memory, only errors of
        ticklock's own fail the start."""
        return Diagnosis(
            isinstance(exc, (ReplicaLost, SlotAlreadyCommitted)),
            f"ticklock could not start: {type(exc).__name__}: {exc}",
        )

    def views(
        self, jobs: Callable[[], Mapping[str, Job]], health: Callable[[], list[JobHealth]]
    ) -> MemoryViews:
        """The operators' view of this database, as the scheduler declaring ``jobs`` sees it."""
        return MemoryViews(self.db, self._clock, jobs, health)


class MemorySession:
    """An open :class:`MemoryCoordinator`."""

    def __init__(self, coordinator: MemoryCoordinator) -> None:
        self._coordinator = coordinator

    async def connected(self) -> None:
        """Wait until the database answers: at once, but never for a killed replica (the
        scheduler's reconnect loop would spin without ever yielding)."""
        c = self._coordinator
        if c.owner in c.db._killed:
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()

    def poke(self) -> None:
        """Something changed here (a job given up or steered): every replica looks again."""
        self._coordinator.db.changed()

    def stalled(self, job_id: str | None, seconds: float) -> None:
        """Keep a stall of this replica's loop, for the ledger."""
        c = self._coordinator
        now = c._clock.now()
        since = now - timedelta(seconds=seconds)
        c.db.incidents.append(Incident(c.owner, STALLED, since, now, job_id))


@dataclass(frozen=True)
class MemoryViews:
    """The operators' view of a :class:`MemoryDatabase`, as one scheduler sees it."""

    db: MemoryDatabase
    clock: Clock
    jobs: Callable[[], Mapping[str, Job]]
    health: Callable[[], list[JobHealth]]

    @property
    def fleet(self) -> Fleet:
        """The database's jobs, history, replicas and operations."""
        return MemoryFleet(self.db, self.clock, self.jobs, self.health)

    @property
    def schedules(self) -> MemorySchedules:
        """The database's stored schedules."""
        return MemorySchedules(self.db, self.clock)
