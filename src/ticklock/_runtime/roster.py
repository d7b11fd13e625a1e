"""The jobs declared in code on this replica: a cycle for each one due within the horizon or
at work, only its row for the rest.

A job's row is its declaration (:class:`~ticklock._schedule.job.Job`) and the fleet's state as
this replica last saw it. A cycle at rest (waiting for its slot with nothing else to
remember: no run or look out, no retry, no trigger to serve, no pause credit, not given up)
whose slot lies beyond the horizon is dropped, since its slot follows from the row
(:func:`~.slots.resting`); every :data:`~.cycle.LOOK` seconds a look builds again the cycles of
the jobs whose slots come within :data:`~.cycle.HORIZON`. Operators' steering, ``run_now`` and
the database answering again wake a job at once. So a replica's memory and timers grow with
what is due soon, not with the number of jobs; :meth:`Roster.health` judges a sleeping job
from its row as a cycle's health judges it (its next fire is its slot: the jitter is drawn
when it wakes). A sleeping ``every`` job keeps to the monotonic clock as a held one does (its
bucket counts on it, as the wall clock stood when it was planned); a cron job to the wall
clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from datetime import datetime, timezone

from .._backends.seam import NO_STATE, FleetState
from .._operators.health import judge
from .._schedule.job import Job, JobHealth, fingerprint
from .._schedule.triggers import Cron
from .._telemetry import logger
from .clock import Clock
from .crew import Crew
from .cycle import HORIZON, LOOK, Cycle
from .entry import NO_CREDIT
from .loop import STEP_TOLERANCE, WALL_WATCH
from .plan import Idle, OnTime, Plan, plan
from .slots import resting

WALL = -1
"""The clock of a sleeping cron job: the wall clock (its slots are the wall clock's instants,
as the loop waits for a held one's)."""


class Roster:
    """The jobs declared in code (``jobs``), and the cycles held for them (``cycles``)."""

    def __init__(self, crew: Crew) -> None:
        self._crew = crew
        self.jobs: dict[str, Job] = {}
        """Every job declared in code, by id, in the order declared."""
        self.cycles: dict[str, Cycle] = {}
        """The jobs held awake, by id."""
        self._states: dict[str, FleetState] = {}  # a sleeping job's state, when it has one
        self._start: datetime | None = None  # when the sleeping jobs that never ran were planned
        self._since: datetime | None = None  # when this run of the scheduler planned them first
        # sleeping jobs by (clock, bucket): a cron job's bucket counts on the wall clock
        # (WALL); an every job's on the monotonic clock, as the wall clock stood (its offset,
        # an index of _offsets) when it was planned, so that a wall-clock step does not move it
        self._asleep: dict[tuple[int, int], list[str]] = {}
        self._offsets: list[float] = []  # the wall-less-monotonic offsets the jobs were planned at
        self._fingerprints: dict[str, str] = {}  # computed when first published
        self._offset = 0.0  # the wall clock less the monotonic one, at the last look

    # -- declaration ---------------------------------------------------------------------

    def add(self, job: Job) -> None:
        """Declare ``job``; while the scheduler runs, plan it at once."""
        self.jobs[job.id] = job
        if self._crew.running:
            cycle = self.cycles[job.id] = Cycle(job, self._crew)
            cycle.start(None, self._crew.clock.now())

    def remove(self, job_id: str) -> Job:
        """Remove ``job_id`` (``KeyError`` if not declared): a run in flight finishes."""
        job = self.jobs.pop(job_id)
        self._states.pop(job_id, None)
        self._fingerprints.pop(job_id, None)
        if (cycle := self.cycles.pop(job_id, None)) is not None:
            cycle.remove()
        return job

    def fingerprints(self, job_ids: Collection[str]) -> tuple[str, ...]:
        """The fingerprints of the declarations of ``job_ids``, which this replica publishes."""
        cache = self._fingerprints
        out = []
        for job_id in job_ids:
            if (found := cache.get(job_id)) is None:
                found = cache[job_id] = fingerprint(self.jobs[job_id])
            out.append(found)
        return tuple(out)

    # -- a run of the scheduler ----------------------------------------------------------

    def start(self, states: Mapping[str, FleetState] | None, now: datetime) -> None:
        """Plan every job at ``now`` from the fleet's ``states`` (``None``: not known yet)."""
        clock = self._crew.clock
        self._start = self._since = now
        self._offset = _offset(clock)
        self._asleep.clear()
        self._offsets = [self._offset]
        for job_id, job in self.jobs.items():
            state = None if states is None else states.get(job_id)
            if (cycle := self.cycles.get(job_id)) is not None:
                cycle.start(state, now)
            else:
                self._place(job, state, now)

    def reload(self, states: Mapping[str, FleetState], now: datetime) -> None:
        """The database answers again: plan every job from the fleet's ``states`` (a job that
        never ran is planned from now, as a cycle's reload plans it; its overdue base stays)."""
        self._start = now
        for job_id, job in self.jobs.items():
            state = states.get(job_id)
            if (cycle := self.cycles.get(job_id)) is not None:
                cycle.reload(state, now)
            else:
                self._place(job, state, now)

    def _place(self, job: Job, state: FleetState | None, now: datetime) -> None:
        """Plan ``job`` at ``now`` as a cycle starting would: asleep if it waits for a slot
        beyond the horizon (or for nothing: disabled, its window ended, its limit reached),
        else in a cycle."""
        if not job.enabled:  # a row whatever its state: nothing to plan
            self._sleep(job, state, None)
            return
        step = plan(job, state or NO_STATE, now)
        if self._over(job, state, step):
            self._sleep(job, state, None)
            return
        if isinstance(step, OnTime) and step.slot == self._resting(job, state):
            key = self._key(job, step.slot, self._epoch(self._offset))
            if key[1] > self._limit(key[0]):
                self._sleep(job, state, key)
                return
        self._states.pop(job.id, None)
        cycle = self.cycles[job.id] = Cycle(job, self._crew)
        cycle.start(state, now)
        cycle.since = self._since

    def _resting(self, job: Job, state: FleetState | None) -> datetime | None:
        assert self._start is not None
        return resting(job, state or NO_STATE, self._start)

    def _epoch(self, offset: float) -> int:
        """The index of ``offset`` among those the sleeping every jobs were planned at."""
        for i, known in enumerate(self._offsets):
            if abs(known - offset) <= STEP_TOLERANCE:
                return i
        self._offsets.append(offset)
        return len(self._offsets) - 1

    def _key(self, job: Job, slot: datetime, epoch: int) -> tuple[int, int]:
        """The bucket of a job sleeping until ``slot``: on the wall clock for cron, on the
        monotonic clock (as the wall clock stood at ``epoch``) for ``every``."""
        if isinstance(job.trigger, Cron):
            return WALL, math.floor(slot.timestamp() / LOOK)
        return epoch, math.floor((slot.timestamp() - self._offsets[epoch]) / LOOK)

    def _limit(self, clock: int) -> int:
        """The last bucket of ``clock`` held now: the slots up to a horizon ahead, and the
        rest of the bucket that ends it."""
        if clock == WALL:
            return math.floor((self._crew.clock.now().timestamp() + HORIZON) / LOOK)
        return math.floor((self._crew.clock.monotonic() + HORIZON) / LOOK)

    def _sleep(self, job: Job, state: FleetState | None, key: tuple[int, int] | None) -> None:
        """Keep only ``job``'s row, woken at ``key``'s look (``None``: never)."""
        if state is None:
            self._states.pop(job.id, None)
        else:
            self._states[job.id] = state
        if key is not None:
            self._asleep.setdefault(key, []).append(job.id)

    async def follow(self) -> None:
        """Until cancelled: a :meth:`look` every :data:`~.cycle.LOOK` seconds, and at once when
        the wall clock steps (NTP, a VM's resume), which may bring cron slots within the
        horizon: the wall clock is read every :data:`~.loop.WALL_WATCH` seconds, as the loop
        reads it for a cron job it holds."""
        clock = self._crew.clock
        next_look = clock.monotonic() + LOOK
        while True:
            await clock.sleep_until(min(next_look, clock.monotonic() + WALL_WATCH))
            offset = _offset(clock)
            if clock.monotonic() < next_look and abs(offset - self._offset) <= STEP_TOLERANCE:
                continue
            next_look, self._offset = clock.monotonic() + LOOK, offset
            try:
                self.look()
            except Exception:  # a bug in ticklock itself must not stop the scheduler
                logger.exception("internal error in a look at the jobs due soon")

    def look(self) -> None:
        """Drop the cycles at rest beyond the horizon (or waiting for nothing: disabled, their
        window ended, their limit reached); build those of the sleeping jobs whose slots come
        within it."""
        for cycle in list(self.cycles.values()):
            # a job that waits for nothing is never overdue: its pause credit is moot
            done = not cycle.job.enabled or self._over(cycle.job, cycle.state, None)
            if not self._quiet(cycle, credited=not done):
                continue
            if done:
                self._drop(cycle, None)
            elif (key := self._at_rest(cycle)) is not None and key[1] > self._limit(key[0]):
                self._drop(cycle, key)
        limits = {clock: self._limit(clock) for clock, _ in self._asleep}
        for key in sorted(k for k in self._asleep if k[1] <= limits[k[0]]):
            for job_id in self._asleep.pop(key):
                job = self.jobs.get(job_id)
                if job is None or job_id in self.cycles:
                    continue  # removed, or woken already
                slot = self._resting(job, self._states.get(job_id))
                if slot is not None and self._key(job, slot, max(key[0], 0)) == key:
                    self._wake(job, slot, key[0])  # else it sleeps in another bucket

    def _drop(self, cycle: Cycle, key: tuple[int, int] | None) -> None:
        """Keep only ``cycle``'s row: its cycle waits for nothing more (a run it started
        finishes, and plans nothing)."""
        del self.cycles[cycle.job.id]
        cycle.remove()
        self._sleep(cycle.job, cycle.state, key)

    def _over(self, job: Job, state: FleetState | None, step: Plan | None) -> bool:
        """Whether ``job`` waits for nothing because its window ended or its limit was
        reached (not paused, no trigger request): a row that only a trigger wakes (``step``:
        its plan, if made)."""
        if job.end is None and job.limit is None:
            return False
        if state is not None and (state.paused_at or state.trigger_at):
            return False
        return isinstance(step, Idle) or (step is None and self._resting(job, state) is None)

    def _quiet(self, cycle: Cycle, *, credited: bool = True) -> bool:
        """Whether ``cycle`` has nothing to remember but its row: no run (nor ``run_now``) or
        look out, no trigger to serve, no retry, no lock found held, no failure here, no pause
        it must credit (``credited``: its credit counts), not given up, no role of its own."""
        credit = cycle.credit
        state = cycle.state
        return not (
            cycle.running
            or cycle.manual
            or cycle.removed
            or cycle.steered
            or cycle.observer
            or cycle.attempt != 1
            or cycle.stage
            or cycle.held_at is not None
            or cycle.own_failures
            or cycle.given_up_at is not None
            or cycle.by_hand
            or (
                credited
                and credit != NO_CREDIT
                and credit[0] == (state.last_end if state else None)
            )
            or (state is not None and state.paused_at is not None)
        )

    def _at_rest(self, cycle: Cycle) -> tuple[int, int] | None:
        """The bucket of the slot a quiet ``cycle`` waits for, if the row gives that slot
        again; else ``None`` (it stays held)."""
        slot, state = cycle.slot, cycle.state
        if slot is None or cycle.fire_at is None:
            return None
        if (state is None or state.last_end is None) and cycle.since != self._since:
            return None  # the overdue base is its own start, which a row does not keep
        if slot != self._resting(cycle.job, state):
            return None
        # the offset it was planned at: its deadline (monotonic) against its fire (wall)
        epoch = self._epoch(cycle.fire_at.timestamp() - cycle.base)
        return self._key(cycle.job, slot, epoch)

    def wake(self, job_id: str) -> Cycle | None:
        """The cycle of ``job_id``, built now from its row if it sleeps (``None``: not
        declared)."""
        if (cycle := self.cycles.get(job_id)) is not None:
            return cycle
        if (job := self.jobs.get(job_id)) is None:
            return None
        slot = self._resting(job, self._states.get(job_id)) if self._start else None
        epoch = 0 if self._offsets else WALL
        if slot is not None:  # out of its bucket (on the clock it was planned on)
            for i in [WALL] if isinstance(job.trigger, Cron) else range(len(self._offsets)):
                found = self._asleep.get(self._key(job, slot, max(i, 0)))
                if found is not None and job_id in found:  # a scan: an operator's wake
                    found.remove(job_id)
                    epoch = i
                    break
        return self._wake(job, slot, epoch)

    def _wake(self, job: Job, slot: datetime | None, epoch: int) -> Cycle:
        state = self._states.pop(job.id, None)
        cycle = self.cycles[job.id] = Cycle(job, self._crew)
        cycle.state, cycle.since = state, self._since
        if job.enabled and self._crew.running and slot is not None:
            now = None  # a cron slot: on the wall clock as it stands
            if epoch != WALL and self._offsets:  # on the clock it was planned on
                now = datetime.fromtimestamp(
                    self._crew.clock.monotonic() + self._offsets[epoch], timezone.utc
                )
            cycle.wait(OnTime(slot), now)
        return cycle

    # -- what operators see --------------------------------------------------------------

    def health(self, now: datetime, clock_now: datetime, *, problem: str | None) -> list[JobHealth]:
        """The health of every job, in the order declared; a sleeping job's from its row."""
        out = []
        running = self._crew.running and self._start is not None
        for job_id, job in self.jobs.items():
            if (cycle := self.cycles.get(job_id)) is not None:
                out.append(cycle.health(now, clock_now, problem=problem))
                continue
            state = self._states.get(job_id)
            planned = running and job.enabled
            out.append(
                judge(
                    job,
                    state or NO_STATE,
                    now=now,
                    clock_now=clock_now,
                    since=self._since,
                    held_at=None,
                    credit=NO_CREDIT,
                    next_fire=self._resting(job, state) if planned else None,
                    problem=problem,
                )
            )
        return out

    def successes(self) -> list[tuple[str, datetime]]:
        """The last success of every job that has one (the telemetry's gauge)."""
        out = []
        for job_id in self.jobs:
            cycle = self.cycles.get(job_id)
            state = self._states.get(job_id) if cycle is None else cycle.state
            if state is not None and state.last_success_at is not None:
                out.append((job_id, state.last_success_at))
        return out


def _offset(clock: Clock) -> float:
    """The wall clock less the monotonic one: it moves when the wall clock steps."""
    return clock.now().timestamp() - clock.monotonic()
