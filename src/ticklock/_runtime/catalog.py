"""The stored schedules this replica runs: one cycle for each schedule of the tasks it has,
built from the records at start and kept in step with every write after.

Writes are numbered by the store. The catalog remembers the number it has applied; when the
watch hands this replica a beat (every beat, and at once after a write's notification), it
asks the store what was written since, reads those schedules, and adds, replaces or removes
their cycles. A run in flight when its schedule changes finishes under the definition it
started with; a tick of a definition that is no longer the records' is refused under the lock
(:func:`~.plan.admit`), so a replica that hears of a change late runs nothing of the old one.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

import anyio

from .._backends.seam import FleetState
from .._schedule.job import Handler
from .._schedule.stored import Schedule, job_of
from .._telemetry import logger
from .crew import Crew
from .cycle import Cycle

LATEST = 2**62
"""A write number past any: :meth:`~._backends.seam.ScheduleStore.changes` gives only the
last write's number."""


class Catalog:
    """The cycles of the stored schedules of ``tasks`` (see the module docstring)."""

    def __init__(self, crew: Crew, tasks: Mapping[str, Handler]) -> None:
        self._crew = crew
        self._tasks = tasks
        self.cycles: dict[str, Cycle] = {}
        self._seen = 0  # the last write applied
        self._wake = anyio.Event()
        self._loaded = False  # the schedules were read once

    def task_of(self, job_id: str) -> str | None:
        """The task of the stored schedule ``job_id`` this replica runs (``None``: none)."""
        cycle = self.cycles.get(job_id)
        return None if cycle is None else cycle.job.task

    def poke(self) -> None:
        """A beat: look for writes since the last one applied."""
        self._wake.set()

    async def follow(self) -> None:
        """Until cancelled: load the stored schedules of this replica's tasks, then on each
        beat apply the writes made since the last one applied. A read that fails (the
        database does not answer) is tried again on the next beat."""
        if not self._tasks:
            return
        while True:
            try:
                await (self._apply() if self._loaded else self._load())
            except Exception as exc:
                logger.debug("reading the stored schedules failed: %s", exc)
            await self._wake.wait()
            self._wake = anyio.Event()

    async def _load(self) -> None:
        crew = self._crew
        store = crew.coordinator.schedules
        seen, _ = await store.changes(LATEST)
        schedules = await store.read(tuple(self._tasks), None)
        states, _ = await crew.coordinator.read([s.id for s in schedules])
        now = crew.clock.now()
        for schedule in schedules:
            if schedule.id not in self.cycles:
                self._add(schedule, states.get(schedule.id), now)
        self._seen, self._loaded = seen, True

    async def _apply(self) -> None:
        crew = self._crew
        store = crew.coordinator.schedules
        seen, ids = await store.changes(self._seen)
        if not ids:
            self._seen = max(self._seen, seen)
            return
        schedules = {s.id: s for s in await store.read(tuple(self._tasks), ids)}
        fresh = [
            i
            for i, s in schedules.items()
            if i not in self.cycles or self.cycles[i].job.version != s.version
        ]
        states, _ = await crew.coordinator.read(fresh) if fresh else ({}, frozenset())
        now = crew.clock.now()
        for schedule_id in ids:
            schedule = schedules.get(schedule_id)
            cycle = self.cycles.get(schedule_id)
            if cycle is not None and (schedule is None or cycle.job.version != schedule.version):
                self._remove(schedule_id)
            if schedule is not None and schedule_id not in self.cycles:
                self._add(schedule, states.get(schedule_id), now)
        self._seen = seen

    def _add(self, schedule: Schedule, state: FleetState | None, now: datetime) -> None:
        try:
            job = job_of(schedule, self._tasks[schedule.task])
        except Exception as exc:  # written by a release whose rules this one does not share
            logger.warning("stored schedule %r cannot run here: %s", schedule.id, exc)
            return
        cycle = self.cycles[schedule.id] = Cycle(job, self._crew)
        self._crew.share.forget(schedule.id)
        if self._crew.running:
            cycle.start(state, now)

    def _remove(self, schedule_id: str) -> None:
        cycle = self.cycles.pop(schedule_id)
        cycle.remove()
        self._crew.share.forget(schedule_id)

    def stop(self) -> None:
        """Wait for nothing (shutdown)."""
        for cycle in self.cycles.values():
            cycle.stop()
