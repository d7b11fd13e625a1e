"""The runs in flight: one task per run, drained with a grace period at shutdown.

Runs must not be cancelled when the scheduler is (that is what the grace is for), so they do
not live in the scheduler's own cancel scope. On asyncio each run is a native task owned by
this group (starting an anyio task costs about 25 µs, a native one about 5: it was the largest
cost of a tick); on other backends, an anyio task group held open in a shielded task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

logger = logging.getLogger("ticklock")
Run = Callable[[Any], Awaitable[None]]
CANCEL_WAIT = 10.0
"""Seconds a cancelled run may take to roll back and record itself at shutdown."""


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Runs:
    """Starts runs and drains them: wait up to a grace period, then cancel the rest."""

    def __init__(self) -> None:
        self.in_flight = 0
        self._idle = anyio.Event()
        self._native = _on_asyncio()
        self._tasks: set[asyncio.Task[None]] = set()
        self._group: TaskGroup | None = None
        self._closed = anyio.Event()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the task group of the runs open until :meth:`drain` (non-asyncio backends)."""
        if self._native:
            task_status.started()
            return
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                await self._closed.wait()
                group.cancel_scope.cancel()

    def start(self, run: Run, arg: Any, name: str) -> None:
        """Start ``run(arg)`` in a task of its own."""
        self.in_flight += 1
        if self._native:
            task = asyncio.get_running_loop().create_task(self._wrap(run, arg), name=name)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            assert self._group is not None
            self._group.start_soon(self._wrap, run, arg, name=name)

    async def _wrap(self, run: Run, arg: Any) -> None:
        try:
            await run(arg)
        except Exception:  # run() records its own failures; this is a bug in ticklock
            logger.exception("ticklock: a run task failed")
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def drain(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the runs in flight, then cancel and await the rest."""
        if self.in_flight:
            self._idle = anyio.Event()
            with anyio.move_on_after(grace):
                await self._idle.wait()
        if self._native:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                # a handler that swallows cancellation must not hang the shutdown
                _, pending = await asyncio.wait(tasks, timeout=CANCEL_WAIT)
                if pending:
                    logger.error(
                        "ticklock: %d run(s) ignored cancellation for %.0f s and were left "
                        "running: a handler swallows CancelledError",
                        len(pending),
                        CANCEL_WAIT,
                    )
        self._closed.set()
