"""PostgreSQL coordination: each tick is one transaction that holds the job's advisory lock.

Round trips of a tick that runs: (1) ``BEGIN; SET LOCAL ...; refuse a slot in the database's
future, else try the lock`` in one simple query, (2) read the fleet state (a fresh snapshot,
taken after the lock), then the handler, (3) the watermark + success + run record in one
statement, (4) ``COMMIT`` (see :mod:`.tick`). A tick that finds the lock held takes 2 (the
first, and ``ROLLBACK`` with a look at the holder: a tick past its deadline, its bound
plus :data:`~.tick.STALE_GRACE`, has its session ended, and the lock is tried again); one that
skips takes 3; a refused slot takes 2, and its handler never starts. "The database's future"
is measured from ``greatest(clock_timestamp(), anchor)`` (see
:class:`.database.DatabaseTime`), here and in the commit's and the failure record's checks.

The locks are transaction-level (``pg_try_advisory_xact_lock``, see :func:`.begin.locks` for
the three a tick takes): they are released by COMMIT, ROLLBACK or the end of the session, never
by a timer, and they work through transaction-mode poolers. ``SET LOCAL`` timeouts make the
server end the session of a holder that is paused (GC, SIGSTOP, VM suspend), which frees the
locks and discards its writes.

The coordinator composes the database's readiness (:mod:`.database`), the tick
(:mod:`.tick`) and the replica's heartbeat (:mod:`.control`).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from random import Random
from typing import TYPE_CHECKING, Any, NoReturn, cast

import anyio

from ..._errors import ClockAhead, SchedulerStateError
from ..._operators.fleet import BY_TICKLOCK, IMMEDIATELY, Fleet
from ..._runtime.clock import Clock
from ..._runtime.slots import overdue_at
from ..._schedule import spec as _spec
from ..._schedule.job import Job, JobHealth, Outcome, fingerprint
from ..._schedule.lock_key import lock_key
from ..seam import FUTURE_LIMIT, Diagnosis, Fill, FleetState, Watcher
from .begin import Begun, Holder, begin, end_stale_holder
from .control import Watch
from .database import Database
from .fleet import PostgresFleet, from_pool
from .schedules import PostgresSchedules
from .tick import SERVER_GRACE, STALE_GRACE, Tick, limit_ms

if TYPE_CHECKING:
    import asyncpg

logger = logging.getLogger("ticklock")


def _role(conn: asyncpg.Connection[Any]) -> str:
    """The role this replica's sessions run as (as the server reported it)."""
    try:
        return str(conn.get_settings().session_authorization)
    except AttributeError:
        return "the replicas' role"


def _refusal(holder: Holder, role: str) -> tuple[str, str]:
    """Why a holder past its deadline may not be ended, and the fix, for the WARNING."""
    if holder is Holder.SUPERUSER:
        return (
            "it runs as a superuser, whose session only a superuser may end",
            "Run the replicas as a role that is not a superuser",
        )
    return (
        f"this replica's role ({role}) may not end its session",
        f"GRANT pg_signal_backend TO {role} (or run every replica as one role)",
    )


KEYS_CACHED = 4096
"""The jobs whose lock keys a coordinator keeps computed."""
GRACE_MS = int(STALE_GRACE * 1000)
_RESCHEDULE = "ticklock.reschedule"  # the advisory lock that serialises load()'s updates


@dataclass(frozen=True)
class PostgresBackend:
    """A namespace of a PostgreSQL database (from a DSN, or the application's pool)."""

    dsn: str | None
    pool: asyncpg.Pool[Any] | None
    namespace: str
    schema: str
    random: Random
    require_database: bool = False

    def coordinator(self, owner: str, clock: Clock) -> PostgresCoordinator:
        """A coordinator with a database of its own (its pool is created at ``open``)."""
        return PostgresCoordinator(
            Database(
                dsn=self.dsn,
                pool=self.pool,
                namespace=self.namespace,
                schema=self.schema,
                clock=clock,
                random=self.random,
                require_database=self.require_database,
                owner=owner,
            )
        )


class PostgresCoordinator:
    """Coordination through one PostgreSQL database (see the module docstring and
    :class:`~.database.Database` for what happens while it does not answer)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.namespace = db.namespace
        self.schema = db.schema
        self._refused: set[Holder] = set()  # why a stale holder may not be ended: said once
        self._keys = self._lock_keys()
        self._watch: Watch | None = None

    @property
    def problem(self) -> str | None:
        """Why the database cannot be used now (its error and the fix), ``None`` when it can
        (once open: a database that did not answer at open has set it)."""
        return self.db.problem

    @property
    def pool(self) -> asyncpg.Pool[Any] | None:
        """The pool ticks use (while open)."""
        return self.db.pool

    @asynccontextmanager
    async def session(self) -> AsyncIterator[PostgresSession]:
        """Create the pool, migrate and check the clock (see :meth:`Database.open`), and
        close the pool at the end if ticklock created it."""
        await self.db.open()
        try:
            yield PostgresSession(self)
        finally:
            with anyio.CancelScope(shield=True):
                await self.db.close()

    def diagnose(self, exc: BaseException) -> Diagnosis:
        """Lost when ``exc`` means the session or the server was lost (or not there)."""
        return Diagnosis(self.db.classify(exc) is Outcome.ERROR, self.db.explain(exc))

    async def watch(self, replica: Watcher) -> NoReturn:
        """Beat for this replica, obey pauses and triggers, and report the live replicas
        (see :mod:`.control`)."""
        self._watch = Watch(self.db, self.db.dsn, self.db.clock, replica)
        try:
            await self._watch.run()
        finally:
            self._watch = None

    def views(
        self, jobs: Callable[[], Mapping[str, Job]], health: Callable[[], list[JobHealth]]
    ) -> PostgresViews:
        """The namespace's fleet and stored schedules through this coordinator's pool (the
        database keeps the declarations: ``jobs`` and ``health`` are not needed)."""
        return PostgresViews(self)

    def poke(self) -> None:
        """Beat now."""
        if self._watch is not None:
            self._watch.poke()

    async def load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        """Register the jobs (a row each, if new), read their fleet state, and move
        the overdue instants that ``ticklock status`` reads to the schedules declared now.

        A database that stopped answering leaves the coordinator not :attr:`ready`."""
        try:
            return await self._load(jobs, now)
        except Exception as exc:
            if self.db.classify(exc):
                self.db.ready = False
                self.db.down(exc)
            raise

    async def _load(self, jobs: Mapping[str, Job], now: datetime) -> dict[str, FleetState]:
        async with self.db.connection() as conn:
            await conn.execute(
                self.db.sql.register,
                self.namespace,
                list(jobs),
                [overdue_at(job, now) for job in jobs.values()],
            )
            await conn.execute(
                self.db.sql.describe,
                self.namespace,
                list(jobs),
                [json.dumps(_spec.to_json(_spec.of(job))) for job in jobs.values()],
            )
            fresh = [job for job in jobs.values() if job.immediately]
            if fresh:  # replicas that start together: one at a time (as below)
                async with conn.transaction():
                    await conn.execute(
                        "SELECT pg_advisory_xact_lock($1)", lock_key(self.schema, _RESCHEDULE)
                    )
                    await conn.execute(
                        self.db.sql.immediately,
                        self.namespace,
                        [job.id for job in fresh],
                        [fingerprint(job) for job in fresh],
                        BY_TICKLOCK,
                        IMMEDIATELY,
                    )
            rows = await conn.fetch(self.db.sql.load, self.namespace, list(jobs))
            states = {row["job_id"]: FleetState(*tuple(row)[2:]) for row in rows}
            # A finished run stores the instant from its own schedule; a deploy that changed
            # the schedule would leave status judging by the old one until the next run ends.
            moved = [
                (row["job_id"], row["last_end"], due)
                for row in rows
                if row["job_id"] in jobs
                and row["last_end"] is not None
                and (due := overdue_at(jobs[row["job_id"]], row["last_end"])) != row["overdue_at"]
            ]
            if moved:
                # Replicas that start together would update the same rows: one at a time,
                # never in two orders (a deadlock). A row whose last end moved since it was
                # read is left to the run that moved it.
                async with conn.transaction():
                    await conn.execute(
                        "SELECT pg_advisory_xact_lock($1)", lock_key(self.schema, _RESCHEDULE)
                    )
                    ids, ends, dues = (list(column) for column in zip(*moved, strict=True))
                    await conn.execute(self.db.sql.reschedule, self.namespace, ids, ends, dues)
        return states

    def _lock_keys(self) -> Callable[[str], tuple[int, int]]:
        """A job's two lock keys (in this installation's schema, and the legacy one),
        computed once per job while it runs often (a bounded cache: a namespace may hold many
        stored schedules)."""

        @functools.lru_cache(maxsize=KEYS_CACHED)
        def keys(job_id: str) -> tuple[int, int]:
            return (
                lock_key(self.namespace, job_id, schema=self.schema),
                lock_key(self.namespace, job_id),
            )

        return keys

    async def _begin(
        self,
        conn: asyncpg.Connection[Any],
        job_id: str,
        budget: float,
        at: datetime,
        replacing: datetime | None,
    ) -> Begun:
        statement = begin(
            *self._keys(job_id),
            limit_ms(budget),
            GRACE_MS,
            transaction_timeout=self.db.transaction_timeout,
            at=at,
            anchor=self.db.anchor(),
            slot=replacing,
        )
        status = await conn.execute(statement)
        return Begun(int(status.rsplit(" ", 1)[1]))

    async def _take_over(
        self, attempt: Tick, job_id: str, budget: float, at: datetime, replacing: datetime | None
    ) -> Begun:
        """The lock is held: roll back, and end the holder's session if it is a tick past its
        deadline (a frozen replica whose handler switched the server-side timeouts off) or,
        ``replacing`` (overlap "replace"), the tick of an older slot, then try once more. The
        common path (the lock taken) never pays this."""
        assert attempt.con is not None
        conn = attempt.con
        key, _ = self._keys(job_id)
        ending = end_stale_holder(key, self.db.terminate_wait, replacing)
        status = await conn.execute("ROLLBACK; " + ending)
        attempt.open = False
        holder = Holder(int(status.rsplit(" ", 1)[1]))
        why = (
            f"its tick began more than its timeout + {SERVER_GRACE + STALE_GRACE:.0f} s ago: "
            "its handler switched off the server-side timeouts, and it is frozen or stuck"
        )
        if replacing is not None:
            why = f"it runs a slot older than {replacing.isoformat()}, which replaces it, or {why}"
        if holder in (Holder.REFUSED, Holder.SUPERUSER) and holder not in self._refused:
            self._refused.add(holder)  # said once per cause
            logger.warning(
                "%s: the replica holding the lock is to be ended (%s), and %s: no replica can "
                "run the job until it lets go. %s",
                job_id,
                why,
                *_refusal(holder, _role(conn)),
                extra={"job_id": job_id},
            )
        if holder is not Holder.ENDED:
            return Begun.HELD
        logger.warning(
            "%s: ended the session of the replica holding the lock (%s): its writes are "
            "rolled back, and this replica runs the job",
            job_id,
            why,
            extra={"job_id": job_id},
        )
        attempt.open = True
        return await self._begin(conn, job_id, budget, at, replacing)

    async def attempt(
        self,
        job_id: str,
        budget: float,
        at: datetime,
        replacing: datetime | None = None,
        fill: Fill | None = None,
    ) -> Tick:
        """BEGIN, set the timeouts, refuse a slot in the database's future (``at``: the slot,
        or the tick's start if later), try the lock, and read the job's state under it."""
        if not self.db.ready:
            await self.db.reconnect()
        sent, since = time.monotonic(), self.db.clock.now()
        try:
            await self.db.fresh()
            assert self.db.pool is not None, "the coordinator is not open"
            conn = cast("asyncpg.Connection[Any]", await self.db.pool.acquire())
        except BaseException as exc:
            self._failed(exc, sent, since)
            raise
        attempt = Tick(self.db, job_id, conn, limit_ms(budget))
        attempt.replacing = replacing  # its later batches name the slot too
        answered = False
        try:
            asked, when = time.monotonic(), self.db.clock.now()
            begun = await self._begin(conn, job_id, budget, at, replacing)
            answered = True
            self.db.answered(asked, when)
            if begun is Begun.HELD:
                begun = await self._take_over(attempt, job_id, budget, at, replacing)
            if begun is Begun.AHEAD:
                self.db.refused(at)
                raise self._ahead(at)
            if begun is not Begun.ACQUIRED:
                return attempt  # held by another replica: close() rolls back
            row = await conn.fetchrow(self.db.sql.state, self.namespace, job_id, attempt.seal)
            assert row is not None  # the statement returns one row
            tx, *state = row
            attempt.acquired = True
            attempt.tx = tx
            attempt.state = FleetState(*state)
            if fill is not None:  # its turn, read under the lock
                attempt.fill = fill
                attempt.turn = bool(
                    await conn.fetchval(self.db.sql.fill_turn, fill.request, fill.index, fill.slot)
                )
            return attempt
        except BaseException as exc:
            if not answered:
                self._failed(exc, sent, since)
                if not isinstance(exc, Exception):
                    attempt.abandon()
            elif isinstance(exc, Exception) and self.db.classify(exc):
                self.db.down(exc)
            if isinstance(exc, Exception):
                self.db.lost(exc)
            await attempt.close()
            raise

    def _failed(self, exc: BaseException, sent: float, since: datetime) -> None:
        """A call sent at ``sent`` (``since`` on the wall clock) got no answer: it failed for
        the database (an outage from then on), or was cut off by its timeout."""
        if not isinstance(exc, Exception):
            self.db.unanswered(sent, since)
        elif self.db.classify(exc):
            self.db.down(exc, since)

    def _ahead(self, at: datetime) -> ClockAhead:
        anchor = self.db.anchor()
        by = "" if anchor is None else f" by about {(at - anchor).total_seconds():.1f} s"
        return ClockAhead(
            f"this replica's clock runs ahead of the database's{by}: slot {at.isoformat()} "
            f"would lie in the fleet's future, beyond the {FUTURE_LIMIT:g} s allowed; the "
            "handler was not started. Synchronise the replica's clock (NTP)"
        )

    async def read(self, job_ids: Sequence[str]) -> tuple[dict[str, FleetState], frozenset[str]]:
        """The fleet state of ``job_ids`` in one statement, and those whose lock is held,
        without taking the locks. A tick past its deadline (its handler switched the
        server-side timeouts off, and it is frozen or stuck) does not count as holding it: an
        attempt now would end its session."""
        if not self.db.ready:
            await self.db.reconnect()
        sent, since = time.monotonic(), self.db.clock.now()
        try:
            async with self.db.connection() as conn:
                ids = list(job_ids)
                keys = [lock_key(self.namespace, job_id, schema=self.schema) for job_id in ids]
                legacy = [lock_key(self.namespace, job_id) for job_id in ids]
                asked, when = time.monotonic(), self.db.clock.now()
                rows = await conn.fetch(self.db.sql.read, self.namespace, ids, keys, legacy)
        except BaseException as exc:
            self._failed(exc, sent, since)
            if isinstance(exc, Exception):
                self.db.lost(exc)
            raise
        self.db.answered(asked, when)
        states = {
            row["job_id"]: FleetState(*tuple(row)[1:-1])
            for row in rows
            if row["consecutive_failures"] is not None  # the job has a row
        }
        return states, frozenset(row["job_id"] for row in rows if row["held"])


class PostgresSession:
    """An open :class:`PostgresCoordinator`, as the replica tells it things between calls."""

    def __init__(self, coordinator: PostgresCoordinator) -> None:
        self._coordinator = coordinator

    async def connected(self) -> None:
        """Return once the database answers and the schema is migrated."""
        await self._coordinator.db.connect()

    def poke(self) -> None:
        """Beat now."""
        self._coordinator.poke()

    def stalled(self, job_id: str | None, seconds: float) -> None:
        """Keep a stall of this replica's loop; its next beat records it."""
        self._coordinator.db.stalled(job_id, seconds)


class PostgresViews:
    """The namespace as operators see it, through a running coordinator's pool."""

    def __init__(self, coordinator: PostgresCoordinator) -> None:
        self._coordinator = coordinator

    def _pool(self, what: str) -> asyncpg.Pool[Any]:
        pool = self._coordinator.db.pool
        if pool is None:
            raise SchedulerStateError(f"the scheduler is not running: in PostgreSQL mode {what}")
        return pool

    @property
    def fleet(self) -> Fleet:
        """The namespace's fleet (operations reach every replica)."""
        c = self._coordinator
        pool = self._pool(
            "its operations use its pool (use 'ticklock pause|resume|trigger' from outside the app)"
        )
        fleet: PostgresFleet = PostgresFleet(
            from_pool(pool), schema=c.schema, namespace=c.namespace
        )
        return fleet

    @property
    def schedules(self) -> PostgresSchedules:
        """The namespace's stored schedules."""
        c = self._coordinator
        pool = self._pool(
            "its schedules are read and written through its pool (use them inside 'async with "
            "scheduler', or 'ticklock schedules' from outside the app)"
        )
        return PostgresSchedules(from_pool(pool), schema=c.schema, namespace=c.namespace)
