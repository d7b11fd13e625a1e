"""Stored schedules in a :class:`~ticklock.testing.MemoryDatabase`, kept as PostgreSQL keeps
them: beside the jobs' states, with versions, an audit and a numbered log of the writes."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Protocol

from .._operators.fleet import Action
from .._runtime.clock import Clock
from .._runtime.slots import first
from .._schedule.job import Job
from .._schedule.stored import Definition, Schedule, declared_in_code, unknown_task
from .seam import Declared, FleetState


class Records(Protocol):
    """What the stored schedules read and write of a ``MemoryDatabase``."""

    schedules: dict[str, Schedule]
    deleted: dict[str, int]
    schedule_log: list[str]
    states: dict[str, FleetState]
    declared: dict[str, Job]
    actions: deque[Action]
    pauses: dict[str, datetime]

    def declarations(self) -> list[Declared]:
        """What each live replica declares."""
        ...

    def immediately(self, jobs: Sequence[Job], now: datetime, *, keyed: bool = True) -> None:
        """Ask for one run of each of ``jobs`` (see ``MemoryDatabase.immediately``)."""
        ...

    def changed(self) -> None:
        """Make every live replica's watch look again."""
        ...


class MemorySchedules:
    """The stored schedules of one :class:`~ticklock.testing.MemoryDatabase`."""

    def __init__(self, db: Records, clock: Clock) -> None:
        self._db = db
        self._clock = clock

    async def put(
        self,
        definition: Definition,
        *,
        who: str,
        note: str | None,
        tasks: Collection[str],
        jobs: Collection[str],
    ) -> Schedule:
        """Create or replace the schedule (see :class:`~ticklock._backends.seam.ScheduleStore`)."""
        db, sid = self._db, definition.id
        declarations = db.declarations()
        if sid in jobs or any(sid in d.enabled or sid in d.disabled for d in declarations):
            raise declared_in_code(sid)
        if definition.task not in tasks and not any(
            definition.task in d.tasks for d in declarations
        ):
            raise unknown_task(sid, definition.task)
        old = db.schedules.get(sid)
        if old is not None and definition.same(old):
            return old
        now = self._clock.now()
        version = (old.version if old is not None else db.deleted.get(sid, 0)) + 1
        schedule = Schedule(
            id=sid,
            task=definition.task,
            trigger=definition.trigger,
            args=definition.args,
            tenant=definition.tenant,
            options=definition.options,
            version=version,
            created_at=now if old is None else old.created_at,
            updated_at=now,
        )
        db.schedules[sid] = schedule
        db.deleted.pop(sid, None)
        db.declared[sid] = definition.job
        state = db.states.get(sid) if old is not None else None
        db.states[sid] = (
            FleetState(version=version) if state is None else replace(state, version=version)
        )
        if definition.job.immediately:  # new or changed: one run at once
            db.immediately([replace(definition.job, id=sid)], now, keyed=False)
        self._written(sid, "put", who, note)
        return schedule

    async def get(self, schedule_id: str) -> Schedule | None:
        """The stored schedule, or ``None``."""
        return self._db.schedules.get(schedule_id)

    async def delete(self, schedule_id: str, *, who: str, note: str | None) -> bool:
        """Delete the schedule; its runs stay in the history."""
        db = self._db
        old = db.schedules.pop(schedule_id, None)
        if old is None:
            return False
        db.deleted[schedule_id] = old.version
        state = db.states.get(schedule_id) or FleetState()
        db.states[schedule_id] = replace(
            state, version=0, paused_at=None, trigger_at=None, successes=0
        )
        db.pauses.pop(schedule_id, None)  # a schedule put again with this id starts afresh
        self._written(schedule_id, "delete", who, note)
        return True

    async def page(
        self, tenant: str | None, task: str | None, after: str | None, limit: int
    ) -> list[Schedule]:
        """Up to ``limit`` schedules by id after ``after``, of ``tenant`` and ``task``."""
        found = sorted(
            (
                s
                for s in self._db.schedules.values()
                if (tenant is None or s.tenant == tenant)
                and (task is None or s.task == task)
                and (after is None or s.id > after)
            ),
            key=lambda s: s.id,
        )
        return found[:limit]

    async def changes(self, since: int) -> tuple[int, list[str]]:
        """The last write's number, and the ids written after ``since``."""
        log = self._db.schedule_log
        return len(log), list(dict.fromkeys(log[since:]))

    async def read(self, tasks: Collection[str], ids: Collection[str]) -> list[Schedule]:
        """The schedules of ``tasks`` among ``ids``."""
        schedules = self._db.schedules
        chosen = (schedules[i] for i in ids if i in schedules)
        return [s for s in chosen if s.task in tasks]

    async def due(
        self,
        tasks: Collection[str],
        now: datetime,
        until: datetime,
        limit: int,
        after: str | None = None,
    ) -> tuple[list[Schedule], str | None]:
        """The schedules of ``tasks`` due by ``until`` (their next slot, computed here)."""
        db, found = self._db, []
        for s in sorted(db.schedules.values(), key=lambda s: s.id):
            state = db.states.get(s.id) or FleetState()
            if s.task not in tasks or state.paused_at is not None:
                continue
            if after is not None and s.id <= after:
                continue
            job = replace(db.declared[s.id], defined_at=s.updated_at)
            due = state.trigger_at or first(job, state, now)
            if due is not None and due <= until:
                found.append(s)
                if len(found) == limit:
                    return found, s.id
        return found, None

    def _written(self, schedule_id: str, action: str, who: str, note: str | None) -> None:
        db = self._db
        db.schedule_log.append(schedule_id)
        db.actions.append(Action(schedule_id, action, who, self._clock.now(), note, True))
        db.changed()
