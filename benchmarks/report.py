"""Turn a results file of ``benchmarks.run`` into the Markdown tables of docs/benchmarks.md.

python -m benchmarks.report benchmarks/results/run-*.json [--plot docs/scaling.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.run import LABELS

ROWS = [
    ("P1", "p99_ms", "lateness p99, ms", "lower"),
    ("P1", "p50_ms", "lateness p50, ms", "lower"),
    ("P1", "runs_ratio", "runs done / owed", "higher"),
    ("P2", "cpu_percent", "idle CPU, %", "lower"),
    ("P2", "wakeups_per_s", "idle wake-ups/s", "lower"),
    ("P3", "bytes_per_job", "bytes per idle job", "lower"),
    ("P4 (1 ms)", "runs_per_s", "runs/s, 1 ms interval", "higher"),
    ("P4 (1 ms)", "cpu_us_per_run", "CPU µs/run, 1 ms", "lower"),
    ("P4 (20 ms)", "runs_per_s", "runs/s, 20 ms interval", "higher"),
    ("P4 (20 ms)", "cpu_us_per_run", "CPU µs/run, 20 ms", "lower"),
    ("P5", "seconds", "start-up, 10,000 jobs, s", "lower"),
]


def cell(summary: dict[str, Any], key: str) -> str:
    stats = summary.get(key)
    if not stats:
        return summary.get("note", "n/a")[:40] if isinstance(summary.get("note"), str) else "n/a"
    median, low, high = stats["median"], stats["min"], stats["max"]
    fmt = (lambda v: f"{v:,.0f}") if abs(median) >= 100 else (lambda v: f"{v:.3g}")
    return f"{fmt(median)} ({fmt(low)}–{fmt(high)})"


RATIOS = (("aps3", "APScheduler 3"), ("anyio", "anyio floor"), ("naive", "naive"))
"""The columns of ticklock's ratios, to these implementations of the same run."""

GOALS = [
    ("P3", "bytes_per_job", "memory per idle job", "aps3", 0.5),
    ("P5", "seconds", "start-up, 10,000 jobs", "aps3", 0.5),
    ("P4 (20 ms)", "cpu_us_per_run", "CPU per no-op run, 20 ms", "anyio", 1.5),
    ("P1", "p99_ms", "lateness p99", "naive", 1.5),
]
"""The local figures' goals: ticklock's median at most ``limit`` times the other's."""


def ratio(summary: dict[str, Any], key: str, other: str) -> float | None:
    t, o = summary.get("ticklock", {}).get(key), summary.get(other, {}).get(key)
    return t["median"] / o["median"] if t and o and o["median"] else None


def comparison(report: dict[str, Any]) -> str:
    results = report["results"]
    impls = [i for i in LABELS if any(i in r["summary"] for r in results.values())]
    ratios = [(i, label) for i, label in RATIOS if i in impls]
    head = "| workload | " + " | ".join(LABELS[i] for i in impls)
    head += "".join(f" | ticklock ÷ {label}" for _, label in ratios) + " |"
    lines = [head, "|---" * (len(impls) + len(ratios) + 1) + "|"]
    for wid, key, label, _ in ROWS:
        if wid not in results:
            continue
        summary = results[wid]["summary"]
        row = [label] + [cell(summary.get(i, {}), key) for i in impls]
        for other, _ in ratios:
            r = ratio(summary, key, other)
            row.append("–" if r is None else f"{r:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def goals(report: dict[str, Any]) -> str:
    """The local figures' goals, met or not."""
    results = report["results"]
    lines = ["| goal | ratio | met |", "|---|---|---|"]
    for wid, key, label, other, limit in GOALS:
        r = ratio(results.get(wid, {}).get("summary", {}), key, other)
        name = dict(RATIOS)[other]
        shown, met = (
            ("–", "not measured") if r is None else (f"{r:.2f}", "yes" if r <= limit else "no")
        )
        lines.append(f"| {label} ≤ {limit} × {name} | {shown} | {met} |")
    return "\n".join(lines)


def scaling(report: dict[str, Any]) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    results = report["results"]
    sizes = sorted({int(k.split("n=")[1]) for k in results if k.startswith("P8")})
    lines = [
        "| jobs | lateness p50 ms | lateness p99 ms | idle CPU % | idle wake-ups/s | bytes/job |",
        "|---|---|---|---|---|---|",
    ]
    series: dict[str, list[tuple[int, float]]] = {"p99": [], "bytes": []}
    for n in sizes:
        lat = results.get(f"P8 lateness n={n}", {}).get("summary", {}).get("ticklock", {})
        idle = results.get(f"P8 idle n={n}", {}).get("summary", {}).get("ticklock", {})
        mem = results.get(f"P8 memory n={n}", {}).get("summary", {}).get("ticklock", {})
        lines.append(
            f"| {n:,} | {cell(lat, 'p50_ms')} | {cell(lat, 'p99_ms')} | "
            f"{cell(idle, 'cpu_percent')} | {cell(idle, 'wakeups_per_s')} | "
            f"{cell(mem, 'bytes_per_job')} |"
        )
        if lat.get("p99_ms"):
            series["p99"].append((n, lat["p99_ms"]["median"]))
        if mem.get("bytes_per_job"):
            series["bytes"].append((n, mem["bytes_per_job"]["median"]))
    return "\n".join(lines), series


def plot(series: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, label in ((a, "p99", "lateness p99 (ms)"), (b, "bytes", "bytes per idle job")):
        xs, ys = zip(*series[key], strict=True) if series[key] else ((), ())
        ax.plot(xs, ys, marker="o")
        ax.set_xscale("log")
        ax.set_xlabel("jobs")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle("ticklock: cost per job against the number of jobs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "results",
        type=Path,
        nargs="+",
        help="result files; a later file's workloads replace an earlier one's (a re-run of "
        "some workloads with --only)",
    )
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    report = json.loads(args.results[0].read_text())
    for later in args.results[1:]:
        report["results"].update(json.loads(later.read_text())["results"])
    print(comparison(report))
    print()
    print(goals(report))
    print()
    table, series = scaling(report)
    print(table)
    if args.plot:
        plot(series, args.plot)


if __name__ == "__main__":
    main()
