"""What operators see and steer of a :class:`~ticklock._backends.memory.MemoryDatabase`: the
:class:`Fleet` of local mode and of the schedulers sharing one in a test."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

import anyio

from .._operators.fleet import (
    BUILTIN,
    Action,
    Backfill,
    JobDeclared,
    JobRecord,
    Replica,
    RunRecord,
    SlotRecord,
    paused_until,
    said,
    state_of,
)
from .._operators.ledger import LIMIT, TEXT, Incident, Span, account
from .._operators.ledger import Records as LedgerRecords
from .._runtime.clock import Clock
from .._runtime.sharing import Member, owner_of
from .._schedule import spec as _spec
from .._schedule.caps import cut_text, shorten_report
from .._schedule.job import Job, JobHealth, Outcome, RunResult
from .._schedule.spec import Spec
from .._schedule.stored import Schedule
from .seam import Declared, FleetState


class Presence(NamedTuple):
    """A replica that was (or is) live, and what it declared."""

    owner: str
    since: datetime
    until: datetime | None
    """``None``: live now."""
    declared: Declared
    exact: bool = False
    """It left at ``until`` (else ``until`` is its last beat: it died, or its beats stopped)."""


class Records(Protocol):
    """What the view reads and writes of a :class:`~ticklock._backends.memory.MemoryDatabase`."""

    states: dict[str, FleetState]
    history: dict[str, deque[RunResult]]
    declared: dict[str, Job]
    actions: deque[Action]
    since: datetime | None
    incidents: deque[Incident]
    schedules: dict[str, Schedule]
    deleted: dict[str, int]
    pauses: dict[str, datetime]
    backfills: dict[int, Backfill]

    def changed(self) -> None:
        """Tell every replica to look again."""
        ...

    def declarations(self) -> list[Declared]:
        """What each live replica declares."""
        ...

    def replicas(self) -> list[Replica]:
        """The live replicas, by owner."""
        ...

    def view(self) -> tuple[dict[str, Member], dict[str, datetime]]:
        """The live replicas as each sees the others."""
        ...

    def presence(self) -> list[Presence]:
        """The replicas live now and those that were."""
        ...

    def steer(
        self, job_id: str, *, paused_at: datetime | None, trigger_at: datetime | None
    ) -> None:
        """Record what operators asked of the job, and tell every replica."""
        ...


class MemoryFleet:
    """What operators see and steer of a ``MemoryDatabase``'s jobs."""

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
        tasks: set[str] = set()
        for declared in self._db.declarations():
            enabled.update(declared.enabled)
            disabled.update(declared.disabled)
            tasks.update(declared.tasks)
        for schedule in self._db.schedules.values():  # run by the replicas with its task
            if schedule.task in tasks:
                on = schedule.options.get("enabled", True)
                (enabled if on else disabled).add(schedule.id)
        return enabled, disabled - enabled

    def _spec(self, job_id: str) -> _spec.Spec | None:
        job = self._jobs().get(job_id)
        job = job or self._db.declared.get(job_id)
        return _spec.of(job) if job is not None else None

    async def jobs(self, *, tenant: str | None = None) -> list[JobRecord]:
        """Every job declared or with a state; with ``tenant``, only that tenant's stored
        schedules."""
        db = self._db
        enabled, disabled = self._declared()
        health = {h.job_id: h for h in self._health()}
        members, _ = db.view()
        last_action = {a.job_id: a for a in db.actions if a.changed and a.action != "forget"}
        records = []
        ids = enabled | disabled | db.states.keys() | db.history.keys()
        if tenant is not None:
            ids = {i for i, s in db.schedules.items() if s.tenant == tenant}
        for job_id in sorted(ids - db.deleted.keys()):
            state = db.states.get(job_id) or FleetState()
            stored = db.schedules.get(job_id)
            task = None if stored is None else stored.task
            runs = db.history.get(job_id, ())
            failed = [r for r in runs if r.outcome is not Outcome.SUCCESS]
            seen = health.get(job_id)
            spec = self._spec(job_id)
            threshold = spec.failure_threshold if spec is not None else 1
            records.append(
                JobRecord(
                    job_id=job_id,
                    state=state_of(
                        ended=spec is not None and spec.ended(self._clock.now()),
                        completed=spec is not None and spec.completed(state.successes),
                        undeclared=job_id not in enabled and job_id not in disabled,
                        disabled=job_id in disabled,
                        paused=state.paused_at is not None or (seen is not None and seen.paused),
                        future=False,
                        overdue=seen is not None and seen.overdue,
                        failing=state.consecutive_failures >= threshold,
                    ),
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
                    schedule=None if spec is None else spec.schedule,
                    timeout=None if spec is None else spec.timeout,
                    retries=None if spec is None else spec.retries,
                    owner=owner_of(members, job_id, task) if members else _alone(db, job_id, task),
                    builtin=job_id.startswith(BUILTIN),
                    last_action=last_action.get(job_id),
                    task=task,
                    tenant=None if stored is None else stored.tenant,
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

    async def pause(
        self,
        job_id: str,
        note: str | None = None,
        until: datetime | None = None,
        *,
        who: str,
    ) -> bool:
        """Pause the job for every replica of this database (until ``until``, if given)."""
        note, who = said(note, who)
        state = self._state(job_id)
        changed = state.paused_at is None
        paused_at = state.paused_at or self._clock.now()
        if until is None:
            self._db.pauses.pop(job_id, None)
        else:
            self._db.pauses[job_id] = until
        self._db.steer(job_id, paused_at=paused_at, trigger_at=state.trigger_at)
        self._audit(job_id, "pause", paused_until(note, until), who, changed)
        return changed

    async def resume(self, job_id: str, note: str | None = None, *, who: str) -> bool:
        """Resume the job for every replica of this database."""
        note, who = said(note, who)
        state = self._state(job_id)
        changed = state.paused_at is not None
        self._db.pauses.pop(job_id, None)
        self._db.steer(job_id, paused_at=None, trigger_at=state.trigger_at)
        self._audit(job_id, "resume", note, who, changed)
        return changed

    async def trigger(self, job_id: str, note: str | None = None, *, who: str) -> datetime:
        """Ask for one run of the job as soon as possible."""
        note, who = said(note, who)
        if job_id not in self._declared()[0]:
            raise KeyError(f"job {job_id!r} is not declared, or declared with enabled=False")
        state = self._state(job_id)
        at = state.trigger_at or self._clock.now()
        self._db.steer(job_id, paused_at=state.paused_at, trigger_at=at)
        self._audit(job_id, "trigger", note, who, state.trigger_at is None)
        return at

    async def forget(self, job_id: str, note: str | None = None, *, who: str) -> None:
        """Delete the state and history of a job no replica declares."""
        note, who = said(note, who)
        enabled, disabled = self._declared()
        if job_id in enabled or job_id in disabled:
            raise JobDeclared(f"job {job_id!r} is declared: remove it from the scheduler first")
        db = self._db
        state, runs = db.states.pop(job_id, None), db.history.pop(job_id, None)
        if state is None and runs is None:
            raise KeyError(f"no job {job_id!r}")
        db.declared.pop(job_id, None)
        db.pauses.pop(job_id, None)
        self._audit(job_id, "forget", note, who, True)

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
        """Ask the replicas that have the job to run ``slots`` of it, in order; audited.
        Refused (``KeyError``) when no live replica declares the job enabled."""
        note, who = said(note, who)
        self._known(job_id)
        if job_id not in self._declared()[0]:
            raise KeyError(
                f"no live replica runs job {job_id!r} (it is not declared, or declared with "
                "enabled=False), so none would run its backfill"
            )
        db = self._db
        request = max(db.backfills, default=0) + 1
        db.backfills[request] = Backfill(
            request, job_id, tuple(slots), 0, who, pace, not slots, rerun=rerun
        )
        self._audit(job_id, "backfill", note, who, True)
        db.changed()
        return request

    async def pass_over(
        self, request: int, done: int, count: int, *, committed: bool = False
    ) -> None:
        """Pass over ``count`` slots of backfill ``request`` from ``done``."""
        backfills = self._db.backfills
        state = backfills.get(request)
        if state is None or state.done != done or state.finished:
            return
        if committed and not self._committed(state.job_id, state.slots[done]):
            return
        end = min(done + count, len(state.slots))
        backfills[request] = replace(
            state,
            done=end,
            finished=end >= len(state.slots),
            passed=state.passed + state.slots[done:end],
        )

    def _committed(self, job_id: str, slot: datetime) -> bool:
        runs = self._db.history.get(job_id, ())
        return any(r.slot == slot and r.outcome is Outcome.SUCCESS for r in runs)

    async def end_backfill(self, request: int) -> None:
        """Finish backfill ``request`` as it stands."""
        state = self._db.backfills.get(request)
        if state is not None:
            self._db.backfills[request] = replace(state, finished=True)

    async def spec(self, job_id: str) -> Spec | None:
        """The job's declaration, as this process knows it."""
        return self._spec(job_id)

    async def backfill_state(self, request: int) -> Backfill | None:
        """Backfill ``request`` as it stands."""
        return self._db.backfills.get(request)

    async def audit(self, job_id: str | None = None, limit: int = 100) -> list[Action]:
        """The last ``limit`` operations, newest first (the database keeps the last 1,000)."""
        actions = [a for a in self._db.actions if job_id is None or a.job_id == job_id]
        return actions[::-1][:limit]

    async def slots(
        self, job_id: str, since: datetime, until: datetime, *, limit: int = LIMIT
    ) -> list[SlotRecord]:
        """The ledger of the job (from the last 100 runs the database keeps of it)."""
        self._known(job_id)
        spec = self._spec(job_id)
        if spec is None:
            raise KeyError(f"job {job_id!r} was never declared here: its schedule is unknown")
        db = self._db
        now = self._clock.now()
        stored = db.schedules.get(job_id)
        task = None if stored is None else stored.task
        presence = [
            Span(p.owner, p.since, p.until, job_id in p.declared.enabled or had, p.exact)
            for p in db.presence()
            if (had := task is not None and task in p.declared.tasks)
            or job_id in p.declared.enabled
            or job_id in p.declared.disabled
        ]
        declared_since = min((p.since for p in presence), default=None)
        if stored is not None and declared_since is not None:  # nothing was owed before it
            declared_since = max(declared_since, stored.created_at)
        kept = db.history.get(job_id, deque())
        full = kept.maxlen is not None and len(kept) >= kept.maxlen
        reach = since - timedelta(minutes=1)  # as PostgreSQL reads them: those of the window
        records = LedgerRecords(
            runs=[_record(run, TEXT) for run in kept],
            actions=[a for a in db.actions if a.job_id == job_id],
            presence=[
                p for p in presence if (p.until is None or p.until >= reach) and p.since <= until
            ],
            incidents=list(db.incidents),
            paused_at=(db.states.get(job_id) or FleetState()).paused_at,
            horizon=db.since,
            declared_since=declared_since,
            complete_since=min(r.slot for r in kept if r.slot) if full and kept else None,
            task=task,
            successes=(db.states.get(job_id) or FleetState()).successes,
            version=None if stored is None else stored.version,
        )
        return await anyio.to_thread.run_sync(account, spec, records, since, until, now, limit)

    def _audit(self, job_id: str, action: str, note: str | None, who: str, changed: bool) -> None:
        self._db.actions.append(Action(job_id, action, who, self._clock.now(), note, changed))

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


def _alone(db: Records, job_id: str, task: str | None) -> str | None:
    """The owner of ``job_id`` when at most one replica is live (the view is then empty)."""
    for replica in db.replicas():
        if job_id in replica.jobs or (task is not None and task in replica.tasks):
            return replica.owner
    return None


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
        backfilled_by=run.backfilled_by,
    )
