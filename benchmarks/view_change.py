"""What a view change costs one replica's event loop: a replica joins a fleet of 10,000 jobs.

    python -m benchmarks.view_change [--jobs 10000] [--replicas 8] [--repeat 3]

One scheduler with ``--jobs`` jobs ``every(60)`` runs on a shared in-memory database
(``ticklock.testing.MemoryDatabase``) beside ``--replicas - 1`` silent replicas declaring the
same jobs; then one more replica joins. Every job takes its role in the new view on this
replica's event loop, which is the work measured: a probe task wakes every millisecond and
records the longest time the loop kept it waiting (its *stall*) over 1.5 s from the join, and
the process's CPU over that span less its CPU over 1.5 s before the join (the probe's own).
The database is in memory, so nothing but the view change runs on the loop; on PostgreSQL a
replica also parses the new replica's declarations (``benchmarks.fleet_scale``'s ``join``
figures measure that fleet as a whole).

Each repetition runs in a fresh process; prints a JSON line per repetition and a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.workloads import cpu

HERE = Path(__file__).parent
WINDOW = 1.5
"""Seconds measured before the join (the probe alone) and after it."""


async def measure(jobs: int, replicas: int) -> dict[str, float]:
    import anyio

    from ticklock import JobContext, Scheduler, every
    from ticklock.testing import MemoryDatabase

    db = MemoryDatabase()
    scheduler = Scheduler(database=db, owner="r0", shutdown_grace=1)

    async def body(ctx: JobContext) -> None:
        pass

    declared = [
        scheduler.add(body, every(60, initial_delay=3600), id=f"job-{i}", timeout=30)
        for i in range(jobs)
    ]
    started = datetime.now(timezone.utc)
    stalls: list[tuple[float, float]] = []  # (went to sleep, woke)

    async def probe() -> None:
        while True:
            before = time.perf_counter()
            await anyio.sleep(0.001)
            stalls.append((before, time.perf_counter()))

    def longest(call: tuple[float, float] = (0.0, 0.0)) -> float:
        """The longest stall, less the benchmark's own ``call`` (start, end) where it fell."""
        spent = call[1] - call[0]
        return max(
            woke - went - 0.001 - (spent if went <= call[0] <= woke else 0.0)
            for went, woke in stalls
        )

    async with scheduler, anyio.create_task_group() as tg:
        for k in range(1, replicas):
            db.silent_replica(f"r{k}", declared, started)
        await anyio.sleep(2.0)  # the first view, then quiet
        tg.start_soon(probe)
        c0 = cpu()
        await anyio.sleep(WINDOW)
        quiet, quiet_cpu = longest(), cpu() - c0
        stalls.clear()
        # the join (the declarations' fingerprints are the benchmark's work, not the replica's)
        c0, t0 = cpu(), time.perf_counter()
        db.silent_replica(f"r{replicas}", declared, started)
        call, c1 = (t0, time.perf_counter()), cpu()
        await anyio.sleep(WINDOW)  # the view change, and the probe's own wake-ups
        join_cpu = cpu() - c1
        stall = longest(call)
        tg.cancel_scope.cancel()
    return {
        "longest stall after the join, ms": 1e3 * stall,
        "longest stall before it, ms": 1e3 * quiet,
        "CPU of the view change, ms": 1e3 * (join_cpu - quiet_cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import anyio

        print(json.dumps(anyio.run(measure, args.jobs, args.replicas)))
        return
    seen: list[dict[str, float]] = []
    for _ in range(args.repeat):
        argv = [sys.executable, "-m", "benchmarks.view_change", "--child"]
        argv += ["--jobs", str(args.jobs), "--replicas", str(args.replicas)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=HERE.parent)
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(seen[-1]), flush=True)
    print(f"| figure ({args.jobs} jobs, a replica joins {args.replicas}) | median (min–max) |")
    print("|---|---|")
    for key in seen[0]:
        values = [s[key] for s in seen]
        print(f"| {key} | {statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f}) |")


if __name__ == "__main__":
    main()
