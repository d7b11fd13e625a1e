"""The ledger: every slot a job's schedule owed in a window, and what happened to it.

Nothing is stored per slot. The slots come from the schedule (a cron job's fires; an ``every``
job's slots from its runs, one interval after each run's end, and one an interval while none
ran), and each slot's fate from the records: the runs, the audit log (pauses), which replicas
were live and what they declared (presence), and the database outages replicas recorded once
they reconnected. :func:`account` is a pure function of those.

A slot's fate, first match wins:

- a run of the slot: ``ran`` if one succeeded, else ``timed out`` or ``failed`` by the last;
- no run of its own, a later success covered it (``catch_up=True``, or a run an operator
  asked for, or an ``every`` run that started after it): ``covered``, naming the run;
- due too recently for its run to have ended (slot + timeout + grace): ``pending``;
- paused by an operator, declared disabled, the run before still running, or the watermark
  already past it: ``skipped``; so is a slot passed over by ``catch_up=False``;
- otherwise ``missed``: the database was unreachable, no live replica declared the job, or no
  record explains it (``unknown``: a defect, to report).

The ledger begins when the job was first declared, as far back as the records reach (no slot
before it was owed). A covered or skipped slot carries the same reason as a missed one would
(why it did not run on time), when the records give one.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ._fleet import Action, Fate, RunRecord, SlotRecord, done, iso
from ._spec import Spec
from ._triggers import Cron, Every

LIMIT = 1000
"""The most slots one ledger gives (the latest of the window)."""
STEPS = 200_000
"""The most schedule steps one ledger walks: a window is bounded by its cost too."""
LIVE_SLACK = timedelta(seconds=20)
"""A replica counts as live this long after its last recorded beat (it beats every 15 s)."""
TOLERANCE = timedelta(seconds=1)
"""Instants closer than this are the same (an ``every`` slot against a run's end)."""


@dataclass(frozen=True, slots=True)
class Span:
    """A stretch of time a record covers: a replica live declaring the job, or an outage."""

    owner: str
    since: datetime
    until: datetime | None
    """``None``: still going."""
    enabled: bool = True
    """For presence: the replica declared the job enabled (``False``: with ``enabled=False``)."""
    exact: bool = False
    """``until`` is when it ended (a replica that left); else its last record (a beat), and
    it may have lasted a beat longer."""

    def covers(self, at: datetime, now: datetime, slack: timedelta) -> bool:
        """Whether ``at`` lies in the span (its end extended by ``slack`` unless exact)."""
        end = now if self.until is None else self.until
        return self.since - TOLERANCE <= at <= (end if self.exact else end + slack)


@dataclass(frozen=True, slots=True)
class Records:
    """What the ledger reads of one job."""

    runs: Sequence[RunRecord]
    """The job's runs in the window, and the last one before it."""
    actions: Sequence[Action] = ()
    """Its audited operations (pause and resume matter here), any order."""
    presence: Sequence[Span] = ()
    """The replicas that were live and declared the job."""
    outages: Sequence[Span] = ()
    """The database outages replicas recorded."""
    paused_at: datetime | None = None
    """The pause in force now."""
    horizon: datetime | None = None
    """Since when the presence records reach (retention, or the schema's upgrade): before it,
    a slot without a run has no reason the records can give."""
    declared_since: datetime | None = None
    """When a replica first declared the job, as far back as the records reach: no slot at
    or before it was owed."""


def account(
    spec: Spec,
    records: Records,
    since: datetime,
    until: datetime,
    now: datetime,
    limit: int = LIMIT,
) -> list[SlotRecord]:
    """The fate of every slot ``spec``'s schedule owed from ``since`` to ``until`` (the latest
    ``limit``), oldest first."""
    runs = sorted((r for r in records.runs if r.slot is not None), key=_slot)
    scheduled = [r for r in runs if not r.manual]
    if records.declared_since is not None:
        since = max(since, records.declared_since + timedelta(microseconds=1))
    slots = deque(_owed(spec, scheduled, since, until, limit), maxlen=limit)
    own: dict[datetime, list[RunRecord]] = {}
    for run in scheduled:
        own.setdefault(_slot(run), []).append(run)
    successes = sorted((r for r in runs if r.outcome == "success"), key=lambda r: r.started_at)
    starts = [r.started_at for r in successes]
    pauses = _pauses(records.actions, records.paused_at)
    grace = timedelta(seconds=spec.timeout + spec.overdue_grace) + TOLERANCE
    ledger = []
    for slot in slots:
        attempts = own.get(slot)
        if attempts:
            ledger.append(_ran(slot, attempts))
            continue
        later = _covering(slot, successes, starts)
        cause = _cause(slot, spec, records, runs, pauses, now)
        if later is not None and (spec.catch_up or later.manual or _slot(later) < slot):
            ledger.append(SlotRecord(slot, Fate.COVERED, cause[1], later))
        elif slot + grace > now:
            ledger.append(SlotRecord(slot, Fate.PENDING))
        elif later is not None:  # passed over by catch_up=False
            why = "catch_up=False: the next run did not cover it"
            ledger.append(SlotRecord(slot, Fate.SKIPPED, f"{why} ({cause[1]})", later))
        else:
            ledger.append(SlotRecord(slot, cause[0], cause[1], cause[2]))
    return ledger


def _slot(run: RunRecord) -> datetime:
    assert run.slot is not None
    return run.slot


def _owed(
    spec: Spec, scheduled: list[RunRecord], since: datetime, until: datetime, limit: int
) -> Iterator[datetime]:
    """The slots owed from ``since`` to ``until``, oldest first."""
    trigger = spec.trigger
    steps = 0
    if not isinstance(trigger, Every):
        yield from _fires(trigger, since, until, limit)
        return
    interval = trigger.delta
    before = [r for r in scheduled if _slot(r) < since]
    end = max((r.finished_at for r in before), default=None)
    if end is None:
        end = since - interval  # no run before the window: its slots count from its start
    last: datetime | None = None
    for run in scheduled:
        slot = _slot(run)
        if slot < since or slot == last:  # before the window, or a retry of the same slot
            if slot == last:
                end = max(end, run.finished_at)
            continue
        at = end + interval
        while at < slot - TOLERANCE and at <= until and steps < STEPS:
            if at >= since:
                yield at
            at += interval
            steps += 1
        if slot > until:
            return
        yield slot
        # a run that started late (a catch-up run) leaves the interval's slots before its start
        at = slot + interval
        while at < run.started_at - TOLERANCE and at <= until and steps < STEPS:
            yield at
            at += interval
            steps += 1
        last, end = slot, run.finished_at
    at = end + interval
    while at <= until and steps < STEPS:
        if at >= since:
            yield at
        at += interval
        steps += 1


def _fires(trigger: Cron, since: datetime, until: datetime, limit: int) -> list[datetime]:
    """A cron trigger's latest ``limit`` fires from ``since`` to ``until``: walked from a start
    that moves back, doubling the span, until it holds that many (or reaches ``since``), so
    that a long window costs about ``limit`` steps, not its length."""
    span = timedelta(seconds=trigger.period * limit)
    while True:
        start = max(since, until - span)
        fires: list[datetime] = []
        at: datetime | None = start - timedelta(microseconds=1)
        while len(fires) < STEPS:
            at = trigger.next_fire(at) if at is not None else None
            if at is None or at > until:
                break
            fires.append(at)
        if len(fires) >= limit or start == since or len(fires) >= STEPS:
            return fires[-limit:]
        span *= 2


def _ran(slot: datetime, attempts: list[RunRecord]) -> SlotRecord:
    for run in attempts:
        if run.outcome == "success":
            return SlotRecord(slot, Fate.RAN, None, run)
    last = max(attempts, key=lambda r: r.finished_at)
    fate = Fate.TIMED_OUT if last.outcome == "timeout" else Fate.FAILED
    return SlotRecord(slot, fate, None, last)


def _covering(
    slot: datetime, successes: list[RunRecord], starts: list[datetime]
) -> RunRecord | None:
    """The first success that started after ``slot`` was due: its run covered it."""
    i = bisect.bisect_left(starts, slot)
    return successes[i] if i < len(successes) else None


def _pauses(
    actions: Sequence[Action], paused_at: datetime | None
) -> list[tuple[datetime, datetime | None, Action | None]]:
    """The stretches the job was paused, from the audit log and the pause in force now."""
    stretches: list[tuple[datetime, datetime | None, Action | None]] = []
    opened: Action | None = None
    for action in sorted(actions, key=lambda a: a.at):
        if not action.changed:
            continue
        if action.action == "pause" and opened is None:
            opened = action
        elif action.action == "resume" and opened is not None:
            stretches.append((opened.at, action.at, opened))
            opened = None
    if opened is not None:
        stretches.append((opened.at, None, opened))
    elif paused_at is not None:  # paused before the audit log was kept
        stretches.append((paused_at, None, None))
    return stretches


def _cause(
    slot: datetime,
    spec: Spec,
    records: Records,
    runs: list[RunRecord],
    pauses: list[tuple[datetime, datetime | None, Action | None]],
    now: datetime,
) -> tuple[Fate, str, RunRecord | None]:
    """Why ``slot`` had no run of its own: the fate that makes it, the reason, and a run that
    explains it."""
    for start, end, action in pauses:
        if start <= slot and (end is None or slot < end):
            if action is None:
                return Fate.SKIPPED, f"paused (since {iso(start)})", None
            return Fate.SKIPPED, done(action), None
    live = [s for s in records.presence if s.covers(slot, now, LIVE_SLACK)]
    if live and not any(s.enabled for s in live):
        return Fate.SKIPPED, "disabled: declared with enabled=False by every live replica", None
    if not spec.enabled and not live:
        return Fate.SKIPPED, "disabled: declared with enabled=False", None
    for run in runs:
        if run.started_at <= slot < run.finished_at:
            return (
                Fate.SKIPPED,
                f"the run of {iso(run.slot)} was still running (a job never overlaps itself)",
                run,
            )
        if run.outcome == "success" and _slot(run) >= slot and run.finished_at <= slot:
            return Fate.SKIPPED, f"already committed by the run of {iso(run.slot)}", run
    down = [s for s in records.outages if s.covers(slot, now, TOLERANCE)]
    if down:
        owners = ", ".join(sorted({s.owner for s in down}))
        return Fate.MISSED, f"the database was unreachable (from {owners})", None
    if not any(s.enabled for s in live):
        if records.horizon is None or slot < records.horizon:
            return (
                Fate.MISSED,
                "unknown: before the records of live replicas begin (retention)",
                None,
            )
        return Fate.MISSED, "no live replica declared the job", None
    owners = ", ".join(sorted({s.owner for s in live if s.enabled}))
    return (
        Fate.MISSED,
        f"unknown: replicas {owners} were live and declared the job, and no record explains "
        "why it did not run (a defect: please report it)",
        None,
    )
