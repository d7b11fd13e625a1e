"""Where a PostgreSQL tick's time goes (P6's breakdown), layer by layer, against the floor.

    python -m benchmarks.p6_breakdown [--ticks N] [--rounds R] [--pin separate|one] [--dsn DSN]

Each variant runs N ticks, the variants interleaved, R rounds; medians per tick of the
client's CPU (``time.process_time``), the server's CPU (its processes' /proc times, 10 ms
resolution; a process that exits in the window, an autovacuum worker say, takes its time
with it, so runs of a few ticks can read below zero), wall time, and event-loop passes (a
selector that counts ``select()`` calls):

- ``floor``: raw asyncpg, BEGIN; the lock + watermark statement; one insert; COMMIT;
- ``coordinator``: the coordinator's attempt, commit and close (its pool, its scopes);
- ``tick``: a whole tick, ``run_now`` of an empty job.

``--pin`` pins this process and the server's to separate cores or to one (see P6 in
``benchmarks.postgres``: the placement moves a round trip by 2x on a small VM).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import selectors
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from benchmarks.postgres import database, floor, placement, postgres_cpu  # noqa: E402
from ticklock import JobContext, Outcome, RunResult, Scheduler, every  # noqa: E402


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Counts the event loop's passes (one ``select()`` each)."""

    calls = 0

    def select(self, timeout: float | None = None) -> Any:
        CountingSelector.calls += 1
        return super().select(timeout)


async def measure(dsn: str, ticks: int, rounds: int) -> None:
    schema = "bench_p6"
    scheduler = Scheduler(dsn, schema=schema, shutdown_grace=1)

    @scheduler.job(every(3600, initial_delay=3000), id="empty")
    async def empty(ctx: JobContext) -> None:
        pass

    async with scheduler:
        runner = scheduler._crew.runner
        assert runner is not None
        coordinator: Any = runner.coordinator
        job = scheduler.jobs["empty"]
        direct = await asyncpg.connect(dsn)

        async def coordinated() -> None:
            now = datetime.now(timezone.utc)
            attempt = await coordinator.attempt("coordinated", job.timeout, now)
            result = RunResult(
                job_id="coordinated", outcome=Outcome.SUCCESS, slot=now, started_at=now,
                finished_at=now, owner="bench", report=None, error=None,
            )  # fmt: skip
            await attempt.commit(result, job)
            await attempt.close()

        async def tick() -> None:
            await scheduler.run_now("empty")

        variants: dict[str, Callable[[], Awaitable[None]]] = {
            "floor": lambda: floor(direct, schema=schema),
            "coordinator": coordinated,
            "tick": tick,
        }
        for run in variants.values():  # warm up: prepare the statements
            for _ in range(50):
                await run()
        seen: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in variants}
        for _ in range(rounds):
            for name, run in variants.items():
                c0, s0 = time.process_time(), postgres_cpu(None)
                w0, p0 = time.perf_counter(), CountingSelector.calls
                for _ in range(ticks):
                    await run()
                seen[name].append(
                    (
                        (time.process_time() - c0) / ticks * 1e6,
                        (postgres_cpu(None) - s0) / ticks * 1e6,
                        (time.perf_counter() - w0) / ticks * 1e6,
                        (CountingSelector.calls - p0) / ticks,
                    )
                )
        await direct.close()
    print("| | client CPU µs | server CPU µs | wall µs | loop passes |")
    print("|---|---|---|---|---|")
    for name, rows in seen.items():
        cells = [statistics.median(row[i] for row in rows) for i in range(4)]
        print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} | {cells[2]:.0f} | {cells[3]:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pin", choices=("separate", "one"))
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    client = server_cpus = None
    if args.pin and len(cpus) >= 2:
        client, server_cpus = {cpus[0]}, {cpus[1] if args.pin == "separate" else cpus[0]}
    loop = asyncio.SelectorEventLoop(CountingSelector())
    try:
        with database(args.dsn) as dsn, placement(client, server_cpus):
            loop.run_until_complete(measure(dsn, args.ticks, args.rounds))
    finally:
        loop.close()


if __name__ == "__main__":
    main()
