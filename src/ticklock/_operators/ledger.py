"""The ledger: every slot a job's schedule owed in a window, and what happened to it (the slot
counters, which count as runs end, are :mod:`ticklock._telemetry`'s).

Nothing is stored per slot. The slots come from the schedule (a cron job's fires; an ``every``
job's slots from its runs, one interval after each run's end, and one an interval while none
ran), and each slot's fate from the records: the runs, the audit log (pauses), which replicas
were live and what they declared (presence), and what replicas recorded of themselves: the
database outages they saw, their event loop's stalls and their ticks refused for their clock.
:func:`account` is a pure function of those.

A slot's fate, first match wins:

- a run of the slot: ``ran`` if one succeeded, else ``timed out`` or ``failed`` by the last;
  a first attempt that started more than the job's ``overdue_grace`` (and its jitter) after
  the slot ran late, and carries the reason a miss would have;
- no run of its own, a later success covered it (``catch_up=True``, or a run an operator
  asked for, or an ``every`` run that started after it): ``covered``, naming the run;
- due too recently for its run to have ended (slot + timeout + grace): ``pending``;
- outside the job's window (``before start``, ``after end``), after its ``limit`` of runs
  (``limit reached``), paused by an operator, declared
  disabled, the run before still running, or the watermark already past it: ``skipped``; so
  is a slot passed over by ``catch_up=False``, or older than a ``catch_up`` duration;
- otherwise ``missed``: the database was unreachable, every replica that declared the job
  recorded what kept it (the database unreachable from it, its event loop blocked by a job,
  its clock ahead of the database's so that its ticks were refused), no live replica declared
  the job, or no record explains it (``unknown``: a defect, to report).

The ledger begins when the job was first declared, as far back as the records reach (no slot
before it was owed). A covered or skipped slot carries the same reason as a missed one would
(why it did not run on time), when the records give one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone

from .._schedule.job import REPLACED
from .._schedule.spec import Spec
from .._schedule.triggers import Cron, Every
from .fleet import Action, Fate, RunRecord, SlotRecord, done, iso

LIMIT = 1000
"""The most slots one ledger gives (the latest of the window)."""
STEPS = 200_000
"""The most schedule steps one ledger walks: a window is bounded by its cost too."""
LIVE_SLACK = timedelta(seconds=20)
"""A replica counts as live this long after its last recorded beat (it beats every 15 s)."""
TEXT = 500
"""The characters of a run's report and error that a ledger gives: a longer one is cut, with a
marker, as the dashboard's pages cut them (``Fleet.history(max_text=)``)."""
TOLERANCE = timedelta(seconds=1)
"""Instants closer than this are the same (an ``every`` slot against a run's end)."""


@dataclass(slots=True)
class Walk:
    """The schedule steps the ledgers computed under :func:`walking` took (its tests' measure
    of a ledger's work: it follows the window, not the age of the records)."""

    steps: int = 0


_WALK: ContextVar[Walk | None] = ContextVar("ticklock_ledger_walk", default=None)


@contextmanager
def walking() -> Iterator[Walk]:
    """Count the schedule steps of the ledgers computed in this context (and the worker
    threads it starts)."""
    walk = Walk()
    token = _WALK.set(walk)
    try:
        yield walk
    finally:
        _WALK.reset(token)


def _walked(steps: int) -> None:
    walk = _WALK.get()
    if walk is not None:
        walk.steps += steps


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


UNREACHABLE, STALLED, AHEAD = "unreachable", "stalled", "ahead"
"""The kinds of :class:`Incident`: the database did not answer the replica; its event loop was
blocked; its clock ran ahead of the database's, so its ticks were refused."""


@dataclass(frozen=True, slots=True)
class Incident:
    """What kept a replica from running its slots, as the replica itself recorded it."""

    owner: str
    kind: str
    """:data:`UNREACHABLE`, :data:`STALLED` or :data:`AHEAD`."""
    since: datetime
    until: datetime
    detail: str | None = None
    """For a stall, the job whose handler blocked the loop (``None``: other code); for a
    clock ahead, by how many seconds."""

    def covers(self, slot: datetime, reach: timedelta) -> bool:
        """Whether it kept its replica from ``slot``, which it could still have run ``reach``
        after it (a backup looks, then runs it): it began by then, and ended after the slot."""
        return self.since - reach <= slot <= self.until + TOLERANCE

    def reason(self) -> str:
        """What it did to the replica's slots, in the ledger's words."""
        if self.kind == STALLED:
            by = "code outside its jobs" if self.detail is None else f"job {self.detail!r}"
            seconds = (self.until - self.since).total_seconds()
            return f"replica {self.owner}'s event loop was blocked by {by} for {seconds:.1f} s"
        if self.kind == AHEAD:
            ahead = float(self.detail or 0)
            return (
                f"replica {self.owner}'s clock is {ahead:.1f} s ahead of the database: "
                "its ticks were refused"
            )
        return f"the database was unreachable (from {self.owner})"


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
    incidents: Sequence[Incident] = ()
    """What else replicas recorded that kept them from their slots (stalls, a clock ahead)."""
    paused_at: datetime | None = None
    """The pause in force now."""
    horizon: datetime | None = None
    """Since when the presence records reach (retention, or the schema's upgrade): before it,
    a slot without a run has no reason the records can give."""
    declared_since: datetime | None = None
    """When a replica first declared the job, as far back as the records reach: no slot
    before it was owed."""
    complete_since: datetime | None = None
    """Since when ``runs`` holds every run (a reader that read only the latest ones, or a
    history that keeps only so many): the ledger begins there."""
    task: str | None = None
    """A stored schedule's task: the replicas that had it declared the schedule."""
    successes: int = 0
    """Its scheduled runs that committed, as its ``limit`` counts them."""
    version: int | None = None
    """A stored schedule's version now: its writes (``put`` in ``actions``) are numbered back
    from it."""


def account(
    spec: Spec,
    records: Records,
    since: datetime,
    until: datetime,
    now: datetime,
    limit: int = LIMIT,
) -> list[SlotRecord]:
    """The fate of every slot ``spec``'s schedule owed from ``since`` to ``until`` (the latest
    ``limit``, at most :data:`LIMIT`), oldest first."""
    limit = max(1, min(limit, LIMIT))
    runs = sorted((r for r in records.runs if r.slot is not None), key=_slot)
    # a backfill's runs are their slots' own, and neither plan the schedule nor cover others
    scheduled = [r for r in runs if r.backfilled_by is None]
    since, first = _begin(spec, records, scheduled, since)
    slots = _owed(spec, scheduled, since, until, limit, first)
    own: dict[datetime, list[RunRecord]] = {}
    for run in runs:
        if not run.manual:
            own.setdefault(_slot(run), []).append(run)
    successes = sorted((r for r in scheduled if r.outcome == "success"), key=lambda r: r.started_at)
    starts = [r.started_at for r in successes]
    facts = _Facts(spec, records, runs, now)
    jitter = timedelta(seconds=spec.trigger.jitter)
    grace = timedelta(seconds=spec.timeout + spec.overdue_grace) + jitter + TOLERANCE
    on_time = timedelta(seconds=spec.overdue_grace) + jitter
    done = _completed_at(spec, scheduled, records.successes)
    ledger = []
    for slot in slots:
        attempts = own.get(slot)
        if attempts:
            ledger.append(_ran(slot, attempts, on_time, facts))
            continue
        if spec.start is not None and slot < spec.start:
            ledger.append(SlotRecord(slot, Fate.SKIPPED, "before start"))
            continue
        if spec.end is not None and slot > spec.end:
            ledger.append(SlotRecord(slot, Fate.SKIPPED, "after end"))
            continue
        if done is not None and slot > done:
            ledger.append(SlotRecord(slot, Fate.SKIPPED, "limit reached"))
            continue
        later = _covering(slot, successes, starts)
        fate, reason, explains = facts.cause(slot)
        if later is not None and (
            later.manual or _slot(later) < slot or _reaches(spec, slot, later, own)
        ):
            lateness = later.started_at - slot
            ledger.append(SlotRecord(slot, Fate.COVERED, reason, later, lateness))
        elif slot + grace > now and later is None:  # no later run began: it may still run
            ledger.append(SlotRecord(slot, Fate.PENDING))
        elif later is not None:  # passed over by catch_up=False, or older than its duration
            why = (
                "catch_up=False: the next run did not cover it"
                if spec.catch_up is False
                else f"outside the catch-up window ({spec.catch_up:g} s before the next run)"
            )
            ledger.append(SlotRecord(slot, Fate.SKIPPED, f"{why} ({reason})", later))
        else:
            ledger.append(SlotRecord(slot, fate, reason, explains))
    return _changes(ledger, records)


def _changes(ledger: list[SlotRecord], records: Records) -> list[SlotRecord]:
    """``ledger`` with each edit of a stored schedule on the first slot after it: its
    writes are its ``put`` actions, the latest one its current version, each earlier one a
    version less (a ``put`` that changes nothing is not written); version 1 is its creation."""
    if records.version is None or not ledger:
        return ledger
    puts = sorted((a for a in records.actions if a.action == "put"), key=lambda a: a.at)
    slots = [record.slot for record in ledger]
    first = records.version - len(puts) + 1
    for version, put in enumerate(puts, start=first):
        i = bisect.bisect_right(slots, put.at)
        if version >= 2 and i < len(ledger):
            said = f"definition v{version} effective from this slot, by {put.who}"
            ledger[i] = replace(ledger[i], change=said)
    return ledger


def _completed_at(spec: Spec, runs: list[RunRecord], successes: int) -> datetime | None:
    """The slot of the scheduled success that reached the job's ``limit`` (``None``: no
    limit, or not reached): the last of those the records hold once the count reached it
    (``datetime.min`` when none is left: it completed before them)."""
    if spec.limit is None or successes < spec.limit:
        return None
    committed = [_slot(r) for r in runs if r.outcome == "success" and not r.manual]
    return committed[-1] if committed else datetime.min.replace(tzinfo=timezone.utc)


def _reaches(
    spec: Spec, slot: datetime, later: RunRecord, own: dict[datetime, list[RunRecord]]
) -> bool:
    """Whether the ``catch_up`` rule let ``later`` cover ``slot``: always (``True``), never
    (``False``), or when the slot lies within the duration before the start of the first
    attempt of ``later``'s slot (when the replica planned it; its jitter aside)."""
    if isinstance(spec.catch_up, bool):
        return spec.catch_up
    planned = min(r.started_at for r in own.get(_slot(later), [later]))
    reach = timedelta(seconds=spec.catch_up + spec.trigger.jitter) + TOLERANCE
    return slot >= planned - reach


def _slot(run: RunRecord) -> datetime:
    assert run.slot is not None
    return run.slot


def _begin(
    spec: Spec, records: Records, runs: list[RunRecord], since: datetime
) -> tuple[datetime, datetime | None]:
    """Where the ledger begins (the records' bounds), and when the job was first declared."""
    if records.complete_since is not None:
        since = max(since, records.complete_since)
    first = records.declared_since
    scheduled = [_slot(r) for r in runs if not r.manual]
    if first is not None and scheduled and scheduled[0] < first:
        first = scheduled[0] - TOLERANCE  # runs from before the presence records began
    if first is not None and not isinstance(spec.trigger, Every):
        since = max(since, first + timedelta(microseconds=1))  # the first fire is after it
    return since, first


def _owed(
    spec: Spec,
    runs: list[RunRecord],
    since: datetime,
    until: datetime,
    limit: int,
    first: datetime | None,
) -> list[datetime]:
    """The latest ``limit`` slots owed from ``since`` to ``until``, oldest first: walked from
    a start that moves back, doubling the span, until it holds that many (or reaches
    ``since``), so that a long window costs about ``limit`` steps, not its length."""
    trigger = spec.trigger
    if until < since:
        return []
    try:
        span = min(timedelta(seconds=trigger.period * limit * 2), until - since)
    except OverflowError:  # a schedule whose fires are years apart
        span = until - since
    while True:
        start = max(since, until - span)
        if isinstance(trigger, Every):
            slots = _every(trigger, runs, start, until, first)
        else:
            slots = _fires(trigger, start, until)
        if len(slots) >= limit or start == since or len(slots) >= STEPS:
            return slots[-limit:]
        span *= 2


def _fires(trigger: Cron, since: datetime, until: datetime) -> list[datetime]:
    """A cron trigger's fires from ``since`` to ``until`` (at most :data:`STEPS`)."""
    fires: list[datetime] = []
    at: datetime | None = since - timedelta(microseconds=1)
    while len(fires) < STEPS:
        _walked(1)
        at = trigger.next_fire(at) if at is not None else None
        if at is None or at > until:
            break
        fires.append(at)
    return fires


def _every(
    trigger: Every, runs: list[RunRecord], since: datetime, until: datetime, first: datetime | None
) -> list[datetime]:
    """An ``every`` job's slots from ``since`` to ``until``: one interval after each run's end
    (a manual run's too: it restarts the interval), and one an interval while none ran."""
    interval = trigger.delta
    # a slot owed between two runs lies a whole interval before the next one's: less is the
    # same slot, planned from a later end than the records show
    slack = max(TOLERANCE, interval / 2)
    slots: list[datetime] = []

    def owe(at: datetime) -> None:
        _walked(1)
        if since <= at <= until and len(slots) < STEPS:
            slots.append(at)

    def onward(at: datetime) -> datetime:
        """``at`` moved on by whole intervals to the window's start: the slots before it
        are not walked one by one (a job paused for months)."""
        return at + interval * -((at - since) // interval) if at < since else at

    ended = [r.finished_at for r in runs if _slot(r) < since]
    if ended:
        due = max(ended) + interval
    elif first is not None:  # the job's first slot: its declaration plus the initial delay
        due = first + TOLERANCE + timedelta(seconds=trigger.initial_delay)
    else:
        due = since  # the records do not say: its slots count from the window's start
    last: datetime | None = None
    for run in runs:
        slot = _slot(run)
        if slot < since:
            continue
        if slot == last:  # a retry of the slot: the interval counts from its end
            due = max(due, run.finished_at + interval)
            continue
        due = onward(due)
        while due < slot - slack and due <= until and len(slots) < STEPS:
            owe(due)
            due += interval
        if slot > until or len(slots) >= STEPS:
            break
        if run.manual:  # owes no slot; the interval counts from its end
            due = max(due, run.finished_at + interval)
            continue
        owe(slot)
        # a run that started late (a catch-up run) leaves the interval's slots before its start
        at = slot + interval
        while at < run.started_at - TOLERANCE and at <= until and len(slots) < STEPS:
            owe(at)
            at += interval
        last, due = slot, run.finished_at + interval
    due = onward(due)
    while due <= until and len(slots) < STEPS:
        owe(due)
        due += interval
    return slots


def _ran(
    slot: datetime, attempts: list[RunRecord], on_time: timedelta, facts: _Facts
) -> SlotRecord:
    """A slot with runs of its own: its fate by them; its lateness by the first, and why,
    when that started later than ``on_time`` after the slot."""
    lateness = min(r.started_at for r in attempts) - slot
    reason = facts.cause(slot)[1] if lateness > on_time else None
    for run in attempts:
        if run.outcome == "success":
            if run.backfilled_by is not None:
                reason = f"backfilled by {run.backfilled_by}"
            return SlotRecord(slot, Fate.RAN, reason, run, lateness)
    last = max(attempts, key=lambda r: r.finished_at)
    if last.error is not None and last.error.startswith(REPLACED):  # overlap="replace"
        return SlotRecord(slot, Fate.SKIPPED, last.error, last, lateness)
    fate = Fate.TIMED_OUT if last.outcome == "timeout" else Fate.FAILED
    return SlotRecord(slot, fate, reason, last, lateness)


def _covering(
    slot: datetime, successes: list[RunRecord], starts: list[datetime]
) -> RunRecord | None:
    """The first success that started after ``slot`` was due: its run covered it."""
    i = bisect.bisect_left(starts, slot)
    return successes[i] if i < len(successes) else None


Stretch = tuple[datetime, "datetime | None", "Action | None"]


def _pauses(
    actions: Sequence[Action], paused_at: datetime | None, runs: list[RunRecord]
) -> list[Stretch]:
    """The stretches the job was paused, from the audit log and the pause in force now."""
    stretches: list[Stretch] = []
    opened: Action | None = None
    for action in sorted(actions, key=lambda a: a.at):
        if not action.changed:
            continue
        if action.action == "pause" and opened is None:
            opened = action
        elif action.action in ("resume", "forget"):
            if opened is not None:
                stretches.append((opened.at, action.at, opened))
            elif action.action == "resume":  # its pause is older than the audit log
                stretches.append((datetime.min.replace(tzinfo=action.at.tzinfo), action.at, None))
            opened = None
    if opened is not None and paused_at is None:
        # not paused now, and the resume is not recorded: it ended by the next scheduled run
        after = [r.started_at for r in runs if not r.manual and r.started_at > opened.at]
        stretches.append((opened.at, min(after, default=opened.at), opened))
    elif opened is not None:
        stretches.append((opened.at, None, opened))
    elif paused_at is not None:  # paused before the audit log was kept
        stretches.append((paused_at, None, None))
    return stretches


class _Facts:
    """Why a slot had no run of its own, from the records (see :meth:`cause`)."""

    def __init__(self, spec: Spec, records: Records, runs: list[RunRecord], now: datetime) -> None:
        self.spec = spec
        self.records = records
        self.now = now
        self.jitter = timedelta(seconds=spec.trigger.jitter)
        # how long after a slot it may still run (as long as it is pending)
        self.reach = timedelta(seconds=spec.timeout + spec.overdue_grace) + self.jitter + TOLERANCE
        self.pauses = _pauses(records.actions, records.paused_at, runs)
        self.by_start = sorted(runs, key=lambda r: r.started_at)
        self.starts = [r.started_at for r in self.by_start]
        successes = [r for r in runs if r.outcome == "success"]
        self.by_end = sorted(successes, key=lambda r: r.finished_at)
        self.ends = [r.finished_at for r in self.by_end]

    def cause(self, slot: datetime) -> tuple[Fate, str, RunRecord | None]:
        """The fate that a slot without a run of its own has, the reason, and a run that
        explains it."""
        for start, end, action in self.pauses:
            if start <= slot + self.jitter and (end is None or slot < end):
                if action is None:
                    return Fate.SKIPPED, "paused (the pause is older than the audit log)", None
                return Fate.SKIPPED, done(action), None
        records, now = self.records, self.now
        live = [s for s in records.presence if s.covers(slot, now, LIVE_SLACK)]
        if live and not any(s.enabled for s in live):
            return Fate.SKIPPED, "disabled: declared with enabled=False by every live replica", None
        if not self.spec.enabled and not live:
            return Fate.SKIPPED, "disabled: declared with enabled=False", None
        i = bisect.bisect_right(self.starts, slot) - 1
        if i >= 0 and slot < self.by_start[i].finished_at:
            run = self.by_start[i]
            why = f"the run before was still running (the run of {iso(run.slot)})"
            return Fate.SKIPPED, why, run
        j = bisect.bisect_right(self.ends, slot) - 1
        if j >= 0 and _slot(self.by_end[j]) >= slot:
            run = self.by_end[j]
            return Fate.SKIPPED, f"already committed by the run of {iso(run.slot)}", run
        declarers = {s.owner for s in live if s.enabled}
        down = {s.owner for s in records.outages if s.covers(slot, now, TOLERANCE)}
        if down and declarers <= down:
            return (
                Fate.MISSED,
                f"the database was unreachable (from {', '.join(sorted(down))})",
                None,
            )
        explained = self._explained(slot, declarers)
        if explained is not None:
            return Fate.MISSED, explained, None
        beating = [s for s in live if s.enabled and (s.exact or s.until is None or s.until >= slot)]
        if declarers and not beating:
            last = max(s.until for s in live if s.enabled and s.until is not None)
            owners = ", ".join(sorted(declarers))
            return (
                Fate.MISSED,
                f"the replicas that declared it ({owners}) stopped beating at {iso(last)} "
                "(killed, frozen, or cut off from the database)",
                None,
            )
        if not declarers:
            if records.horizon is None or slot < records.horizon:
                why = "unknown: before the records of live replicas begin (retention)"
                return Fate.MISSED, why, None
            if records.task is not None:
                return Fate.MISSED, f"no live replica has its task {records.task!r}", None
            return Fate.MISSED, "no live replica declared the job", None
        return (
            Fate.MISSED,
            f"unknown: replicas {', '.join(sorted(declarers))} were live and declared the job, "
            "and no record explains why it did not run (a defect: please report it)",
            None,
        )

    def _explained(self, slot: datetime, declarers: set[str]) -> str | None:
        """Why each replica that declared the job did not run ``slot``, from what it recorded
        (the database unreachable from it, its loop blocked, its clock ahead), if every one
        recorded something that covers it."""
        if not declarers:
            return None
        now, why = self.now, dict[str, Incident]()
        for owner in sorted(declarers):
            down = [
                Incident(owner, UNREACHABLE, s.since, s.until or now)
                for s in self.records.outages
                if s.owner == owner
            ]
            found = [
                i
                for i in (*down, *self.records.incidents)
                if i.owner == owner and i.covers(slot, self.reach)
            ]
            if not found:
                return None
            why[owner] = max(found, key=lambda i: i.until - i.since)
        cut = [owner for owner, i in why.items() if i.kind == UNREACHABLE]
        said = [f"the database was unreachable (from {', '.join(cut)})"] if cut else []
        return "; ".join(said + [i.reason() for i in why.values() if i.kind != UNREACHABLE])
