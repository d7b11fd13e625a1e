"""The runs in flight: one task per run, drained with a grace period at shutdown.

Runs must not be cancelled when the scheduler is (that is what the grace is for), so they do
not live in the scheduler's own cancel scope. On asyncio each run is a native task owned by
this group (starting an anyio task costs about 25 µs, a native one about 5: it was the largest
cost of a tick); on other backends, an anyio task group held open in a shielded task.

On Python 3.12+ a run's task starts eagerly: its first step runs at once, in the task's own
context, and a run that never suspends (most local-mode runs) finishes without being
scheduled on the loop at all (about 4 µs less a run on P4). A loop with a task factory of its
own (instrumentation, say) gets its tasks from that factory, not eagerly.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

logger = logging.getLogger("ticklock")
Run = Callable[[Any], Coroutine[Any, Any, None]]
CANCEL_WAIT = 10.0
"""Seconds a cancelled run may take to roll back and record itself at shutdown."""
EAGER = sys.version_info >= (3, 12)
"""Whether run tasks start eagerly (``asyncio.Task(..., eager_start=True)``, Python 3.12+)."""


class Runs:
    """Starts runs and drains them: wait up to a grace period, then cancel the rest."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._tasks: set[asyncio.Task[None]] = set()
        # other backends: the runs' task group, how many are in flight, when that reaches 0
        self._group: TaskGroup | None = None
        self._in_flight = 0
        self._idle = anyio.Event()
        self._closed = anyio.Event()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the task group of the runs open until :meth:`drain` (non-asyncio backends)."""
        if self._loop is not None:
            task_status.started()
            return
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                await self._closed.wait()
                group.cancel_scope.cancel()

    def start(self, run: Run, arg: Any, name: str) -> None:
        """Start ``run(arg)`` in a task of its own (``run`` records its own failures)."""
        loop = self._loop
        if loop is not None:
            if EAGER and loop.get_task_factory() is None:  # a loop's task factory is honoured
                task = asyncio.Task(run(arg), loop=loop, name=name, eager_start=True)  # type: ignore[call-arg,unused-ignore]
                if task.done():  # it never suspended
                    self._done(task)
                    return
            else:
                task = loop.create_task(run(arg), name=name)
            self._tasks.add(task)
            task.add_done_callback(self._done)
        else:
            assert self._group is not None
            self._in_flight += 1
            self._group.start_soon(self._wrap, run, arg, name=name)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("a run task failed", exc_info=exc)

    async def _wrap(self, run: Run, arg: Any) -> None:
        try:
            await run(arg)
        except Exception:
            logger.exception("a run task failed")
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the runs in flight, then cancel and await the rest."""
        if self._loop is None:
            if self._in_flight:
                self._idle = anyio.Event()
                with anyio.move_on_after(grace):
                    await self._idle.wait()
            self._closed.set()  # the task group cancels what is left, and waits for it
            return
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            # a handler that swallows cancellation must not hang the shutdown
            _, pending = await asyncio.wait(tasks, timeout=CANCEL_WAIT)
            if pending:
                logger.error(
                    "%d run(s) ignored cancellation for %.0f s and were left "
                    "running: a handler swallows CancelledError",
                    len(pending),
                    CANCEL_WAIT,
                )
