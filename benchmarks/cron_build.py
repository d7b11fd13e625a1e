"""What building one ``cron()`` trigger costs, per expression and zone (issue 34).

    python -m benchmarks.cron_build [--before DIR] [--schedules 10000] [--quick]

Each implementation runs in a child process of its own: this checkout's ticklock, and with
``--before DIR`` another checkout's (a ``git worktree`` of an older commit), on this Python.
Measured, per expression and zone:

- **new**: building a trigger for an expression the process has not built before: ticklock's
  per-expression caches (the bounded ``lru_cache`` functions of ``ticklock._schedule.cron``) are
  cleared before each build. The zone is loaded already (once per process and zone; its first
  load is reported apart).
- **again**: the same expression built again (what a second schedule with it costs).
- an expression that never fires: the time to its ``ScheduleError``.

And a load: ``--schedules`` distinct schedules as tenants store them (a random minute and
hour, one of a few day patterns, one of 20 zones), built one after another from a cold
process; ``--before`` builds at most 1,000 of them (the old construction takes milliseconds
each) and reports the same per-schedule figure. Each figure is the median of repeated builds
(up to 200, or half a second). Results: ``benchmarks/results/cron-build.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RESULTS = HERE / "results"
EXPRESSIONS = [
    "*/5 * * * *",
    "0 9 * * *",
    "30 2 * * 1-5",
    "0 0 1 1 *",
    "0 0 13 * 5",
    "0 0 29 2 *",
    "0 0 29 2 */7",  # 29 February on a Sunday: 28 years apart at least
    "0 0,23 */7 * 4,5",  # a gap of 1 h once in 28 years
]
NEVER = ["0 0 31 2 *", "0 0 30,31 2 */2"]
ZONES = ["UTC", "Europe/Berlin", "Pacific/Apia", "Australia/Lord_Howe"]
TENANT_ZONES = [
    "UTC",
    "Europe/Berlin",
    "Europe/London",
    "Europe/Paris",
    "Europe/Madrid",
    "Europe/Warsaw",
    "America/New_York",
    "America/Chicago",
    "America/Denver",
    "America/Los_Angeles",
    "America/Sao_Paulo",
    "Asia/Tokyo",
    "Asia/Kolkata",
    "Asia/Singapore",
    "Asia/Tehran",
    "Australia/Sydney",
    "Australia/Lord_Howe",
    "Pacific/Auckland",
    "Pacific/Apia",
    "Africa/Casablanca",
]
DAY_PATTERNS = ["* * *", "* * 1-5", "* * 1", "1 * *", "1,15 * *", "* * 0,6", "1 1 *"]


def tenant_schedules(count: int) -> list[tuple[str, str]]:
    """``count`` distinct (expression, zone) pairs, the same for every implementation."""
    rng = random.Random(34)
    seen: dict[tuple[str, str], None] = {}
    while len(seen) < count:
        expr = f"{rng.randrange(60)} {rng.randrange(24)} {rng.choice(DAY_PATTERNS)}"
        seen.setdefault((expr, rng.choice(TENANT_ZONES)), None)
    return list(seen)


def child(schedules: int, budget: float) -> dict[str, Any]:
    """The measurements, in the process of one implementation."""
    started = time.perf_counter()
    from ticklock import ScheduleError, _cron, _zones, cron

    imported = time.perf_counter() - started
    caches = [
        value
        for value in vars(_cron).values()
        if callable(getattr(value, "cache_clear", None)) and value.cache_info().maxsize is not None
    ]

    def forget() -> None:
        for cache in caches:
            cache.cache_clear()

    # the load first, in a process that has built nothing yet (zones load as they come)
    mix = tenant_schedules(schedules)
    begin = time.perf_counter()
    for expr, tz in mix:
        cron(expr, tz=tz)
    load = time.perf_counter() - begin

    zone_first = {}
    for tz in ZONES:
        _zones.zone.cache_clear()
        begin = time.perf_counter()
        _zones.zone(tz)
        zone_first[tz] = (time.perf_counter() - begin) * 1e6
    cron("0 0 * * *")  # once per process: the imports and tables a first trigger builds

    def median_us(build: Any, cold: bool) -> float:
        times: list[float] = []
        deadline = time.perf_counter() + budget
        while len(times) < 200 and (len(times) < 5 or time.perf_counter() < deadline):
            if cold:
                forget()
            begin = time.perf_counter()
            build()
            times.append(time.perf_counter() - begin)
        return statistics.median(times) * 1e6

    def refused(expr: str, tz: str) -> None:
        try:
            cron(expr, tz=tz)
        except ScheduleError:
            return
        raise AssertionError(f"{expr!r} was not refused")

    rows = []
    for expr in EXPRESSIONS + NEVER:
        for tz in ZONES:

            def build(expr: str = expr, tz: str = tz) -> None:
                if expr in NEVER:
                    refused(expr, tz)
                else:
                    cron(expr, tz=tz)

            rows.append(
                {
                    "expr": expr,
                    "tz": tz,
                    "never": expr in NEVER,
                    "new_us": median_us(build, cold=True),
                    "again_us": median_us(build, cold=False),
                }
            )
    return {
        "import_s": imported,
        "zone_first_us": zone_first,
        "schedules": schedules,
        "load_s": load,
        "rows": rows,
    }


def run(src: Path, schedules: int, budget: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, "-m", "benchmarks.cron_build", "--child", str(schedules)]
    command += ["--budget", str(budget)]
    out = subprocess.run(
        command, env=env, cwd=HERE.parent, capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout of ticklock (A/B)")
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="seconds: proves it still works")
    parser.add_argument("--out", type=Path, default=RESULTS / "cron-build.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=0.5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.budget)))
        return
    budget = 0.01 if args.quick else args.budget
    schedules = 100 if args.quick else args.schedules
    results = {"ticklock": run(HERE.parent / "src", schedules, budget)}
    if args.before:
        results["before"] = run(args.before / "src", min(schedules, 1000), budget)
    report(results)
    if not args.quick:
        args.out.parent.mkdir(exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {args.out}")


def report(results: dict[str, Any]) -> None:
    names = list(results)
    head = " | ".join(f"{name} new | {name} again" for name in names)
    print(f"| expression | zone | {head} |")
    print("|---|---|" + "---|---|" * len(names))
    by_key = {name: {(r["expr"], r["tz"]): r for r in results[name]["rows"]} for name in names}
    for row in results[names[0]]["rows"]:
        key = (row["expr"], row["tz"])
        cells = " | ".join(
            f"{by_key[n][key]['new_us']:,.1f} µs | {by_key[n][key]['again_us']:,.1f} µs"
            for n in names
        )
        shown = f"`{row['expr']}`" + (" (refused)" if row["never"] else "")
        print(f"| {shown} | {row['tz']} | {cells} |")
    for name in names:
        data = results[name]
        per = data["load_s"] / data["schedules"] * 1e6
        print(
            f"{name}: {data['schedules']:,} distinct tenant schedules built in "
            f"{data['load_s']:.2f} s ({per:,.1f} µs each; 100,000 would take "
            f"{per * 100_000 / 1e6:,.1f} s); a zone's first load "
            + ", ".join(f"{tz} {us:,.0f} µs" for tz, us in data["zone_first_us"].items())
        )


if __name__ == "__main__":
    main()
