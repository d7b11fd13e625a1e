"""The runtime's loop: the deadline heap that wakes every job of a scheduler from one task,
and the task group of the runs in flight.

One sleeping task for all jobs: :meth:`Dispatcher.due` sleeps on the scheduler's clock until
the earliest deadline and returns the timers that came due; it wakes early when a deadline is
set or forgotten. Two kinds of deadline share it: a :class:`Timer` (a job's next start or look,
set by its cycle), and a run's timeout (:meth:`Dispatcher.bound`), so that the system clock and
a test's :class:`~ticklock.testing.ManualClock` drive the same code. It knows deadlines, not
jobs: what a timer does when it comes due is its cycle's (:mod:`.cycle` drives the loop).

A timer may carry a wall-clock instant (a cron slot): while one is queued the loop re-reads the
wall clock at least every :data:`WALL_WATCH` seconds, so that a wall-clock step is noticed
within that bound, and it never returns such a timer before its instant.

A handler that blocks the event loop stops every job and the app with it: the runner names
the job whose step held the loop; the loop warns, without a name, when it wakes late by as much
for any other reason (code outside the handlers).

:class:`Runs` holds the runs in flight: their task group must not be cancelled when the
scheduler is (that is what the shutdown grace is for), so it lives in a shielded task; the
loop runs there too, so that run timeouts still fire while the runs drain.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Callable, Coroutine
from datetime import datetime
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .clock import Clock
from .sharing import LOOK_GRID

BLOCKED_WARNING = 1.0
"""A handler step, or a wake-up past a deadline, this many seconds long means the event loop
was blocked: warn."""
THREADING_ADVICE = "run it in a worker thread with 'await anyio.to_thread.run_sync(...)'"
"""What to do about synchronous work in a handler."""
WALL_WATCH = 5.0
"""Seconds between wall-clock checks while any cron job is scheduled (the G8 bound)."""
STEP_TOLERANCE = 0.1
"""A change of the wall-minus-monotonic offset larger than this re-derives the wall deadlines."""
MIN_COMPACT = 64
"""Superseded heap items are dropped once there are more than this and than live ones."""

logger = logging.getLogger("ticklock")


class Timeout:
    """A run's timeout: a cancel scope, entered as a context manager, that the dispatcher
    cancels when its clock reaches ``deadline`` (``scope`` is ``None`` once the run left it)."""

    __slots__ = ("_dispatcher", "deadline", "scope")

    def __init__(self, dispatcher: Dispatcher, deadline: float) -> None:
        self._dispatcher = dispatcher
        self.deadline = deadline
        self.scope: anyio.CancelScope | None = None

    def __enter__(self) -> anyio.CancelScope:
        scope = self.scope = anyio.CancelScope()
        scope.__enter__()
        self._dispatcher._add(self)
        return scope

    def shorten(self, deadline: float) -> None:
        """End the run at ``deadline`` instead, if that is sooner (a newer slot replaces it)."""
        if deadline < self.deadline and self.scope is not None:
            self.deadline = deadline
            self._dispatcher._add(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        scope, self.scope = self.scope, None
        self._dispatcher._drop_finished()
        assert scope is not None
        return scope.__exit__(exc_type, exc, traceback)


class Timer:
    """One deadline in the heap, returned by :meth:`Dispatcher.due` when the clock reaches it.

    ``base`` is the monotonic instant the deadline counts from, ``lag`` the seconds after it
    (rounded up to :data:`LOOK_GRID`), and ``wall`` a wall-clock instant it never fires before
    (a cron slot's fire): the dispatcher re-derives ``base`` from it when the wall clock steps.
    """

    __slots__ = ("base", "deadline", "generation", "lag", "queued", "wall")

    def __init__(self) -> None:
        self.base = math.inf
        self.lag = 0.0
        self.wall: datetime | None = None
        self.deadline = math.inf
        self.generation = 0
        self.queued = False  # its current deadline is in the heap

    def __lt__(self, other: Timer) -> bool:  # heap ties on (deadline, generation)
        return id(self) < id(other)


class Dispatcher:
    """Holds the deadlines of every timer and of the runs in flight: returns each timer that
    comes due, and cancels each run whose timeout passes."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Timer]] = []
        self._timeouts: list[tuple[float, int, Timeout]] = []
        self._sequence = itertools.count().__next__
        self._wake: anyio.CancelScope | None = None
        self._sleeping_until = math.inf
        self._offset: float | None = None
        self._stale = 0  # heap items superseded before they came due
        self._walls = 0  # timers with a wall instant in the heap: the wall clock is watched
        self._blocks = 0  # handler steps reported by blocked()
        self.stalled: Callable[[str | None, float], None] = _unnoted
        """Told of each stall of the loop: the job whose handler blocked it (``None``: other
        code) and for how many seconds (the coordinator keeps it for the ledger)."""

    def set(
        self, timer: Timer, base: float, *, lag: float = 0.0, wall: datetime | None = None
    ) -> None:
        """Fire ``timer`` ``lag`` seconds after the monotonic instant ``base`` (at once if that
        is past), never before the wall-clock instant ``wall``."""
        self.forget(timer)
        timer.base, timer.wall = base, wall
        self._queue(timer, lag)

    def again(self, timer: Timer, lag: float) -> None:
        """Fire ``timer`` ``lag`` seconds after its base again."""
        self.forget(timer)
        self._queue(timer, lag)

    def _queue(self, timer: Timer, lag: float) -> None:
        timer.lag = lag
        timer.deadline = _lagged(timer.base, lag, self._clock.monotonic())
        self._push(timer)
        if timer.deadline < self._sleeping_until:
            self.wake()

    def _push(self, timer: Timer) -> None:
        heapq.heappush(self._heap, (timer.deadline, timer.generation, timer))
        timer.queued = True
        if timer.wall is not None:
            if not self._walls:  # the wall clock is watched from now: a step after is news
                clock = self._clock
                self._offset = clock.now().timestamp() - clock.monotonic()
            self._walls += 1

    def _unqueue(self, timer: Timer) -> None:
        timer.queued = False
        self._walls -= timer.wall is not None

    def forget(self, timer: Timer) -> None:
        """Forget ``timer``'s deadline (its heap item goes stale)."""
        timer.generation += 1
        timer.deadline = math.inf
        if timer.queued:
            self._unqueue(timer)
            self._stale += 1
            # A removed job, or one re-planned early (run_now), leaves its old item until it
            # would have come due: a day later for a daily job. Past half the heap, drop them
            # all (amortised O(1) per item), so that neither memory nor the removed jobs the
            # items hold pile up.
            if self._stale > MIN_COMPACT and 2 * self._stale > len(self._heap):
                self._heap[:] = [item for item in self._heap if item[1] == item[2].generation]
                heapq.heapify(self._heap)
                self._stale = 0

    def bound(self, deadline: float) -> Timeout:
        """A context manager: a cancel scope that this loop cancels when its clock reaches
        ``deadline`` (the timeout of a run; the scope has no deadline of its own, so shields
        inside hold)."""
        return Timeout(self, deadline)

    def _add(self, timeout: Timeout) -> None:
        heapq.heappush(self._timeouts, (timeout.deadline, self._sequence(), timeout))
        if timeout.deadline < self._sleeping_until:
            self.wake()

    def _drop_finished(self) -> None:
        timeouts = self._timeouts
        while timeouts and timeouts[0][2].scope is None:  # finished runs on top
            heapq.heappop(timeouts)

    def blocked(self, job_id: str, seconds: float) -> None:
        """Warn that a step of ``job_id``'s handler held the event loop for ``seconds``."""
        self._blocks += 1
        self.stalled(job_id, seconds)
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

    async def due(self) -> list[Timer]:
        """Sleep until the earliest deadline (or until woken), end every run whose timeout
        passed, and return the timers that came due (possibly none), each taken off the heap."""
        clock = self._clock
        heap, timeouts = self._heap, self._timeouts
        blocks = self._blocks
        until = min(heap[0][0] if heap else math.inf, timeouts[0][0] if timeouts else math.inf)
        if self._walls:
            until = min(until, clock.monotonic() + WALL_WATCH)
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
            self.stalled(None, late)
            logger.warning(
                "the event loop was blocked for %.1f s, so jobs start late: some code "
                "runs synchronous work on the event loop; %s",
                late,
                THREADING_ADVICE,
            )
        now_m = clock.monotonic()
        now = clock.now() if self._walls else None
        if now is not None:
            self._watch_wall(now, now_m)
        while timeouts and (timeouts[0][2].scope is None or timeouts[0][0] <= now_m):
            cancelled = heapq.heappop(timeouts)[2].scope
            if cancelled is not None:
                cancelled.cancel()
        due: list[Timer] = []
        while heap and heap[0][0] <= now_m:
            _, generation, timer = heapq.heappop(heap)
            if generation != timer.generation:
                self._stale -= 1
                continue
            self._unqueue(timer)
            wall = timer.wall
            if now is not None and wall is not None and wall > now:
                # never fire before a wall instant (the wall clock stepped back)
                timer.base = now_m + (wall - now).total_seconds()
                timer.deadline = _lagged(timer.base, timer.lag, now_m)
                self._push(timer)
                continue
            due.append(timer)
        return due

    def _watch_wall(self, now: datetime, now_m: float) -> None:
        offset = now.timestamp() - now_m
        if self._offset is None:
            self._offset = offset
            return
        if abs(offset - self._offset) <= STEP_TOLERANCE:
            return
        # The wall clock stepped (NTP, VM suspend): re-derive every wall deadline.
        self._offset = offset
        rebuilt = []
        for deadline, generation, timer in self._heap:
            if generation != timer.generation:
                continue  # superseded: dropped while rebuilding anyway
            if timer.wall is not None:
                timer.base = now_m + (timer.wall - now).total_seconds()
                deadline = timer.deadline = _lagged(timer.base, timer.lag, now_m)
            rebuilt.append((deadline, generation, timer))
        heapq.heapify(rebuilt)
        self._heap[:] = rebuilt
        self._stale = 0


def _unnoted(job_id: str | None, seconds: float) -> None:
    """No coordinator to tell (the scheduler is not running)."""


def _lagged(base: float, lag: float, now: float) -> float:
    """The deadline ``lag`` seconds after ``base`` (now at the earliest), rounded up to
    :data:`LOOK_GRID` when there is a lag."""
    if not lag:
        return max(base, now)  # base itself unless past: a job waiting costs no second float
    return math.ceil(max(base + lag, now) / LOOK_GRID) * LOOK_GRID


class Runs:
    """Starts runs and drains them: wait up to a grace period, then cancel the rest."""

    def __init__(self) -> None:
        self._group: TaskGroup | None = None
        self._in_flight = 0
        self._idle = anyio.Event()
        self._closed = anyio.Event()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the runs' task group open until :meth:`drain` has finished with it."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                await self._closed.wait()
                group.cancel_scope.cancel()

    @property
    def in_flight(self) -> int:
        """The runs (ticks and looks) started and not ended."""
        return self._in_flight

    def service(self, func: Callable[[], Coroutine[Any, Any, Any]], name: str) -> None:
        """Run ``func()`` beside the runs until the group closes (not counted as a run)."""
        assert self._group is not None
        self._group.start_soon(func, name=name)

    def start(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Start ``run()`` in a task of its own, counted in flight until :meth:`ended` (the
        run says so itself, and records its own failures)."""
        assert self._group is not None
        self._in_flight += 1
        self._group.start_soon(run, name=name)

    def ended(self) -> None:
        """A run started by :meth:`start` ended."""
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the runs in flight, then cancel the rest and wait
        for them to roll back and record themselves."""
        if self._in_flight:
            self._idle = anyio.Event()
            with anyio.move_on_after(grace):
                await self._idle.wait()
        self._closed.set()  # the task group cancels what is left, and waits for it
