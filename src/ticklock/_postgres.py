"""PostgreSQL coordination: each tick is one transaction that holds the job's advisory lock.

Round trips of a tick that runs: (1) ``BEGIN; SET LOCAL ...; try the lock`` in one simple
query, (2) read the fleet state (a fresh snapshot, taken after the lock), then the handler,
(3) the watermark + success + run record in one statement, (4) ``COMMIT``. A tick that finds
the lock held takes 2 (the first and ``ROLLBACK``); one that skips takes 3.

The session reset of a released connection (``pg_advisory_unlock_all(); RESET ALL; ...``,
which undoes any session state a handler set) would be one more round trip per tick. On the
pool ticklock creates (:mod:`ticklock._pgpool`), a tick sends it in the same simple query as
its COMMIT (just before it, inside the transaction) or its ROLLBACK (just after it), and the
connection goes back to the pool at once. A pool the user passes keeps its own reset.

The lock is transaction-level (``pg_try_advisory_xact_lock``): it is released by COMMIT,
ROLLBACK or the end of the session, never by a timer, and it works through transaction-mode
poolers. ``SET LOCAL`` timeouts make the server end the session of a holder that is paused
(GC, SIGSTOP, VM suspend), which frees the lock and discards its writes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

import anyio

from ._clock import Clock
from ._coordination import FleetState
from ._job import Job, Outcome, RunResult
from ._lock_key import lock_key
from ._pgpool import ConnectionLease, ConnectionPool
from ._plan import overdue_at
from ._schema import migrate, quote

if TYPE_CHECKING:
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

logger = logging.getLogger("ticklock")

SERVER_GRACE = 1.0
"""Seconds the server-side timeouts add to the job's timeout, so that the client's own
timeout normally fires first and the server's is the backstop for a paused process."""
SKEW_WARNING = 1.0
"""A replica clock further than this from the database's logs a WARNING at start."""
CLEANUP_SECONDS = 5.0
"""How long cleanup (commit, rollback, release, failure record) may take, shielded."""
_LOST_STATES = ("08", "57")  # connection exceptions; operator intervention / query canceled
_LOST_CODES = frozenset({"25P03", "25P04"})  # idle-in-transaction / transaction timeout
_RESCHEDULE = "ticklock.reschedule"  # the advisory lock that serialises load()'s updates


class SlotAlreadyCommitted(RuntimeError):
    """The watermark was already at or past this slot: the commit was refused."""


class TransactionEnded(RuntimeError):
    """The handler ended the tick's transaction itself: the lock went with it."""


class _PgAttempt:
    __slots__ = (
        "_con",
        "_coordinator",
        "_job_id",
        "_lease",
        "_open",
        "acquired",
        "conn",
        "state",
    )

    def __init__(
        self,
        coordinator: PostgresCoordinator,
        job_id: str,
        con: asyncpg.Connection[Any],
    ) -> None:
        self._coordinator = coordinator
        self._job_id = job_id
        self._open = True  # until our own COMMIT or ROLLBACK ends the transaction
        self._con: asyncpg.Connection[Any] | None = con
        # What the handler gets: a lease on the connection (or on a given pool's proxy).
        self._lease = ConnectionLease(con)
        self.conn: asyncpg.Connection[Any] | None = cast("asyncpg.Connection[Any]", self._lease)
        self.acquired = False
        self.state = FleetState()

    async def commit(self, result: RunResult, job: Job) -> None:
        report = None if result.report is None else json.dumps(result.report)
        with self._coordinator.shielded():
            await self._write(result, report, overdue_at(job, result.finished_at))
        if self._open:  # the cleanup bound cut it short: never report that as a success
            raise TimeoutError(
                f"the commit did not finish within {CLEANUP_SECONDS:g} s (a stalled server "
                "or network): the tick is rolled back, unless its COMMIT had reached the server"
            )

    async def _write(
        self, result: RunResult, report: str | None, overdue_at: datetime | None
    ) -> None:
        assert self._con is not None
        if not self._con.is_in_transaction():
            raise TransactionEnded(
                "the handler ended the tick's transaction (a COMMIT or ROLLBACK through "
                "ctx.conn), which released the job's lock: what it wrote after that was not "
                "guarded, and the slot is not marked done. Leave the transaction to ticklock; "
                "for a partial rollback use 'async with ctx.conn.transaction()' (a savepoint)"
            )
        c = self._coordinator
        written = await self._con.fetchval(
            c.sql_commit,
            c.namespace,
            self._job_id,
            result.slot,
            result.finished_at,
            result.started_at,
            result.owner,
            report,
            overdue_at,
        )
        if written != 1:
            raise SlotAlreadyCommitted(f"slot {result.slot} of {self._job_id} is already committed")
        # The reset goes before COMMIT, inside the transaction: if it failed, nothing would
        # commit, so a run is never recorded as failed after its writes committed.
        await self._con.execute(self._reset() + "COMMIT")
        self._open = False

    def _reset(self) -> str:
        """The session reset this tick needs: none on a given pool (``reset_query`` is empty:
        it resets on release), none if the handler never touched the connection."""
        return self._coordinator.reset_query if self._lease.used else ""

    async def close(self) -> None:
        con, self._con, self.conn = self._con, None, None
        if con is None:
            return
        lease = self._lease
        lease.end()
        c = self._coordinator
        own = c.own_pool
        if own is not None and not self._open:  # our COMMIT ended it, with the reset
            own.release(con, clean=not lease.callbacks)
            return
        with c.shielded():
            try:
                if self._open and not con.is_closed():
                    # after ROLLBACK: an aborted transaction accepts no other statement
                    reset = self._reset()
                    await con.execute("ROLLBACK" + (reset and "; " + reset))
                    self._open = False
            except Exception:
                con.terminate()
            finally:
                if own is not None:
                    own.release(con, clean=not self._open and not lease.callbacks)
                else:  # asyncpg's pool: its release rolls back and resets what is left
                    assert c.given_pool is not None
                    await c.given_pool.release(cast("PoolConnectionProxy[Any]", con))


class PostgresCoordinator:
    """Coordination through one PostgreSQL database (see the module docstring)."""

    def __init__(
        self,
        *,
        dsn: str | None,
        pool: asyncpg.Pool[Any] | None,
        namespace: str,
        schema: str,
        clock: Clock,
    ) -> None:
        self._dsn = dsn
        self.given_pool = pool
        """A pool the user passed (ticks use it; it is never closed here)."""
        self.own_pool: ConnectionPool | None = None
        """The pool ticklock opened from ``dsn``, while the coordinator is open."""
        self.namespace = namespace
        self.schema = schema
        self._clock = clock
        self._transaction_timeout = False
        self._begin: dict[tuple[str, float], str] = {}  # (job id, budget): the tick's BEGIN
        self._scope_class = anyio.CancelScope
        self._loop_time = time.monotonic
        self.reset_query = ""
        """The session reset, sent with a tick's COMMIT/ROLLBACK on ticklock's own pool
        (``""`` on a given pool, which resets the session itself)."""
        s = quote(schema)
        self.sql_state = (
            "SELECT last_slot, last_end, last_success_at, consecutive_failures "
            f"FROM {s}.jobs WHERE namespace = $1 AND job_id = $2"
        )
        self.sql_register = (
            f"INSERT INTO {s}.jobs (namespace, job_id, overdue_at) "
            "SELECT $1, id, due FROM unnest($2::text[], $3::timestamptz[]) AS t(id, due) "
            "ON CONFLICT (namespace, job_id) DO NOTHING"
        )
        self.sql_reschedule = (
            f"UPDATE {s}.jobs AS j SET overdue_at = v.due "
            "FROM unnest($2::text[], $3::timestamptz[], $4::timestamptz[]) AS v(id, success, due) "
            "WHERE j.namespace = $1 AND j.job_id = v.id AND j.last_success_at = v.success "
            "AND j.overdue_at IS DISTINCT FROM v.due"
        )
        self.sql_load = (
            "SELECT job_id, overdue_at, last_slot, last_end, last_success_at, consecutive_failures "
            f"FROM {s}.jobs WHERE namespace = $1"
        )
        self.sql_commit = f"""
WITH j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_slot, last_end, last_success_at,
                               last_outcome, consecutive_failures, overdue_at, updated_at)
    VALUES ($1, $2, $3, $4, $4, 'success', 0, $8, now())
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        last_slot = EXCLUDED.last_slot,
        last_end = GREATEST(j.last_end, EXCLUDED.last_end),
        last_success_at = EXCLUDED.last_success_at,
        last_outcome = 'success', consecutive_failures = 0,
        overdue_at = EXCLUDED.overdue_at, updated_at = now()
    WHERE j.last_slot IS NULL OR j.last_slot < EXCLUDED.last_slot
    RETURNING 1
), r AS (
    INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner, report)
    SELECT $1, $2, $3, $5, $4, 'success', $6, $7::text::jsonb FROM j
)
SELECT count(*) FROM j"""
        self.sql_failure = f"""
WITH j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_end, last_outcome,
                               consecutive_failures, updated_at)
    VALUES ($1, $2, $4, $6, 1, now())
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        last_end = GREATEST(j.last_end, EXCLUDED.last_end),
        last_outcome = EXCLUDED.last_outcome,
        consecutive_failures = j.consecutive_failures + 1, updated_at = now()
    WHERE j.last_slot IS NULL OR j.last_slot < $3
)
INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner, error)
VALUES ($1, $2, $3, $5, $4, $6, $7, $8)"""

    async def open(self) -> None:
        """Create the pool (unless one was given), migrate, and check the clock."""
        # asyncpg runs on asyncio: the shielded scopes take the backend's class and the loop's
        # clock directly instead of looking the backend up for every scope
        self._scope_class = type(anyio.CancelScope())
        self._loop_time = asyncio.get_running_loop().time
        if self.given_pool is None:
            self.own_pool = ConnectionPool(self._dsn, max_size=10)
        try:
            async with self._connection() as conn:
                await migrate(conn, self.schema)
                self._transaction_timeout = conn.get_server_version().major >= 17
                if self.own_pool is not None and (query := conn.get_reset_query()):
                    self.reset_query = query if query.rstrip().endswith(";") else query + ";"
                await self._check_clock(conn)
        except BaseException:
            await self.close()
            raise

    def shielded(self) -> anyio.CancelScope:
        """Cleanup that must finish even when the tick was cancelled, but not hang forever."""
        return self._scope_class(shield=True, deadline=self._loop_time() + CLEANUP_SECONDS)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[asyncpg.Connection[Any]]:
        """A connection for ticklock's own statements outside a tick (no session state)."""
        if self.own_pool is None:
            assert self.given_pool is not None, "the coordinator is not open"
            async with self.given_pool.acquire() as proxy:
                yield cast("asyncpg.Connection[Any]", proxy)
            return
        pool = self.own_pool
        con = await pool.acquire()
        clean = False
        try:
            yield con
            clean = True
        finally:
            pool.release(con, clean)

    async def _check_clock(self, conn: asyncpg.Connection[Any]) -> None:
        before = self._clock.now()
        server = await conn.fetchval("SELECT clock_timestamp()")
        after = self._clock.now()
        local = before + (after - before) / 2
        skew = abs((server - local).total_seconds())
        if skew > SKEW_WARNING:
            logger.warning(
                "ticklock: this replica's clock differs from the database's by %.1f s; "
                "slots come from the replica clocks, so keep them NTP-synchronised",
                skew,
            )

    async def close(self) -> None:
        """Close the pool if ticklock created it (a pool the user passed stays open)."""
        pool, self.own_pool = self.own_pool, None
        if pool is not None:
            await pool.close()

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """Register the jobs (a row each, if new), read the namespace's fleet state, and move
        the overdue instants that ``ticklock status`` reads to the schedules declared now."""
        async with self._connection() as conn:
            await conn.execute(
                self.sql_register,
                self.namespace,
                list(jobs),
                [overdue_at(job, now) for job in jobs.values()],
            )
            rows = await conn.fetch(self.sql_load, self.namespace)
            states = {row["job_id"]: FleetState(*tuple(row)[2:]) for row in rows}
            # A commit stores the instant from its own schedule; a deploy that changed the
            # schedule would leave status judging by the old one until the next success.
            moved = [
                (row["job_id"], row["last_success_at"], due)
                for row in rows
                if row["job_id"] in jobs
                and row["last_success_at"] is not None
                and (due := overdue_at(jobs[row["job_id"]], row["last_success_at"]))
                != row["overdue_at"]
            ]
            if moved:
                # Replicas that start together would update the same rows: one at a time,
                # never in two orders (a deadlock). A row whose last success moved since it
                # was read is left to the commit that moved it.
                async with conn.transaction():
                    await conn.execute(
                        "SELECT pg_advisory_xact_lock($1)", lock_key(self.schema, _RESCHEDULE)
                    )
                    ids, successes, dues = (list(column) for column in zip(*moved, strict=True))
                    await conn.execute(self.sql_reschedule, self.namespace, ids, successes, dues)
        return states

    def _begin_sql(self, job_id: str, budget: float) -> str:
        sql = self._begin.get((job_id, budget))
        if sql is None:
            sql = self._begin[job_id, budget] = self._make_begin(job_id, budget)
        return sql

    def _make_begin(self, job_id: str, budget: float) -> str:
        ms = int((budget + SERVER_GRACE) * 1000)
        key = lock_key(self.namespace, job_id)  # an int we computed: safe to inline
        if self._transaction_timeout:  # PG 17+: bounds the whole transaction, idle or busy
            limits = f"SET LOCAL transaction_timeout = {ms}; "
        else:
            limits = (
                f"SET LOCAL statement_timeout = {ms}; "
                f"SET LOCAL idle_in_transaction_session_timeout = {ms}; "
            )
        # The status tag of the last statement says whether the lock was taken: "SELECT 1"
        # or "SELECT 0". No error is raised for a held lock, so the server logs nothing.
        return f"BEGIN; {limits}SELECT 1 WHERE pg_try_advisory_xact_lock({key})"

    async def attempt(self, job_id: str, budget: float) -> _PgAttempt:
        """BEGIN, set the timeouts, try the lock, and read the job's state under it."""
        if self.own_pool is not None:
            conn = await self.own_pool.acquire()
        else:
            assert self.given_pool is not None, "the coordinator is not open"
            conn = cast("asyncpg.Connection[Any]", await self.given_pool.acquire())
        attempt = _PgAttempt(self, job_id, conn)
        try:
            status = await conn.execute(self._begin_sql(job_id, budget))
            if status != "SELECT 1":
                return attempt  # held by another replica: close() rolls back
            row = await conn.fetchrow(self.sql_state, self.namespace, job_id)
            attempt.acquired = True
            if row is not None:
                attempt.state = FleetState(*tuple(row))
            return attempt
        except BaseException:
            await attempt.close()
            raise

    async def record_failure(self, result: RunResult) -> None:
        """Record a run that did not commit, in its own short transaction."""
        with self.shielded() as scope:
            await self._record(result)
        if scope.cancelled_caught:
            raise TimeoutError(f"the record did not finish within {CLEANUP_SECONDS:g} s")

    async def _record(self, result: RunResult) -> None:
        async with self._connection() as conn:
            await conn.execute(
                self.sql_failure,
                self.namespace,
                result.job_id,
                result.slot,
                result.finished_at,
                result.started_at,
                result.outcome.value,
                result.owner,
                result.error,
            )

    def classify(self, exc: BaseException) -> Outcome | None:
        """``ERROR`` when ``exc`` means the session or the server was lost."""
        import asyncpg

        if isinstance(exc, (OSError, asyncpg.InterfaceError, SlotAlreadyCommitted)):
            return Outcome.ERROR
        if isinstance(exc, asyncpg.PostgresError):
            state = exc.sqlstate or ""
            if state.startswith(_LOST_STATES) or state in _LOST_CODES:
                return Outcome.ERROR
        return None
