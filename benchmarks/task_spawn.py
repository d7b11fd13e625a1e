"""What a task a run costs on its own: anyio's ``start_soon`` against asyncio's ``create_task``.

    python -m benchmarks.task_spawn [--n 200000] [--repeat 3]

Each figure is the CPU per task of starting ``--n`` tasks of a no-op coroutine and running
them to the end (yielding to the loop every 1,000), and of entering and leaving an anyio
``CancelScope`` (a run's timeout), in one process on asyncio. The floor under P4's CPU per
no-op run that plain anyio sets, whatever ticklock does around it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from importlib.metadata import version

import anyio

from benchmarks.workloads import cpu


async def noop() -> None:
    pass


async def anyio_tasks(n: int) -> float:
    c0 = cpu()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(noop)
            if i % 1000 == 999:
                await asyncio.sleep(0)
    return (cpu() - c0) / n


async def asyncio_tasks(n: int) -> float:
    c0 = cpu()
    tasks: set[asyncio.Task[None]] = set()
    for i in range(n):
        task = asyncio.create_task(noop())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if i % 1000 == 999:
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (cpu() - c0) / n


async def cancel_scopes(n: int) -> float:
    c0 = cpu()
    for _ in range(n):
        with anyio.CancelScope():  # noqa: ASYNC100 (its cost is what is measured)
            pass
    return (cpu() - c0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    figures = {
        "anyio start_soon, a no-op task": anyio_tasks,
        "asyncio create_task, a no-op task": asyncio_tasks,
        "anyio CancelScope, entered and left": cancel_scopes,
    }
    seen: dict[str, list[float]] = {name: [] for name in figures}
    for _ in range(args.repeat):
        for name, measure in figures.items():
            seen[name].append(1e6 * asyncio.run(measure(args.n)))
    print("| CPU per | µs, median (min–max) |")
    print("|---|---|")
    for name, values in seen.items():
        print(f"| {name} | {statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f}) |")
    print(f"({time.strftime('%Y-%m-%d %H:%M')}, anyio {version('anyio')})")


if __name__ == "__main__":
    main()
