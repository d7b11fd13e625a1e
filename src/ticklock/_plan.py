"""Which slot a job runs next, from the fleet's state: pure functions, same on every replica."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from ._coordination import FleetState
from ._job import Job
from ._triggers import Cron, Every, Trigger


def after(trigger: Trigger, end: datetime) -> datetime | None:
    """The next slot by fixed delay after a run that ended at ``end``."""
    if isinstance(trigger, Every):
        return end + trigger.delta
    return trigger.next_fire(end)


def first(job: Job, state: FleetState, now: datetime) -> datetime | None:
    """The slot to wait for at start or when re-aligning to the fleet's state.

    A job that never ran starts at ``now + initial_delay`` (``every``) or its next fire
    (``cron``). A job whose next slot passed while no replica ran it is due at once with
    ``catch_up`` (one run covers the whole window), else it waits for the next slot after now.
    """
    trigger = job.trigger
    if state.last_end is None:
        if isinstance(trigger, Every):
            return now + timedelta(seconds=trigger.initial_delay)
        return trigger.next_fire(now)
    due = after(trigger, state.last_end)
    if due is None or due > now:
        return due
    if isinstance(trigger, Every):
        if job.catch_up:
            return due
        steps = math.ceil((now - due).total_seconds() / trigger.interval)
        return due + timedelta(seconds=steps * trigger.interval)
    if job.catch_up:
        return latest(trigger, due, now)
    return trigger.next_fire(now)


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


def stale(job: Job, state: FleetState, slot: datetime) -> bool:
    """Whether the fleet has moved past ``slot``: committed it, or ran since it was planned."""
    if state.last_end is None:
        return False
    due = after(job.trigger, state.last_end)
    return due is None or due > slot


def overdue_at(job: Job, base: datetime) -> datetime | None:
    """When ``job`` is overdue if no success comes after ``base`` (its last success or start).

    The first fire due after ``base``, plus the jitter, the timeout and the overdue grace.
    """
    due = after(job.trigger, base)
    if due is None:
        return None
    slack = job.trigger.jitter + job.timeout + job.overdue_grace
    return due + timedelta(seconds=slack)
