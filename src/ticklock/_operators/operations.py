"""A scheduler's jobs as operators see and steer them: the :class:`Fleet` of
:meth:`Scheduler.fleet <ticklock.Scheduler.fleet>`.

Its coordinator gives the fleet (:meth:`Coordinator.views
<ticklock._backends.seam.Coordinator.views>`): in PostgreSQL mode the namespace's, through the
running scheduler's pool (an operation here reaches every replica); in memory, the database's
replicas. Either way the replicas obey through the same path: their coordinator's ``watch``
hands them the paused and triggered jobs; an operation here pokes this replica's watch (through
its open session), so that it looks again at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from .._backends.seam import Session, Views
from .._schedule.spec import Spec
from .._schedule.stored import ScheduleStore
from . import backfill as _backfill
from .fleet import (
    Action,
    Backfill,
    Fleet,
    JobRecord,
    Replica,
    RunRecord,
    SlotRecord,
    caller,
    pause_end,
)
from .ledger import LIMIT


class SchedulerFleet:
    """The jobs of one scheduler's namespace (see the module docstring)."""

    def __init__(
        self,
        namespace: str,
        views: Callable[[], Views],
        session: Callable[[], Session],
        now: Callable[[], datetime],
    ) -> None:
        self.namespace = namespace
        self._views = views
        self._session = session  # poked after an operation: this replica obeys at once
        self._now = now  # the scheduler's clock

    @property
    def schedules(self) -> ScheduleStore:
        """The namespace's stored schedules (the store behind ``scheduler.schedules``)."""
        return self._views().schedules

    def _fleet(self) -> Fleet:
        return self._views().fleet

    async def jobs(self, *, tenant: str | None = None) -> list[JobRecord]:
        """Every job of the namespace; with ``tenant``, only that tenant's stored schedules."""
        fleet = self._fleet()
        if tenant is None:
            return await fleet.jobs()
        by_tenant: Any = fleet  # both backends' fleets take it (a Fleet of a test may not)
        return list(await by_tenant.jobs(tenant=tenant))

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first; ``max_text`` as in
        :meth:`Fleet.history <ticklock._operators.fleet.Fleet.history>`."""
        return await self._fleet().history(job_id, limit, max_text=max_text)

    async def replicas(self) -> list[Replica]:
        """The live replicas."""
        return await self._fleet().replicas()

    async def pause(
        self,
        job_id: str,
        note: str | None = None,
        until: datetime | None = None,
        *,
        who: str | None = None,
    ) -> bool:
        """Pause the job (fleet-wide); whether it was not paused already. Audited: ``who``
        (default: this process's ``user@host``) and ``note``. ``until``: an aware datetime
        at which it resumes by itself, fleet-wide, audited as resumed by ``ticklock``."""
        until = pause_end(until)
        changed = await self._fleet().pause(job_id, note, until, who=who or caller())
        self._session().poke()
        return changed

    async def resume(self, job_id: str, note: str | None = None, *, who: str | None = None) -> bool:
        """Resume the job (fleet-wide); whether it was paused. Audited."""
        changed = await self._fleet().resume(job_id, note, who=who or caller())
        self._session().poke()
        return changed

    async def trigger(
        self, job_id: str, note: str | None = None, *, who: str | None = None
    ) -> datetime:
        """Ask for one run as soon as possible; returns the request's instant. Audited."""
        at = await self._fleet().trigger(job_id, note, who=who or caller())
        self._session().poke()
        return at

    async def forget(self, job_id: str, note: str | None = None, *, who: str | None = None) -> None:
        """Delete the state and history of a job that is no longer declared. Audited."""
        await self._fleet().forget(job_id, note, who=who or caller())

    async def audit(self, job_id: str | None = None, limit: int = 100) -> list[Action]:
        """The last ``limit`` operations (of ``job_id``, or of every job), newest first."""
        return await self._fleet().audit(job_id, limit)

    async def backfill(
        self,
        job_id: str,
        since: datetime,
        until: datetime,
        *,
        rerun: bool = False,
        dry_run: bool = False,
        pace: float | None = None,
        who: str | None = None,
        note: str | None = None,
    ) -> list[SlotRecord]:
        """Run the job's slots in ``[since, until)`` after the fact: the trigger's fires (an
        ``every`` job's: ``since``, then one per interval), also before the job was first
        declared; without ``rerun`` only those the records do not show committed. The
        replicas that have the job run them in order, one at a time under its lock, each with
        ``ctx.slot`` that slot and ``ctx.backfill`` true, recorded as backfilled by ``who``;
        the watermark never moves back. ``pace``: at most that many slots per second.
        ``dry_run``: run nothing. Returns each slot with its fate once done (``dry_run``:
        now). Audited (``who``, default this process's ``user@host``, and ``note``)."""
        fleet = self._fleet()
        return await _backfill.backfill(
            fleet,
            job_id,
            since,
            until,
            self._now(),
            rerun=rerun,
            dry_run=dry_run,
            pace=pace,
            who=who or caller(),
            note=note,
        )

    async def request_backfill(
        self,
        job_id: str,
        slots: Sequence[datetime],
        pace: float | None,
        note: str | None,
        *,
        who: str,
        rerun: bool = False,
    ) -> int:
        """Ask the replicas that have the job to run ``slots`` of it (see :meth:`backfill`)."""
        fleet = self._fleet()
        request = await fleet.request_backfill(job_id, slots, pace, note, who=who, rerun=rerun)
        self._session().poke()
        return request

    async def pass_over(
        self, request: int, done: int, count: int, *, committed: bool = False
    ) -> None:
        """Pass over ``count`` slots of backfill ``request`` from ``done``."""
        await self._fleet().pass_over(request, done, count, committed=committed)

    async def end_backfill(self, request: int) -> None:
        """Finish backfill ``request`` as it stands."""
        await self._fleet().end_backfill(request)

    async def backfill_state(self, request: int) -> Backfill | None:
        """Backfill ``request`` as it stands."""
        return await self._fleet().backfill_state(request)

    async def spec(self, job_id: str) -> Spec | None:
        """The job's declaration as the records keep it."""
        return await self._fleet().spec(job_id)

    async def slots(
        self, job_id: str, since: datetime, until: datetime, *, limit: int = LIMIT
    ) -> list[SlotRecord]:
        """Every slot the job's schedule owed from ``since`` to ``until`` (the latest
        ``limit``), oldest first, each with its fate: ``ran``, ``failed``, ``timed out``,
        ``covered``, ``skipped``, ``missed`` or ``pending``, and why."""
        return await self._fleet().slots(job_id, since, until, limit=limit)
