"""What ``ticklock jobs`` and ``ticklock demo`` say of a job's next fires, true for fixed delay
and jitter: a cron job's fires, each plus up to its jitter; an ``every`` job's first fire (plus
up to its jitter), then one interval after each run ends, which no listing can know."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from itertools import islice

from ..._runtime.slots import first_fires
from ..._schedule.job import Job
from ..._schedule.triggers import Cron, Every, _human


def jitter(job: Job) -> str:
    """``+ up to 30s jitter``, or ``""`` for a job without jitter."""
    spread = job.trigger.jitter
    return f"+ up to {_human(spread)} jitter" if spread else ""


def then(trigger: Every) -> str:
    """What follows an ``every`` job's first fire."""
    spread = f" (+ up to {_human(trigger.jitter)} jitter)" if trigger.jitter else ""
    return f"then one interval ({_human(trigger.interval)}) after each run ends{spread}"


def fires(job: Job, now: datetime, count: int) -> Iterator[datetime]:
    """The fires a listing shows, as a scheduler started at ``now`` plans them (without
    jitter): ``count`` of a cron job's, the first of an ``every`` job's."""
    shown = 1 if isinstance(job.trigger, Every) else count
    return islice(first_fires(job, now), shown)


def lines(job: Job, now: datetime, count: int) -> list[str]:
    """``ticklock jobs``'s lines under a job: its next fires, in UTC and in a cron job's zone."""
    shown = []
    for fire in fires(job, now, count):
        notes = [jitter(job)] if job.trigger.jitter else []
        if isinstance(job.trigger, Cron):
            zone = job.trigger.zone
            notes.insert(0, f"{fire.astimezone(zone).isoformat(timespec='seconds')} {zone.key}")
        else:
            notes.insert(0, "if started now")
        shown.append(f"    {fire.isoformat(timespec='seconds')}  ({', '.join(notes)})")
    if isinstance(job.trigger, Every) and shown:
        shown.append(f"    {then(job.trigger)}")
    return shown


def summary(job: Job, now: datetime, count: int) -> str:
    """The demo's words for a job's next fires (UTC, to the second)."""
    times = ", ".join(f"{fire:%H:%M:%S}" for fire in fires(job, now, count))
    spread = f" ({jitter(job)})" if job.trigger.jitter else ""
    if isinstance(job.trigger, Every):
        return f"next: {times}{spread}, {then(job.trigger)}"
    return f"next: {times}{f' (each {jitter(job)})' if job.trigger.jitter else ''}"
