"""What an operator sees and steers of a fleet: job, run and replica records, and the operations.

The JSON of the records (:func:`job_json`, :func:`run_json`, :func:`slot_json`,
:func:`replica_json`, :func:`action_json`) and of the answers that hold them (:func:`jobs_json`,
:func:`runs_json`, :func:`slots_json`, :func:`replicas_json`) is written here once: ``ticklock
status --json``, ``history --json`` and ``slots --json`` print what the dashboard's
``/api/jobs``, ``/api/jobs/{id}/runs`` and ``/api/jobs/{id}/slots`` answer, with ``job_id`` in
every record of a job.

:class:`Fleet` is the seam the CLI and the dashboard use. In PostgreSQL mode
(``PostgresFleet``) it reads and writes the namespace's tables, so an
operation reaches every replica; in memory (``MemoryFleet``) it is the
process's database (local mode, or the schedulers sharing a ``MemoryDatabase``).
"""

from __future__ import annotations

import enum
import getpass
import json
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

from .._errors import ScheduleError
from .._schedule.spec import Spec
from .._schedule.stored import Schedule
from .._schedule.validate import hidden, instant


class JobState(str, enum.Enum):
    """What ``ticklock status`` and the dashboard say of a job, most urgent first."""

    UNDECLARED = "undeclared"
    """Live replicas run, and none declares the job (renamed or removed): ``forget`` it."""
    DISABLED = "disabled"
    """Declared with ``enabled=False`` by every live replica that declares it."""
    PAUSED = "paused"
    """Paused by an operator: no scheduled run starts; never overdue."""
    ENDED = "ended"
    """Its window's ``end`` has passed: no slot is owed any more; never overdue."""
    COMPLETED = "completed"
    """Its ``limit`` of scheduled runs committed, fleet-wide: it runs no more; never overdue."""
    FUTURE = "future"
    """Its watermark lies in the database's future (a replica's clock ran ahead)."""
    OVERDUE = "overdue"
    """The absence alarm: no run finished since its first fire after the last run that
    finished (of any outcome), plus timeout and grace. Failures never make a job overdue."""
    FAILING = "failing"
    """Its last runs failed (``failure_threshold`` in a row, default 1); it still runs."""
    OK = "ok"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Action:
    """An operation on a job, from the audit log: who made it, when, and why."""

    job_id: str
    action: str
    """``pause``, ``resume``, ``trigger`` or ``forget``."""
    who: str
    """The CLI's user and host, the dashboard's caller as the mounting app identifies it, or
    the string a Python caller gave."""
    at: datetime
    note: str | None
    changed: bool
    """Whether it changed anything (a second pause does not)."""


class Fate(str, enum.Enum):
    """What happened to a slot a job's schedule owed (see :meth:`Fleet.slots`)."""

    RAN = "ran"
    """A run of the slot succeeded."""
    FAILED = "failed"
    """Runs of the slot executed and none succeeded; the last failed (or lost the database)."""
    TIMED_OUT = "timed out"
    """Runs of the slot executed and none succeeded; the last timed out."""
    COVERED = "covered"
    """No run of its own: a later run covered it (a catch-up run, or one an operator asked for)."""
    SKIPPED = "skipped"
    """Not run by design: paused, disabled, ``catch_up=False``, the run before still running,
    or already committed."""
    MISSED = "missed"
    """No run, and none covered it yet: the reason says why (no live replica, the database
    unreachable), or that no record explains it (a defect)."""
    PENDING = "pending"
    """Not due yet, or due so recently that its run may still be in progress."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class SlotRecord:
    """One slot a job's schedule owed, and its fate."""

    slot: datetime
    fate: Fate
    reason: str | None = None
    """Why it was covered, skipped or missed, or why its run started late (``None`` for one
    whose run started on time, and for one pending)."""
    run: RunRecord | None = None
    """Its run (the last attempt), or the run that covered it."""
    lateness: timedelta | None = None
    """From the slot to the start of its run (its first attempt), or of the run that covered
    it; ``None`` without one."""
    change: str | None = None
    """A stored schedule edited before this slot, the first under its new definition:
    ``definition v2 effective from this slot, by alice``."""

    @property
    def late(self) -> bool:
        """Whether a run of its own started later than the job's ``overdue_grace`` after it
        (beyond its jitter): its ``reason`` says why."""
        return self.fate in _RUN_FATES and self.reason is not None


_RUN_FATES = frozenset({Fate.RAN, Fate.FAILED, Fate.TIMED_OUT})


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
    schedule: str | None = None
    """The trigger as declared, with its zone (``cron '17 3 * * *' Europe/Berlin``); ``None``
    for a job whose declaration the records do not hold."""
    timeout: float | None = None
    retries: int | None = None
    owner: str | None = None
    """The live replica that runs the job's next slot (``None``: no live replica declares it)."""
    builtin: bool = False
    """One of ticklock's own jobs (``ticklock.retention``): not for operators to pause."""
    last_action: Action | None = None
    """The last operation that changed the job (pause, resume, trigger)."""
    task: str | None = None
    """A stored schedule's task (``None``: a job declared in code)."""
    tenant: str | None = None
    """A stored schedule's tenant."""


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
    backfilled_by: str | None = None
    """The run is a slot of a backfill, asked for by this operator (``None``: not one)."""

    @property
    def duration(self) -> float:
        """Seconds from start to end."""
        return (self.finished_at - self.started_at).total_seconds()


@dataclass(frozen=True, slots=True)
class Backfill:
    """A backfill an operator asked for: its slots, in order, and how far it got."""

    id: int
    job_id: str
    slots: tuple[datetime, ...]
    done: int
    """Its slots that ran, failed or were passed over: the next one is ``slots[done]``."""
    who: str
    pace: float | None = None
    """At most this many slots per second (``None``: one after the other)."""
    finished: bool = False
    passed: tuple[datetime, ...] = ()
    """Its slots passed over: due (by the pace) while the slot before still ran (the job's
    ``overlap``), or committed meanwhile by another run."""
    rerun: bool = False
    """Its slots run even if a run committed them (else one committed meanwhile is passed
    over)."""


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
    tasks: tuple[str, ...] = ()
    """The tasks it has: it runs their stored schedules."""


def state_of(
    *,
    undeclared: bool,
    disabled: bool,
    paused: bool,
    future: bool,
    overdue: bool,
    failing: bool,
    ended: bool = False,
    completed: bool = False,
) -> JobState:
    """A job's state from what is true of it: the most urgent one that holds."""
    for holds, state in (
        (undeclared, JobState.UNDECLARED),
        (disabled, JobState.DISABLED),
        (paused, JobState.PAUSED),
        (completed, JobState.COMPLETED),
        (ended, JobState.ENDED),
        (future, JobState.FUTURE),
        (overdue, JobState.OVERDUE),
        (failing, JobState.FAILING),
    ):
        if holds:
            return state
    return JobState.OK


BUILTIN = "ticklock."
"""The id prefix of ticklock's own jobs."""


NOTE_LIMIT = 500
"""The most characters of an operation's note (and of ``who``)."""


BY_TICKLOCK = "ticklock"
"""Who the audit log names for what ticklock did by itself: a pause that expired, a run a job
declared ``immediately`` asks for."""


def pause_end(until: object) -> datetime | None:
    """``until`` of a pause, checked: ``None``, or an aware datetime (``ValueError``)."""
    if until is None:
        return None
    try:
        return instant(until, "until")
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None


def paused_until(note: str | None, until: datetime | None) -> str | None:
    """The audit note of a pause: ``note``, and the instant it resumes by itself."""
    if until is None:
        return note
    when = f"until {iso(until)}"
    return when if note is None else f"{note} ({when})"


IMMEDIATELY = "immediately: its declaration is new or changed"
"""The audit note of the trigger request a job declared with ``immediately=True`` makes."""


def expired(until: datetime) -> str:
    """The audit note of a pause that expired."""
    return f"the pause until {iso(until)} expired"


def checked(text: str | None, name: str) -> str | None:
    """An operation's ``note`` or ``who`` as the audit log keeps it: ``None`` for none or
    blank; ``ValueError`` for one over :data:`NOTE_LIMIT` characters or with a character a
    line must not hold (``hidden()``: a terminal escape, a NUL, a bidi
    override, a zero-width character, a line separator, an unpaired surrogate)."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{name} must be text, got {type(text).__name__}")
    text = text.strip()
    if len(text) > NOTE_LIMIT:
        raise ValueError(f"{name} is {len(text)} characters; at most {NOTE_LIMIT} are kept")
    if (found := hidden(text)) is not None:
        raise ValueError(
            f"{name} must be one line of plain text, without control, format or separator "
            f"characters: it has {found}"
        )
    return text or None


def said(note: str | None, who: str) -> tuple[str | None, str]:
    """An operation's note and who, :func:`checked`, as its writer records them."""
    return checked(note, "note"), checked(who, "who") or "unknown"


def caller() -> str:
    """Who this process runs as, for the audit log: ``user@host``."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment or the password database
        user = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


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
        "schedule": job.schedule,
        "timeout": job.timeout,
        "retries": job.retries,
        "owner": job.owner,
        "builtin": job.builtin,
        "last_action": None if job.last_action is None else action_json(job.last_action),
    }


def schedule_json(schedule: Schedule) -> dict[str, Any]:
    """A stored schedule as ``ticklock schedules --json`` and ``/api/schedules`` give it."""
    return {
        "id": schedule.id,
        "task": schedule.task,
        "tenant": schedule.tenant,
        "schedule": schedule.schedule,
        "args": dict(schedule.args),
        "options": {
            k: iso(v) if isinstance(v, datetime) else v for k, v in schedule.options.items()
        },
        "version": schedule.version,
        "created_at": iso(schedule.created_at),
        "updated_at": iso(schedule.updated_at),
    }


def action_json(action: Action) -> dict[str, Any]:
    """An audited operation as ``--json`` output and the dashboard give it."""
    return {
        "job_id": action.job_id,
        "action": action.action,
        "who": action.who,
        "at": iso(action.at),
        "note": action.note,
        "changed": action.changed,
    }


_DONE = {
    "pause": "paused",
    "resume": "resumed",
    "trigger": "triggered",
    "forget": "forgot",
    "put": "put",
    "delete": "deleted",
}


def done(action: Action) -> str:
    """The operation as a line: ``paused by ops@host at 2026-12-01T03:05:00+00:00: INC-42``."""
    note = f": {action.note}" if action.note else ""
    verb = _DONE.get(action.action, action.action)
    return f"{verb} by {action.who} at {iso(action.at)}{note}"


def slot_json(slot: SlotRecord, job_id: str) -> dict[str, Any]:
    """A slot of ``job_id``'s ledger as ``ticklock slots --json`` and the dashboard give it."""
    return {
        "job_id": job_id,
        "slot": iso(slot.slot),
        "fate": slot.fate.value,
        "reason": slot.reason,
        "lateness": None if slot.lateness is None else slot.lateness.total_seconds(),
        "change": slot.change,
        "run": None if slot.run is None else run_json(slot.run),
    }


def run_json(run: RunRecord) -> dict[str, Any]:
    """A run as ``ticklock history --json`` and the dashboard give it."""
    return {
        "job_id": run.job_id,
        "slot": iso(run.slot),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "duration": run.duration,
        "outcome": run.outcome,
        "owner": run.owner,
        "manual": run.manual,
        "batches": run.batches,
        "capped": run.capped,
        "backfilled_by": run.backfilled_by,
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
        "tasks": list(replica.tasks),
    }


def jobs_json(
    namespace: str, jobs: Iterable[JobRecord], replicas: Iterable[Replica] | None = None
) -> dict[str, Any]:
    """The jobs of a namespace as ``/api/jobs`` gives them; with ``replicas`` (``ticklock
    status --json``) the live replicas too."""
    body: dict[str, Any] = {"namespace": namespace, "jobs": [job_json(job) for job in jobs]}
    if replicas is not None:
        body["replicas"] = [replica_json(replica) for replica in replicas]
    return body


def runs_json(job_id: str, runs: Iterable[RunRecord]) -> dict[str, Any]:
    """A job's runs, newest first, as ``ticklock history --json`` and ``/api/jobs/{id}/runs``
    give them."""
    return {"job_id": job_id, "runs": [run_json(run) for run in runs]}


def slots_json(
    job_id: str, since: datetime, until: datetime, slots: Iterable[SlotRecord]
) -> dict[str, Any]:
    """A job's ledger from ``since`` to ``until``, oldest first, as ``ticklock slots --json``
    and ``/api/jobs/{id}/slots`` give it."""
    return {
        "job_id": job_id,
        "since": iso(since),
        "until": iso(until),
        "slots": [slot_json(slot, job_id) for slot in slots],
    }


def replicas_json(namespace: str, replicas: Iterable[Replica]) -> dict[str, Any]:
    """The live replicas of a namespace as ``/api/replicas`` gives them."""
    return {"namespace": namespace, "replicas": [replica_json(r) for r in replicas]}


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

    async def pause(
        self,
        job_id: str,
        note: str | None = None,
        until: datetime | None = None,
        *,
        who: str,
    ) -> bool:
        """Stop starting scheduled runs of the job (a run in flight finishes); whether it
        was not paused before. Audited with ``who`` and ``note``. ``until``: the instant it
        resumes by itself, fleet-wide (audited as resumed by ``ticklock``); ``None``: until
        :meth:`resume` (a pause already in force loses its ``until``)."""
        ...

    async def resume(self, job_id: str, note: str | None = None, *, who: str) -> bool:
        """Undo :meth:`pause` (the next slot follows the job's ``catch_up`` rule); whether it
        was paused. Audited."""
        ...

    async def trigger(self, job_id: str, note: str | None = None, *, who: str) -> datetime:
        """Ask for one run as soon as possible; returns the request's instant (its slot).
        Audited."""
        ...

    async def forget(self, job_id: str, note: str | None = None, *, who: str) -> None:
        """Delete the job's state and history; raises :class:`JobDeclared` while a live
        replica declares it. Audited (the audit log keeps the job's operations)."""
        ...

    async def audit(self, job_id: str | None = None, limit: int = 100) -> list[Action]:
        """The last ``limit`` operations (of ``job_id``, or of every job), newest first."""
        ...

    async def slots(
        self, job_id: str, since: datetime, until: datetime, *, limit: int = 1000
    ) -> list[SlotRecord]:
        """Every slot the job's schedule owed from ``since`` to ``until`` (the latest
        ``limit`` of them), oldest first, each with its fate (see :mod:`.ledger`)."""
        ...

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
        """Ask the replicas that have the job to run ``slots`` of it, in order (audited as
        ``backfill`` by ``who``, with ``note``; ``rerun``: also a slot committed meanwhile);
        the request's id. ``KeyError`` when no live replica declares the job enabled."""
        ...

    async def backfill_state(self, request: int) -> Backfill | None:
        """Backfill ``request`` as it stands (``None``: not known)."""
        ...

    async def spec(self, job_id: str) -> Spec | None:
        """The job's declaration as the records keep it (``None``: they keep none)."""
        ...

    async def pass_over(
        self, request: int, done: int, count: int, *, committed: bool = False
    ) -> None:
        """Pass over ``count`` slots of backfill ``request`` from ``slots[done]`` (the job's
        ``overlap``), if it is still at ``done``; ``committed``: the slot ``slots[done]``
        only if a run committed it."""
        ...

    async def end_backfill(self, request: int) -> None:
        """Finish backfill ``request`` as it stands: its slots not run yet never run."""
        ...
