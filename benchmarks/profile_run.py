"""Where a no-op run's CPU goes: P4 (1,000 jobs due every 20 ms) in one process, by ablation.

    python benchmarks/profile_run.py [--seconds 4] [--repeat 3] [--only base,timeout]

Each mode switches one part of a run off (in that process only, by replacing it with a no-op)
and measures the CPU per run as P4 does; the difference from ``base`` is what that part costs.
Modes run interleaved and repeated, each in a fresh process (the machine's noise moves between
them); the table gives the median. ``--cprofile FILE`` writes a cProfile of ``base`` instead.

The modes (none of them is a way to run ticklock; they only take a part away to weigh it):

- ``gc``: the cyclic garbage collector off;
- ``telemetry``: no span attributes, metrics or log line at the run's end;
- ``tracing``: no check whether a tracer provider was set;
- ``watch``: the handler awaited directly, without the blocked-loop watch;
- ``timeout``: no cancel scope nor deadline for the run's timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
MODES = ["base", "gc", "telemetry", "tracing", "watch", "timeout"]


def ablate(mode: str) -> None:
    """Switch the part ``mode`` names off, in this process."""
    from ticklock import _telemetry
    from ticklock._runtime import loop as _loop
    from ticklock._runtime import runner as _runner

    if mode == "gc":
        gc.disable()
    elif mode == "telemetry":
        _telemetry.Telemetry.record = lambda self, *a, **k: None  # type: ignore[method-assign]
    elif mode == "tracing":
        _telemetry.Telemetry.tracing = lambda self: False  # type: ignore[method-assign]
    elif mode == "watch":

        async def direct(awaitable: Any, job_id: str, blocked: Any) -> Any:
            return await awaitable

        _runner.watch = direct  # type: ignore[assignment]
    elif mode == "timeout":

        class Scope:
            cancel_called = False

        class Unbounded:
            def __enter__(self) -> Scope:
                return Scope()

            def __exit__(self, *exc_info: object) -> bool:
                return False

        _loop.Dispatcher.bound = lambda self, deadline: Unbounded()  # type: ignore[assignment,method-assign,return-value]


async def measure(seconds: float, profile: str | None) -> float:
    sys.path.insert(0, str(HERE))
    import workloads

    n, interval = 1000, 0.02
    runs = [0]

    def on_run(i: int, intended: float) -> None:
        runs[0] += 1

    async with workloads.run_ticklock(n, interval, [time.time()] * n, on_run):
        await asyncio.sleep(1.0)
        profiler = cProfile.Profile() if profile else None
        r0, c0 = runs[0], workloads.cpu()
        if profiler is not None:
            profiler.enable()
        await asyncio.sleep(seconds)
        if profiler is not None:
            profiler.disable()
        r1, c1 = runs[0], workloads.cpu()
    if profiler is not None and profile:
        profiler.dump_stats(profile)
    return 1e6 * (c1 - c0) / (r1 - r0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default=",".join(MODES))
    parser.add_argument("--cprofile", help="write a cProfile of base to this file")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    if args.mode is not None or args.cprofile:
        ablate(args.mode or "base")
        print(json.dumps(asyncio.run(measure(args.seconds, args.cprofile))))
        return
    modes = [m.strip() for m in args.only.split(",") if m.strip()]
    seen: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for mode in modes:  # interleaved: base gc ..., base gc ...
            argv = [sys.executable, __file__, "--mode", mode, "--seconds", str(args.seconds)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True)
            seen[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(seen["base"]) if "base" in seen else None
    print("| switched off | CPU µs a run | its cost, µs |")
    print("|---|---|---|")
    for mode, values in seen.items():
        median = statistics.median(values)
        cost = "" if base is None or mode == "base" else f"{base - median:.1f}"
        print(f"| {mode} | {median:.1f} ({min(values):.1f}–{max(values):.1f}) | {cost} |")


if __name__ == "__main__":
    main()
