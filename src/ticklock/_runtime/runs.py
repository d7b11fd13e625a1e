"""The runs in flight: a task group of their own, drained with a grace period at shutdown.

Runs must not be cancelled when the scheduler is (that is what the grace is for), so their
task group lives in a shielded task. The dispatcher runs there too, so that run timeouts still
fire while the runs drain.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

logger = logging.getLogger("ticklock")


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

    def start(self, run: Callable[[Any], Awaitable[None]], arg: Any, name: str) -> None:
        """Start ``run(arg)`` in a task of its own (``run`` records its own failures)."""
        assert self._group is not None
        self._in_flight += 1
        self._group.start_soon(self._wrap, run, arg, name=name)

    async def _wrap(self, run: Callable[[Any], Awaitable[None]], arg: Any) -> None:
        try:
            await run(arg)
        except Exception:
            logger.exception("a run task failed")
        finally:
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
