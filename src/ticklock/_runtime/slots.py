"""When a job's slots fall, from its declaration and the fleet's state: pure functions, the
same on every replica, that :mod:`.plan` (what a job does next), the roster, the stored
schedules' catalog, the health and the backends' records share.

- :func:`first`: the slot to wait for at start or when re-aligning (the ``catch_up`` rule);
- :func:`next_slot` / :func:`following`: the slot after a run (fixed delay; ``overlap``);
- :func:`windowed`: a slot within the job's ``start`` and ``end``; :func:`completed`: its
  ``limit`` reached;
- :func:`stale`: whether the fleet has moved past a slot;
- :func:`resting`, :func:`first_fires`, :func:`next_due`: the slots as operators see them;
- :func:`overdue_at`: the absence alarm's instant.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime, timedelta

from .._backends.seam import FleetState
from .._schedule.job import Job, RunResult
from .._schedule.triggers import Cron, Every, Trigger, within


def completed(job: Job, state: FleetState) -> bool:
    """Whether ``job`` ran its ``limit`` of scheduled runs fleet-wide: it runs no more."""
    return job.limit is not None and state.successes >= job.limit


OVERLAPPING = ("buffer_one", "replace")
"""The ``overlap`` policies under which a cron fire that came while a run ran runs once it
ends (the run ended by itself, or was replaced at that fire)."""


def next_slot(
    job: Job, end: datetime, slot: datetime | None, ran: datetime | None = None
) -> datetime | None:
    """The slot after a run that ended at ``end``, the watermark at ``slot`` (``ran``: the
    slot of that run, if later: a failure): by fixed delay (:func:`after`, from
    :func:`since`); for a cron job whose ``overlap`` is "buffer_one" or "replace", the latest
    fire that came while that run ran, if one did: it runs at once (the one buffered; the one
    that replaced the run). The latest, not the first: derived from the watermark and the
    run's end alone, every replica (and the next run's end) agrees on it, and the run covers
    the fires before it; those are skipped (the run before was still running)."""
    trigger = job.trigger
    ran = slot if ran is None or (slot is not None and slot > ran) else ran
    if ran is not None and isinstance(trigger, Cron) and job.overlap in OVERLAPPING:
        fire = trigger.next_fire(ran)
        if fire is not None and fire <= end:
            return latest(trigger, fire, end)
    return after(trigger, since(trigger, end, slot))


def following(job: Job, state: FleetState) -> datetime | None:
    """The slot after the fleet's last run (:func:`next_slot`; the job ran before)."""
    assert state.last_end is not None
    return next_slot(job, state.last_end, state.last_slot, state.failed_slot)


def after(trigger: Trigger, end: datetime) -> datetime | None:
    """The next slot by fixed delay after a run that ended at ``end``."""
    if isinstance(trigger, Every):
        return end + trigger.delta
    return trigger.next_fire(end)


def since(trigger: Trigger, end: datetime, slot: datetime | None) -> datetime:
    """What the next slot counts from after a run of ``slot`` that ended at ``end``: its end;
    for cron, not before its slot. A wall clock that stepped back during the run ended it
    before its slot, and the next fire after that end would be the slot itself again: a cron
    fire at or before the watermark is never owed again. (For ``every`` the slot is the end
    plus the interval, whatever the wall clock did.)"""
    if isinstance(trigger, Cron) and slot is not None and slot > end:
        return slot
    return end


def next_due(job: Job, result: RunResult) -> datetime | None:
    """When the run after ``result`` is due, as operators see it (retries aside)."""
    return windowed(job, next_slot(job, result.finished_at, result.slot))


def windowed(job: Job, slot: datetime | None) -> datetime | None:
    """``slot`` within the job's window (``start``, ``end``; see :func:`~.triggers.within`)."""
    if job.start is None and job.end is None:
        return slot
    return within(job.trigger, job.start, job.end, slot)


def first(job: Job, state: FleetState, now: datetime) -> datetime | None:
    """The slot to wait for at start or when re-aligning: a job that never ran starts at
    ``now + initial_delay`` (``every``) or its next fire (``cron``); a job whose next slot passed
    unrun is due at once with ``catch_up`` (one run covers the window; with a duration, only
    if a slot it owes lies within it), else at the next one after now. Within the job's window
    (:func:`windowed`)."""
    return windowed(job, _first(job, state, now))


def _first(job: Job, state: FleetState, now: datetime) -> datetime | None:
    trigger = job.trigger
    if state.last_end is None:
        if isinstance(trigger, Every):
            return now + timedelta(seconds=trigger.initial_delay)
        return trigger.next_fire(now)
    due = following(job, state)
    defined = job.defined_at  # an edited schedule owes no fire of its new trigger before it
    if defined is not None and isinstance(trigger, Cron) and due is not None and due <= defined:
        due = after(trigger, defined)
    if due is None or due > now or job.catch_up is True and isinstance(trigger, Every):
        return due
    # the oldest missed slot a run covers: any (True), none (False), or those within a duration
    floor = now if job.catch_up is False else now - timedelta(seconds=job.catch_up)
    if isinstance(trigger, Every):
        if due >= floor:
            return due
        # the first slot of the interval's grid within the window (after now: none missed in it)
        steps = math.ceil((floor - due).total_seconds() / trigger.interval)
        return due + timedelta(seconds=steps * trigger.interval)
    if job.catch_up is False:
        return trigger.next_fire(now)
    last = latest(trigger, due, now)
    return last if job.catch_up is True or last >= floor else trigger.next_fire(now)


def resting(job: Job, state: FleetState, start: datetime) -> datetime | None:
    """The slot ``job`` waits for while nothing happens to it: after its last run by fixed
    delay, or (it never ran) its first as planned at ``start``. Derived from the row alone,
    so that a replica need not hold a cycle for it (see :mod:`.roster`)."""
    if completed(job, state):
        return None
    if state.last_end is None:
        return first(job, state, start)
    return windowed(job, following(job, state))


def first_fires(job: Job, now: datetime) -> Iterator[datetime]:
    """The slots of a job that never ran, as a scheduler started at ``now`` plans them
    (:func:`first`, then fixed delay with runs that take no time), without jitter."""
    fire = first(job, FleetState(), now)
    while fire is not None:
        yield fire
        fire = windowed(job, after(job.trigger, fire))


def latest(trigger: Cron, due: datetime, now: datetime) -> datetime:
    """The last fire at or before ``now``, given that ``due <= now`` is a fire."""
    window = timedelta(seconds=trigger.period)
    candidate = due
    while True:  # widen the window back from now until it holds a fire, at most back to due
        start = max(now - window, due - timedelta(microseconds=1))
        found = trigger.next_fire(start)
        if found is not None and found <= now:
            candidate = found
            break
        if start <= due:
            break
        window *= 2
    while (following := trigger.next_fire(candidate)) is not None and following <= now:
        candidate = following
    return candidate


def stale(job: Job, state: FleetState, slot: datetime, attempt: int = 1) -> bool:
    """Whether the fleet has moved past ``slot``: committed it, or ran since it was planned
    (for a retry: ran any attempt of it but the one before, or a later slot)."""
    if attempt > 1:
        committed = state.last_slot is not None and state.last_slot >= slot
        return committed or state.failed_slot != slot or state.failed_attempts != attempt - 1
    if state.last_end is None:
        return False
    due = following(job, state)
    return due is None or due > slot


def overdue_at(job: Job, base: datetime) -> datetime | None:
    """When ``job`` is overdue if no run finishes after ``base`` (the end of its last finished
    run of any outcome, or its start): the first fire due after it, plus the jitter, the
    timeout and the overdue grace. The absence alarm's one judge: ``health()`` compares it
    with now, and PostgreSQL stores it with every finished run for ``ticklock status``."""
    due = windowed(job, after(job.trigger, base))
    if due is None:  # the schedule is over (an end passed): never overdue
        return None
    if job.start is not None and base < job.start:  # nothing is owed before its first slot
        opening = windowed(job, job.start - timedelta(microseconds=1))
        if opening is None:
            return None
        due = max(due, opening)
    slack = job.trigger.jitter + job.timeout + job.overdue_grace
    return due + timedelta(seconds=slack)


def previous(trigger: Trigger, slot: datetime) -> datetime | None:
    """The schedule's slot before ``slot``: an interval before it (``every``), or the last
    fire before it (``cron``; ``None`` if none within about a century)."""
    if isinstance(trigger, Every):
        return slot - trigger.delta
    window = timedelta(seconds=trigger.period)
    while window < timedelta(days=40_000):
        fire = trigger.next_fire(slot - window - timedelta(microseconds=1))
        if fire is not None and fire < slot:
            return latest(trigger, fire, slot - timedelta(microseconds=1))
        window *= 2
    return None
