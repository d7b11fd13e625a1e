"""One benchmark workload for one scheduler, run in that scheduler's own interpreter.

    python benchmarks/workloads.py IMPL WORKLOAD [--jobs N] [--seconds S] [--interval I]

IMPL: ticklock, naive, anyio (the anyio floor: a task and a cancel scope per run), aps3
(APScheduler 3 AsyncIOScheduler), aps4 (APScheduler 4 AsyncScheduler, memory store), aiocron.
WORKLOAD: lateness (P1), idle (P2), memory (P3), throughput (P4), startup (P5). Prints one
JSON object. Every implementation schedules the same no-op body; every one runs on asyncio
(anyio's too), so that event-loop wake-ups can be counted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any

OnRun = Callable[[int, float], None]  # (job index, intended wall instant or NaN)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu() -> float:
    """CPU seconds used by this process so far.

    Linux: the scheduler's own count in nanoseconds (``/proc/self/task/*/schedstat``).
    ``getrusage`` is sampled at the kernel's tick (4 ms at HZ=250), too coarse for an idle
    process: 0.01 % of 20 s is 2 ms. Elsewhere: ``getrusage``.
    """
    try:
        total = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime


# -- the implementations: each starts n jobs, job i first due at first[i] (wall), then every
# -- `interval` s, calling on_run(i, intended) at the start of each body ---------------------


@asynccontextmanager
async def run_ticklock(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    from ticklock import JobContext, Scheduler, every

    scheduler = Scheduler(shutdown_grace=1)
    now = time.time()

    async def body(ctx: JobContext) -> None:
        on_run(int(ctx.job_id), ctx.slot.timestamp())

    for i in range(n):
        scheduler.add(body, every(interval, initial_delay=max(0.0, first[i] - now)), id=str(i))
    async with scheduler:
        yield


@asynccontextmanager
async def run_naive(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    async def loop(i: int) -> None:
        intended = first[i]
        await asyncio.sleep(max(0.0, intended - time.time()))
        while True:
            on_run(i, intended)
            intended = time.time() + interval  # fixed delay, like ticklock
            await asyncio.sleep(interval)

    tasks = [asyncio.ensure_future(loop(i)) for i in range(n)]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def run_anyio(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    """The anyio floor: what a run costs on anyio with no scheduling logic.

    One loop per job, as in the naive baseline, but each run is what ticklock's is on anyio:
    a task started in a task group, running the no-op body inside a ``fail_after`` scope
    (its timeout). The loop sleeps until its next deadline (fixed delay, like ticklock).
    No plan, no heap, no records: whatever ticklock costs beyond this is its own.
    """
    import anyio

    async def body(i: int, intended: float) -> None:
        on_run(i, intended)

    async def run(i: int, intended: float) -> None:
        with anyio.fail_after(60):  # a run's timeout, as ticklock's default
            await body(i, intended)

    async def loop(i: int, runs: anyio.abc.TaskGroup) -> None:
        intended = first[i]
        deadline = anyio.current_time() + max(0.0, intended - time.time())
        while True:
            await anyio.sleep_until(deadline)
            runs.start_soon(run, i, intended)
            deadline = anyio.current_time() + interval
            intended = time.time() + interval

    async with anyio.create_task_group() as runs, anyio.create_task_group() as loops:
        for i in range(n):
            loops.start_soon(loop, i, runs)
        try:
            yield
        finally:
            loops.cancel_scope.cancel()
            runs.cancel_scope.cancel()


@asynccontextmanager
async def run_aps3(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    scheduler = AsyncIOScheduler(timezone="UTC")

    async def body(i: int, start: float) -> None:  # intended: start + k * interval
        now = time.time()
        on_run(i, start + math.floor((now - start) / interval + 1e-9) * interval)

    for i in range(n):
        scheduler.add_job(
            body,
            "interval",
            seconds=interval,
            start_date=datetime.fromtimestamp(first[i], timezone.utc),
            args=(i, first[i]),
            id=str(i),
            misfire_grace_time=None,
            coalesce=True,
            max_instances=1,
        )
    scheduler.start()
    try:
        yield
    finally:
        scheduler.shutdown(wait=False)


_APS4_ON_RUN: list[OnRun] = []


async def aps4_body(i: int) -> None:
    """APScheduler 4 only schedules module-level functions (it stores a reference)."""
    from apscheduler import current_job

    fire = current_job.get().scheduled_fire_time
    _APS4_ON_RUN[0](i, fire.timestamp() if fire is not None else math.nan)


@asynccontextmanager
async def run_aps4(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    from apscheduler import AsyncScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    _APS4_ON_RUN[:] = [on_run]
    async with AsyncScheduler() as scheduler:
        for i in range(n):
            start = datetime.fromtimestamp(first[i], timezone.utc)
            await scheduler.add_schedule(
                aps4_body,
                IntervalTrigger(seconds=interval, start_time=start),
                id=str(i),
                args=(i,),
            )
        await scheduler.start_in_background()
        yield


@asynccontextmanager
async def run_aiocron(
    n: int, interval: float, first: list[float], on_run: OnRun
) -> AsyncIterator[None]:
    import aiocron

    if interval == 1:
        spec = "* * * * * *"  # every second (cron cannot stagger below a second)
    elif interval == 3600:
        spec = "0 * * * *"
    else:
        raise NotImplementedError(f"aiocron cannot express an interval of {interval} s")

    async def body(i: int) -> None:
        now = time.time()
        on_run(i, math.floor(now / interval + 1e-9) * interval)

    crons = [aiocron.crontab(spec, func=body, args=(i,), start=True) for i in range(n)]
    try:
        yield
    finally:
        for c in crons:
            c.stop()


IMPLS = {
    "ticklock": run_ticklock,
    "naive": run_naive,
    "anyio": run_anyio,
    "aps3": run_aps3,
    "aps4": run_aps4,
    "aiocron": run_aiocron,
}


# -- the workloads --------------------------------------------------------------------------


class WakeCounter:
    """Counts the event loop's selector calls: one per wake-up of the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count = 0
        selector = loop._selector  # type: ignore[attr-defined]
        original = selector.select

        def select(timeout: float | None = None) -> Any:
            self.count += 1
            return original(timeout)

        selector.select = select


async def lateness(impl: str, n: int, seconds: float, interval: float) -> dict[str, Any]:
    """P1: n jobs every `interval` s, staggered over the first interval; body start - slot."""
    late: list[float] = []
    runs = [0]
    t0 = time.time() + 1.0
    first = [t0 + interval * i / n for i in range(n)]
    warm_until = t0 + min(interval, 1.0)  # skip the first second (start-up)

    def on_run(i: int, intended: float) -> None:
        now = time.time()
        runs[0] += 1
        if now >= warm_until and not math.isnan(intended):
            late.append(now - intended)

    async with IMPLS[impl](n, interval, first, on_run):
        await asyncio.sleep(max(0.0, t0 - time.time()) + seconds)
    late.sort()
    owed = n * seconds / interval

    def pct(p: float) -> float:
        return late[min(len(late) - 1, int(p * len(late)))] * 1000 if late else math.nan

    return {
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": late[-1] * 1000 if late else math.nan,
        "runs": runs[0],
        "runs_owed": owed,
        "runs_ratio": runs[0] / owed,
    }


async def idle(impl: str, n: int, seconds: float, interval: float) -> dict[str, Any]:
    """P2: n jobs with a long interval, nothing due: CPU and event-loop wake-ups."""
    start = time.time() + interval  # nothing is due during the window
    first = [start + i * 0.001 for i in range(n)]
    loop = asyncio.get_running_loop()
    async with IMPLS[impl](n, interval, first, lambda i, t: None):
        await asyncio.sleep(2.0)  # let start-up settle
        counter = WakeCounter(loop)
        c0, w0 = cpu(), time.monotonic()
        await asyncio.sleep(seconds)
        c1, w1 = cpu(), time.monotonic()
        wakes = counter.count
    return {
        "cpu_percent": 100 * (c1 - c0) / (w1 - w0),
        "wakeups_per_s": wakes / (w1 - w0),
    }


async def memory(impl: str, n: int, seconds: float, interval: float) -> dict[str, Any]:
    """P3: RSS growth per idle job (after a warm-up with one job: imports are not per job)."""
    start = time.time() + interval
    async with IMPLS[impl](1, interval, [start], lambda i, t: None):
        await asyncio.sleep(0.1)
    first = [start] * n
    gc.collect()
    before = rss()
    async with IMPLS[impl](n, interval, first, lambda i, t: None):
        await asyncio.sleep(1.0)
        gc.collect()
        after = rss()
    return {"bytes_per_job": (after - before) / n}


async def throughput(impl: str, n: int, seconds: float, interval: float) -> dict[str, Any]:
    """P4: n jobs due constantly: runs per second and CPU per run."""
    runs = [0]
    first = [time.time()] * n

    def on_run(i: int, intended: float) -> None:
        runs[0] += 1

    async with IMPLS[impl](n, interval, first, on_run):
        await asyncio.sleep(1.0)
        r0, c0, w0 = runs[0], cpu(), time.monotonic()
        await asyncio.sleep(seconds)
        r1, c1, w1 = runs[0], cpu(), time.monotonic()
    done = r1 - r0
    return {
        "runs_per_s": done / (w1 - w0),
        "cpu_us_per_run": 1e6 * (c1 - c0) / done if done else math.inf,
    }


async def startup(impl: str, n: int, seconds: float, interval: float) -> dict[str, Any]:
    """P5: declare n jobs and start the scheduler."""
    first = [time.time() + interval] * n
    t0 = time.perf_counter()
    async with IMPLS[impl](n, interval, first, lambda i, t: None):
        elapsed = time.perf_counter() - t0
    return {"seconds": elapsed}


WORKLOADS = {
    "lateness": lateness,
    "idle": idle,
    "memory": memory,
    "throughput": throughput,
    "startup": startup,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=sorted(IMPLS))
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    try:
        result = asyncio.run(
            WORKLOADS[args.workload](args.impl, args.jobs, args.seconds, args.interval)
        )
    except NotImplementedError as exc:
        result = {"unsupported": str(exc)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
