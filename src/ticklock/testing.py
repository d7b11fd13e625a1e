"""Test helpers that are part of ticklock's public API: :class:`ManualClock`, :func:`run_job`,
and :class:`MemoryDatabase`, an in-memory database that several schedulers share as replicas."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import math
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from ._backends.memory import MemoryDatabase, ReplicaLost
from ._schedule.job import JobContext, _is_async

if TYPE_CHECKING:
    import asyncpg

__all__ = ("ManualClock", "MemoryDatabase", "ReplicaLost", "run_job")

T = TypeVar("T")
_SETTLE_ROUNDS = 10_000  # bounds the wait when some task never blocks


class ManualClock:
    """A clock that moves only when told to; time never goes backwards.

    It starts at ``start`` (default: the current time, to the nearest second), and ``now()`` and
    ``monotonic()`` advance together. On PostgreSQL the database follows it: slots up to the
    time it reads at start plus what the clock advanced since are accepted (see
    docs/testing.md), so a ``start`` in the database's future is refused as a clock ahead.
    ``await advance(seconds)`` walks through every sleeper's deadline in order, letting all
    tasks run at each one, so the code under test sees exactly the instants it asked for::

        clock = ManualClock(datetime(2026, 3, 29, 0, 0, tzinfo=timezone.utc))
        scheduler = Scheduler(clock=clock)
        ...
        async with scheduler:
            await clock.advance(3600)      # every deadline on the way fires, in order
    """

    def __init__(self, start: datetime | None = None) -> None:
        if start is None:
            # to the nearest second: readable instants, within half a second of the database's
            now = datetime.now(timezone.utc)
            start = (now + timedelta(microseconds=500_000)).replace(microsecond=0)
        if start.tzinfo is None or start.utcoffset() is None:
            raise ValueError(f"ManualClock(start): start must be an aware datetime, got {start!r}")
        self._start = start.astimezone(timezone.utc)
        self._elapsed = 0.0
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._counter = itertools.count()

    def now(self) -> datetime:
        """The virtual wall time, aware, in UTC."""
        return self._start + timedelta(seconds=self._elapsed)

    def monotonic(self) -> float:
        """Virtual seconds since the clock was made."""
        return self._elapsed

    async def sleep_until(self, deadline: float) -> None:
        """Wait until virtual time reaches ``deadline`` (``math.inf``: forever)."""
        if deadline <= self._elapsed:
            await anyio.lowlevel.checkpoint()
            return
        if math.isinf(deadline):
            await anyio.sleep_forever()
        event = anyio.Event()
        heapq.heappush(self._sleepers, (deadline, next(self._counter), event))
        await event.wait()

    async def advance(self, seconds: float | timedelta) -> None:
        """Move virtual time forward by ``seconds`` (a number or a timedelta), waking every
        sleeper on the way in order."""
        step = seconds.total_seconds() if isinstance(seconds, timedelta) else seconds
        if not 0 <= step < math.inf:
            raise ValueError(
                f"ManualClock.advance: seconds must be non-negative and finite, got {seconds!r}"
            )
        target = self._elapsed + step
        await self.settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            self._elapsed = max(self._elapsed, self._sleepers[0][0])
            while self._sleepers and self._sleepers[0][0] <= self._elapsed:
                heapq.heappop(self._sleepers)[2].set()
            await self.settle()
        self._elapsed = max(self._elapsed, target)
        await self.settle()

    async def settle(self) -> None:
        """Let every task run until all are blocked, without moving time."""
        if not _on_asyncio():  # trio's own wait_all_tasks_blocked is exact
            await anyio.wait_all_tasks_blocked()
            return
        # on asyncio, anyio's checks the same (each task's _fut_waiter: no public API) but sleeps
        # 0.1 s of real time between looks: a virtual day of minutely runs took over two minutes
        this = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for _ in range(_SETTLE_ROUNDS):
            await asyncio.sleep(0)
            # pending callbacks (e.g. anyio delivering a cancellation) are work still to do
            if getattr(loop, "_ready", None):
                continue
            waiters = [
                getattr(t, "_fut_waiter", None) for t in asyncio.all_tasks() if t is not this
            ]
            if all(waiter is not None and not waiter.done() for waiter in waiters):
                return


async def run_job(
    handler: Callable[[JobContext], Awaitable[T]],
    *,
    conn: asyncpg.Connection[Any] | None = None,
    dsn: str | None = None,
    commit: bool = False,
    slot: datetime | None = None,
    previous_success: datetime | None = None,
    attempt: int = 1,
    job_id: str = "test",
    namespace: str = "default",
    timeout: float | timedelta = 60.0,  # noqa: ASYNC109 (the job's timeout, as declared)
) -> T:
    """Run ``handler`` once with a real :class:`~ticklock.JobContext` and return what it
    returns, without a scheduler (no lock, no watermark, no run record).

    Without ``conn`` or ``dsn`` it runs as in local mode: ``ctx.db`` raises. Given an
    asyncpg connection (``conn``), or a ``dsn`` to connect to and close after, the handler
    runs inside a transaction on it, as a tick does (``ctx.db`` is that connection); the
    transaction is rolled back, or committed with ``commit=True`` when the handler returns.
    ``slot`` defaults to now. The handler's exception propagates; a run longer than
    ``timeout`` raises ``TimeoutError``; a report the scheduler could not store (not JSON)
    raises ``ValueError``. ``conn`` and ``dsn`` need asyncio, as asyncpg does::

        report = await run_job(purge, conn=conn, slot=datetime(2026, 1, 1, tzinfo=timezone.utc))
        assert report == {"deleted": 3}    # and the deletion was rolled back
    """
    from ._schedule.validate import dsn as valid_dsn
    from ._schedule.validate import name, seconds

    if not _is_async(handler):
        raise TypeError(f"run_job: handler must be an async function, got {handler!r}")
    if conn is not None and dsn is not None:
        raise ValueError("run_job: give conn or dsn, not both")
    if not isinstance(commit, bool):
        raise ValueError(f"run_job: commit must be True or False, got {commit!r}")
    if commit and conn is None and dsn is None:
        raise ValueError("run_job: commit=True needs conn or dsn (local mode has no transaction)")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
        raise ValueError(f"run_job: attempt must be an int of at least 1, got {attempt!r}")
    limit = seconds(timeout, "timeout", allow_zero=False)
    if dsn is not None:
        dsn = valid_dsn(dsn, "dsn")
    if (conn is not None or dsn is not None) and not _on_asyncio():
        raise RuntimeError(
            "run_job: conn and dsn need asyncio, as asyncpg does, and this test runs on another "
            "event loop (trio?): pin it to asyncio, e.g. with a fixture 'anyio_backend' that "
            'returns "asyncio"'
        )
    if previous_success is not None:
        previous_success = _utc(previous_success, "previous_success")
    started = datetime.now(timezone.utc)
    ctx = JobContext(
        job_id=name(job_id, "job_id"),
        slot=started if slot is None else _utc(slot, "slot"),
        previous_success=previous_success,
        started_at=started,
        deadline=started + timedelta(seconds=limit),
        owner="test",
        conn=conn,
        namespace=name(namespace, "namespace"),
        attempt=attempt,
    )
    if dsn is None:
        return await _run(handler, ctx, limit, commit)
    from ._backends.postgres.connection import connect

    own, _ = await connect(dsn)
    try:
        return await _run(handler, dataclasses.replace(ctx, conn=own), limit, commit)
    finally:
        with anyio.CancelScope(shield=True):
            await own.close()


async def _run(
    handler: Callable[[JobContext], Awaitable[T]], ctx: JobContext, limit: float, commit: bool
) -> T:
    """Call ``handler`` under its timeout, in a transaction on ``ctx.conn`` if there is one."""
    from ._runtime.runner import _check_report  # the scheduler's own test of a storable report

    conn = ctx.conn
    tx = None if conn is None else conn.transaction()
    if conn is not None and tx is not None:
        await tx.start()
        began = await conn.fetchval("SELECT now()")  # the transaction's start
    try:
        with anyio.fail_after(limit):
            report = await handler(ctx)
        if conn is not None and not await conn.fetchval("SELECT now() = $1", began):
            raise RuntimeError(
                f"run_job: job {ctx.job_id!r}: the handler ended the transaction (a COMMIT "
                "or ROLLBACK through ctx.conn); a scheduled tick refuses such a statement "
                "before it reaches the server, and ends as failure"
            )
        if report is not None:
            try:
                _check_report(report)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ValueError(
                    f"run_job: job {ctx.job_id!r}: the report is not JSON-serialisable "
                    f"({exc}); the scheduler would record the run as a failure"
                ) from exc
    except BaseException:
        if tx is not None:
            with anyio.CancelScope(shield=True):
                await tx.rollback()
        raise
    if tx is not None:
        await (tx.commit() if commit else tx.rollback())
    return report


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _utc(value: datetime, field: str) -> datetime:
    """``value`` in UTC; refuses anything but an aware datetime."""
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ValueError(f"run_job: {field} must be an aware datetime, got {value!r}")
    return value.astimezone(timezone.utc)
