"""What a job does next, from the fleet's state: pure functions, the same on every replica."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

from ._coordination import FleetState
from ._job import Job, Outcome, RunResult
from ._triggers import Cron, Every, Trigger


@dataclass(frozen=True, slots=True)
class Plan:
    """What a job waits for next: ``slot`` alone, run it at its instant (plus jitter); ``slot``
    and ``delay``, run it again after ``delay`` seconds as attempt ``attempt`` (a retry);
    ``delay`` alone, read the fleet's state again then (the lock was held elsewhere); neither,
    the schedule is over."""

    slot: datetime | None
    delay: float | None = None
    attempt: int = 1


def plan(job: Job, state: FleetState, now: datetime, result: RunResult | None = None) -> Plan:
    """What ``job`` does next, given the fleet's ``state`` (with ``result`` folded in) and the
    ``result`` of the attempt that just ended (``None``: at start, or when re-aligning).
    A paused job waits for nothing."""
    if state.paused_at is not None:
        return Plan(None)
    if result is not None and result.outcome is Outcome.LOCKED:
        return Plan(None, job.trigger.period)  # running elsewhere: look again a period later
    retry = _retry(job, state, now)
    if retry is not None:
        return retry
    if result is None or result.outcome is Outcome.SKIPPED:
        return Plan(first(job, state, now))
    return Plan(after(job.trigger, result.finished_at))


def _retry(job: Job, state: FleetState, now: datetime) -> Plan | None:
    """The retry of the fleet's last failed slot, if it has attempts left and fits before the
    next slot (which then covers it, through ``previous_success``)."""
    failed, done = state.failed_slot, state.failed_attempts
    if failed is None or done > job.retries or state.last_end is None:
        return None
    if state.last_slot is not None and state.last_slot >= failed:
        return None
    at = state.last_end + timedelta(seconds=job.retry_backoff * 2 ** (done - 1))
    following = after(job.trigger, state.last_end)
    if following is not None and max(at, now) >= following:
        return None
    return Plan(failed, max(0.0, (at - now).total_seconds()), done + 1)


def after(trigger: Trigger, end: datetime) -> datetime | None:
    """The next slot by fixed delay after a run that ended at ``end``."""
    if isinstance(trigger, Every):
        return end + trigger.delta
    return trigger.next_fire(end)


def next_due(job: Job, result: RunResult) -> datetime | None:
    """When the run after ``result`` is due, as operators see it (retries aside)."""
    return after(job.trigger, result.finished_at)


def first(job: Job, state: FleetState, now: datetime) -> datetime | None:
    """The slot to wait for at start or when re-aligning: a job that never ran starts at
    ``now + initial_delay`` (``every``) or its next fire (``cron``); a job whose next slot passed
    unrun is due at once with ``catch_up`` (one run covers the window), else at the next one
    after now."""
    trigger = job.trigger
    if state.last_end is None:
        if isinstance(trigger, Every):
            return now + timedelta(seconds=trigger.initial_delay)
        return trigger.next_fire(now)
    due = after(trigger, state.last_end)
    if due is None or due > now or (job.catch_up and isinstance(trigger, Every)):
        return due
    if isinstance(trigger, Every):
        steps = math.ceil((now - due).total_seconds() / trigger.interval)
        return due + timedelta(seconds=steps * trigger.interval)
    return latest(trigger, due, now) if job.catch_up else trigger.next_fire(now)


def first_fires(job: Job, now: datetime) -> Iterator[datetime]:
    """The slots of a job that never ran, as a scheduler started at ``now`` plans them
    (:func:`first`, then fixed delay with runs that take no time), without jitter."""
    fire = first(job, FleetState(), now)
    while fire is not None:
        yield fire
        fire = after(job.trigger, fire)


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
    due = after(job.trigger, state.last_end)
    return due is None or due > slot


def overdue_at(job: Job, base: datetime) -> datetime | None:
    """When ``job`` is overdue if no success comes after ``base`` (its last success or start):
    the first fire due after it, plus the jitter, the timeout and the overdue grace."""
    due = after(job.trigger, base)
    if due is None:
        return None
    slack = job.trigger.jitter + job.timeout + job.overdue_grace
    return due + timedelta(seconds=slack)
