"""A backfill: the slots of a window of a job's schedule, run after the fact, by the replicas
that have the job (see :mod:`ticklock._runtime.fills`), one at a time under its lock.

Which slots: the trigger's fires in ``[since, until)`` (an ``every`` job's: ``since``, then one
per interval), also before the job was first declared. Without ``rerun``, only those the
records do not show committed: a slot the ledger lists as ``ran`` or ``covered`` (an
``every`` slot: one of its interval) is left as it is. A preview (``dry_run``) gives each
slot's fate as the records stand, and runs nothing.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

import anyio

from .._errors import ScheduleError
from .._schedule.spec import Spec
from .._schedule.triggers import Every
from .._schedule.validate import instant
from .fleet import Backfill, Fate, Fleet, RunRecord, SlotRecord
from .ledger import LIMIT

MAX_SLOTS = LIMIT
"""The most slots one backfill runs (a longer window is several backfills)."""
NOT_OWED = "not owed: before the job was first declared, or before the records reach"
"""Why a slot the records have no fate for (the ledger begins when the job was declared)."""
PASSED = (
    "the run before was still running: the backfill's pace and the job's overlap passed it over"
)
"""Why a slot of a paced backfill did not run (see :mod:`ticklock._runtime.fills`)."""
STALL = 60.0
"""Seconds without a slot done (beyond the job's timeout: a run in flight) after which a
backfill is given up and cancelled: no replica that has the job runs it."""
POLL = 0.05
MAX_POLL = 1.0
"""Seconds between two reads of a backfill's progress while it runs (doubling up to it)."""
COMMITTED = (Fate.RAN, Fate.COVERED)


def fires(spec: Spec, since: datetime, until: datetime) -> list[datetime]:
    """The trigger's fires in ``[since, until)``; raises ``ValueError`` past
    :data:`MAX_SLOTS`."""
    trigger = spec.trigger
    found: list[datetime] = []
    at: datetime | None
    if isinstance(trigger, Every):
        at = since
        while at < until:
            found.append(at)
            at += trigger.delta
            if len(found) > MAX_SLOTS:
                break
    else:
        at = trigger.next_fire(since - timedelta(microseconds=1))
        while at is not None and at < until and len(found) <= MAX_SLOTS:
            found.append(at)
            at = trigger.next_fire(at)
    if len(found) > MAX_SLOTS:
        raise ValueError(
            f"the window holds more than {MAX_SLOTS} slots of the job's schedule: backfill a "
            "shorter one at a time"
        )
    return found


def fates(
    spec: Spec, slots: Sequence[datetime], ledger: Sequence[SlotRecord], runs: Sequence[RunRecord]
) -> list[SlotRecord]:
    """Each of ``slots`` with its fate: the ledger's (an ``every`` slot: the first committed
    slot of its interval, else the ledger's first of it), else a backfilled run of it (the
    ledger begins when the job was declared), else not owed."""
    by_slot = {record.slot: record for record in ledger}
    owed = sorted(by_slot)
    filled = {r.slot: r for r in reversed(runs) if r.backfilled_by is not None}
    interval = spec.trigger.delta if isinstance(spec.trigger, Every) else None
    found = []
    for slot in slots:
        record = by_slot.get(slot)
        if record is None and interval is not None:
            i = bisect.bisect_left(owed, slot)
            within = [by_slot[s] for s in owed[i:] if s < slot + interval]
            done = [r for r in within if r.fate in COMMITTED]
            if done or within:
                near = (done or within)[0]
                record = SlotRecord(slot, near.fate, near.reason, near.run, near.lateness)
        run = filled.get(slot)
        if (record is None or record.fate not in COMMITTED) and run is not None:
            fate = Fate.RAN if run.outcome == "success" else Fate.FAILED
            record = SlotRecord(slot, fate, f"backfilled by {run.backfilled_by}", run)
        found.append(record or SlotRecord(slot, Fate.SKIPPED, NOT_OWED))
    return found


async def backfill(
    fleet: Fleet,
    job_id: str,
    since: datetime,
    until: datetime,
    now: datetime,
    *,
    rerun: bool,
    dry_run: bool,
    pace: float | None,
    who: str,
    note: str | None,
) -> list[SlotRecord]:
    """Run the slots of ``job_id`` in ``[since, until)`` again (see the module docstring);
    each slot with its fate, as it stands once the backfill is done (``dry_run``: now)."""
    since = _instant(since, "since", job_id)
    until = _instant(until, "until", job_id)
    if until <= since:
        raise ScheduleError("until must be after since", job_id=job_id, field="until")
    if until > now:
        raise ScheduleError(
            f"until ({until.isoformat()}) is in the future: a backfill runs past slots only",
            job_id=job_id,
            field="until",
        )
    if pace is not None and (
        isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 < pace < math.inf
    ):
        raise ScheduleError(
            f"pace must be a positive number of slots per second, got {pace!r}",
            job_id=job_id,
            field="pace",
        )
    spec = await fleet.spec(job_id)
    if spec is None:
        raise KeyError(f"job {job_id!r}: its schedule is not known (never declared)")
    try:
        slots = fires(spec, since, until)
    except ValueError as exc:
        raise ScheduleError(str(exc), job_id=job_id, field="until") from None
    records = await _fates(fleet, spec, job_id, slots, since, until)
    if dry_run:
        return records
    chosen = [r.slot for r in records if rerun or r.fate not in COMMITTED]
    said = f"{since.isoformat()} to {until.isoformat()}: {len(chosen)} slots"
    said += ", committed ones too (rerun)" if rerun else ""
    request = await fleet.request_backfill(
        job_id, chosen, pace, said if not note else f"{said}; {note}", who=who, rerun=rerun
    )
    try:
        state = await _done(fleet, job_id, request, STALL + spec.timeout)
    except BaseException:  # cancelled (an operator's Ctrl-C), or stalled
        with anyio.CancelScope(shield=True):
            await fleet.end_backfill(request)  # its slots not run yet never run
        raise
    records = await _fates(fleet, spec, job_id, slots, since, until)
    passed = set() if state is None else set(state.passed)
    return [
        SlotRecord(r.slot, Fate.SKIPPED, PASSED, r.run, r.lateness, r.change)
        if r.slot in passed and r.fate not in COMMITTED
        else r
        for r in records
    ]


async def _done(fleet: Fleet, job_id: str, request: int, stall: float) -> Backfill | None:
    """Backfill ``request`` once done; ``TimeoutError`` when no slot of it ran for ``stall``
    seconds."""
    wait, last, moved = POLL, -1, time.monotonic()
    while True:
        state = await fleet.backfill_state(request)
        if state is None or state.finished:
            return state
        if state.done != last:
            last, moved = state.done, time.monotonic()
        elif time.monotonic() - moved > stall:
            raise TimeoutError(
                f"backfill of {job_id!r}: no slot of it ran for {stall:g} s (the replicas that "
                f"have the job stopped, or cannot reach the database): it is cancelled, "
                f"{state.done} of its {len(state.slots)} slots done"
            )
        await anyio.sleep(wait)
        wait = min(wait * 2, MAX_POLL)


async def _fates(
    fleet: Fleet,
    spec: Spec,
    job_id: str,
    slots: list[datetime],
    since: datetime,
    until: datetime,
) -> list[SlotRecord]:
    ledger = await fleet.slots(job_id, since, until - timedelta(microseconds=1))
    runs = await fleet.history(job_id, min(LIMIT, 2 * len(slots) + 100))
    return fates(spec, slots, ledger, runs)


def _instant(value: object, field: str, job_id: str) -> datetime:
    at = instant(value, field, job_id=job_id)
    if at is None:
        raise ScheduleError(f"{field} is needed", job_id=job_id, field=field)
    return at
