"""PostgreSQL coordination: each tick is one transaction that holds the job's advisory lock.

Round trips of a tick that runs: (1) ``BEGIN; SET LOCAL ...; refuse a slot in the database's
future, else try the lock`` in one simple query, (2) read the fleet state (a fresh snapshot,
taken after the lock), then the handler, (3) the watermark + success + run record in one
statement, (4) ``COMMIT``. A tick that finds the lock held takes 2 (the first, and
``ROLLBACK`` with a look at the holder: one past its bound plus :data:`STALE_GRACE` has its
session ended, and the lock is tried again); one that skips takes 3; a refused slot takes 2,
and its handler never starts. "The database's future" is measured from
``greatest(clock_timestamp(), anchor)`` (see :mod:`.dbtime`), here and in the commit's and
the failure record's checks.

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
from .._sharing import Member
from .connection import ConnectionLease, Pooler, create_pool
from .control import Watch
from .dbtime import database_time
from .sql import (
    LEFTOVERS,
    RESET,
    Begun,
    Holder,
    Statements,
    begin,
    end_stale_holder,
    migrate,
)

if TYPE_CHECKING:
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

logger = logging.getLogger("ticklock")

SERVER_GRACE = 1.0
"""Seconds the server-side timeouts add to the job's timeout, so that the client's own
timeout normally fires first and the server's is the backstop for a paused process."""
STALE_GRACE = 1.0
"""Seconds past a holder's server-side bound after which another replica ends its session:
what bounds a frozen holder whose handler switched the server-side timeouts off."""
TERMINATE_WAIT_MS = 1000
"""How long a replica that ends a stale holder's session waits for it to go (PostgreSQL 14+)."""
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
            c.anchor(),
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


class _Ungranted(Exception):
    """The DSN's user lacks privileges on ticklock's tables (found before any tick needs them)."""


class PostgresCoordinator:
    """Coordination through one PostgreSQL database (see the module docstring).

    Nothing the database answers at start-up stops the scheduler: down or restarting (a
    WARNING), or refusing it in a way an operator fixes while the app runs (not accepting
    connections, a missing database or role, a missing grant: an ERROR naming the fix).
    :attr:`ready` stays false, :attr:`problem` says why, ticks end as ``error``, and
    :meth:`connect` retries with backoff until it works. Only a DSN option asyncpg refuses,
    or any of these with ``require_database=True``, raises :class:`StartupError`.
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
        self._advice: str | None = None  # the fix an operator makes, if the cause needs one
        self.problem: str | None = None
        """Why the database cannot be used now (its error and the fix), ``None`` when it can."""
        self._retry_at = -math.inf  # when to try to migrate again (while not ready)
        self._retry_delay = RETRY_FIRST
        self._transaction_timeout = False
        self._terminate_wait: int | None = TERMINATE_WAIT_MS  # None before PostgreSQL 14
        self._refused_warned = False  # a stale holder this role may not end: said once
        self._time = database_time(clock)  # the reference for "in the database's future"
        self.sql = Statements(schema)
        self._watch: Watch | None = None

    async def watch(
        self,
        owner: str,
        declared: Callable[[], Declared],
        apply: Callable[[Mapping[str, Control]], None],
        members: Callable[[Mapping[str, Member], Mapping[str, datetime]], None],
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
            if self._require_database or not _answered(exc):
                await self.close()
                raise StartupError(self.explain(exc)) from exc
            self._down(exc)

    async def connect(self) -> None:
        """Return once the database answers and the schema is migrated, trying again with
        capped, jittered backoff (the same attempts a tick makes while not :attr:`ready`)."""
        while not self.ready:
            await self._clock.sleep_until(self._retry_at)
            with contextlib.suppress(DatabaseUnavailable):
                await self.reconnect()

    async def reconnect(self) -> None:
        """From a tick or a beat while not :attr:`ready`: migrate again once the backoff
        allows; raises :class:`DatabaseUnavailable` until then."""
        if self._clock.monotonic() >= self._retry_at:
            try:
                await self._prepare()
                return
            except Exception as exc:
                self._down(exc)
        fix = f": {self._advice}" if self._advice else ""
        raise DatabaseUnavailable(f"the database is not available ({self._cause}){fix}")

    async def _prepare(self) -> None:
        async with self.connection() as conn:
            await migrate(conn, self.schema)
            missing = await conn.fetchval(self.sql.ungranted)
            if missing:
                raise _Ungranted(f"permission denied for {', '.join(missing)}")
            major = conn.get_server_version().major
            self._transaction_timeout = major >= 17
            self._terminate_wait = TERMINATE_WAIT_MS if major >= 14 else None
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
            if self.classify(exc):  # down, restarting, overloaded: it comes back by itself
                self._advice = None
                self.problem = f"the database is unavailable ({cause})"
                logger.warning(
                    "the database is unavailable (%s): ticks end as 'error' until it answers",
                    cause,
                )
            else:  # an operator's fix: say which
                self._advice = self._fix(exc)
                self.problem = f"{cause}: {self._advice}"
                logger.error(
                    "ticklock cannot use the database (%s): %s; it tries again with backoff "
                    "(at most every %g s), and ticks end as 'error' until then",
                    cause,
                    self._fix(exc),
                    RETRY_MAX,
                )
        if self._down_since is None:
            self._down_since = time.monotonic()
        self._cause = cause

    def _up(self) -> None:
        self._retry_delay = RETRY_FIRST
        self.problem = None
        if self._down_since is not None:
            logger.info(
                "the database answers again, after %.1f s", time.monotonic() - self._down_since
            )
            self._down_since = None

    def explain(self, exc: BaseException) -> str:
        """One line for an error that fails start-up: its cause, and the fix."""
        return f"ticklock could not start: {describe(exc)}: {self._fix(exc)}"

    def _fix(self, exc: BaseException) -> str:
        """What an operator does about ``exc``."""
        import asyncpg

        if isinstance(exc, asyncpg.InvalidPasswordError):
            fix = "check the password in the DSN (or PGPASSWORD / ~/.pgpass)"
        elif isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
            fix = "create the role (CREATE ROLE ... LOGIN), or correct the user in the DSN"
        elif isinstance(exc, asyncpg.InvalidCatalogNameError):
            fix = "create the database, or correct its name in the DSN"
        elif isinstance(exc, asyncpg.ObjectNotInPrerequisiteStateError) and "accepting" in str(exc):
            fix = "let the database accept connections (ALTER DATABASE ... ALLOW_CONNECTIONS true)"
        elif isinstance(exc, asyncpg.InsufficientPrivilegeError) and "CONNECT" in str(
            getattr(exc, "detail", None)
        ):
            fix = "GRANT CONNECT ON DATABASE ... to the DSN's user"
        elif isinstance(exc, (asyncpg.InsufficientPrivilegeError, _Ungranted)):
            s = self.schema
            grants = (
                f"GRANT USAGE ON SCHEMA {s}, GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES "
                f"IN SCHEMA {s} and GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} to it"
            )
            fix = (
                f"the tables are there: {grants}"
                if isinstance(exc, _Ungranted)
                else f"the DSN's user needs CREATE on the database, for ticklock to create its "
                f"tables in schema {s!r}; or, once 'ticklock migrate' has created them as "
                f"another user: {grants}"
            )
        elif self.classify(exc):
            fix = "the database did not answer, and require_database=True fails start-up"
        else:
            fix = "ticklock cannot work with this database as it is"
        return fix

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

    def anchor(self) -> datetime | None:
        """The database's time carried on this replica's clock (see :mod:`.dbtime`): with
        ``clock_timestamp()``, the reference of every check for "in the database's future"."""
        return self._time.at(self._clock.monotonic())

    async def _check_clock(self, conn: asyncpg.Connection[Any]) -> None:
        """Read the database's clock into the anchor, and warn of a replica clock off by more
        than :data:`SKEW_WARNING` from it."""
        clock = self._clock
        before, started = clock.now(), clock.monotonic()
        server = await conn.fetchval("SELECT clock_timestamp()")
        after, ended = clock.now(), clock.monotonic()
        self._time.observe(server, started + (ended - started) / 2)
        local = before + (after - before) / 2
        reference = self.anchor() or server  # a clock that others moved on (advance) is not off
        skew = abs((reference - local).total_seconds())
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

    async def _begin(
        self, conn: asyncpg.Connection[Any], key: int, budget: float, at: datetime
    ) -> Begun:
        statement = begin(
            key,
            _limit_ms(budget),
            transaction_timeout=self._transaction_timeout,
            at=at,
            anchor=self.anchor(),
        )
        status = await conn.execute(statement)
        return Begun(int(status.rsplit(" ", 1)[1]))

    async def _take_over(
        self, attempt: _PgAttempt, key: int, job_id: str, budget: float, at: datetime
    ) -> Begun:
        """The lock is held: roll back, and end the holder's session if it is past its bound
        by :data:`STALE_GRACE` (a frozen replica whose handler switched the server-side
        timeouts off), then try once more. The common path (the lock taken) never pays this."""
        assert attempt._con is not None
        conn = attempt._con
        stale_ms = _limit_ms(budget) + int(STALE_GRACE * 1000)
        status = await conn.execute(
            "ROLLBACK; " + end_stale_holder(key, stale_ms, self._terminate_wait)
        )
        attempt._open = False
        holder = Holder(int(status.rsplit(" ", 1)[1]))
        if holder is Holder.REFUSED and not self._refused_warned:
            self._refused_warned = True
            logger.warning(
                "%s: the replica holding the lock has held it for more than %.1f s, past its "
                "server-side timeouts, and this role may not end its session: no replica can "
                "run the job until it lets go. Run the replicas as one role, or GRANT "
                "pg_signal_backend to this one",
                job_id,
                stale_ms / 1000,
                extra={"job_id": job_id},
            )
        if holder is not Holder.ENDED:
            return Begun.HELD
        logger.warning(
            "%s: ended the session of the replica holding the lock for more than %.1f s (its "
            "handler had switched off the server-side timeouts, and it is frozen or stuck): "
            "its writes are rolled back, and this replica runs the job",
            job_id,
            stale_ms / 1000,
            extra={"job_id": job_id},
        )
        attempt._open = True
        return await self._begin(conn, key, budget, at)

    async def attempt(self, job_id: str, budget: float, at: datetime) -> _PgAttempt:
        """BEGIN, set the timeouts, refuse a slot in the database's future (``at``: the slot,
        or the tick's start if later), try the lock, and read the job's state under it."""
        if not self.ready:
            await self.reconnect()
        try:
            assert self.pool is not None, "the coordinator is not open"
            conn = cast("asyncpg.Connection[Any]", await self.pool.acquire())
        except Exception as exc:
            if self.classify(exc):
                self._down(exc)
            raise
        attempt = _PgAttempt(self, job_id, conn, _limit_ms(budget))
        key = lock_key(self.namespace, job_id)
        try:
            begun = await self._begin(conn, key, budget, at)
            self._up()
            if begun is Begun.HELD:
                begun = await self._take_over(attempt, key, job_id, budget, at)
            if begun is Begun.AHEAD:
                raise self._ahead(at)
            if begun is not Begun.ACQUIRED:
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

    def _ahead(self, at: datetime) -> ClockAhead:
        anchor = self.anchor()
        by = "" if anchor is None else f" by about {(at - anchor).total_seconds():.1f} s"
        return ClockAhead(
            f"this replica's clock runs ahead of the database's{by}: slot {at.isoformat()} "
            f"would lie in the fleet's future, beyond the {FUTURE_LIMIT:g} s allowed; the "
            "handler was not started. Synchronise the replica's clock (NTP)"
        )

    async def read(self, job_ids: Sequence[str]) -> tuple[dict[str, FleetState], frozenset[str]]:
        """The fleet state of ``job_ids`` in one statement, and those whose lock is held,
        without taking the locks."""
        if not self.ready:
            await self.reconnect()
        try:
            async with self.connection() as conn:
                ids = list(job_ids)
                keys = [lock_key(self.namespace, job_id) for job_id in ids]
                rows = await conn.fetch(self.sql.read, self.namespace, ids, keys)
        except Exception as exc:
            if self.classify(exc):
                self._down(exc)
            self.lost(exc)
            raise
        states = {
            row["job_id"]: FleetState(*tuple(row)[1:-1])
            for row in rows
            if row["consecutive_failures"] is not None  # the job has a row
        }
        return states, frozenset(row["job_id"] for row in rows if row["held"])

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
                self.anchor(),
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


def _answered(exc: BaseException) -> bool:
    """Whether ``exc`` is the database's answer (or its silence), which an operator can fix
    while the app runs, rather than a DSN option asyncpg itself refuses."""
    import asyncpg

    if isinstance(exc, asyncpg.ClientConfigurationError):
        return False
    return isinstance(exc, (OSError, asyncpg.InterfaceError, asyncpg.PostgresError, _Ungranted))


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
