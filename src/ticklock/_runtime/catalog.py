"""The stored schedules this replica runs: of the schedules of its tasks, it keeps a cycle
only for those due within :data:`HORIZON`, those it runs and those operators steer, so that
its memory and its work do not grow with the number of schedules.

Every :data:`LOOK` seconds (a deadline it sleeps until, not a poll per schedule) the catalog
asks the store which schedules of its tasks are due within the horizon (the next slot the
records hold of each), a window at a time, and builds the cycles it lacks; a cycle that
waits for a slot beyond the horizon, or for nothing (paused), is dropped: the records hold
its next slot, and a later look builds it again in time.

Writes are numbered by the store. The catalog remembers the number it has applied; on each
beat the watch hands this replica (every beat, and at once after a write's notification) it
asks what was written since and replaces or removes the cycles of those schedules (a new one
waits for the next look, or is built at once if due within the horizon). A run in flight when
its schedule changes finishes under the definition it started with; a tick of a definition
that is no longer the records' is refused under the lock (:func:`~.plan.admit`), so a replica
that hears of a change late runs nothing of the old one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timedelta

import anyio

from .._backends.seam import Control
from .._schedule.job import Handler
from .._schedule.stored import Schedule, ScheduleStore, job_of
from .._telemetry import logger
from .clock import until
from .crew import Crew
from .cycle import HORIZON, LOOK, Cycle

WINDOW = 10_000
"""The most schedules one read of a look returns; a full window is followed by the next, by
id, in the same look."""
LATEST = 2**62
"""A write number past any: :meth:`~ticklock._schedule.stored.ScheduleStore.changes` then
gives only the last write's number."""


class Catalog:
    """The cycles of the stored schedules of ``tasks`` (see the module docstring)."""

    def __init__(
        self, crew: Crew, tasks: Mapping[str, Handler], store: Callable[[], ScheduleStore]
    ) -> None:
        self._crew = crew
        self._tasks = tasks
        self._store = store  # the namespace's stored schedules (through the coordinator)
        self.cycles: dict[str, Cycle] = {}
        self._seen: int | None = None  # the last write applied (None: not read yet)
        self._wake = anyio.Event()
        self._steered: set[str] = set()  # triggered: held here whatever their next slot
        self._paused: set[str] = set()  # paused at the last beat
        self._pending: set[str] = set()  # triggered or resumed: to build if not held
        self._refused: dict[str, int] = {}  # the version of each schedule refused here

    def task_of(self, job_id: str) -> str | None:
        """The task of the stored schedule ``job_id`` this replica runs (``None``: none)."""
        cycle = self.cycles.get(job_id)
        return None if cycle is None else cycle.job.task

    def beat(self, controls: Mapping[str, Control]) -> None:
        """A beat, with the namespace's paused and triggered jobs: look for writes since the
        last one applied, and build the cycles of triggered schedules not held here."""
        self._steered = {i for i, c in controls.items() if c.trigger_at is not None}
        paused = {i for i, c in controls.items() if c.paused_at is not None}
        self._pending |= self._steered | (self._paused - paused)  # triggered, or resumed
        self._paused = paused
        self._wake.set()

    async def reload(self) -> None:
        """The database answers again: plan the cycles held here from the fleet's states
        (a read that fails drops those not running: the next look builds them from the
        records), and look for writes now."""
        held = list(self.cycles)  # not those built meanwhile, from the states they read
        if held:
            try:
                states, _ = await self._crew.coordinator.read(held)
            except Exception as exc:
                logger.debug("reading the stored schedules' states failed: %s", exc)
                for schedule_id, cycle in list(self.cycles.items()):
                    if not cycle.running:
                        self._remove(schedule_id)
            else:
                now = self._crew.clock.now()
                for schedule_id in held:
                    if (kept := self.cycles.get(schedule_id)) is not None:
                        kept.reload(states.get(schedule_id), now)
        self._wake.set()

    async def follow(self) -> None:
        """Until cancelled: look for the schedules due within the horizon every
        :data:`LOOK` seconds, and apply the writes on each beat. A read that fails (the
        database does not answer) is tried again at the next beat or look."""
        if not self._tasks:
            return
        clock = self._crew.clock
        next_look = clock.monotonic()
        while True:
            try:
                if self._seen is None:
                    self._seen, _ = await self._store().changes(LATEST)
                else:
                    await self._apply()
                if clock.monotonic() >= next_look:
                    await self._look()
                    next_look = clock.monotonic() + LOOK
                pending, self._pending = self._pending, set()
                await self._build([i for i in pending if i not in self.cycles])
            except Exception as exc:
                if not self._crew.coordinator.diagnose(exc).lost:  # not an outage: say so
                    logger.warning("reading the stored schedules failed", exc_info=True)
                else:
                    logger.debug("reading the stored schedules failed: %s", exc)
            await until(self._wake, clock, next_look)  # a beat, or the next look's deadline
            self._wake = anyio.Event()

    async def _look(self) -> None:
        """Build the cycles of the schedules due within the horizon, read a window at a
        time by id; drop those waiting for a slot beyond it."""
        crew = self._crew
        now = crew.clock.now()
        until = now + timedelta(seconds=HORIZON)
        for schedule_id, cycle in list(self.cycles.items()):
            if not cycle.running and schedule_id not in self._steered and _beyond(cycle, until):
                self._remove(schedule_id)
        store, after = self._store(), None
        while True:
            due, after = await store.due(tuple(self._tasks), now, until, WINDOW, after)
            await self._add([s for s in due if s.id not in self.cycles])
            if after is None:
                return

    async def _apply(self) -> None:
        store = self._store()
        seen, ids = await store.changes(self._seen or 0)
        if ids:
            schedules = {s.id: s for s in await store.read(tuple(self._tasks), ids)}
            for schedule_id in ids:
                schedule, cycle = schedules.get(schedule_id), self.cycles.get(schedule_id)
                if cycle is not None and (
                    schedule is None or cycle.job.version != schedule.version
                ):
                    self._remove(schedule_id)
            await self._add([s for s in schedules.values() if s.id not in self.cycles], within=True)
        if seen != self._seen:
            logger.debug("stored schedules: applied the writes up to %d", seen)
        self._seen = seen

    async def hold(self, schedule_id: str) -> Cycle | None:
        """The cycle of the stored schedule ``schedule_id``, built now if it is not held
        (``run_now``); ``None`` when no schedule of this replica's tasks has that id."""
        if schedule_id not in self.cycles and self._tasks:
            store = self._store()
            await self._add(await store.read(tuple(self._tasks), [schedule_id]))
        return self.cycles.get(schedule_id)

    async def _build(self, ids: Collection[str]) -> None:
        """Build the cycles of the triggered or resumed schedules ``ids`` due within the
        horizon (a trigger request is due at once)."""
        if ids:
            store = self._store()
            await self._add(await store.read(tuple(self._tasks), ids), within=True)

    async def _add(self, schedules: list[Schedule], *, within: bool = False) -> None:
        """Build the cycles of ``schedules`` from the fleet's states (``within``: only those
        whose next slot falls within the horizon)."""
        if not schedules:
            return
        crew = self._crew
        states, _ = await crew.coordinator.read([s.id for s in schedules])
        now = crew.clock.now()
        until = now + timedelta(seconds=HORIZON)
        for schedule in schedules:
            if schedule.id in self.cycles:
                continue
            try:
                job = job_of(schedule, self._tasks[schedule.task])
            except Exception as exc:  # written by a release whose rules this one refuses
                if self._refused.get(schedule.id) != schedule.version:  # once per version
                    self._refused[schedule.id] = schedule.version
                    logger.warning("stored schedule %r cannot run here: %s", schedule.id, exc)
                continue
            cycle = self.cycles[schedule.id] = Cycle(job, crew)  # its task ranks it
            crew.share.forget(schedule.id)
            state = states.get(schedule.id)
            cycle.start(state, now)
            if state is not None and (state.paused_at or state.trigger_at):
                cycle.control(state.paused_at, state.trigger_at)  # a request to serve
            if within and _beyond(cycle, until):
                self._remove(schedule.id)

    def _remove(self, schedule_id: str) -> None:
        self.cycles.pop(schedule_id).remove()
        self._crew.share.forget(schedule_id)

    def stop(self) -> None:
        """Wait for nothing (shutdown)."""
        for cycle in self.cycles.values():
            cycle.stop()


def _beyond(cycle: Cycle, until: datetime) -> bool:
    """Whether ``cycle`` waits for nothing, or for a slot after ``until``."""
    if cycle.manual or cycle.slot is None and cycle.queued:
        return False  # a trigger request to serve, or a recheck soon
    return cycle.fire_at is None or cycle.fire_at > until
