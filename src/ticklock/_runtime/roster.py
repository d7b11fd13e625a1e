"""The jobs declared in code on this replica: a cycle for each one due within the horizon or
at work, only its row for the rest.

A job's row is its declaration (:class:`~ticklock._schedule.job.Job`) and the fleet's state as
this replica last saw it. A cycle at rest (waiting for its slot with nothing else to
remember: no run or look out, no retry, no trigger to serve, no pause credit, not given up)
whose slot lies beyond the horizon is dropped, since its slot follows from the row
(:func:`~.plan.resting`); every :data:`~.cycle.LOOK` seconds a look builds again the cycles of
the jobs whose slots come within :data:`~.cycle.HORIZON`. Operators' steering, ``run_now`` and
the database answering again wake a job at once. So a replica's memory and timers grow with
what is due soon, not with the number of jobs; :meth:`Roster.health` judges a sleeping job
from its row as a cycle's health judges it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from datetime import datetime

from .._backends.seam import NO_STATE, FleetState
from .._operators.health import judge
from .._schedule.job import Job, JobHealth, fingerprint
from .._telemetry import logger
from .clock import Clock
from .crew import Crew
from .cycle import HORIZON, LOOK, Cycle
from .entry import NO_CREDIT
from .loop import STEP_TOLERANCE, WALL_WATCH
from .plan import Idle, OnTime, Plan, plan, resting


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
        self._asleep: dict[int, list[str]] = {}  # sleeping jobs by their slot's bucket
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
        self._start, self._offset = now, _offset(self._crew.clock)
        self._asleep.clear()
        for job_id, job in self.jobs.items():
            state = None if states is None else states.get(job_id)
            if (cycle := self.cycles.get(job_id)) is not None:
                cycle.start(state, now)
            else:
                self._place(job, state, now)

    def reload(self, states: Mapping[str, FleetState], now: datetime) -> None:
        """The database answers again: plan every job from the fleet's ``states``."""
        self._start = now  # a job that never ran is planned anew from now, as a cycle is
        for job_id, job in self.jobs.items():
            state = states.get(job_id)
            if (cycle := self.cycles.get(job_id)) is not None:
                cycle.reload(state, now)
            else:
                self._place(job, state, now)

    def _place(self, job: Job, state: FleetState | None, now: datetime) -> None:
        """Plan ``job`` at ``now`` as a cycle starting would: asleep if it waits for a slot
        beyond the horizon (or, disabled, for nothing), else in a cycle."""
        if not job.enabled:  # a row whatever its state: nothing to plan
            self._sleep(job.id, state, None)
            return
        step = plan(job, state or NO_STATE, now)
        if self._over(job, state, step):
            self._sleep(job.id, state, None)
            return
        if isinstance(step, OnTime) and step.slot == self._resting(job, state):
            bucket = _bucket(step.slot)
            if bucket > _limit(now):
                self._sleep(job.id, state, bucket)
                return
        cycle = self.cycles[job.id] = Cycle(job, self._crew)
        cycle.start(state, now)

    def _resting(self, job: Job, state: FleetState | None) -> datetime | None:
        assert self._start is not None
        return resting(job, state or NO_STATE, self._start)

    def _sleep(self, job_id: str, state: FleetState | None, bucket: int | None) -> None:
        """Keep only ``job_id``'s row, woken at ``bucket``'s look (``None``: never)."""
        if state is None:
            self._states.pop(job_id, None)
        else:
            self._states[job_id] = state
        if bucket is not None:
            self._asleep.setdefault(bucket, []).append(job_id)

    async def follow(self) -> None:
        """Until cancelled: a :meth:`look` every :data:`~.cycle.LOOK` seconds, and at once when
        the wall clock steps (NTP, a VM's resume), which may bring slots within the horizon:
        the wall clock is read every :data:`~.loop.WALL_WATCH` seconds, as the loop reads it
        for a cron job it holds."""
        clock = self._crew.clock
        next_look = clock.monotonic() + LOOK
        while True:
            await clock.sleep_until(min(next_look, clock.monotonic() + WALL_WATCH))
            offset = _offset(clock)
            if clock.monotonic() < next_look and abs(offset - self._offset) <= STEP_TOLERANCE:
                continue
            next_look, self._offset = clock.monotonic() + LOOK, offset
            try:
                self.look(clock.now())
            except Exception:  # a bug in ticklock itself must not stop the scheduler
                logger.exception("internal error in a look at the jobs due soon")

    def look(self, now: datetime) -> None:
        """Drop the cycles at rest beyond the horizon; build those of the sleeping jobs whose
        slots come within it."""
        limit = _limit(now)
        for job_id, cycle in list(self.cycles.items()):
            if (slot := self._at_rest(cycle)) is not None and (bucket := _bucket(slot)) > limit:
                del self.cycles[job_id]
                cycle.stop()
                self._sleep(job_id, cycle.state, bucket)
            elif self._quiet(cycle) and self._over(cycle.job, cycle.state, None):
                del self.cycles[job_id]
                cycle.stop()
                self._sleep(job_id, cycle.state, None)
        for bucket in sorted(b for b in self._asleep if b <= limit):
            for job_id in self._asleep.pop(bucket):
                job = self.jobs.get(job_id)
                if job is None or job_id in self.cycles:
                    continue  # removed, or woken already
                slot = self._resting(job, self._states.get(job_id))
                if slot is not None and _bucket(slot) == bucket:  # else it sleeps elsewhere
                    self.wake(job_id)

    def _over(self, job: Job, state: FleetState | None, step: Plan | None) -> bool:
        """Whether ``job`` waits for nothing because its window ended or its limit was
        reached (not paused, no trigger request): a row that only a trigger wakes (``step``:
        its plan, if made)."""
        if job.end is None and job.limit is None:
            return False
        if state is not None and (state.paused_at or state.trigger_at):
            return False
        return isinstance(step, Idle) or (step is None and self._resting(job, state) is None)

    def _quiet(self, cycle: Cycle) -> bool:
        """Whether ``cycle`` has nothing to remember but its row (see :meth:`_at_rest`)."""
        return not (
            not cycle.job.enabled
            or cycle.running
            or cycle.manual
            or cycle.removed
            or cycle.steered
            or cycle.observer
            or cycle.attempt != 1
            or cycle.stage
            or cycle.held_at is not None
            or cycle.own_failures
            or cycle.given_up_at is not None
            or cycle.credit != NO_CREDIT
        )

    def _at_rest(self, cycle: Cycle) -> datetime | None:
        """The slot ``cycle`` waits for if it has nothing else to remember, and the row gives
        that slot again; else ``None`` (it stays held)."""
        if cycle.slot is None or not self._quiet(cycle):
            return None
        state = cycle.state
        if (state is None or state.last_end is None) and cycle.since != self._start:
            return None  # the overdue base is its own start, which a row does not keep
        return cycle.slot if cycle.slot == self._resting(cycle.job, state) else None

    def wake(self, job_id: str) -> Cycle | None:
        """The cycle of ``job_id``, built now from its row if it sleeps (``None``: not
        declared)."""
        if (cycle := self.cycles.get(job_id)) is not None:
            return cycle
        if (job := self.jobs.get(job_id)) is None:
            return None
        state = self._states.pop(job_id, None)
        cycle = self.cycles[job_id] = Cycle(job, self._crew)
        cycle.state, cycle.since = state, self._start
        if job.enabled and self._crew.running and (slot := self._resting(job, state)):
            cycle.wait(OnTime(slot))
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
                    since=self._start,
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


def _bucket(slot: datetime) -> int:
    """The look at or after which a job waiting for ``slot`` is held again."""
    return math.floor(slot.timestamp() / LOOK)


def _limit(now: datetime) -> int:
    """The last bucket held at ``now``: the slots up to a horizon ahead, and the rest of the
    bucket that ends it."""
    return math.floor((now.timestamp() + HORIZON) / LOOK)
