"""A job's runtime record on this replica: what it waits for, and what it last saw.

An entry is its job's :class:`~ticklock._runtime.loop.Timer` too. Its cycle
(:class:`~ticklock._runtime.cycle.Cycle`, a subclass) is its only writer; health reads it.
"""

from __future__ import annotations

from datetime import datetime

from .._backends.seam import FleetState
from .._schedule.job import Job
from .loop import Timer

NO_CREDIT: tuple[datetime | None, float, datetime | None] = (None, 0.0, None)


class Entry(Timer):
    """The runtime state of one declared job, and its deadline."""

    __slots__ = (
        "ahead",
        "attempt",
        "by_hand",
        "credit",
        "fire_at",
        "given_up_at",
        "held_at",
        "job",
        "manual",
        "observer",
        "own_failures",
        "removed",
        "role_version",
        "running",
        "since",
        "slot",
        "stage",
        "state",
        "steered",
    )

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.slot: datetime | None = None  # the slot it waits for (None: a recheck, or idle)
        self.attempt = 1  # of the slot: 2 and more for a retry
        self.fire_at: datetime | None = None  # the slot plus this replica's jitter
        self.running = False  # a run or a look of it is in flight
        self.by_hand = 0  # run_now() calls in flight
        self.removed = False
        self.since: datetime | None = None  # when it was scheduled: the overdue base
        self.state: FleetState | None = None  # the fleet's state as this replica last saw it
        # when this replica last found the job's lock held by a run elsewhere, since it last
        # read the fleet's state: that run's outcome is learnt at the next attempt
        self.held_at: datetime | None = None
        self.manual = False  # the next run serves a trigger request (its slot)
        self.steered = False  # operators changed its pause or trigger while it ran
        # (the last finished run's end, seconds paused since, when last resumed): the time a
        # job was paused is not overdue, and its slots are not missed
        self.credit: tuple[datetime | None, float, datetime | None] = NO_CREDIT
        self.ahead: tuple[str, ...] = ()  # the replicas ranked before this one (see _sharing)
        self.observer = False  # declared otherwise than the ruling declaration: never attempts
        self.role_version = -1  # the share's version ahead and observer were taken at
        self.stage = 0  # 1: a backup's second look at an open slot (see _sharing)
        self.own_failures = 0  # this replica's consecutive failed runs of the job
        self.given_up_at: datetime | None = None  # this replica gave the job up (see _plan)
