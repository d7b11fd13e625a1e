"""Run every benchmark, ticklock and its peers side by side, and report medians and ratios.

    python -m benchmarks.run            # the full run (about 25 minutes on 2 cores)
    python -m benchmarks.run --quick    # seconds: proves the benchmarks still work (CI)

Peers are installed from PyPI into their own virtual environments under
``benchmarks/.venvs/py3.X`` (APScheduler 3.11, APScheduler 4.0.0a6, aiocron 2.1), made with the
Python that runs this script; the naive baseline (one asyncio task per job: sleep, run) and
ticklock and the anyio floor (a loop per job starting each run as an anyio task with a cancel
scope, and nothing else) run in this interpreter's environment. So every implementation runs
on one Python.
Implementations are interleaved (A B C A B C ...) and repeated, because shared machines are
noisy; the report quotes medians with min-max spreads, and ratios to the naive baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
VENVS = HERE / ".venvs" / f"py{sys.version_info.major}.{sys.version_info.minor}"  # per Python
RESULTS = HERE / "results"
PEERS = {
    "aps3": "APScheduler==3.11.*",
    "aps4": "APScheduler==4.0.0a6",
    "aiocron": "aiocron==2.1",
}
LABELS = {
    "ticklock": "ticklock",
    "before": "ticklock (--before)",
    "naive": "naive (task per job)",
    "anyio": "anyio floor",
    "aps3": "APScheduler 3.11",
    "aps4": "APScheduler 4.0.0a6",
    "aiocron": "aiocron 2.1",
}


def python_for(impl: str) -> str:
    if impl in PEERS:
        return str(VENVS / impl / "bin" / "python")
    return sys.executable


def ensure_peers(wanted: set[str] | None = None) -> list[str]:
    ready = []
    for name, spec in PEERS.items():
        if wanted is not None and name not in wanted:
            continue
        python = VENVS / name / "bin" / "python"
        if not python.exists():
            print(f"installing {spec} into {VENVS / name} ...", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(VENVS / name)], check=True)
            pip = [str(python), "-m", "pip", "install", "-q", spec]
            if subprocess.run(pip).returncode != 0:
                print(f"could not install {spec}; skipping it", flush=True)
                continue
        ready.append(name)
    return ready


def version_of(impl: str) -> str:
    module = {"aps3": "apscheduler", "aps4": "apscheduler", "aiocron": "aiocron"}.get(impl)
    dist = {"aps3": "APScheduler", "aps4": "APScheduler", "aiocron": "aiocron"}.get(impl)
    if module is None:
        return ""
    code = f"import importlib.metadata as m; print(m.version('{dist}'))"
    out = subprocess.run([python_for(impl), "-c", code], capture_output=True, text=True)
    return out.stdout.strip()


BEFORE: Path | None = None  # --before: another checkout's ticklock, measured beside this one


def workload(impl: str, name: str, jobs: int, seconds: float, interval: float) -> dict[str, Any]:
    src = {"ticklock": HERE.parent / "src", "before": BEFORE and BEFORE / "src"}.get(impl)
    argv = [python_for(impl), str(HERE / "workloads.py"), "ticklock" if src else impl, name]
    argv += ["--jobs", str(jobs), "--seconds", str(seconds), "--interval", str(interval)]
    env = {**os.environ, "PYTHONPATH": str(src)} if src else None
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds * 4 + 120, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": "no result"}


def summarise(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if isinstance(v, (int, float)) and v == v]
    if not finite:
        return {}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
    }


def plan(quick: bool) -> list[dict[str, Any]]:
    """The workloads: (id, workload, jobs, seconds, interval, impls)."""
    if quick:
        return [
            {"id": "P1", "name": "lateness", "jobs": 50, "seconds": 1.5, "interval": 0.5},
            {"id": "P2", "name": "idle", "jobs": 100, "seconds": 0.5, "interval": 3600},
            {"id": "P3", "name": "memory", "jobs": 200, "seconds": 0, "interval": 3600},
            {"id": "P4", "name": "throughput", "jobs": 20, "seconds": 0.5, "interval": 0.02},
            {"id": "P5", "name": "startup", "jobs": 200, "seconds": 0, "interval": 3600},
        ]
    return [
        {"id": "P1", "name": "lateness", "jobs": 1000, "seconds": 20, "interval": 1},
        {"id": "P2", "name": "idle", "jobs": 10000, "seconds": 20, "interval": 3600},
        {"id": "P3", "name": "memory", "jobs": 10000, "seconds": 0, "interval": 3600},
        {"id": "P4 (1 ms)", "name": "throughput", "jobs": 1000, "seconds": 10, "interval": 0.001},
        {"id": "P4 (20 ms)", "name": "throughput", "jobs": 1000, "seconds": 10, "interval": 0.02},
        {"id": "P5", "name": "startup", "jobs": 10000, "seconds": 0, "interval": 3600},
    ]


def scaling(quick: bool) -> list[dict[str, Any]]:
    """P8: lateness at a constant 1,000 runs/s (interval n/1000 s) and idle cost, by n."""
    sizes = [100, 1000] if quick else [100, 1000, 10000, 100000]
    out = []
    for n in sizes:
        out.append(
            {
                "id": f"P8 lateness n={n}",
                "name": "lateness",
                "jobs": n,
                "seconds": 2 if quick else 15,
                "interval": max(1.0, n / 1000),
            }
        )
        out.append(
            {
                "id": f"P8 idle n={n}",
                "name": "idle",
                "jobs": n,
                "seconds": 0.5 if quick else 10,
                "interval": 3600,
            }
        )
        out.append(
            {"id": f"P8 memory n={n}", "name": "memory", "jobs": n, "seconds": 0, "interval": 3600}
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, ticklock and naive")
    parser.add_argument("--repeat", type=int, default=None, help="repetitions (default 3)")
    parser.add_argument("--only", default="", help="comma-separated workload ids, e.g. P1,P4")
    parser.add_argument(
        "--before", type=Path, help="another checkout of ticklock, measured beside this one (A/B)"
    )
    parser.add_argument(
        "--peers", default=None, help="comma-separated peers to run (default: all), e.g. aps3"
    )
    args = parser.parse_args()
    global BEFORE
    BEFORE = args.before
    repeat = args.repeat or (1 if args.quick else 3)
    impls = ["ticklock", *(["before"] if BEFORE else []), "naive", "anyio"]
    peers_wanted = None if args.peers is None else {p.strip() for p in args.peers.split(",")}
    impls += [] if args.quick else ensure_peers(peers_wanted)
    started = time.time()
    report: dict[str, Any] = {
        "machine": machine(),
        "versions": {impl: version_of(impl) for impl in impls},
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks.run", *sys.argv[1:]]),
        "repeat": repeat,
        "results": {},
    }
    wanted = {w.strip() for w in args.only.split(",") if w.strip()}
    for spec in plan(args.quick) + scaling(args.quick):
        if wanted and not any(spec["id"].startswith(w) for w in wanted):
            continue
        peers = impls if not spec["id"].startswith("P8") else ["ticklock", "naive"]
        runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in peers}
        for _ in range(repeat):
            for impl in peers:  # interleaved: A B C, A B C, ...
                result = workload(
                    impl, spec["name"], spec["jobs"], spec["seconds"], spec["interval"]
                )
                runs[impl].append(result)
                print(f"{spec['id']:<22} {impl:<9} {json.dumps(result)}", flush=True)
        summary = {}
        for impl, results in runs.items():
            keys = {k for r in results for k in r if isinstance(r.get(k), (int, float))}
            summary[impl] = {k: summarise([r.get(k, float("nan")) for r in results]) for k in keys}
            errors = [
                r.get("error") or r.get("unsupported")
                for r in results
                if "error" in r or "unsupported" in r
            ]
            if errors:
                summary[impl]["note"] = errors[0]
        report["results"][spec["id"]] = {"spec": spec, "summary": summary}
    report["machine"]["load_average_end"] = os.getloadavg()
    report["seconds"] = time.time() - started
    RESULTS.mkdir(exist_ok=True)
    name = "quick.json" if args.quick else time.strftime("run-%Y%m%d-%H%M%S.json")
    (RESULTS / name).write_text(json.dumps(report, indent=1))
    print(f"\nwritten {RESULTS / name} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
