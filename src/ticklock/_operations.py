"""A scheduler's jobs as operators see and steer them: the :class:`~ticklock._fleet.Fleet` of
:meth:`Scheduler.fleet <ticklock.Scheduler.fleet>`.

Its coordinator gives the fleet (:meth:`Coordinator.fleet
<ticklock._coordination.Coordinator.fleet>`): in PostgreSQL mode the namespace's, through the
running scheduler's pool (an operation here reaches every replica); in memory, the database's
replicas. Either way the replicas obey through the same path: their coordinator's ``watch``
hands them the paused and triggered jobs; an operation here makes this replica's watch look
again at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from ._coordination import Coordinator
from ._fleet import Fleet, JobRecord, Replica, RunRecord
from ._job import Job, JobHealth


class SchedulerFleet:
    """The jobs of one scheduler's namespace (see the module docstring)."""

    def __init__(
        self,
        namespace: str,
        coordinator: Callable[[], Coordinator],
        jobs: Callable[[], Mapping[str, Job]],
        health: Callable[[], list[JobHealth]],
    ) -> None:
        self.namespace = namespace
        self._coordinator = coordinator
        self._jobs = jobs
        self._health = health

    def _fleet(self) -> Fleet:
        return self._coordinator().fleet(self._jobs, self._health)

    async def jobs(self) -> list[JobRecord]:
        """Every job of the namespace."""
        return await self._fleet().jobs()

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first; ``max_text`` as in
        :meth:`Fleet.history <ticklock._fleet.Fleet.history>`."""
        return await self._fleet().history(job_id, limit, max_text=max_text)

    async def replicas(self) -> list[Replica]:
        """The live replicas."""
        return await self._fleet().replicas()

    async def pause(self, job_id: str) -> None:
        """Pause the job (fleet-wide)."""
        await self._fleet().pause(job_id)
        self._coordinator().poke()

    async def resume(self, job_id: str) -> None:
        """Resume the job (fleet-wide)."""
        await self._fleet().resume(job_id)
        self._coordinator().poke()

    async def trigger(self, job_id: str) -> datetime:
        """Ask for one run as soon as possible; returns the request's instant."""
        at = await self._fleet().trigger(job_id)
        self._coordinator().poke()
        return at

    async def forget(self, job_id: str) -> None:
        """Delete the state and history of a job that is no longer declared."""
        await self._fleet().forget(job_id)
