"""The alternative to ticklock's fleet design, measured: due jobs claimed in batches with
``FOR UPDATE SKIP LOCKED`` (raw asyncpg, a minimal prototype).

    python -m benchmarks.skip_locked [--replicas 8] [--jobs 250] [--handler-ms 0] [--seconds 45]
        [--poll 0.25] [--dsn DSN]

With no ``--replicas``/``--jobs``/``--handler-ms``, it measures 8 x 250 and 4 x 250
``every(1 s)`` jobs (fixed delay: ``next_due = end + 1 s``) with empty handlers, 8 x 250 with a
handler that inserts a row into ``sl.writes`` through the run's connection (in the run's
transaction) and sleeps 50 ms (as P9's ``write`` handler in ``benchmarks.fleet_scale``), then an
idle fleet of 8 (every job due in an hour). Each replica is a process (this module with
``--replica``) with an asyncio loop and an asyncpg pool of at most 10 connections (no session
reset on release, as ticklock's own pool).

Tables (schema ``sl``, dropped first): ``jobs (job_id, next_due, last_slot, last_end,
claimed_by, claimed_until)`` with an index on ``next_due``, and ``runs (job_id, slot,
started_at, finished_at, owner)``. Variants, one replica loop each:

- ``claim+run``: one autocommit statement claims up to 50 due, unclaimed jobs
  (``SELECT ... ORDER BY next_due LIMIT 50 FOR UPDATE SKIP LOCKED``, then ``claimed_by = me,
  claimed_until = now() + LEASE`` so that the others skip them once the row locks are gone),
  and returns the earliest future ``next_due``. Each claimed job then runs in a transaction of
  its own, with ticklock's round trips: ``BEGIN; SET LOCAL transaction_timeout;
  pg_try_advisory_xact_lock``; read the job (still claimed by me, slot not yet run); handler;
  one statement writing the run record and ``last_slot, last_end, next_due = end + 1 s``,
  releasing the claim (fenced on ``claimed_by = me``); ``COMMIT``. Per-job atomicity kept.
- ``run-in-claim``: ``BEGIN; SET LOCAL transaction_timeout``; the same claim without the
  marking (the row locks are the claim); the batch's handlers one after the other on that
  connection (they share its transaction); one statement writing every run record and job
  row; ``COMMIT``. A batch commits or fails as one, and its transaction has the time limit of
  its jobs together (0.9 s x 50): one job's 0.9 s would abort the batch it shares.

The claimer does not spin: with fewer than 50 claimed it sleeps until the earliest future
``next_due`` the claim returned, at most ``--poll`` seconds (0.25 by default): with nothing
due, a replica sends a claim (one transaction) every poll period.

Measured over a window after a warm-up (as P7 in ``benchmarks.postgres``): runs started in the
window, transactions per run (``pg_stat_database`` ``xact_commit + xact_rollback``; also as
counted by the replicas), the database's CPU (this server's processes only), lateness
(``started_at - slot``, the slot being the ``next_due`` claimed), slots run twice, the longest
gap between the end of a run and the start of the next of the same job, claims per run and
the share of claims that got nothing. Without --dsn a throwaway server is started (as in
``benchmarks.postgres``). Results: ``benchmarks/results/skip-locked.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg

HERE = Path(__file__).parent
SCHEMA = "sl"
VARIANTS = ("claim+run", "run-in-claim")
BATCH = 50
"""Jobs claimed at most per claim."""
POLL = 0.25
"""Default longest sleep of a claimer (seconds)."""
INTERVAL = 1.0
"""every(1 s), fixed delay."""
TIMEOUT_MS = 900
"""A transaction's server-side limit (``SET LOCAL transaction_timeout``), as ticklock's 0.9 s."""
LEASE = 2.0
"""claim+run: how long a claim keeps the other replicas off a job (the run's 0.9 s and time to
get a connection): a replica that dies holding claims delays their jobs this long."""
WARM_UP = 5.0
POOL_MAX = 10

STATS = (
    "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
)


def lock_key(job_id: str) -> int:
    """A signed 64-bit advisory lock key for the job."""
    digest = hashlib.blake2b(f"sl:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# claim+run: claim and mark in one statement (one transaction), and the earliest future due
CLAIM_MARK = f"""
WITH c AS (
    SELECT job_id, next_due FROM {SCHEMA}.jobs
    WHERE next_due <= now() AND (claimed_until IS NULL OR claimed_until < now())
    ORDER BY next_due LIMIT $2 FOR UPDATE SKIP LOCKED
), u AS (
    UPDATE {SCHEMA}.jobs AS j SET claimed_by = $1, claimed_until = now() + $3 * interval '1 s'
    FROM c WHERE j.job_id = c.job_id RETURNING j.job_id, c.next_due
)
SELECT job_id, next_due FROM u
UNION ALL SELECT NULL, min(next_due) FROM {SCHEMA}.jobs WHERE next_due > now()"""
READ = f"SELECT claimed_by, last_slot FROM {SCHEMA}.jobs WHERE job_id = $1"
COMMIT_ONE = f"""
WITH j AS (
    UPDATE {SCHEMA}.jobs SET last_slot = $2, last_end = $4, next_due = $6,
        claimed_by = NULL, claimed_until = NULL
    WHERE job_id = $1 AND claimed_by = $5 AND (last_slot IS NULL OR last_slot < $2)
    RETURNING 1
)
INSERT INTO {SCHEMA}.runs (job_id, slot, started_at, finished_at, owner)
SELECT $1, $2, $3, $4, $5 FROM j"""

# run-in-claim: the claim inside the run's transaction (the row locks are the claim)
CLAIM_LOCK = f"""
WITH c AS (
    SELECT job_id, next_due FROM {SCHEMA}.jobs WHERE next_due <= now()
    ORDER BY next_due LIMIT $1 FOR UPDATE SKIP LOCKED
)
SELECT job_id, next_due FROM c
UNION ALL SELECT NULL, min(next_due) FROM {SCHEMA}.jobs WHERE next_due > now()"""
COMMIT_BATCH = f"""
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::timestamptz[], $4::timestamptz[],
        $5::timestamptz[]) AS v(job_id, slot, started_at, finished_at, next_due)
), j AS (
    UPDATE {SCHEMA}.jobs AS j SET last_slot = v.slot, last_end = v.finished_at,
        next_due = v.next_due
    FROM v WHERE j.job_id = v.job_id AND (j.last_slot IS NULL OR j.last_slot < v.slot)
    RETURNING j.job_id
)
INSERT INTO {SCHEMA}.runs (job_id, slot, started_at, finished_at, owner)
SELECT v.job_id, v.slot, v.started_at, v.finished_at, $6 FROM v JOIN j USING (job_id)"""

BEGIN = f"BEGIN; SET LOCAL transaction_timeout = {TIMEOUT_MS}"
BEGIN_BATCH = f"BEGIN; SET LOCAL transaction_timeout = {TIMEOUT_MS * BATCH}"
WRITE = f"INSERT INTO {SCHEMA}.writes (job_id, slot, owner) VALUES ($1, $2, $3)"


async def no_reset(con: Any) -> None:
    """The pool's release resets nothing (ticklock's own pool doesn't either)."""


async def handler(con: Any, job_id: str, slot: datetime, owner: str, ms: float) -> None:
    """The job: empty, or (``ms`` > 0) one row written through the run's connection, then
    ``ms`` milliseconds of sleep."""
    if ms > 0:
        await con.execute(WRITE, job_id, slot, owner)
        await asyncio.sleep(ms / 1000)


class Replica:
    def __init__(self, pool: Any, owner: str, variant: str, poll: float, handler_ms: float) -> None:
        self.pool, self.owner, self.variant, self.poll = pool, owner, variant, poll
        self.handler_ms = handler_ms
        self.claims: list[tuple[float, int]] = []  # (when, jobs claimed)
        self.runs: list[tuple[float, str]] = []  # (when, outcome) of each run transaction
        self.errors: Counter[str] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                claimed, earliest = await self.claim()
            except (asyncpg.PostgresError, OSError) as exc:
                self.errors[type(exc).__name__] += 1
                claimed, earliest = 0, None
            if claimed == BATCH:
                await asyncio.sleep(0)  # more may be due: claim again at once
                continue
            delay = self.poll
            if earliest is not None:
                delay = min(max(0.0, (earliest - utcnow()).total_seconds()), self.poll)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def claim(self) -> tuple[int, datetime | None]:
        if self.variant == "claim+run":
            rows = await self.pool.fetch(CLAIM_MARK, self.owner, BATCH, LEASE)
            jobs = [(r["job_id"], r["next_due"]) for r in rows if r["job_id"] is not None]
            self.claims.append((time.time(), len(jobs)))
            for job_id, slot in jobs:
                self.spawn(self.run_one(job_id, slot))
            return len(jobs), rows[-1]["next_due"]
        con = await self.pool.acquire()
        try:
            await con.execute(BEGIN_BATCH)
            rows = await con.fetch(CLAIM_LOCK, BATCH)
        except BaseException:
            await self.pool.release(con)  # rolls back an open transaction
            raise
        jobs = [(r["job_id"], r["next_due"]) for r in rows if r["job_id"] is not None]
        self.claims.append((time.time(), len(jobs)))
        if jobs:
            self.spawn(self.run_batch(con, jobs))  # commits and releases
        else:
            try:
                await con.execute("COMMIT")
                self.runs.append((time.time(), "empty claim"))
            finally:
                await self.pool.release(con)
        return len(jobs), rows[-1]["next_due"]

    async def run_one(self, job_id: str, slot: datetime) -> None:
        """claim+run: one job in its own transaction, ticklock's round trips."""
        outcome = "error"
        try:
            async with self.pool.acquire() as con:
                try:
                    status = await con.execute(
                        f"{BEGIN}; SELECT 1 WHERE pg_try_advisory_xact_lock({lock_key(job_id)})"
                    )
                    if status != "SELECT 1":
                        outcome = "locked"
                        await con.execute("ROLLBACK")
                        return
                    row = await con.fetchrow(READ, job_id)
                    if row["claimed_by"] != self.owner or (
                        row["last_slot"] is not None and row["last_slot"] >= slot
                    ):
                        outcome = "skipped"
                        await con.execute("ROLLBACK")
                        return
                    started = utcnow()
                    await handler(con, job_id, slot, self.owner, self.handler_ms)
                    finished = utcnow()
                    due = finished + timedelta(seconds=INTERVAL)
                    status = await con.execute(
                        COMMIT_ONE, job_id, slot, started, finished, self.owner, due
                    )
                    await con.execute("COMMIT")
                    outcome = "success" if status == "INSERT 0 1" else "fenced"
                except BaseException:
                    if not con.is_closed() and con.is_in_transaction():
                        await con.execute("ROLLBACK")
                    raise
        except (asyncpg.PostgresError, OSError) as exc:
            self.errors[type(exc).__name__] += 1
        finally:
            self.runs.append((time.time(), outcome))

    async def run_batch(self, con: Any, jobs: list[tuple[str, datetime]]) -> None:
        """run-in-claim: the claimed batch's handlers in the claim's transaction."""
        outcome = "error"
        try:
            starts, ends = [], []
            for job_id, slot in jobs:
                starts.append(utcnow())
                await handler(con, job_id, slot, self.owner, self.handler_ms)
                ends.append(utcnow())
            await con.execute(
                COMMIT_BATCH,
                [j for j, _ in jobs],
                [s for _, s in jobs],
                starts,
                ends,
                [e + timedelta(seconds=INTERVAL) for e in ends],
                self.owner,
            )
            await con.execute("COMMIT")
            outcome = "success"
        except (asyncpg.PostgresError, OSError) as exc:
            self.errors[type(exc).__name__] += 1
        finally:
            await self.pool.release(con)  # rolls back what didn't commit
            self.runs.append((time.time(), f"batch {outcome}"))


async def replica_main(
    dsn: str, variant: str, owner: str, poll: float, handler_ms: float, out: str
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=POOL_MAX, reset=no_reset)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    replica = Replica(pool, owner, variant, poll, handler_ms)
    await replica.loop(stop)
    if replica.tasks:
        await asyncio.wait(replica.tasks, timeout=5)
    dump(out, {"claims": replica.claims, "runs": replica.runs, "errors": replica.errors})
    await pool.close()


def dump(out: str, data: dict[str, Any]) -> None:
    Path(out).write_text(json.dumps(data))


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def server_cpu(postmaster: int) -> float:
    """CPU seconds used so far by one server's processes: ``postgres_cpu`` from
    ``benchmarks.postgres`` counts every server on the machine, this one those of the server
    under test only (another benchmark may run a server of its own at the same time)."""
    from benchmarks.postgres import postgres_pids

    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in postgres_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if pid == postmaster or int(stat[1]) == postmaster:
                total += (int(stat[11]) + int(stat[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


async def setup(admin: Any, jobs: int, first_due: float) -> None:
    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await admin.execute(f"CREATE SCHEMA {SCHEMA}")
    await admin.execute(
        f"CREATE TABLE {SCHEMA}.jobs (job_id text PRIMARY KEY, next_due timestamptz NOT NULL, "
        "last_slot timestamptz, last_end timestamptz, claimed_by text, "
        "claimed_until timestamptz)"
    )
    await admin.execute(f"CREATE INDEX ON {SCHEMA}.jobs (next_due)")
    await admin.execute(
        f"CREATE TABLE {SCHEMA}.runs (job_id text NOT NULL, slot timestamptz NOT NULL, "
        "started_at timestamptz NOT NULL, finished_at timestamptz NOT NULL, owner text NOT NULL)"
    )
    await admin.execute(
        f"CREATE TABLE {SCHEMA}.writes (job_id text NOT NULL, slot timestamptz NOT NULL, "
        "owner text NOT NULL)"
    )
    await admin.execute(
        f"INSERT INTO {SCHEMA}.jobs (job_id, next_due) SELECT 'job-' || i, "
        "now() + $2 * interval '1 s' FROM generate_series(0, $1 - 1) AS i",
        jobs,
        first_due,
    )
    await admin.execute(f"VACUUM ANALYZE {SCHEMA}.jobs")
    # this session's counts reach pg_stat_database now, not 10 s later inside the window
    await admin.execute("SELECT pg_stat_force_next_flush()")


async def measure(
    dsn: str,
    variant: str,
    replicas: int,
    jobs: int,
    seconds: float,
    poll: float,
    idle: bool,
    handler_ms: float = 0.0,
) -> dict[str, Any]:
    from benchmarks.postgres import pct

    admin = await asyncpg.connect(dsn)
    postmaster = parent_of(await admin.fetchval("SELECT pg_backend_pid()"))
    await setup(admin, jobs, 3600.0 if idle else 0.0)
    warm_up = 3.0 if idle else WARM_UP
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"r{i}.json" for i in range(replicas)]
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.skip_locked", "--replica", "--dsn", dsn,
                "--variant", variant, "--owner", f"r{i}", "--poll", str(poll),
                "--handler-ms", str(handler_ms),
                "--out", str(outs[i]), cwd=str(HERE.parent),
            )
            for i in range(replicas)
        ]  # fmt: skip
        await asyncio.sleep(warm_up)
        x0, cpu0, t0 = await admin.fetchval(STATS), server_cpu(postmaster), time.time()
        await asyncio.sleep(seconds)
        # read before the replicas stop: their backends' CPU time leaves /proc with them
        x1, cpu1, t1 = await admin.fetchval(STATS), server_cpu(postmaster), time.time()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [await asyncio.wait_for(proc.wait(), 30) for proc in procs]
        reports = [json.loads(out.read_text()) for out in outs if out.exists()]
    rows = await admin.fetch(
        f"SELECT job_id, slot, started_at, finished_at FROM {SCHEMA}.runs "
        "ORDER BY job_id, started_at"
    )
    # handler writes that no run record of the same job, slot and owner vouches for
    orphans = await admin.fetchval(
        f"SELECT count(*) FROM {SCHEMA}.writes AS w WHERE NOT EXISTS (SELECT FROM "
        f"{SCHEMA}.runs AS r WHERE (r.job_id, r.slot, r.owner) = (w.job_id, w.slot, w.owner))"
    )
    await admin.close()
    elapsed = t1 - t0
    inside = [r for r in rows if t0 <= r["started_at"].timestamp() <= t1]
    late_ms = [(r["started_at"] - r["slot"]).total_seconds() * 1000 for r in inside]
    gaps: list[float] = []
    previous: dict[str, Any] = {}
    for r in rows:
        prev = previous.get(r["job_id"])
        if prev is not None and t0 <= r["started_at"].timestamp() <= t1:
            gaps.append((r["started_at"] - prev["finished_at"]).total_seconds())
        previous[r["job_id"]] = r
    claims = [n for rep in reports for t, n in rep["claims"] if t0 <= t <= t1]
    runs_tx = Counter(o for rep in reports for t, o in rep["runs"] if t0 <= t <= t1)
    errors: Counter[str] = Counter()
    for rep in reports:
        errors.update(rep["errors"])
    committed = len(inside)
    transactions = x1 - x0
    client_tx = len(claims) * (1 if variant == "claim+run" else 0) + sum(runs_tx.values())
    result: dict[str, Any] = {
        "variant": variant,
        "replicas": replicas,
        "jobs": jobs,
        "workload": "idle (every job due in an hour)" if idle else f"every({INTERVAL:g} s)",
        "handler": f"write + sleep {handler_ms:g} ms" if handler_ms else "empty",
        "poll_s": poll,
        "window_s": round(elapsed, 2),
        "committed_runs": committed,
        "runs_owed": round(0 if idle else jobs * elapsed / INTERVAL),
        "transactions": transactions,
        "transactions_counted_by_replicas": client_tx,
        "claims": len(claims),
        "empty_claims": sum(1 for n in claims if n == 0),
        "database_cpu_percent": 100 * (cpu1 - cpu0) / elapsed,
        "run_transactions": dict(runs_tx),
        "errors": dict(errors),
        "replica_exit_codes": codes,
    }
    if idle:
        result["transactions_per_second_per_replica"] = transactions / elapsed / replicas
        result["claims_per_second_per_replica"] = len(claims) / elapsed / replicas
        return result
    result |= {
        "transactions_per_committed_run": transactions / committed if committed else None,
        "claims_per_committed_run": len(claims) / committed if committed else None,
        "mean_jobs_per_nonempty_claim": (
            sum(claims) / sum(1 for n in claims if n) if any(claims) else None
        ),
        "lateness_p50_ms": pct(late_ms, 0.5) if late_ms else None,
        "lateness_p99_ms": pct(late_ms, 0.99) if late_ms else None,
        "lateness_max_ms": max(late_ms) if late_ms else None,
        "slots_run_twice": len(rows) - len({(r["job_id"], r["slot"]) for r in rows}),
        "writes_without_their_run": orphans,
        "max_gap_s": max(gaps) if gaps else None,
    }
    return result


async def main_async(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    from benchmarks.run import machine

    admin = await asyncpg.connect(dsn)
    facts = machine() | {
        "nproc": len(os.sched_getaffinity(0)),
        "postgresql": await admin.fetchval("SHOW server_version"),
        "asyncpg": asyncpg.__version__,
    }
    await admin.close()
    report: dict[str, Any] = {
        "machine": facts,
        "settings": {
            "batch": BATCH,
            "poll_s": args.poll,
            "lease_s": LEASE,
            "transaction_timeout_ms": TIMEOUT_MS,
            "pool_max": POOL_MAX,
            "warm_up_s": WARM_UP,
        },
        "results": {},
    }
    print(json.dumps(report), flush=True)
    if args.replicas or args.jobs or args.handler_ms:
        points = [(args.replicas or 8, args.jobs or 250, args.handler_ms)]
    else:
        points = [(8, 250, 0.0), (4, 250, 0.0), (8, 250, 50.0)]
    for replicas, jobs, handler_ms in points:
        for variant in VARIANTS:
            key = f"{replicas}x{jobs} {variant}"
            if handler_ms:
                key += f" write {handler_ms:g} ms"
            report["results"][key] = await measure(
                dsn, variant, replicas, jobs, args.seconds, args.poll, False, handler_ms
            )
            print(json.dumps({key: report["results"][key]}, default=str), flush=True)
    if args.idle_seconds > 0:
        replicas = args.replicas or 8
        for variant in VARIANTS:
            key = f"idle {replicas} {variant}"
            report["results"][key] = await measure(
                dsn, variant, replicas, args.jobs or 250, args.idle_seconds, args.poll, idle=True
            )
            print(json.dumps({key: report["results"][key]}, default=str), flush=True)
    report["machine"]["load_average_after"] = os.getloadavg()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--poll", type=float, default=POLL)
    parser.add_argument("--handler-ms", type=float, default=0.0)
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--out", default=str(HERE / "results" / "skip-locked.json"))
    parser.add_argument("--replica", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--owner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        replica = replica_main(
            args.dsn, args.variant, args.owner, args.poll, args.handler_ms, args.out
        )
        asyncio.run(replica)
        return
    from benchmarks.postgres import database

    with database(args.dsn) as dsn:
        report = asyncio.run(main_async(args, dsn))
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"written {out}")


if __name__ == "__main__":
    main()
