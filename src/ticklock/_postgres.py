"""PostgreSQL coordination: each tick is one transaction that holds the job's advisory lock.

Round trips of a tick that runs: (1) ``BEGIN; SET LOCAL ...; try the lock`` in one simple
query, (2) read the fleet state (a fresh snapshot, taken after the lock), then the handler,
(3) the watermark + success + run record in one statement, (4) ``COMMIT``. A tick that finds
the lock held takes 2 (the first and ``ROLLBACK``); one that skips takes 3.

The pool's reset of a released connection (``pg_advisory_unlock_all(); RESET ALL; ...``,
which undoes any session state a handler set) would be one more round trip per tick. On the
pool ticklock creates, a tick sends it in the same simple query as its COMMIT (just before
it, inside the transaction) or its ROLLBACK (just after it), and the pool's ``reset`` skips
connections released clean that way. A pool the user passes keeps its own reset.

The lock is transaction-level (``pg_try_advisory_xact_lock``): it is released by COMMIT,
ROLLBACK or the end of the session, never by a timer, and it works through transaction-mode
poolers. ``SET LOCAL`` timeouts make the server end the session of a holder that is paused
(GC, SIGSTOP, VM suspend), which frees the lock and discards its writes.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

import anyio

from ._clock import Clock
from ._coordination import FleetState
from ._job import Job, Outcome, RunResult
from ._lock_key import lock_key
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
_RELEASED_CLEAN: ContextVar[bool] = ContextVar("ticklock_released_clean", default=False)
"""Set around a release whose session a tick already reset (the pool's reset task copies it)."""


def _shielded() -> anyio.CancelScope:
    """Cleanup that must finish even when the tick was cancelled, but not hang forever."""
    return anyio.CancelScope(shield=True, deadline=anyio.current_time() + CLEANUP_SECONDS)


class SlotAlreadyCommitted(RuntimeError):
    """The watermark was already at or past this slot: the commit was refused."""


class _PgAttempt:
    __slots__ = (
        "_coordinator",
        "_job_id",
        "_open",
        "_proxy",
        "acquired",
        "conn",
        "state",
    )

    def __init__(
        self,
        coordinator: PostgresCoordinator,
        job_id: str,
        proxy: PoolConnectionProxy[Any],
        acquired: bool,
        state: FleetState,
    ) -> None:
        self._coordinator = coordinator
        self._job_id = job_id
        self._open = True  # until our own COMMIT or ROLLBACK ends the transaction
        self._proxy: PoolConnectionProxy[Any] | None = proxy
        # The pool's proxy forwards every Connection method: handlers see a Connection.
        self.conn: asyncpg.Connection[Any] | None = cast("asyncpg.Connection[Any]", proxy)
        self.acquired = acquired
        self.state = state

    async def commit(self, result: RunResult, job: Job) -> None:
        report = None if result.report is None else json.dumps(result.report)
        with _shielded():
            await self._write(result, report, overdue_at(job, result.finished_at))

    async def _write(
        self, result: RunResult, report: str | None, overdue_at: datetime | None
    ) -> None:
        assert self.conn is not None
        c = self._coordinator
        written = await self.conn.fetchval(
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
        await self.conn.execute(c.reset_query + "COMMIT")
        self._open = False

    async def close(self) -> None:
        conn, self._proxy, self.conn = self._proxy, None, None
        if conn is None:
            return
        c = self._coordinator
        with _shielded():
            try:
                if self._open and not conn.is_closed():
                    # A handler had the session only if the lock was taken.
                    # after ROLLBACK: an aborted transaction accepts no other statement
                    reset = "; " + c.reset_query if self.acquired and c.reset_query else ""
                    await conn.execute("ROLLBACK" + reset)
                    self._open = False
            except Exception:
                conn.terminate()
            finally:
                # ended by our own COMMIT/ROLLBACK, which carried the reset where one was due
                token = _RELEASED_CLEAN.set(not self._open and bool(c.reset_query))
                try:
                    await c.pool.release(conn)
                finally:
                    _RELEASED_CLEAN.reset(token)


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
        self._given_pool = pool
        self._pool: asyncpg.Pool[Any] | None = None
        self.namespace = namespace
        self.schema = schema
        self._clock = clock
        self._transaction_timeout = False
        self.reset_query = ""
        """The pool's session reset, sent with a tick's COMMIT/ROLLBACK on ticklock's own pool
        (``""``: the pool resets the session itself)."""
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
        self.sql_load = (
            "SELECT job_id, last_slot, last_end, last_success_at, consecutive_failures "
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

    @property
    def pool(self) -> asyncpg.Pool[Any]:
        """The pool ticks take their connection from."""
        assert self._pool is not None, "the coordinator is not open"
        return self._pool

    async def open(self) -> None:
        """Create the pool (unless one was given), migrate, and check the clock."""
        import asyncpg

        if self._given_pool is not None:
            self._pool = self._given_pool
        else:
            self._pool = await asyncpg.create_pool(
                self._dsn, min_size=1, max_size=10, reset=self._reset
            )
        try:
            async with self._pool.acquire() as proxy:
                conn = cast("asyncpg.Connection[Any]", proxy)
                await migrate(conn, self.schema)
                self._transaction_timeout = conn.get_server_version().major >= 17
                if self._given_pool is None and (query := conn.get_reset_query()):
                    self.reset_query = query if query.rstrip().endswith(";") else query + ";"
                await self._check_clock(conn)
        except BaseException:
            await self.close()
            raise

    @staticmethod
    async def _reset(conn: asyncpg.Connection[Any]) -> None:
        """The reset of ticklock's own pool: asyncpg's, unless a tick already sent it."""
        if not _RELEASED_CLEAN.get() and (query := conn.get_reset_query()):
            await conn.execute(query)

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
        pool, self._pool = self._pool, None
        if pool is not None and self._given_pool is None:
            with anyio.move_on_after(10, shield=True) as scope:
                await pool.close()
            if scope.cancelled_caught:
                pool.terminate()

    async def load(self, jobs: dict[str, datetime | None]) -> dict[str, FleetState]:
        """Register the jobs (a row each, if new) and read the namespace's fleet state."""
        await self.pool.execute(self.sql_register, self.namespace, list(jobs), list(jobs.values()))
        rows = await self.pool.fetch(self.sql_load, self.namespace)
        return {row["job_id"]: FleetState(*tuple(row)[1:]) for row in rows}

    def _begin_sql(self, job_id: str, budget: float) -> str:
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
        conn = await self.pool.acquire()
        attempt = _PgAttempt(self, job_id, conn, False, FleetState())
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
        with _shielded():
            await self._record(result)

    async def _record(self, result: RunResult) -> None:
        await self.pool.execute(
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
