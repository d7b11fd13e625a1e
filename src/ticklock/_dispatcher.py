"""The deadline heap that drives every job of a scheduler from one task.

One sleeping task for all jobs: the loop sleeps on the scheduler's clock until the earliest
deadline and wakes early when a job is added, removed or rescheduled. Two kinds of deadline
share it: a job's next start, and a run's timeout (:meth:`Dispatcher.bound`), so that the
system clock and a test's :class:`~ticklock.testing.ManualClock` drive the same code. A task
exists only for a run in flight.

Cron deadlines are wall-clock instants: while a cron job is scheduled the loop re-reads the
wall clock at least every :data:`WALL_WATCH` seconds, so that a wall-clock step is noticed
within that bound, and it never starts a cron run before its instant.

A handler that blocks the event loop stops every job and the app with it: :mod:`._blocked`
names the job whose step held the loop; the loop warns, without a name, when it wakes late by
as much for any other reason (code outside the handlers).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random as _random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import NoReturn

import anyio

from ._blocked import BLOCKED_WARNING, THREADING_ADVICE
from ._clock import Clock
from ._entry import Entry
from ._plan import Delayed, Idle, OnTime, Plan, Recheck, Serve
from ._sharing import LOOK_GRID

WALL_WATCH = 5.0
"""Seconds between wall-clock checks while any cron job is scheduled (the G8 bound)."""
STEP_TOLERANCE = 0.1
"""A change of the wall-minus-monotonic offset larger than this re-plans cron deadlines."""
MIN_COMPACT = 64
"""Superseded heap items are dropped once there are more than this and than live ones."""

logger = logging.getLogger("ticklock")


class _Timeout:
    """A run's timeout in the heap: ``scope`` is ``None`` once the run has left it."""

    __slots__ = ("scope",)

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope: anyio.CancelScope | None = scope


class Dispatcher:
    """Holds the deadlines of all entries and of the runs in flight: starts a run for each
    entry that comes due, and cancels each run whose timeout passes."""

    def __init__(self, clock: Clock, rng: _random.Random, spawn: Callable[[Entry], None]) -> None:
        self._clock = clock
        self._random = rng
        self._spawn = spawn
        self._heap: list[tuple[float, int, Entry]] = []
        self._timeouts: list[tuple[float, int, _Timeout]] = []
        self._sequence = itertools.count().__next__
        self._wake: anyio.CancelScope | None = None
        self._sleeping_until = math.inf
        self._offset: float | None = None
        self._stale = 0  # heap items superseded before they came due
        self._cron = 0  # cron entries in the heap: the wall clock is watched while any is
        self._blocks = 0  # handler steps reported by blocked()

    def schedule(self, entry: Entry, plan: Plan, lag: float = 0.0) -> None:
        """Wait for what ``plan`` says: its slot (plus fresh jitter), or its delay; with a
        ``lag``, ``lag`` seconds after the slot's latest fire (its jitter's maximum) or after
        the delay, rounded up to :data:`LOOK_GRID` (a backup's look)."""
        self.forget(entry)
        clock = self._clock
        entry.attempt = 1
        # The wall clock first: the time between the two reads then makes the deadline late,
        # never early (a fixed delay must be at least the interval).
        now = clock.now() if isinstance(plan, OnTime) else None
        now_m = clock.monotonic()
        match plan:
            case Idle():  # paused, or the schedule is over
                entry.slot = entry.fire_at = None
                return
            case Recheck(delay):  # read the fleet's state again (no slot)
                entry.slot = entry.fire_at = None
                entry.jitter = 0.0
                entry.base = now_m + delay
            case Delayed(slot, delay, attempt):  # a retry
                entry.slot = entry.fire_at = slot
                entry.attempt = attempt
                entry.jitter = 0.0
                entry.base = now_m + delay
            case Serve(slot):  # a trigger request, at once
                entry.slot = entry.fire_at = slot
                entry.jitter = 0.0
                entry.base = now_m
            case OnTime(slot):
                jitter_max = entry.job.trigger.jitter
                if lag:  # the owner's jitter is its own: the slot's latest fire
                    entry.jitter = jitter_max
                else:
                    entry.jitter = self._random.uniform(0.0, jitter_max) if jitter_max else 0.0
                entry.slot = slot
                entry.fire_at = slot + timedelta(seconds=entry.jitter) if entry.jitter else slot
                assert now is not None
                entry.base = now_m + (entry.fire_at - now).total_seconds()  # past: due now
        entry.lag = lag
        entry.deadline = _lagged(entry.base, lag, now_m)
        self._push(entry)
        if entry.deadline < self._sleeping_until:
            self.wake()

    def requeue(self, entry: Entry, lag: float) -> None:
        """Wait for the same slot or delay again, until ``lag`` seconds after its base (its
        latest fire, or the delay's end)."""
        self.forget(entry)
        entry.lag = lag
        entry.deadline = _lagged(entry.base, lag, self._clock.monotonic())
        self._push(entry)
        if entry.deadline < self._sleeping_until:
            self.wake()

    def _push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, (entry.deadline, entry.generation, entry))
        entry.queued = True
        self._cron += entry.is_cron

    def _unqueue(self, entry: Entry) -> None:
        entry.queued = False
        self._cron -= entry.is_cron

    def forget(self, entry: Entry) -> None:
        """Forget ``entry``'s deadline (its heap item goes stale)."""
        entry.generation += 1
        entry.deadline = math.inf
        if entry.queued:
            self._unqueue(entry)
            self._stale += 1
            # A removed job, or one re-planned early (run_now), leaves its old item until it
            # would have come due: a day later for a daily job. Past half the heap, drop them
            # all (amortised O(1) per item), so that neither memory nor the removed handlers
            # the items hold pile up.
            if self._stale > MIN_COMPACT and 2 * self._stale > len(self._heap):
                self._heap[:] = [item for item in self._heap if item[1] == item[2].generation]
                heapq.heapify(self._heap)
                self._stale = 0

    @contextmanager
    def bound(self, deadline: float) -> Iterator[anyio.CancelScope]:
        """A cancel scope that this loop cancels when its clock reaches ``deadline`` (the
        timeout of a run; the scope has no deadline of its own, so shields inside hold)."""
        with anyio.CancelScope() as scope:
            timeout = _Timeout(scope)
            heapq.heappush(self._timeouts, (deadline, self._sequence(), timeout))
            if deadline < self._sleeping_until:
                self.wake()
            try:
                yield scope
            finally:
                timeout.scope = None
                timeouts = self._timeouts
                while timeouts and timeouts[0][2].scope is None:  # finished runs on top
                    heapq.heappop(timeouts)

    def blocked(self, job_id: str, seconds: float) -> None:
        """Warn that a step of ``job_id``'s handler held the event loop for ``seconds``."""
        self._blocks += 1
        logger.warning(
            "the event loop was blocked for %.1f s by job %r: its handler runs synchronous "
            "work on the event loop, which holds up every job and the application; %s",
            seconds,
            job_id,
            THREADING_ADVICE,
            extra={"job_id": job_id, "blocked": seconds},
        )

    def wake(self) -> None:
        """Make the loop re-read its deadlines now."""
        if self._wake is not None:
            self._wake.cancel()

    async def run(self) -> NoReturn:
        """Start every run that comes due and end every run that times out, forever."""
        clock = self._clock
        heap, timeouts = self._heap, self._timeouts
        due: list[Entry] = []
        while True:
            blocks = self._blocks
            now_m = clock.monotonic()
            now = clock.now() if self._cron else None
            if now is not None:
                self._watch_wall(now, now_m)
            while timeouts and (timeouts[0][2].scope is None or timeouts[0][0] <= now_m):
                scope = heapq.heappop(timeouts)[2].scope
                if scope is not None:
                    scope.cancel()
            while heap and heap[0][0] <= now_m:
                _, generation, entry = heapq.heappop(heap)
                if generation != entry.generation:
                    self._stale -= 1
                    continue
                self._unqueue(entry)
                if entry.running:
                    continue
                fire_at = entry.fire_at
                if now is not None and fire_at is not None and fire_at > now and entry.is_cron:
                    # never fire a cron job early (the wall clock stepped back)
                    entry.base = now_m + (fire_at - now).total_seconds()
                    entry.deadline = _lagged(entry.base, entry.lag, now_m)
                    self._push(entry)
                    continue
                entry.running = True
                due.append(entry)
            # Spawned after the pass, so that a deadline a run sets is served by the next one.
            for entry in due:
                self._spawn(entry)
            due.clear()
            until = min(heap[0][0] if heap else math.inf, timeouts[0][0] if timeouts else math.inf)
            if self._cron:
                until = min(until, now_m + WALL_WATCH)
            self._sleeping_until = until
            with anyio.CancelScope() as scope:
                self._wake = scope
                await clock.sleep_until(until)
            self._wake = None
            self._sleeping_until = math.inf
            if (
                not scope.cancel_called
                and (late := clock.monotonic() - until) > BLOCKED_WARNING
                and self._blocks == blocks  # else a handler's block, named already
            ):
                logger.warning(
                    "the event loop was blocked for %.1f s, so jobs start late: some code "
                    "runs synchronous work on the event loop; %s",
                    late,
                    THREADING_ADVICE,
                )

    def _watch_wall(self, now: datetime, now_m: float) -> None:
        offset = now.timestamp() - now_m
        if self._offset is None:
            self._offset = offset
            return
        if abs(offset - self._offset) <= STEP_TOLERANCE:
            return
        # The wall clock stepped (NTP, VM suspend): re-plan every cron deadline from its instant.
        self._offset = offset
        rebuilt = []
        for deadline, generation, entry in self._heap:
            if generation != entry.generation:
                continue  # superseded: dropped while rebuilding anyway
            if entry.fire_at is not None and entry.is_cron:
                wait = (entry.fire_at - now).total_seconds()
                entry.base = now_m + wait
                deadline = entry.deadline = _lagged(entry.base, entry.lag, now_m)
            rebuilt.append((deadline, generation, entry))
        heapq.heapify(rebuilt)
        self._heap[:] = rebuilt
        self._stale = 0


def _lagged(base: float, lag: float, now: float) -> float:
    """The deadline ``lag`` seconds after ``base`` (now at the earliest), rounded up to
    :data:`LOOK_GRID` when there is a lag."""
    deadline = max(base + lag, now)
    return math.ceil(deadline / LOOK_GRID) * LOOK_GRID if lag else deadline
