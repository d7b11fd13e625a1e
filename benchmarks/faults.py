"""The fleet under faults (issue 22): a fix's figures before and after, side by side in one run.

    python -m benchmarks.faults [--before REV] [--only lost2,join16,storm] [--dsn DSN]

Each scenario runs twice on real replica processes (``benchmarks/fleet_replica.py``): once with
ticklock at ``--before`` (``git archive``, by default the commit before the fixes) and once
with the working tree's ``src/``, each on a schema of its own.

- ``lost2``: 5 replicas x 20 jobs ``every(5)``, ``timeout=4``; SIGKILL of the two replicas
  ranked first for ``job-0`` (a node with both is lost): how late after its latest fire the
  first slot after the kill ran, for ``job-0`` and for the other jobs.
- ``join16``: 16 replicas x 250 jobs ``every(1)`` started together: the longest gap between a
  job's runs after the first 3 s (beyond the interval), and the runs committed of those owed
  over 30 s.
- ``rolling16``: 4 replicas x 250 jobs ``every(1)``; 12 more join within 10 s while the 4
  leave gracefully (a rolling deploy): the longest gap between a job's runs beyond the
  interval, from the first join on.
- ``storm``: 3 replicas x 20 jobs ``every(1)``; for 10 s, notifications on ticklock's channel
  back to back from another session: the replicas' beats per second and their CPU (% of a core,
  from /proc), against the 10 s before.

Results: ``benchmarks/results/faults.json``, and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks.fleet_scale import extract_baseline, git
from ticklock._runtime.sharing import weight

HERE = Path(__file__).parent
REPO = HERE.parent
BEFORE = "6a9ce05"
"""The last commit before the issue's fixes."""


class Fleet:
    def __init__(self, dsn: str, schema: str, src: Path, logs: Path) -> None:
        self.dsn, self.schema, self.src, self.logs = dsn, schema, src, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, owner: str, jobs: int, interval: float, timeout: float) -> None:
        argv = [sys.executable, str(HERE / "fleet_replica.py"), self.dsn, self.schema]
        argv += [str(jobs), owner, "own", str(interval), str(timeout)]
        with open(self.logs / f"{self.schema}-{owner}.log", "ab") as out:
            self.procs[owner] = subprocess.Popen(
                argv,
                env={**os.environ, "PYTHONPATH": str(self.src)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def cpu(self) -> dict[str, float]:
        """Each replica's user + system CPU seconds so far."""
        ticks = os.sysconf("SC_CLK_TCK")
        result = {}
        for owner, proc in self.procs.items():
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            result[owner] = (int(fields[11]) + int(fields[12])) / ticks
        return result

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def successes(conn: Any, schema: str, since: float) -> dict[str, list[Any]]:
    rows = await conn.fetch(
        f"SELECT job_id, extract(epoch FROM started_at) AS s, extract(epoch FROM finished_at) "
        f"AS f FROM {schema}.runs WHERE outcome = 'success' AND job_id LIKE 'job-%' "
        "AND started_at > to_timestamp($1) ORDER BY started_at",
        since,
    )
    per: dict[str, list[Any]] = {}
    for row in rows:
        per.setdefault(row["job_id"], []).append((float(row["s"]), float(row["f"])))
    return per


def gaps(runs: list[Any], interval: float) -> list[float]:
    return [b[0] - a[1] - interval for a, b in zip(runs, runs[1:], strict=False)]


async def lost2(conn: Any, fleet: Fleet) -> dict[str, Any]:
    owners = [f"r{i}" for i in range(5)]
    for owner in owners:
        fleet.start(owner, 20, 5.0, 4.0)
    await asyncio.sleep(15)
    ranked = sorted(owners, key=lambda o: (weight(o, "job-0"), o), reverse=True)
    killed = time.time()
    for owner in ranked[:2]:
        fleet.procs[owner].send_signal(signal.SIGKILL)
    await asyncio.sleep(20)
    per = await successes(conn, fleet.schema, killed - 6)
    late = {job: max(gaps(runs, 5.0), default=None) for job, runs in per.items()}
    others = [v for job, v in late.items() if job != "job-0" and v is not None]
    return {"job-0 late s": late.get("job-0"), "other jobs late s (max)": max(others)}


async def join16(conn: Any, fleet: Fleet) -> dict[str, Any]:
    started = time.time()
    for i in range(16):
        fleet.start(f"r{i}", 250, 1.0, 0.9)
    await asyncio.sleep(34)
    per = await successes(conn, fleet.schema, started + 3)
    window = [r for runs in per.values() for r in runs if r[0] < started + 33]
    worst = sorted(
        ((g, job, runs[i][1] - started) for job, runs in per.items() for i, g in
         enumerate(gaps(runs, 1.0))),
        reverse=True,
    )[:5]  # fmt: skip
    late = await conn.fetchval(
        f"SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - "
        f"slot)) FROM {fleet.schema}.runs WHERE outcome = 'success' AND job_id LIKE 'job-%' "
        "AND started_at > to_timestamp($1)",
        started + 3,
    )
    return {
        "longest gap beyond the interval s": worst[0][0] if worst else None,
        "the 5 longest (gap s, job, s after start)": [
            (round(g, 2), job, round(at, 1)) for g, job, at in worst
        ],
        "lateness p99 s": late,
        "runs in 30 s (of ~7,500)": len(window),
    }


async def rolling16(conn: Any, fleet: Fleet) -> dict[str, Any]:
    """4 replicas x 250 jobs ``every(1)`` run; then 12 more join, one every 0.8 s, and the
    first 4 leave gracefully (SIGTERM) among them: the gaps from the first join on."""
    for i in range(4):
        fleet.start(f"old{i}", 250, 1.0, 0.9)
    await asyncio.sleep(12)
    t0 = time.time()
    for i in range(12):
        fleet.start(f"new{i}", 250, 1.0, 0.9)
        if i % 3 == 2:
            fleet.procs[f"old{i // 3}"].send_signal(signal.SIGTERM)
        await asyncio.sleep(0.8)
    await asyncio.sleep(10)
    per = await successes(conn, fleet.schema, t0)
    worst = sorted(
        ((g, job, runs[i][1] - t0) for job, runs in per.items() for i, g in
         enumerate(gaps(runs, 1.0))),
        reverse=True,
    )[:5]  # fmt: skip
    return {
        "longest gap beyond the interval s": worst[0][0] if worst else None,
        "the 5 longest (gap s, job, s after the first join)": [
            (round(g, 2), job, round(at, 1)) for g, job, at in worst
        ],
        "gaps beyond interval + 1 s": sum(
            1 for runs in per.values() for g in gaps(runs, 1.0) if g > 1.0
        ),
    }


async def storm(conn: Any, fleet: Fleet, dsn: str) -> dict[str, Any]:
    s = fleet.schema
    for owner in ("a", "b", "c"):
        fleet.start(owner, 20, 1.0, 0.9)
    await asyncio.sleep(8)
    await conn.execute(
        f"""
CREATE TABLE {s}.beats (at timestamptz DEFAULT clock_timestamp());
CREATE FUNCTION {s}.beat() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO {s}.beats DEFAULT VALUES; RETURN NULL; END $$;
CREATE TRIGGER beat AFTER INSERT OR UPDATE ON {s}.replicas
    FOR EACH ROW EXECUTE FUNCTION {s}.beat();"""
    )
    idle0, t0 = fleet.cpu(), time.time()
    await asyncio.sleep(10)
    idle1, t1 = fleet.cpu(), time.time()
    attacker = await asyncpg.connect(dsn)
    sent = 0
    payload = json.dumps([s, "default"])
    end = time.time() + 10
    while time.time() < end:
        await attacker.execute("SELECT pg_notify('ticklock', $1)", payload)
        sent += 1
    storm1, t2 = fleet.cpu(), time.time()
    await attacker.close()

    def per_core(a: dict[str, float], b: dict[str, float], seconds: float) -> float:
        return max((b[o] - a[o]) / seconds * 100 for o in a)

    beats = await conn.fetchval(f"SELECT count(*) FROM {s}.beats WHERE at > to_timestamp($1)", t1)
    idle_beats = await conn.fetchval(
        f"SELECT count(*) FROM {s}.beats WHERE at BETWEEN to_timestamp($1) AND to_timestamp($2)",
        t0,
        t1,
    )
    return {
        "notifications/s": round(sent / (t2 - t1)),
        "beats/s idle": round(idle_beats / (t1 - t0), 2),
        "beats/s storm": round(beats / (t2 - t1), 1),
        "CPU % idle (max replica)": round(per_core(idle0, idle1, t1 - t0), 1),
        "CPU % storm (max replica)": round(per_core(idle1, storm1, t2 - t1), 1),
    }


async def main_async(
    dsn: str | None, before: str, only: list[str], sides: tuple[str, ...] = ("before", "after")
) -> dict[str, Any]:
    from benchmarks.postgres import database

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        old = extract_baseline_at(Path(tmp), before)
        logs = Path(tmp)
        with database(dsn) as url:
            conn = await asyncpg.connect(url)
            try:
                for name in only:
                    for label, src in (("before", old), ("after", REPO / "src")):
                        if label not in sides:
                            continue
                        schema = f"bench_faults_{name}_{label}"
                        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
                        fleet = Fleet(url, schema, src, logs)
                        try:
                            if name == "lost2":
                                figures = await lost2(conn, fleet)
                            elif name == "join16":
                                figures = await join16(conn, fleet)
                            elif name == "rolling16":
                                figures = await rolling16(conn, fleet)
                            else:
                                figures = await storm(conn, fleet, url)
                        finally:
                            fleet.stop()
                        results.setdefault(name, {})[label] = figures
                        print(name, label, figures, flush=True)
            finally:
                await conn.close()
    return results


def extract_baseline_at(into: Path, rev: str) -> Path:
    import benchmarks.fleet_scale as fs

    saved, fs.BASELINE = fs.BASELINE, rev
    try:
        return extract_baseline(into)
    finally:
        fs.BASELINE = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--only", default="lost2,join16,storm")
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--sides", default="before,after", help="before, after, or both")
    args = parser.parse_args()
    sides = tuple(args.sides.split(","))
    results = asyncio.run(main_async(args.dsn, args.before, args.only.split(","), sides))
    results["facts"] = {"commit": git("rev-parse", "--short", "HEAD"), "before": args.before,
                        "cores": os.cpu_count()}  # fmt: skip
    out = HERE / "results" / "faults.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    for name, sides in results.items():
        if name == "facts":
            continue
        print(f"\n| {name} | before | after |\n|---|---|---|")
        keys = next(iter(sides.values()))
        for key in keys:
            cells = " | ".join(
                str(sides[side].get(key)) for side in ("before", "after") if side in sides
            )
            print(f"| {key} | {cells} |")


if __name__ == "__main__":
    main()
