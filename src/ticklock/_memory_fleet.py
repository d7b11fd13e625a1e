"""What operators see and steer of a :class:`~ticklock._memory.MemoryDatabase`: the
:class:`~ticklock._fleet.Fleet` of local mode and of the schedulers sharing one in a test."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol

from ._caps import cut_text, shorten_report
from ._clock import Clock
from ._coordination import Declared, FleetState
from ._fleet import JobDeclared, JobRecord, JobState, Replica, RunRecord
from ._job import Job, JobHealth, Outcome, RunResult


class Records(Protocol):
    """What the view reads and writes of a :class:`~ticklock._memory.MemoryDatabase`."""

    states: dict[str, FleetState]
    history: dict[str, deque[RunResult]]

    def declarations(self) -> list[Declared]:
        """What each live replica declares."""
        ...

    def replicas(self) -> list[Replica]:
        """The live replicas, by owner."""
        ...

    def steer(
        self, job_id: str, *, paused_at: datetime | None, trigger_at: datetime | None
    ) -> None:
        """Record what operators asked of the job, and tell every replica."""
        ...


class MemoryFleet:
    """What operators see and steer of a :class:`~ticklock._memory.MemoryDatabase`'s jobs."""

    namespace = "default"

    def __init__(
        self,
        db: Records,
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
        for declared in self._db.declarations():
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
        """The job's last ``limit`` runs (the database keeps the last 100 of each job)."""
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
