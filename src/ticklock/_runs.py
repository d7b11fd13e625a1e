"""The runs in flight: a task group of their own, drained with a grace period at shutdown.

Runs must not be cancelled when the scheduler is (that is what the grace is for), so their
task group lives in a shielded task. The dispatcher runs there too, so that run timeouts still
fire while the runs drain.

A run does not get a task of its own until it waits: one task, the *server*, starts the runs
due one after the other, each in a copy of the context it was started from (as a task of its
own would be). A run that ends without waiting (a local run of a short handler) has cost no
task; when one waits, it keeps the server's task and a new server starts the runs after it,
so that no run waits for another.
"""

from __future__ import annotations

import contextvars
import logging
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

logger = logging.getLogger("ticklock")

Run = Callable[[Any], Awaitable[None]]


class Runs:
    """Starts runs and drains them: wait up to a grace period, then cancel the rest."""

    def __init__(self) -> None:
        self._group: TaskGroup | None = None
        self._in_flight = 0
        self._idle = anyio.Event()
        self._closed = anyio.Event()
        self._queue: deque[tuple[Run, Any, contextvars.Context]] = deque()
        self._serving = False  # a server task exists: starting runs, or waiting for some
        self._ready: anyio.Event | None = None  # set when a run is queued for a waiting server

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the runs' task group open until :meth:`drain` has finished with it."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                await self._closed.wait()
                group.cancel_scope.cancel()

    def service(self, func: Callable[[], Coroutine[Any, Any, Any]], name: str) -> None:
        """Run ``func()`` beside the runs until the group closes (not counted as a run)."""
        assert self._group is not None
        self._group.start_soon(func, name=name)

    def start(self, run: Run, arg: Any) -> None:
        """Start ``run(arg)`` soon, beside the other runs (``run`` records its own failures)."""
        assert self._group is not None
        self._in_flight += 1
        self._queue.append((run, arg, contextvars.copy_context()))
        if not self._serving:
            self._serving = True
            self._group.start_soon(self._serve, name="ticklock.runs")
        elif self._ready is not None:  # the server waits: wake it (once)
            self._ready.set()
            self._ready = None

    async def _serve(self) -> None:
        """Start the queued runs one after the other; once one waits, it keeps this task
        (another server took over) and this task ends with it."""
        queue = self._queue
        while True:
            while queue:
                run, arg, context = queue.popleft()
                if await self._drive(self._wrap(run, arg), context):
                    return
            ready = self._ready = anyio.Event()
            await ready.wait()

    @types.coroutine
    def _drive(
        self, coro: Coroutine[Any, Any, None], context: contextvars.Context
    ) -> Generator[Any, Any, bool]:
        """Run ``coro`` to its end in ``context``, step by step (send, throw and close are
        passed through, so cancellation is the run's); whether it waited. At its first wait a
        new server takes over the queue."""
        waited = False
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                if thrown is None:
                    signal = context.run(coro.send, sent)
                else:
                    signal, thrown = context.run(coro.throw, thrown), None
            except StopIteration:
                return waited
            if not waited:
                waited = True
                self._hand_over()
            try:
                sent = yield signal
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation, or anything else thrown in
                sent, thrown = None, exc

    def _hand_over(self) -> None:
        """The server's run waits: another server starts the runs from now on."""
        self._serving = False
        if self._queue:
            assert self._group is not None
            self._serving = True
            self._group.start_soon(self._serve, name="ticklock.runs")

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
        """Wait up to ``grace`` seconds for the runs in flight, then cancel the rest and wait
        for them to roll back and record themselves."""
        if self._in_flight:
            self._idle = anyio.Event()
            with anyio.move_on_after(grace):
                await self._idle.wait()
        self._closed.set()  # the task group cancels what is left, and waits for it
