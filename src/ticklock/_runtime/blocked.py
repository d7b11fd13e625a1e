"""Naming the job whose handler blocks the event loop.

A handler that blocks the event loop (synchronous work in an ``async def``) stops every job
and the app with it. :func:`watch` times each step of a handler and names the job whose step
held the loop for more than :data:`BLOCKED_WARNING` seconds, for two clock reads per step.
"""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Generator
from time import monotonic
from typing import Any, TypeVar

BLOCKED_WARNING = 1.0
"""A handler step, or a wake-up past a deadline, this many seconds long means the event loop
was blocked: warn."""
THREADING_ADVICE = "run it in a worker thread with 'await anyio.to_thread.run_sync(...)'"
"""What to do about synchronous work in a handler."""
T = TypeVar("T")


@types.coroutine
def watch(
    awaitable: Awaitable[T], job_id: str, blocked: Callable[[str, float], None]
) -> Generator[Any, Any, T]:
    """Await ``awaitable`` (a run of job ``job_id``), calling ``blocked(job_id, seconds)`` when
    one of its steps holds the event loop for more than :data:`BLOCKED_WARNING` seconds.

    A step is the code between two suspensions, so a step that long is synchronous work on
    the loop. Two clock reads per step, no thread, no timer. The awaitable is driven step by
    step (send, throw, close are passed through), so results, exceptions and cancellation are
    those of the handler.
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
                blocked(job_id, held)
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            thrown = None  # not kept: the traceback holds this frame
            if (held := monotonic() - start) > BLOCKED_WARNING:
                blocked(job_id, held)
            raise
        thrown = None
        if (held := monotonic() - start) > BLOCKED_WARNING:
            blocked(job_id, held)
        try:
            sent = yield signal
        except GeneratorExit:  # closed without finishing: close the handler too
            steps.close()
            raise
        except BaseException as exc:  # cancellation, or anything else thrown in
            sent, thrown = None, exc
