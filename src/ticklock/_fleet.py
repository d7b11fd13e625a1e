"""What an operator sees and steers of a fleet: job, run and replica records, and the operations.

The records' JSON (:func:`job_json`, :func:`run_json`, :func:`replica_json`) is written here once,
for ``ticklock status --json`` / ``history --json`` and for the dashboard's JSON API.

:class:`Fleet` is the seam the CLI and the dashboard use. In PostgreSQL mode
(``ticklock._postgres.fleet.PostgresFleet``) it reads and writes the namespace's tables, so an
operation reaches every replica; in memory (``ticklock._memory_fleet.MemoryFleet``) it is the
process's database (local mode, or the schedulers sharing a ``MemoryDatabase``).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol


class JobState(str, enum.Enum):
    """What ``ticklock status`` and the dashboard say of a job, most urgent first."""

    UNDECLARED = "undeclared"
    """Live replicas run, and none declares the job (renamed or removed): ``forget`` it."""
    DISABLED = "disabled"
    """Declared with ``enabled=False`` by every live replica that declares it."""
    PAUSED = "paused"
    """Paused by an operator: no scheduled run starts; never overdue."""
    FUTURE = "future"
    """Its watermark lies in the database's future (a replica's clock ran ahead)."""
    OVERDUE = "overdue"
    """No success since its first fire after the last one, plus timeout and grace."""
    OK = "ok"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job as the fleet knows it."""

    job_id: str
    state: JobState
    last_success: datetime | None
    last_outcome: str | None
    """The outcome of the last run that executed: ``success``, ``failure``, ``timeout``, ..."""
    next_due: datetime | None
    """When the next scheduled run is due (without jitter), as of the last run."""
    consecutive_failures: int
    last_error: str | None
    """The error of the last run that did not succeed (kept after a later success)."""
    last_owner: str | None
    """The replica that ran it last."""
    paused_at: datetime | None
    trigger_at: datetime | None
    """The instant of a trigger request that no replica has served yet."""
    declared_otherwise: tuple[str, ...] = ()
    """The live replicas that declare the job otherwise (trigger, timeout, retries...) than
    the ruling declaration (the one most live replicas share; between as many, the one whose
    replicas started first); empty when they all agree."""
    last_batches: int = 0
    """The batches the last run committed (0: it entered none)."""
    last_capped: bool = False
    """``max_batches`` stopped the last run: a backlog is left (one that never drains keeps
    every run capped)."""


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run that executed, from the history (newest first)."""

    job_id: str
    slot: datetime | None
    started_at: datetime
    finished_at: datetime
    outcome: str
    owner: str
    report: Any
    error: str | None
    manual: bool
    """Started by ``trigger`` or ``run_now``, not by the schedule."""
    batches: int = 0
    """The batches of ``ctx.batches()`` the run committed (0: it entered none)."""
    capped: bool = False
    """``max_batches`` stopped the run's loop: a backlog was left for the next run."""

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return (self.finished_at - self.started_at).total_seconds()


@dataclass(frozen=True, slots=True)
class Replica:
    """A live replica: a scheduler of the namespace that reported in recently."""

    owner: str
    started_at: datetime
    seen_at: datetime
    jobs: tuple[str, ...]
    """The ids of the jobs it declares (enabled or not)."""
    failing: tuple[str, ...] = ()
    """The jobs it gave up: its own runs of them kept failing while other replicas could
    run them (it runs them only when no other replica does)."""


def job_json(job: JobRecord) -> dict[str, Any]:
    """A job as ``ticklock status --json`` and the dashboard's ``/api/jobs`` give it."""
    return {
        "job_id": job.job_id,
        "state": job.state.value,
        "last_success": iso(job.last_success),
        "last_outcome": job.last_outcome,
        "next_due": iso(job.next_due),
        "consecutive_failures": job.consecutive_failures,
        "last_error": job.last_error,
        "last_owner": job.last_owner,
        "paused_at": iso(job.paused_at),
        "trigger_at": iso(job.trigger_at),
        "declared_otherwise": list(job.declared_otherwise),
        "last_batches": job.last_batches,
        "last_capped": job.last_capped,
    }


def run_json(run: RunRecord) -> dict[str, Any]:
    """A run as ``ticklock history --json`` gives it (the dashboard adds its ``job_id``)."""
    return {
        "slot": iso(run.slot),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "duration": run.duration,
        "outcome": run.outcome,
        "owner": run.owner,
        "manual": run.manual,
        "batches": run.batches,
        "capped": run.capped,
        "report": run.report,
        "error": run.error,
    }


def replica_json(replica: Replica) -> dict[str, Any]:
    """A live replica as ``ticklock status --json`` and ``/api/replicas`` give it."""
    return {
        "owner": replica.owner,
        "started_at": iso(replica.started_at),
        "seen_at": iso(replica.seen_at),
        "jobs": list(replica.jobs),
        "failing": list(replica.failing),
    }


def iso(when: datetime | None) -> str | None:
    """An instant as ISO 8601 in UTC (``2026-11-29T20:45:07.250000+00:00``); ``None`` for none."""
    return when.astimezone(timezone.utc).isoformat() if when is not None else None


def json_text(value: Any, indent: int | None = None) -> str:
    """``value`` as JSON text, non-ASCII kept, anything JSON cannot hold (a report of an
    in-process fleet) as its ``str``."""
    return json.dumps(value, ensure_ascii=False, default=str, indent=indent)


class JobDeclared(Exception):
    """``forget`` refused: a live replica still declares the job."""


class Fleet(Protocol):
    """Read and steer the jobs of one namespace. Unknown job ids raise ``KeyError``."""

    namespace: str

    async def jobs(self) -> list[JobRecord]:
        """Every job of the namespace, by id."""
        ...

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first. With ``max_text``, a report whose JSON
        text or an error longer than that many characters comes cut, as where it is recorded
        (for a display that shows less)."""
        ...

    async def replicas(self) -> list[Replica]:
        """The live replicas, by owner."""
        ...

    async def pause(self, job_id: str) -> None:
        """Stop starting scheduled runs of the job (a run in flight finishes)."""
        ...

    async def resume(self, job_id: str) -> None:
        """Undo :meth:`pause`; the next slot follows the job's ``catch_up`` rule."""
        ...

    async def trigger(self, job_id: str) -> datetime:
        """Ask for one run as soon as possible; returns the request's instant (its slot)."""
        ...

    async def forget(self, job_id: str) -> None:
        """Delete the job's state and history; raises :class:`JobDeclared` while a live
        replica declares it."""
        ...
