"""A scheduler's jobs as operators see and steer them: the :class:`~ticklock._fleet.Fleet` of
:meth:`Scheduler.fleet <ticklock.Scheduler.fleet>`.

In PostgreSQL mode it is the namespace's fleet, through the running scheduler's pool (an
operation here reaches every replica); in local mode, this process. Either way the scheduler
obeys through the same path: its coordinator's ``watch`` hands it the paused and triggered jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from ._caps import cut_text, shorten_report
from ._clock import Clock
from ._coordination import Coordinator, FleetState, LocalCoordinator
from ._errors import SchedulerStateError
from ._fleet import Fleet, JobDeclared, JobRecord, JobState, Replica, RunRecord
from ._job import Job, JobHealth, Outcome, RunResult

if TYPE_CHECKING:
    from ._postgres.fleet import PostgresFleet


class SchedulerFleet:
    """The jobs of one scheduler's namespace (see the module docstring)."""

    def __init__(
        self,
        namespace: str,
        owner: str,
        clock: Clock,
        coordinator: Callable[[], Coordinator],
        jobs: Callable[[], Mapping[str, Job]],
        health: Callable[[], list[JobHealth]],
        started: Callable[[], datetime | None],
    ) -> None:
        self.namespace = namespace
        self._owner = owner
        self._clock = clock
        self._coordinator = coordinator
        self._jobs = jobs
        self._health = health
        self._started = started

    def _fleet(self) -> Fleet | None:
        """The database's fleet in PostgreSQL mode (``None`` in local mode)."""
        coordinator = self._coordinator()
        if isinstance(coordinator, LocalCoordinator):
            return None
        from ._postgres.coordinator import PostgresCoordinator
        from ._postgres.fleet import PostgresFleet, from_pool

        assert isinstance(coordinator, PostgresCoordinator)
        if coordinator.pool is None:
            raise SchedulerStateError(
                "the scheduler is not running: in PostgreSQL mode its operations use its "
                "pool (use 'ticklock pause|resume|trigger' from outside the app)"
            )
        fleet: PostgresFleet = PostgresFleet(
            from_pool(coordinator.pool), schema=coordinator.schema, namespace=self.namespace
        )
        return fleet

    def _local(self) -> LocalCoordinator:
        coordinator = self._coordinator()
        assert isinstance(coordinator, LocalCoordinator)
        return coordinator

    async def jobs(self) -> list[JobRecord]:
        """Every job of the namespace."""
        if (fleet := self._fleet()) is not None:
            return await fleet.jobs()
        local, declared = self._local(), self._jobs()
        health = {h.job_id: h for h in self._health()}
        records = []
        for job_id in sorted(declared.keys() | local.states.keys()):
            state = local.states.get(job_id) or FleetState()
            runs = local.history.get(job_id, ())
            failed = [r for r in runs if r.outcome is not Outcome.SUCCESS]
            seen = health.get(job_id)
            records.append(
                JobRecord(
                    job_id=job_id,
                    state=_state(declared.get(job_id), seen),
                    last_success=state.last_success_at,
                    last_outcome=runs[-1].outcome.value if runs else None,
                    next_due=None if seen is None else seen.next_fire,
                    consecutive_failures=state.consecutive_failures,
                    last_error=failed[-1].error if failed else None,
                    last_owner=runs[-1].owner if runs else None,
                    paused_at=state.paused_at,
                    trigger_at=state.trigger_at,
                )
            )
        return records

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first (in local mode, of the last 100);
        ``max_text`` as in :meth:`Fleet.history <ticklock._fleet.Fleet.history>`."""
        if (fleet := self._fleet()) is not None:
            return await fleet.history(job_id, limit, max_text=max_text)
        self._known(job_id)
        runs = list(self._local().history.get(job_id, ()))[::-1][:limit]
        return [_record(run, max_text) for run in runs]

    async def replicas(self) -> list[Replica]:
        """The live replicas (in local mode, this process while it runs)."""
        if (fleet := self._fleet()) is not None:
            return await fleet.replicas()
        started = self._started()
        if started is None:
            return []
        return [Replica(self._owner, started, self._clock.now(), tuple(self._jobs()))]

    async def pause(self, job_id: str) -> None:
        """Pause the job (fleet-wide in PostgreSQL mode)."""
        if (fleet := self._fleet()) is not None:
            await fleet.pause(job_id)
        else:
            state = self._state(job_id)
            now = self._clock.now()
            self._local().steer(
                job_id, paused_at=state.paused_at or now, trigger_at=state.trigger_at
            )
        self._coordinator().poke()

    async def resume(self, job_id: str) -> None:
        """Resume the job (fleet-wide in PostgreSQL mode)."""
        if (fleet := self._fleet()) is not None:
            await fleet.resume(job_id)
        else:
            state = self._state(job_id)
            self._local().steer(job_id, paused_at=None, trigger_at=state.trigger_at)
        self._coordinator().poke()

    async def trigger(self, job_id: str) -> datetime:
        """Ask for one run as soon as possible; returns the request's instant."""
        if (fleet := self._fleet()) is not None:
            at = await fleet.trigger(job_id)
        else:
            job = self._jobs().get(job_id)
            if job is None or not job.enabled:
                raise KeyError(f"job {job_id!r} is not declared, or declared with enabled=False")
            state = self._state(job_id)
            at = state.trigger_at or self._clock.now()
            self._local().steer(job_id, paused_at=state.paused_at, trigger_at=at)
        self._coordinator().poke()
        return at

    async def forget(self, job_id: str) -> None:
        """Delete the state and history of a job that is no longer declared."""
        if (fleet := self._fleet()) is not None:
            await fleet.forget(job_id)
            return
        if job_id in self._jobs():
            raise JobDeclared(f"job {job_id!r} is declared: remove it from the scheduler first")
        local = self._local()
        state, runs = local.states.pop(job_id, None), local.history.pop(job_id, None)
        if state is None and runs is None:
            raise KeyError(f"no job {job_id!r}")

    def _known(self, job_id: str) -> None:
        local = self._local()
        if not any(job_id in known for known in (self._jobs(), local.states, local.history)):
            raise KeyError(f"no job {job_id!r}")

    def _state(self, job_id: str) -> FleetState:
        self._known(job_id)
        return self._local().states.get(job_id) or FleetState()


def _state(job: Job | None, health: JobHealth | None) -> JobState:
    if job is None:
        return JobState.UNDECLARED
    if not job.enabled:
        return JobState.DISABLED
    if health is not None and health.paused:
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
    )
