"""PostgreSQL coordination in one process against a real server: G2, G4, G6, G7 and §4."""

from __future__ import annotations

import logging
import random
from datetime import datetime, timedelta, timezone
from typing import Any

import anyio
import asyncpg
import pytest

import ticklock._backends.postgres.database
from helpers import add_lock_holder, at, eventually, run_log
from pgserver import TempPostgres
from ticklock import JobContext, Outcome, Scheduler, SystemClock, cron, every, lock_key
from ticklock._backends.postgres.retention import Retention
from ticklock._backends.postgres.schema import migrate
from ticklock.testing import ManualClock

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def count(conn: Any, sql: str, *args: object) -> int:
    return int(await conn.fetchval(sql, *args))


async def test_a_handler_that_writes_then_raises_leaves_nothing_and_is_recorded(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="me")

    @scheduler.job(every(3600, initial_delay=3000), id="crashy")
    async def crashy(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'x')", ctx.slot)
        raise RuntimeError("after the write")

    async with scheduler:
        result = await scheduler.run_now("crashy")
    assert result.outcome is Outcome.FAILURE
    assert result.error == "RuntimeError: after the write"
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0
    rows = await pg_conn.fetch(
        f"SELECT outcome, owner, error FROM {pg_schema}.runs WHERE job_id = 'crashy'"
    )
    assert [tuple(r) for r in rows].count(("failure", "me", "RuntimeError: after the write")) >= 1
    state = await pg_conn.fetchrow(
        f"SELECT last_slot, consecutive_failures, last_outcome FROM {pg_schema}.jobs "
        "WHERE job_id = 'crashy'"
    )
    assert state["last_slot"] is None and state["consecutive_failures"] >= 1
    assert state["last_outcome"] == "failure"


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError(2, "No such file or directory", "/run/secrets/api-key"),
        TimeoutError("the API did not answer"),
        ConnectionRefusedError(111, "Connect call failed ('10.0.0.9', 443)"),
    ],
    ids=["secret-file-missing", "own-timeout", "api-refused"],
)
async def test_a_handler_s_own_os_error_is_a_failure_not_the_database_s_error(
    pg_dsn: str, pg_schema: str, exc: OSError
) -> None:
    # the handler's own I/O failed (a secret file missing on this host, a timeout of its own,
    # an API refusing): a failure of the handler, which a failing owner counts to give the job
    # up, never the outcome of a database outage
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="me")

    @scheduler.job(every(3600, initial_delay=3000), id="secret")
    async def secret(ctx: JobContext) -> None:
        raise exc

    async with scheduler:
        result = await scheduler.run_now("secret")
    assert result.outcome is Outcome.FAILURE
    assert result.error is not None and result.error.startswith(type(exc).__name__)


async def test_success_commits_writes_watermark_and_record_together(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="me")

    @scheduler.job(every(3600, initial_delay=3000), id="writer")
    async def writer(ctx: JobContext) -> dict[str, str]:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'ok')", ctx.slot)
        timeouts = await ctx.conn.fetchrow(
            "SELECT current_setting('statement_timeout') AS st, "
            "current_setting('idle_in_transaction_session_timeout') AS idle, "
            "current_setting('transaction_timeout', true) AS tx"
        )
        assert timeouts is not None
        return dict(timeouts)

    async with scheduler:
        result = await scheduler.run_now("writer")
    assert result.outcome is Outcome.SUCCESS
    # SET LOCAL from the job's timeout (3600 / 2 capped at 300 s) plus the 1 s server grace:
    # transaction_timeout alone on PostgreSQL 17+ (it bounds the statements and the idle time
    # too), the statement and idle timeouts before it
    if result.report["tx"] is None:
        assert result.report["st"] == "301s" and result.report["idle"] == "301s"
    else:
        assert result.report["tx"] == "301s"
        assert result.report["st"] == "0" and result.report["idle"] == "0"
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 1
    row = await pg_conn.fetchrow(
        f"SELECT last_slot, last_success_at FROM {pg_schema}.jobs WHERE job_id = 'writer'"
    )
    assert row["last_slot"] == result.slot and row["last_success_at"] == result.finished_at
    report = await pg_conn.fetchval(
        f"SELECT report FROM {pg_schema}.runs WHERE job_id = 'writer' AND outcome = 'success'"
    )
    assert report is not None and '"st"' in report


async def test_a_handler_that_commits_the_tick_transaction_gets_a_failure_and_commits_nothing(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    # A COMMIT through ctx.conn would end the tick's transaction and release the job's lock
    # with it, leaving what the handler writes after it unguarded: it is refused before it
    # reaches the server, and the run rolls back as any failure does.
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(every(3600, initial_delay=3000), id="committer")
    async def committer(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'before')", ctx.slot)
        await ctx.conn.execute("COMMIT")
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'unguarded')", ctx.slot)

    async with scheduler:
        result = await scheduler.run_now("committer")
    assert result.outcome is Outcome.FAILURE
    assert result.error is not None
    assert result.error.startswith("StatementRefused: ctx.conn.execute(): 'COMMIT' would end ")
    assert await pg_conn.fetchval(f"SELECT count(*) FROM {table}") == 0
    watermark = await pg_conn.fetchval(
        f"SELECT last_slot FROM {pg_schema}.jobs WHERE job_id = 'committer'"
    )
    assert watermark is None  # the slot is not marked done: the next run covers it again


async def test_set_local_never_leaks_to_the_pooled_connection(pg_dsn: str, pg_schema: str) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    try:
        scheduler = Scheduler(pool=pool, schema=pg_schema)

        @scheduler.job(every(60), id="x", timeout=5)
        async def x(ctx: JobContext) -> None:
            pass

        async with scheduler:
            assert (await scheduler.run_now("x")).outcome is Outcome.SUCCESS
        # the user's pool stays open, and its only connection has the server defaults
        async with pool.acquire() as conn:
            assert await conn.fetchval("SHOW statement_timeout") == "0"
            assert await conn.fetchval("SHOW idle_in_transaction_session_timeout") == "0"
    finally:
        await pool.close()


async def test_session_state_a_handler_leaves_is_reset_before_the_next_tick(
    pg_dsn: str, pg_schema: str
) -> None:
    # ticklock's own pool folds asyncpg's reset into the tick's COMMIT/ROLLBACK and skips the
    # pool's separate reset round trip: what one run leaves in the session must still be gone.
    scheduler = Scheduler(pg_dsn, schema=pg_schema)
    seen: list[tuple[int, str, int, list[str]]] = []
    fail = [False]

    @scheduler.job(every(3600, initial_delay=3000), id="dirty", timeout=5)
    async def dirty(ctx: JobContext) -> None:
        conn = ctx.conn
        assert conn is not None
        row = await conn.fetchrow(
            "SELECT pg_backend_pid(), current_setting('search_path'), "
            "(SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND pid = pg_backend_pid() AND objid = 4242), "
            "ARRAY(SELECT pg_listening_channels())"
        )
        assert row is not None
        seen.append((row[0], row[1], row[2], list(row[3])))
        await conn.execute("SET search_path = nowhere")  # session-level, not LOCAL
        await conn.execute("SELECT pg_advisory_lock(4242)")  # a session lock: not transactional
        await conn.execute("LISTEN ticklock_test")
        if fail[0]:
            raise RuntimeError("after dirtying the session")

    async with scheduler:
        for failing in (False, False, True, False):
            fail[0] = failing
            expected = Outcome.FAILURE if failing else Outcome.SUCCESS
            assert (await scheduler.run_now("dirty")).outcome is expected
    assert len(seen) == 4
    # (the replica's heartbeat may hold a second connection of the pool meanwhile)
    assert len({pid for pid, *_ in seen}) < len(seen), "ticks should reuse pool connections"
    for _, search_path, locks, channels in seen:
        assert search_path == '"$user", public'
        assert locks == 0
        assert channels == []


async def test_timeout_and_shutdown_roll_back_and_are_recorded(
    pg_dsn: str, pg_schema: str, pg_conn: Any, table: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, shutdown_grace=0.2)
    started = anyio.Event()

    @scheduler.job(every(3600), id="slow", timeout=0.3)
    async def slow(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'slow')", ctx.slot)
        await anyio.sleep(5)

    @scheduler.job(every(3600), id="in-flight", timeout=60)
    async def in_flight(ctx: JobContext) -> None:
        assert ctx.conn is not None
        await ctx.conn.execute(f"INSERT INTO {table} VALUES ($1, 'in-flight')", ctx.slot)
        started.set()
        await anyio.sleep(30)

    with run_log() as log:
        async with scheduler:
            with anyio.fail_after(10):
                await started.wait()

            async def timed_out() -> bool:
                return "timeout" in log.outcomes("slow")

            await eventually(timed_out, 10, "the slow run to time out")
        # leaving the block cancelled "in-flight" after the 0.2 s grace
    assert "cancelled" in log.outcomes("in-flight")
    assert await count(pg_conn, f"SELECT count(*) FROM {table}") == 0
    outcomes = {
        r["job_id"]: r["outcome"]
        for r in await pg_conn.fetch(f"SELECT job_id, outcome FROM {pg_schema}.runs")
    }
    assert outcomes["in-flight"] == "cancelled" and outcomes["slow"] == "timeout"
    # no connection, transaction or lock left behind
    leftovers = await count(
        pg_conn,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    )
    assert leftovers == 0
    assert await count(pg_conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") == 0


async def test_a_commit_cut_short_by_its_bound_is_an_error_not_a_success(
    pg_dsn: str,
    pg_schema: str,
    pg_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The commit runs shielded but bounded (a stalled server or network must not hang the
    # tick). A commit the bound cut short had been reported as a success: the watermark
    # rolled back while the run, its gauge and health said it had committed.
    monkeypatch.setattr(ticklock._backends.postgres.database, "CLEANUP_SECONDS", 0.5)
    caplog.set_level(logging.WARNING, logger="ticklock")
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(every(3600, initial_delay=3000), id="stalled")
    async def stalled(ctx: JobContext) -> None:
        pass

    async with scheduler:
        # another session holds the job's row, so the tick's watermark write waits on it
        holder = pg_conn.transaction()
        await holder.start()
        await pg_conn.execute(f"SELECT FROM {pg_schema}.jobs WHERE job_id = 'stalled' FOR UPDATE")
        with anyio.fail_after(10):
            result = await scheduler.run_now("stalled")
        await holder.rollback()
        health = {h.job_id: h for h in scheduler.health()}["stalled"]
    assert result.outcome is Outcome.ERROR
    assert result.error is not None and "did not finish within 0.5 s" in result.error
    assert health.last_success is None and health.consecutive_failures == 1
    watermark = await pg_conn.fetchval(
        f"SELECT last_slot FROM {pg_schema}.jobs WHERE job_id = 'stalled'"
    )
    assert watermark is None
    # its failure record waited on the same row and was cut short too: that is said, not lost
    assert any("could not record the error of stalled" in r.message for r in caplog.records)


async def test_catch_up_covers_a_window_missed_by_the_whole_fleet(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    seen: list[tuple[str, str | None]] = []

    def build(clock: ManualClock, catch_up: bool) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)

        @scheduler.job(cron("0 * * * *"), id="hourly", catch_up=catch_up)
        async def hourly(ctx: JobContext) -> None:
            prev = ctx.previous_success
            seen.append((ctx.slot.strftime("%H:%M"), prev.strftime("%H:%M") if prev else None))

        return scheduler

    async def ran(n: int) -> bool:
        return len(seen) >= n

    clock = ManualClock(at("2020-01-01T00:59:00Z"))
    async with build(clock, True):
        await clock.advance(60)
        await eventually(lambda: ran(1), 10, "the 01:00 run")
    # every replica is down across 02:00 and 03:00; one starts at 03:30
    async with build(ManualClock(at("2020-01-01T03:30:00Z")), True):
        await eventually(lambda: ran(2), 10, "the catch-up run")
    assert seen == [("01:00", None), ("03:00", "01:00")]
    # with catch_up=False the missed 04:00 and 05:00 are skipped: nothing runs at 05:30
    async with build(ManualClock(at("2020-01-01T05:30:00Z")), False):
        await anyio.sleep(0.5)
    assert len(seen) == 2
    watermark = await pg_conn.fetchval(
        f"SELECT last_slot FROM {pg_schema}.jobs WHERE job_id = 'hourly'"
    )
    assert watermark == at("2020-01-01T03:00:00Z")


async def test_two_schedulers_locked_and_skipped(pg_dsn: str, pg_schema: str) -> None:
    gate = anyio.Event()
    entered = anyio.Event()

    def build(owner: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner)
        add_lock_holder(scheduler, entered, gate)
        return scheduler

    a, b = build("a"), build("b")
    async with a, b:
        await eventually(lambda: _is_set(entered), 10, "a run to hold the lock")
        locked = await b.run_now("shared")
        assert locked.outcome is Outcome.LOCKED
        gate.set()
    # both replicas woke for the first slot: one ran it, the other skipped or was locked
    async with build("c") as c:
        (h,) = [h for h in c.health() if h.job_id == "shared"]
        assert h.last_success is not None


async def test_a_follower_does_not_call_a_job_overdue_while_another_replica_runs_it(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # A replica that finds the lock held learns the outcome of that run only at its next
    # attempt (once that run must have ended). Judged from the success it last read, it
    # called the job overdue in between, at every slot the other replica ran (45 % of the
    # time in a real two-replica run): a /health endpoint on every follower flapped to 503
    # while the job was fine.
    clock = ManualClock(at("2020-01-01T00:00:00Z"))
    scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)
    runs: list[str] = []

    @scheduler.job(every(100, initial_delay=50), id="shared", timeout=10, overdue_grace=1)
    async def shared(ctx: JobContext) -> None:
        runs.append(ctx.slot.strftime("%H:%M:%S"))
        if len(runs) > 1:
            raise RuntimeError("the run after the other replica's fails")

    def overdue() -> bool:
        return {h.job_id: h for h in scheduler.health()}["shared"].overdue

    key = lock_key("default", "shared")
    with run_log() as log:
        async with scheduler:
            assert (await scheduler.run_now("shared")).outcome is Outcome.SUCCESS  # 00:00:00
            # another replica holds the job's lock from now on: it is running the job
            await pg_conn.execute("SELECT pg_advisory_lock($1)", key)
            await clock.advance(100)

            async def locked() -> bool:
                return "locked" in log.outcomes("shared")

            await eventually(locked, 10, "the 00:01:40 attempt to find the lock held")
            # past the limit of the success this replica read (00:01:40 + 10 s + 1 s): that
            # run may have succeeded, so not overdue; this replica attempts again once that
            # run must have ended (10 s + 2 s after it found the lock held), and finds it held
            await clock.advance(12)

            async def locked_again() -> bool:
                return log.outcomes("shared").count("locked") == 2

            await eventually(locked_again, 10, "the 00:01:52 attempt to find the lock held")
            assert not overdue()
            # the other replica's run ended without a record; this replica's next attempt,
            # 12 s on, reads that, runs the slot and fails: failing, and not overdue (its run
            # finished). (Issue 33 item 9: it attempted a period after it found the lock held.)
            await pg_conn.execute("SELECT pg_advisory_unlock($1)", key)
            await clock.advance(12)

            async def failed() -> bool:
                return "failure" in log.outcomes("shared")

            await eventually(failed, 10, "the retry to run and fail")
            assert not overdue()
            assert {h.job_id: h for h in scheduler.health()}["shared"].failing
    assert runs == ["00:00:00", "00:01:40"]


@pytest.mark.parametrize("schema_key", [True, False], ids=["schema-key", "key-without-schema"])
async def test_a_job_whose_lock_stays_held_turns_overdue_on_the_replica_that_finds_it_held(
    pg_dsn: str, pg_schema: str, pg_conn: Any, schema_key: bool
) -> None:
    # An operator holds the job off by hand (its schema's key; or the key without a schema,
    # as a replica of an earlier release holds it), or a holder no replica may end: the job
    # has stopped. This replica presumes a run it found holding the lock ends within its timeout,
    # but no run holds a lock longer than its bound: attempt after attempt finding it held
    # must not keep moving the absence clock, or health() never raises the alarm.
    clock = ManualClock(at("2020-01-01T00:00:00Z"))
    scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=clock)

    @scheduler.job(every(100, initial_delay=50), id="held", timeout=10, overdue_grace=1)
    async def held(ctx: JobContext) -> None:
        pass

    def overdue() -> bool:
        return {h.job_id: h for h in scheduler.health()}["held"].overdue

    key = lock_key("default", "held", schema=pg_schema if schema_key else None)
    with run_log() as log:
        async with scheduler:
            assert (await scheduler.run_now("held")).outcome is Outcome.SUCCESS  # 00:00:00
            await pg_conn.execute("SELECT pg_advisory_lock($1)", key)
            try:
                for attempts in range(1, 31):  # 00:01:40, then every 12 s: 00:07:28
                    await clock.advance(100 if attempts == 1 else 12)

                    async def locked(n: int = attempts) -> bool:
                        return log.outcomes("held").count("locked") >= n

                    await eventually(locked, 10, f"attempt {attempts} to find the lock held")
                # the slot was due at 00:01:40: by any bound of a run that found it held
                # (its timeout, its server-side bound), it has stopped
                assert overdue()
            finally:
                await pg_conn.execute("SELECT pg_advisory_unlock($1)", key)


async def _is_set(event: anyio.Event) -> bool:
    return event.is_set()


async def test_a_database_outage_gives_error_and_ticks_resume_by_themselves() -> None:
    server = TempPostgres()
    server.start()
    try:
        scheduler = Scheduler(server.dsn)
        results: list[str] = []

        @scheduler.job(every(0.2), id="beat", timeout=0.15)
        async def beat(ctx: JobContext) -> None:
            assert ctx.conn is not None
            await ctx.conn.execute("SELECT 1")

        with run_log() as log:
            async with scheduler:

                async def successes(n: int) -> bool:
                    return log.outcomes("beat").count("success") >= n

                await eventually(lambda: successes(2), 10, "runs before the outage")
                await anyio.to_thread.run_sync(server.stop, "immediate")

                async def errors() -> bool:
                    return "error" in log.outcomes("beat")

                await eventually(errors, 10, "ticks failing with outcome error")
                before = log.outcomes("beat").count("success")
                await anyio.to_thread.run_sync(server.start)
                await eventually(lambda: successes(before + 2), 20, "ticks to resume")
            results = log.outcomes("beat")
        assert "error" in results and results[-1] == "success"
    finally:
        server.cleanup()


async def test_migrations_are_idempotent_and_safe_concurrently(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    conns = [await asyncpg.connect(pg_dsn) for _ in range(4)]
    try:
        async with anyio.create_task_group() as tg:
            for conn in conns:
                tg.start_soon(migrate, conn, pg_schema)
        await migrate(conns[0], pg_schema)
    finally:
        for conn in conns:
            await conn.close()
    tables = await pg_conn.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 "
        "ORDER BY table_name",
        pg_schema,
    )
    assert [t["table_name"] for t in tables] == [
        "audit",
        "backfilled",
        "backfills",
        "counts",
        "firsts",
        "jobs",
        "outages",
        "pauses",
        "presence",
        "replicas",
        "runs",
        "schedule_log",
        "schema_version",
        "seals",
    ]
    assert await count(pg_conn, f"SELECT count(*) FROM {pg_schema}.schema_version") == 1


async def test_retention_is_a_listed_job_that_prunes_old_runs(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # on a clock that stands still, only run_now() runs it
    clock = ManualClock(at("2020-01-01T00:00:00Z"))
    scheduler = Scheduler(pg_dsn, schema=pg_schema, retention=timedelta(days=1), clock=clock)
    assert "ticklock.retention" in scheduler.jobs
    async with scheduler:
        await pg_conn.execute(
            f"INSERT INTO {pg_schema}.runs (namespace, job_id, slot, started_at, finished_at, "
            "outcome, owner) VALUES ('default', 'old', now() - interval '3 days', "
            "now() - interval '3 days', now() - interval '3 days', 'success', 'x'), "
            "('default', 'new', now(), now(), now(), 'success', 'x')"
        )
        result = await scheduler.run_now("ticklock.retention")
    assert result.outcome is Outcome.SUCCESS
    assert result.report == {"deleted": 1, "capped": False}
    jobs = [r["job_id"] for r in await pg_conn.fetch(f"SELECT job_id FROM {pg_schema}.runs")]
    assert "old" not in jobs and "new" in jobs


async def test_retention_prunes_the_ledgers_records_with_the_history(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    clock = ManualClock(at("2020-01-01T00:00:00Z"))
    scheduler = Scheduler(pg_dsn, schema=pg_schema, retention=timedelta(days=1), clock=clock)
    s = pg_schema
    async with scheduler:
        for age in ("3 days", "1 hour"):
            old = f"now() - interval '{age}'"
            await pg_conn.execute(
                f"INSERT INTO {s}.presence (namespace, owner, started_at, since, until, jobs, "
                f"disabled) VALUES ('default', '{age}', {old}, {old}, {old}, '{{j}}', '{{}}'); "
                f"INSERT INTO {s}.outages (namespace, owner, since, until) "
                f"VALUES ('default', '{age}', {old}, {old}); "
                f"INSERT INTO {s}.audit (namespace, job_id, at, action, who, changed) "
                f"VALUES ('default', 'j', {old}, 'pause', '{age}', true); "
                # a backfilled run, its mark and its finished backfill
                f"WITH r AS (INSERT INTO {s}.runs (namespace, job_id, slot, started_at, "
                f"finished_at, outcome, owner) VALUES ('default', 'j', {old}, {old}, {old}, "
                f"'success', 'x') RETURNING id) INSERT INTO {s}.backfilled (run_id, request, "
                f"who) SELECT id, 0, '{age}' FROM r; "
                f"INSERT INTO {s}.backfills (namespace, job_id, slots, who, finished_at) "
                f"VALUES ('default', 'j', '{{}}', '{age}', {old})"
            )
        assert (await scheduler.run_now("ticklock.retention")).outcome is Outcome.SUCCESS
    for table, column in (
        ("presence", "owner"),
        ("outages", "owner"),
        ("audit", "who"),
        ("backfilled", "who"),
        ("backfills", "who"),
    ):
        kept = [r[0] for r in await pg_conn.fetch(f"SELECT {column} FROM {s}.{table}")]
        assert "3 days" not in kept and "1 hour" in kept, (table, kept)


async def test_retention_works_off_a_backlog_batch_by_batch_and_says_so(
    pg_dsn: str, pg_schema: str, pg_conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run deletes one bounded batch (a short tick) and says when it left a backlog; the
    # job runs every minute, so that a busy fleet's history does not outgrow it.
    monkeypatch.setattr(Retention, "BATCH", 2)
    clock = ManualClock(datetime.now(timezone.utc))  # its own run records are new
    scheduler = Scheduler(
        pg_dsn,
        schema=pg_schema,
        retention=timedelta(days=1),
        clock=clock,
        random=random.Random(1),  # its first slot's jitter: 1.3 s, after the four run_now()
    )
    assert scheduler.jobs["ticklock.retention"].trigger.period == 60
    async with scheduler:
        await pg_conn.execute(
            f"INSERT INTO {pg_schema}.runs (namespace, job_id, started_at, finished_at, outcome, "
            "owner) SELECT 'default', 'old', now() - interval '3 days', "
            "now() - interval '3 days', 'success', 'x' FROM generate_series(1, 5)"
        )
        reports = []
        for _ in range(4):
            reports.append((await scheduler.run_now("ticklock.retention")).report)
            await clock.advance(0.001)  # run_now's slot is now: one run per instant
    assert reports == [
        {"deleted": 2, "capped": True},
        {"deleted": 2, "capped": True},
        {"deleted": 1, "capped": False},
        {"deleted": 0, "capped": False},
    ]


async def test_a_changed_schedule_moves_the_overdue_instant_that_status_reads(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # `ticklock status` judges a job overdue from the instant stored with its last success.
    # A deploy that lengthens the job's period must move it at start, or status reports the
    # job overdue until its first success on the new schedule (a day, here).
    start = at("2020-01-01T00:00:00Z")

    async def tidy(ctx: JobContext) -> None:
        pass

    def build(period: float) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, clock=ManualClock(start))
        scheduler.add(tidy, every(period, initial_delay=60), id="tidy", timeout=5, overdue_grace=1)
        return scheduler

    async def stored() -> Any:
        return await pg_conn.fetchval(
            f"SELECT overdue_at FROM {pg_schema}.jobs WHERE job_id = 'tidy'"
        )

    hourly = build(3600)
    async with hourly:
        assert (await hourly.run_now("tidy")).outcome is Outcome.SUCCESS  # at 00:00:00
    assert await stored() == at("2020-01-01T01:00:06Z")  # + 1 h + timeout + grace
    async with build(86400):  # deployed as a daily job; it does not run here
        pass
    assert await stored() == at("2020-01-02T00:00:06Z")
    # replicas that start together with a changed schedule update the row one at a time
    await pg_conn.execute(f"UPDATE {pg_schema}.jobs SET overdue_at = NULL")
    fleet = [build(86400) for _ in range(4)]
    async with anyio.create_task_group() as tg:
        for replica in fleet:
            tg.start_soon(replica.run)

        async def started() -> bool:
            return all(h.next_fire is not None for r in fleet for h in r.health())

        await eventually(started, 10, "four replicas to start together")
        tg.cancel_scope.cancel()
    assert await stored() == at("2020-01-02T00:00:06Z")
    version = f"SELECT xmin::text FROM {pg_schema}.jobs WHERE job_id = 'tidy'"
    before = await pg_conn.fetchval(version)
    async with build(86400):  # unchanged since: the row is not written again
        pass
    assert await stored() == at("2020-01-02T00:00:06Z")
    assert await pg_conn.fetchval(version) == before


async def test_a_skewed_replica_clock_logs_a_warning(
    pg_dsn: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    class Ahead(SystemClock):
        def now(self):  # type: ignore[no-untyped-def]
            return super().now() + timedelta(seconds=5)

    caplog.set_level(logging.WARNING, logger="ticklock")
    async with Scheduler(pg_dsn, schema=pg_schema, clock=Ahead()):
        pass
    assert any("clock differs from the database's by 5.0 s" in r.message for r in caplog.records)


def test_lock_key_is_stable() -> None:
    # pinned values: replicas of different releases must agree during a rolling deploy
    assert lock_key("default", "purge-expired") == lock_key("default", "purge-expired")
    assert lock_key("default", "a") != lock_key("other", "a")
    assert lock_key("default", "purge-expired") == -5080253436944125446
    assert -(2**63) <= lock_key("x", "y") < 2**63


async def test_namespaces_separate_applications(pg_dsn: str, pg_schema: str) -> None:
    ran: list[str] = []

    def build(namespace: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, namespace=namespace)

        @scheduler.job(every(3600), id="same-id")
        async def job(ctx: JobContext) -> None:
            ran.append(namespace)

        return scheduler

    async with build("app-a"), build("app-b"):
        await eventually(lambda: _has(ran, 2), 10, "both namespaces to run")
    assert sorted(ran) == ["app-a", "app-b"]


async def _has(items: list[str], n: int) -> bool:
    return len(items) >= n
