"""The deadline heap that drives every job of a scheduler from one task.

One sleeping task for all jobs: the loop sleeps until the earliest deadline (on the clock's
monotonic time) and wakes early when a job is added, removed or rescheduled. A task exists
only for a run in flight. Cron deadlines are wall-clock instants: the loop re-reads the wall
clock at least every :data:`WALL_WATCH` seconds while a cron job is scheduled, so that a
wall-clock step is noticed within that bound, and it never starts a cron run before its
instant.

A handler that blocks the event loop (synchronous work in an ``async def``) stops every job
and the app with it. :func:`watch` times each step of a handler and names the job whose step
held the loop for more than :data:`BLOCKED_WARNING` seconds; the dispatcher warns, without a
name, when it wakes that late for any other reason (code outside the handlers).
"""

from __future__ import annotations

import heapq
import logging
import math
import random as _random
import threading
import types
from collections.abc import Awaitable, Callable, Generator
from datetime import datetime, timedelta
from time import monotonic
from typing import Any, NoReturn, TypeVar

import anyio

from ._clock import Clock, SystemClock
from ._coordination import FleetState
from ._job import Job
from ._timerfd import open_timer
from ._triggers import Cron

WALL_WATCH = 5.0
"""Seconds between wall-clock checks while any cron job is scheduled (the G8 bound)."""
STEP_TOLERANCE = 0.1
"""A change of the wall-minus-monotonic offset larger than this re-plans cron deadlines."""
BLOCKED_WARNING = 1.0
"""A handler step, or a wake-up past a deadline, this many seconds long means the event loop
was blocked: warn."""
MIN_COMPACT = 64
"""Superseded heap items are dropped once there are more than this and than live ones."""

logger = logging.getLogger("ticklock")
T = TypeVar("T")
_THREADING_ADVICE = "run it in a worker thread with 'await anyio.to_thread.run_sync(...)'"


class _Blocks(threading.local):
    """How many handler steps were reported as blocking this thread's event loop."""

    reported = 0


_blocks = _Blocks()


@types.coroutine
def watch(awaitable: Awaitable[T], job_id: str) -> Generator[Any, Any, T]:
    """Await ``awaitable`` (a run of job ``job_id``), warning when one of its steps holds the
    event loop for more than :data:`BLOCKED_WARNING` seconds.

    A step is the code between two suspensions, so a step that long is synchronous work on
    the loop. Two clock reads per step, no thread, no timer: a handler that returns without
    suspending pays about 0.6 µs. The awaitable is driven step by step (send, throw, close
    are passed through), so results, exceptions and cancellation are those of the handler.
    """
    steps: Any = awaitable if type(awaitable) is types.CoroutineType else awaitable.__await__()
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        start = monotonic()
        try:
            signal = steps.send(sent) if thrown is None else steps.throw(thrown)
        except StopIteration as stop:
            if (held := monotonic() - start) > BLOCKED_WARNING:
                _blocked_by(job_id, held)
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            thrown = None  # not kept: the traceback holds this frame
            if (held := monotonic() - start) > BLOCKED_WARNING:
                _blocked_by(job_id, held)
            raise
        thrown = None
        if (held := monotonic() - start) > BLOCKED_WARNING:
            _blocked_by(job_id, held)
        try:
            sent = yield signal
        except GeneratorExit:  # closed without finishing: close the handler too
            steps.close()
            raise
        except BaseException as exc:  # cancellation, or anything else thrown in
            sent, thrown = None, exc


def _blocked_by(job_id: str, seconds: float) -> None:
    _blocks.reported += 1
    logger.warning(
        "the event loop was blocked for %.1f s by job %r: its handler runs synchronous work "
        "on the event loop, which holds up every job and the application; %s",
        seconds,
        job_id,
        _THREADING_ADVICE,
        extra={"job_id": job_id, "blocked": seconds},
    )


class Entry:
    """The runtime state of one scheduled job."""

    __slots__ = (
        "deadline",
        "fire_at",
        "generation",
        "held_at",
        "is_cron",
        "jitter",
        "job",
        "queued",
        "removed",
        "running",
        "since",
        "slot",
        "state",
    )

    def __init__(self, job: Job) -> None:
        self.job = job
        self.is_cron = isinstance(job.trigger, Cron)
        self.slot: datetime | None = None
        self.fire_at: datetime | None = None
        self.jitter = 0.0
        self.deadline = math.inf
        self.generation = 0
        self.queued = False  # its current deadline is in the heap
        self.running = False
        self.removed = False
        self.since: datetime | None = None  # when it was scheduled: the overdue base
        self.state: FleetState | None = None  # the fleet's state as this replica last saw it
        # when this replica last found the job's lock held by a run elsewhere, since it last
        # read the fleet's state: that run's outcome is learnt at the next attempt
        self.held_at: datetime | None = None

    def __lt__(self, other: Entry) -> bool:  # heap ties on (deadline, generation)
        return id(self) < id(other)


class Dispatcher:
    """Holds the deadlines of all entries and starts a run for each one that comes due."""

    def __init__(self, clock: Clock, rng: _random.Random, spawn: Callable[[Entry], None]) -> None:
        self._clock = clock
        self._random = rng
        self._spawn = spawn
        self._heap: list[tuple[float, int, Entry]] = []
        self._wake: anyio.CancelScope | None = None
        self._sleeping_until = math.inf
        self._offset: float | None = None
        self._stale = 0  # heap items superseded before they came due
        self.cron_jobs = 0

    def schedule(
        self, entry: Entry, slot: datetime | None, *, retry_after: float | None = None
    ) -> None:
        """Plan ``entry`` for ``slot`` (plus fresh jitter), or re-align after ``retry_after`` s."""
        self.forget(entry)
        clock = self._clock
        # The wall clock first: the time between the two reads then makes the deadline late,
        # never early (a fixed delay must be at least the interval).
        now = clock.now() if slot is not None else None
        now_m = clock.monotonic()
        if retry_after is not None:
            entry.slot = entry.fire_at = None
            entry.jitter = 0.0
            entry.deadline = now_m + retry_after
        elif slot is None:  # the schedule is over
            entry.slot = entry.fire_at = None
            return
        else:
            jitter_max = entry.job.trigger.jitter
            entry.jitter = self._random.uniform(0.0, jitter_max) if jitter_max else 0.0
            entry.slot = slot
            entry.fire_at = slot + timedelta(seconds=entry.jitter) if entry.jitter else slot
            assert now is not None
            wait = (entry.fire_at - now).total_seconds()
            entry.deadline = now_m + wait if wait > 0 else now_m
        heapq.heappush(self._heap, (entry.deadline, entry.generation, entry))
        entry.queued = True
        if entry.deadline < self._sleeping_until and self._wake is not None:
            self._wake.cancel()

    def forget(self, entry: Entry) -> None:
        """Forget ``entry``'s deadline (its heap item goes stale)."""
        entry.generation += 1
        entry.deadline = math.inf
        if entry.queued:
            entry.queued = False
            self._stale += 1
            # A removed job, or one re-planned early (run_now), leaves its old item until it
            # would have come due: a day later for a daily job. Past half the heap, drop them
            # all (amortised O(1) per item), so that neither memory nor the removed handlers
            # the items hold pile up.
            if self._stale > MIN_COMPACT and 2 * self._stale > len(self._heap):
                self._heap[:] = [item for item in self._heap if item[1] == item[2].generation]
                heapq.heapify(self._heap)
                self._stale = 0

    def wake(self) -> None:
        """Make the loop re-read its deadlines now."""
        if self._wake is not None:
            self._wake.cancel()

    async def run(self) -> NoReturn:
        """Start every run that comes due, forever (until cancelled)."""
        clock = self._clock
        # On the system clock, a timerfd wakes the loop to the microsecond (asyncio's own
        # timers wake up to 1 ms late); see _timerfd.
        timer = open_timer() if type(clock) is SystemClock else None
        try:
            await self._serve(clock.sleep_until if timer is None else timer.sleep_until)
        finally:
            if timer is not None:
                timer.close()

    async def _serve(self, sleep_until: Callable[[float], Awaitable[None]]) -> NoReturn:
        clock = self._clock
        heap = self._heap
        due: list[Entry] = []
        while True:
            # read before spawning: a run that starts eagerly (3.12+) may block right here
            reported = _blocks.reported
            now_m = clock.monotonic()
            now = clock.now() if self.cron_jobs else None
            if now is not None:
                self._watch_wall(now, now_m)
            while heap and heap[0][0] <= now_m:
                _, generation, entry = heapq.heappop(heap)
                if generation != entry.generation:
                    self._stale -= 1
                    continue
                entry.queued = False
                if entry.running:
                    continue
                fire_at = entry.fire_at
                if now is not None and fire_at is not None and fire_at > now and entry.is_cron:
                    # never fire a cron job early (the wall clock stepped back)
                    entry.deadline = now_m + (fire_at - now).total_seconds()
                    heapq.heappush(heap, (entry.deadline, generation, entry))
                    entry.queued = True
                    continue
                entry.running = True
                due.append(entry)
            # Spawned after the pass: a run that starts eagerly may finish and reschedule its
            # job at once, and a deadline it sets is served by the next pass, not this one.
            for entry in due:
                self._spawn(entry)
            due.clear()
            until = heap[0][0] if heap else math.inf
            if self.cron_jobs:
                until = min(until, now_m + WALL_WATCH)
            self._sleeping_until = until
            with anyio.CancelScope() as scope:
                self._wake = scope
                await sleep_until(until)
            self._wake = None
            self._sleeping_until = math.inf
            if (
                not scope.cancel_called
                and (late := clock.monotonic() - until) > BLOCKED_WARNING
                and _blocks.reported == reported  # else a handler's block, named already
            ):
                logger.warning(
                    "the event loop was blocked for %.1f s, so jobs start late: some code "
                    "runs synchronous work on the event loop; %s",
                    late,
                    _THREADING_ADVICE,
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
                deadline = entry.deadline = now_m + max(wait, 0.0)
            rebuilt.append((deadline, generation, entry))
        heapq.heapify(rebuilt)
        self._heap[:] = rebuilt
        self._stale = 0
