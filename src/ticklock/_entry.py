"""A job's runtime record on this replica: what it waits for, and what it last saw."""

from __future__ import annotations

import math
from datetime import datetime

from ._coordination import FleetState
from ._job import Job, fingerprint
from ._triggers import Cron


class Entry:
    """The runtime state of one scheduled job."""

    __slots__ = (
        "ahead",
        "attempt",
        "base",
        "credit",
        "deadline",
        "failing_since",
        "fingerprint",
        "fire_at",
        "generation",
        "held_at",
        "is_cron",
        "jitter",
        "job",
        "lag",
        "manual",
        "observer",
        "own_failures",
        "queued",
        "removed",
        "running",
        "since",
        "slot",
        "stage",
        "steered",
        "state",
    )

    def __init__(self, job: Job) -> None:
        self.job = job
        self.is_cron = isinstance(job.trigger, Cron)
        self.slot: datetime | None = None
        self.attempt = 1  # of the slot: 2 and more for a retry
        self.fire_at: datetime | None = None
        self.jitter = 0.0
        self.deadline = math.inf
        self.base = math.inf  # the slot's latest fire, or the delay's end (may be past)
        self.lag = 0.0  # > 0: the deadline is a backup's look at the slot, not an attempt
        self.generation = 0
        self.queued = False  # its current deadline is in the heap
        self.running = False
        self.removed = False
        self.since: datetime | None = None  # when it was scheduled: the overdue base
        self.state: FleetState | None = None  # the fleet's state as this replica last saw it
        # when this replica last found the job's lock held by a run elsewhere, since it last
        # read the fleet's state: that run's outcome is learnt at the next attempt
        self.held_at: datetime | None = None
        self.manual = False  # the next run serves a trigger request (its slot)
        self.steered = False  # operators changed its pause or trigger while it ran
        # (last success, seconds paused since): the time a job was paused is not overdue
        self.credit: tuple[datetime | None, float] = (None, 0.0)
        self.ahead: tuple[str, ...] = ()  # the replicas ranked before this one (see _sharing)
        self.observer = False  # declared otherwise than the ruling declaration: never attempts
        self.stage = 0  # 1: a backup's second look at an open slot (see _sharing)
        self.own_failures = 0  # this replica's consecutive failed runs of the job
        self.failing_since: datetime | None = None  # the start of the first of them
        self.fingerprint = fingerprint(job)  # of its declaration, which this replica publishes

    def __lt__(self, other: Entry) -> bool:  # heap ties on (deadline, generation)
        return id(self) < id(other)
