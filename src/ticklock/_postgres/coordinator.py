"""PostgreSQL coordination: each tick is one transaction that holds the job's advisory lock.

Round trips of a tick that runs: (1) ``BEGIN; SET LOCAL ...; try the lock`` in one simple
query, (2) read the fleet state (a fresh snapshot, taken after the lock), then the handler,
(3) the watermark + success + run record in one statement, (4) ``COMMIT``. A tick that finds
the lock held takes 2 (the first and ``ROLLBACK``); one that skips takes 3.

A handler that used ``ctx.conn`` may have left session state: settings, a role, temporary
tables, cursors, listeners, advisory locks (``sql.RESET`` undoes them all), or SQL prepared
statements (``PREPARE``, which no statement can drop without also dropping asyncpg's own):
the commit statement (or, on the way out of a failed tick, a query after the reset) says
whether any is left, and such a connection is closed instead of reused. The reset rides in the
same simple query as the tick's COMMIT (just before it, inside the transaction) or its
ROLLBACK (just after it): no extra round trip, and a tick that commits is one transaction.

The commit statement itself checks that the transaction is still the one that took the lock
(a handler's ``COMMIT AND CHAIN`` would start another one, without the lock), that the
server-side timeouts are still in force, and that the slot and end are not in the future of
the database's clock beyond :data:`FUTURE_LIMIT` (a replica whose clock runs ahead would
otherwise stop the fleet until its clock's "now" comes).

The lock is transaction-level (``pg_try_advisory_xact_lock``): it is released by COMMIT,
ROLLBACK or the end of the session, never by a timer, and it works through transaction-mode
poolers. ``SET LOCAL`` timeouts make the server end the session of a holder that is paused
(GC, SIGSTOP, VM suspend), which frees the lock and discards its writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from random import Random
from typing import TYPE_CHECKING, Any, NoReturn, cast

import anyio

from .._caps import ERROR_LIMIT, cut_text
from .._clock import Clock
from .._coordination import FUTURE_LIMIT, Control, Declared, FleetState
from .._errors import (
    ClockAhead,
    DatabaseUnavailable,
    LimitsChanged,
    SlotAlreadyCommitted,
    StartupError,
    TransactionEnded,
    describe,
)
from .._job import Job, Outcome, RunResult
from .._lock_key import lock_key
from .._plan import next_due, overdue_at
from .connection import ConnectionLease, Pooler, create_pool
from .control import Watch
from .sql import LEFTOVERS, RESET, Statements, begin, migrate

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
RETRY_FIRST, RETRY_MAX = 0.5, 30.0
"""Seconds between attempts to reach a database that did not answer at start-up: the first
wait, doubling up to the cap (each drawn between half and all of it)."""
_LOST_STATES = ("08", "57")  # connection exceptions; operator intervention / query canceled
_LOST_CODES = frozenset({"25P03", "25P04"})  # idle-in-transaction / transaction timeout
_RESCHEDULE = "ticklock.reschedule"  # the advisory lock that serialises load()'s updates
_TRANSIENT_CODES = frozenset({"53300", "25006"})  # too many connections; a read-only standby
_MISSING = frozenset({"42P01", "3F000"})  # undefined table, invalid schema name


class _PgAttempt:
    __slots__ = (
        "_con",
        "_coordinator",
        "_job_id",
        "_lease",
        "_limit_ms",
        "_open",
        "_tx",
        "acquired",
        "conn",
        "state",
    )

    def __init__(
        self,
        coordinator: PostgresCoordinator,
        job_id: str,
        con: asyncpg.Connection[Any],
        limit_ms: int,
    ) -> None:
        self._coordinator = coordinator
        self._job_id = job_id
        self._limit_ms = limit_ms  # the server-side timeouts the tick set
        self._tx: datetime | None = None  # the start of the transaction that took the lock
        self._open = True  # until our own COMMIT or ROLLBACK ends the transaction
        self._con: asyncpg.Connection[Any] | None = con
        # What the handler gets: a lease on the connection (or on a given pool's proxy).
        self._lease = ConnectionLease(con)
        self.conn: asyncpg.Connection[Any] | None = cast("asyncpg.Connection[Any]", self._lease)
        self.acquired = False
        self.state = FleetState()

    async def commit(self, result: RunResult, job: Job) -> None:
        # The handler has returned: nothing it left running may use the connection now,
        # between the commit statement's checks and the COMMIT.
        self._lease.end()
        report = None if result.report is None else json.dumps(result.report)
        with self._coordinator.shielded():
            try:
                await self._write(
                    result, report, overdue_at(job, result.finished_at), next_due(job, result)
                )
            except Exception as exc:
                self._coordinator.lost(exc)
                raise
        if self._open:  # the cleanup bound cut it short: never report that as a success
            raise TimeoutError(
                f"the commit did not finish within {CLEANUP_SECONDS:g} s (a stalled server "
                "or network): the tick is rolled back, unless its COMMIT had reached the server"
            )

    async def _write(
        self,
        result: RunResult,
        report: str | None,
        overdue_at: datetime | None,
        next_due: datetime | None,
    ) -> None:
        assert self._con is not None
        c = self._coordinator
        row = await self._con.fetchrow(
            c.sql.commit,
            c.namespace,
            self._job_id,
            result.slot,
            result.finished_at,
            result.started_at,
            result.owner,
            report,
            overdue_at,
            self._tx,
            self._limit_ms,
            result.manual,
            next_due,
            self._lease.used,
        )
        assert row is not None  # the statement returns one row
        written, same_tx, bounded, ahead, prepared = row
        if not same_tx:
            raise TransactionEnded(
                "the handler ended the tick's transaction (a COMMIT or ROLLBACK through "
                "ctx.conn), which released the job's lock: what it wrote after that was not "
                "guarded, and the slot is not marked done. Leave the transaction to ticklock; "
                "for a partial rollback use 'async with ctx.conn.transaction()' (a savepoint)"
            )
        if not bounded:
            raise LimitsChanged(
                "the handler changed the tick's server-side timeouts (statement_timeout, "
                "idle_in_transaction_session_timeout or transaction_timeout) through "
                "ctx.conn, so a paused replica could hold the lock for ever: nothing was "
                "committed. To give a job more time, raise its timeout="
            )
        if ahead > FUTURE_LIMIT:
            raise ClockAhead(
                f"this replica's clock is {ahead:.1f} s ahead of the database's: its slot "
                f"or end would lie in the fleet's future, beyond the {FUTURE_LIMIT:g} s "
                "allowed, and stop the other replicas until then; nothing was committed. "
                "Synchronise the replica's clock (NTP)"
            )
        if written != 1:
            raise SlotAlreadyCommitted(f"slot {result.slot} of {self._job_id} is already committed")
        # The reset goes before COMMIT, inside the transaction: if it failed, nothing would
        # commit, so a run is never recorded as failed after its writes committed.
        if self._lease.used:
            self._lease.retire |= prepared
            await self._con.execute(self._coordinator.reset() + "COMMIT")
        else:
            await self._con.execute("COMMIT")
        self._open = False

    async def close(self) -> None:
        con, self._con, self.conn = self._con, None, None
        if con is None:
            return
        lease = self._lease
        lease.end()
        c = self._coordinator
        if self._open and not con.is_closed():
            with c.shielded():
                try:
                    # after ROLLBACK: an aborted transaction accepts no other statement
                    if lease.used:
                        reset = c.reset()
                        status = await con.execute("ROLLBACK; " + reset + LEFTOVERS[2:])
                        lease.retire |= status == "SELECT 1"
                    else:
                        await con.execute("ROLLBACK")
                    self._open = False
                except Exception:
                    con.terminate()
        if self._open or lease.retire:
            con.terminate()  # never reused: still in a transaction, or with state left
        await c.release(con)


class PostgresCoordinator:
    """Coordination through one PostgreSQL database (see the module docstring).

    A database that does not answer at start-up (down, restarting, refusing connections)
    does not stop the scheduler: :attr:`ready` stays false, ticks end as ``error``, and
    :meth:`connect` retries until it answers. Errors that cannot fix themselves (a failed
    login, a missing database, no permission to migrate) raise :class:`StartupError`.
    """

    def __init__(
        self,
        *,
        dsn: str | None,
        pool: asyncpg.Pool[Any] | None,
        namespace: str,
        schema: str,
        clock: Clock,
        random: Random,
        require_database: bool = False,
    ) -> None:
        self._dsn = dsn
        self._given = pool is not None  # a pool the user passed is never closed here
        self.pooler = Pooler()
        self.pool: asyncpg.Pool[Any] | None = pool
        """The pool ticks use: the user's, or the one ticklock creates from ``dsn``."""
        self.namespace = namespace
        self.schema = schema
        self._clock = clock
        self._random = random
        self._require_database = require_database
        self.ready = False
        """Whether the database answered and the schema is migrated."""
        self._down_since: float | None = None  # the outage in progress (monotonic seconds)
        self._cause = ""
        self._retry_at = -math.inf  # when to try to migrate again (while not ready)
        self._retry_delay = RETRY_FIRST
        self._transaction_timeout = False
        self.sql = Statements(schema)
        self._watch: Watch | None = None

    async def watch(
        self,
        owner: str,
        declared: Callable[[], Declared],
        apply: Callable[[Mapping[str, Control]], None],
        members: Callable[[Mapping[str, frozenset[str]], Mapping[str, datetime]], None],
    ) -> NoReturn:
        """Beat for this replica, obey pauses and triggers, and report the live replicas
        (see :mod:`.control`)."""
        self._watch = Watch(self, self._dsn, self._clock, owner, declared, apply, members)
        try:
            await self._watch.run()
        finally:
            self._watch = None

    def poke(self) -> None:
        """Beat now."""
        if self._watch is not None:
            self._watch.poke()

    async def open(self) -> None:
        """Create the pool (unless one was given), then migrate and check the clock, or note
        that the database does not answer yet (see the class docstring)."""
        if self.pool is None:
            self.pool = await create_pool(self._dsn, self.pooler)
        try:
            await self._prepare()
        except Exception as exc:
            if self._require_database or not self.classify(exc):
                await self.close()
                raise StartupError(self.explain(exc)) from exc
            self._down(exc)

    async def connect(self) -> None:
        """Return once the database answers and the schema is migrated, trying again with
        capped, jittered backoff (the same attempts a tick makes while not :attr:`ready`)."""
        while not self.ready:
            await self._clock.sleep_until(self._retry_at)
            with contextlib.suppress(DatabaseUnavailable):
                await self._reconnect()

    async def _reconnect(self) -> None:
        """From a tick while not :attr:`ready`: migrate again once the backoff allows."""
        if self._clock.monotonic() >= self._retry_at:
            try:
                await self._prepare()
                return
            except Exception as exc:
                self._down(exc)
        raise DatabaseUnavailable(f"the database is not available ({self._cause})")

    async def _prepare(self) -> None:
        async with self.connection() as conn:
            await migrate(conn, self.schema)
            self._transaction_timeout = conn.get_server_version().major >= 17
            await self._check_clock(conn)
        self.ready = True
        self._up()

    def _down(self, exc: BaseException) -> None:
        """Note a failed attempt: log the start of an outage (or a change of its cause) once,
        without a traceback, and put off the next attempt to migrate (jittered backoff)."""
        wait = self._retry_delay * self._random.uniform(0.5, 1.0)
        self._retry_at = self._clock.monotonic() + wait
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)
        cause = describe(exc)
        if self._down_since is None or type(exc).__name__ not in self._cause:
            logger.warning(
                "the database is unavailable (%s): ticks end as 'error' until it answers",
                cause,
            )
        if self._down_since is None:
            self._down_since = time.monotonic()
        self._cause = cause

    def _up(self) -> None:
        self._retry_delay = RETRY_FIRST
        if self._down_since is not None:
            logger.info(
                "the database answers again, after %.1f s", time.monotonic() - self._down_since
            )
            self._down_since = None

    def explain(self, exc: BaseException) -> str:
        """One line for an error that waiting cannot fix: its cause, and the fix."""
        import asyncpg

        cause = describe(exc)
        if isinstance(
            exc, (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError)
        ):
            fix = "check the user and password in the DSN (or PGPASSWORD / ~/.pgpass)"
        elif isinstance(exc, asyncpg.InvalidCatalogNameError):
            fix = "create the database, or correct its name in the DSN"
        elif isinstance(exc, asyncpg.InsufficientPrivilegeError):
            s = self.schema
            fix = (
                f"the DSN's user needs CREATE on the database, for ticklock to create its "
                f"tables in schema {s!r}; or, once 'ticklock migrate' has created them as "
                f"another user: GRANT USAGE ON SCHEMA {s}, GRANT SELECT, INSERT, UPDATE, "
                f"DELETE ON ALL TABLES IN SCHEMA {s} and GRANT USAGE ON ALL SEQUENCES IN "
                f"SCHEMA {s} to it"
            )
        elif self.classify(exc):
            fix = "the database did not answer, and require_database=True fails start-up"
        else:
            fix = "ticklock cannot work with this database"
        return f"ticklock could not start: {cause}: {fix}"

    def lost(self, exc: Exception) -> None:
        """Note that a statement found ticklock's tables missing (a database restored or
        replaced without them): the next tick migrates again."""
        if getattr(exc, "sqlstate", None) in _MISSING:
            self.ready = False

    def reset(self) -> str:
        """:data:`RESET`, and behind a pooler (where ticklock prepares nothing by name, and a
        retired client connection does not end the server session) ``DEALLOCATE ALL``."""
        return RESET + "DEALLOCATE ALL; " if self.pooler.unnamed else RESET

    def shielded(self) -> anyio.CancelScope:
        """Cleanup that must finish even when the tick was cancelled, but not hang forever."""
        return anyio.CancelScope(shield=True, deadline=anyio.current_time() + CLEANUP_SECONDS)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection[Any]]:
        """A connection for ticklock's own statements outside a tick (no session state)."""
        assert self.pool is not None, "the coordinator is not open"
        async with self.pool.acquire() as proxy:
            yield cast("asyncpg.Connection[Any]", proxy)

    async def release(self, con: asyncpg.Connection[Any]) -> None:
        """Give a tick's connection back to the pool (which replaces it if it was closed)."""
        assert self.pool is not None
        with self.shielded():
            await self.pool.release(cast("PoolConnectionProxy[Any]", con))

    async def _check_clock(self, conn: asyncpg.Connection[Any]) -> None:
        before = self._clock.now()
        server = await conn.fetchval("SELECT clock_timestamp()")
        after = self._clock.now()
        local = before + (after - before) / 2
        skew = abs((server - local).total_seconds())
        if skew > SKEW_WARNING:
            logger.warning(
                "this replica's clock differs from the database's by %.1f s; slots come "
                "from the replica clocks, so keep them NTP-synchronised (a slot more than "
                "%g s in the database's future is refused)",
                skew,
                FUTURE_LIMIT,
            )

    async def close(self) -> None:
        """Close the pool if ticklock created it (a pool the user passed stays open)."""
        if self.pool is not None and not self._given:
            pool, self.pool = self.pool, None
            with anyio.move_on_after(CLEANUP_SECONDS, shield=True):
                await pool.close()
            pool.terminate()  # what did not close in time

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """Register the jobs (a row each, if new), read the namespace's fleet state, and move
        the overdue instants that ``ticklock status`` reads to the schedules declared now.

        A database that stopped answering leaves the coordinator not :attr:`ready`."""
        try:
            return await self._load(jobs, now)
        except Exception as exc:
            if self.classify(exc):
                self.ready = False
                self._down(exc)
            raise

    async def _load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        async with self.connection() as conn:
            await conn.execute(
                self.sql.register,
                self.namespace,
                list(jobs),
                [overdue_at(job, now) for job in jobs.values()],
            )
            rows = await conn.fetch(self.sql.load, self.namespace)
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
                    await conn.execute(self.sql.reschedule, self.namespace, ids, successes, dues)
        return states

    def _begin(self, job_id: str, budget: float) -> str:
        key = lock_key(self.namespace, job_id)
        return begin(key, _limit_ms(budget), transaction_timeout=self._transaction_timeout)

    async def attempt(self, job_id: str, budget: float) -> _PgAttempt:
        """BEGIN, set the timeouts, try the lock, and read the job's state under it."""
        if not self.ready:
            await self._reconnect()
        try:
            assert self.pool is not None, "the coordinator is not open"
            conn = cast("asyncpg.Connection[Any]", await self.pool.acquire())
        except Exception as exc:
            if self.classify(exc):
                self._down(exc)
            raise
        attempt = _PgAttempt(self, job_id, conn, _limit_ms(budget))
        try:
            status = await conn.execute(self._begin(job_id, budget))
            self._up()
            if status != "SELECT 1":
                return attempt  # held by another replica: close() rolls back
            row = await conn.fetchrow(self.sql.state, self.namespace, job_id)
            assert row is not None  # the statement returns one row
            tx, *state = row
            attempt.acquired = True
            attempt._tx = tx
            attempt.state = FleetState(*state)
            return attempt
        except BaseException as exc:
            if isinstance(exc, Exception) and self.classify(exc):
                self._down(exc)
            if isinstance(exc, Exception):
                self.lost(exc)
            await attempt.close()
            raise

    async def read(self, job_ids: Sequence[str]) -> dict[str, FleetState]:
        """The fleet state of ``job_ids`` in one statement, without their locks."""
        if not self.ready:
            await self._reconnect()
        try:
            async with self.connection() as conn:
                rows = await conn.fetch(self.sql.read, self.namespace, list(job_ids))
        except Exception as exc:
            if self.classify(exc):
                self._down(exc)
            self.lost(exc)
            raise
        return {row["job_id"]: FleetState(*tuple(row)[1:]) for row in rows}

    async def record_failure(self, result: RunResult, job: Job) -> None:
        """Record a run that did not commit, in its own short transaction."""
        with self.shielded() as scope:
            await self._record(result, next_due(job, result))
        if scope.cancelled_caught:
            raise TimeoutError(f"the record did not finish within {CLEANUP_SECONDS:g} s")

    async def _record(self, result: RunResult, next_due: datetime | None) -> None:
        async with self.connection() as conn:
            await conn.execute(
                self.sql.failure,
                self.namespace,
                result.job_id,
                result.slot,
                result.finished_at,
                result.started_at,
                result.outcome.value,
                result.owner,
                None if result.error is None else storable(result.error),
                result.manual,
                next_due,
            )

    def classify(self, exc: BaseException) -> Outcome | None:
        """``ERROR`` when ``exc`` means the session or the server was lost (or not there)."""
        import asyncpg

        if isinstance(exc, asyncpg.ClientConfigurationError):
            return None  # a DSN option asyncpg refuses: waiting cannot fix it
        if isinstance(exc, (OSError, asyncpg.InterfaceError, SlotAlreadyCommitted)):
            return Outcome.ERROR
        if isinstance(exc, asyncpg.PostgresError):
            state = exc.sqlstate or ""
            if state.startswith(_LOST_STATES) or state in _LOST_CODES | _TRANSIENT_CODES:
                return Outcome.ERROR
        return None


def _limit_ms(budget: float) -> int:
    """The server-side timeouts of a tick whose job has ``budget`` seconds, in ms."""
    return int((budget + SERVER_GRACE) * 1000)


def storable(text: str) -> str:
    """``text`` as PostgreSQL can store it: NUL and unpaired surrogates escaped, and still
    within :data:`~ticklock._caps.ERROR_LIMIT` once escaped."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode()
    return cut_text(text, len(text), ERROR_LIMIT)
