"""The database's readiness for PostgreSQL mode: the pool, the migration, the backoff while the
database does not answer, the errors an operator fixes (explained), the session reset, and the
replica clock checked against the database's.

Nothing the database answers at start-up stops the scheduler: down or restarting (a WARNING),
or refusing it in a way an operator fixes while the app runs (not accepting connections, a
missing database or role, a missing grant: an ERROR naming the fix). :attr:`Database.ready`
stays false, :attr:`Database.problem` says why, ticks end as ``error``, and
:meth:`Database.connect` retries with backoff until it works. Only a DSN option asyncpg
refuses, or any of these with ``require_database=True``, raises :class:`StartupError`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from random import Random
from typing import TYPE_CHECKING, Any, cast

import anyio

from ..._errors import (
    DatabaseUnavailable,
    SchemaBusy,
    SlotAlreadyCommitted,
    StartupError,
    TakenOver,
    describe,
)
from ..._operators.ledger import AHEAD, STALLED, UNREACHABLE, Incident
from ..._runtime.clock import Clock
from ..._schedule.job import Outcome
from ..seam import FUTURE_LIMIT
from .connection import Pooler, create_pool
from .schema import migrate
from .sql import RESET, Statements

if TYPE_CHECKING:
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

logger = logging.getLogger("ticklock")

SKEW_WARNING = 1.0
"""A replica clock further than this from the database's logs a WARNING at start."""
CLEANUP_SECONDS = 5.0
"""How long cleanup (commit, rollback, release, failure record) may take, shielded."""
RETRY_FIRST, RETRY_MAX = 0.5, 30.0
"""Seconds between attempts to reach a database that did not answer at start-up: the first
wait, doubling up to the cap (each drawn between half and all of it)."""
UNANSWERED = 0.25
"""A call cut off (by its timeout) after waiting this many seconds without an answer means
the database did not answer: an outage, noted as one that failed."""
SLOW_ANSWER = 2.0
"""A statement that waited this many seconds for its answer (ticklock's own, which take
milliseconds) saw the database unreachable meanwhile: an outage, from when it was sent."""
KEPT = 1000
"""The most records of what kept this replica from its slots waiting for the next beat."""
TERMINATE_WAIT_MS = 1000
"""How long a replica that ends a stale holder's session waits for it to go (PostgreSQL 14+)."""
_LOST_STATES = ("08", "57")  # connection exceptions; operator intervention / query canceled
_LOST_CODES = frozenset({"25P03", "25P04"})  # idle-in-transaction / transaction timeout
_TRANSIENT_CODES = frozenset({"53300", "25006"})  # too many connections; a read-only standby
_MISSING = frozenset({"42P01", "3F000"})  # undefined table, invalid schema name


class DatabaseTime:
    """The database's clock as last read, and the monotonic instant of that read: the
    reference for "in the database's future".

    A slot, an end or a failure's end is refused when it lies more than
    :data:`~ticklock._backends.seam.FUTURE_LIMIT` seconds beyond ``greatest(clock_timestamp(),
    anchor)``: the database's own clock, or the anchor, whichever is later. The anchor is the
    database's clock as read when a coordinator connected, carried forward on the replica's
    monotonic clock (the instant read + the monotonic seconds since the read).

    - A replica whose wall clock is wrong still has a monotonic clock that runs at the real rate,
      so its anchor stays at the database's time: a wall clock ahead is refused.
    - A :class:`~ticklock.testing.ManualClock` moves its monotonic clock with ``advance()``, so the
      anchor moves with it and the database accepts the slots of a test that advances by days.
    - A monotonic clock that stood still while the wall clock went on (a VM suspended, on some
      hosts) leaves the anchor behind; ``greatest()`` with ``clock_timestamp()`` covers that.

    The anchor belongs to the clock object: every scheduler that shares one clock shares it, so
    that one started after ``advance()`` knows the time the others carried. A new read of the
    database's clock (at each connect) replaces the anchor only when it is later. The anchor's
    error is the monotonic clock's drift since the read it came from, far below the limit on a
    host whose clock NTP disciplines. One clock used with two databases carries one anchor: their
    clocks are taken to agree as closely as the replicas' do.
    """

    __slots__ = ("_monotonic", "_server")

    def __init__(self) -> None:
        self._server: datetime | None = None
        self._monotonic = 0.0

    def observe(self, server: datetime, monotonic: float) -> None:
        """Note a read of the database's clock (``server``) made at ``monotonic``: it becomes
        the anchor if it is later than the one carried so far."""
        carried = self.at(monotonic)
        if carried is None or server > carried:
            self._server, self._monotonic = server, monotonic

    def at(self, monotonic: float) -> datetime | None:
        """The anchor at ``monotonic`` (``None`` before the first read)."""
        if self._server is None:
            return None
        return self._server + timedelta(seconds=monotonic - self._monotonic)


_TIMES: weakref.WeakKeyDictionary[Clock, DatabaseTime] = weakref.WeakKeyDictionary()


def database_time(clock: Clock) -> DatabaseTime:
    """The :class:`DatabaseTime` carried on ``clock``, shared by every coordinator that uses
    it; a clock that cannot be weakly referenced (or hashed) gets one of its own."""
    try:
        found = _TIMES.get(clock)
        if found is None:
            found = _TIMES[clock] = DatabaseTime()
    except TypeError:
        return DatabaseTime()
    return found


class _Ungranted(Exception):
    """The DSN's user lacks privileges on ticklock's tables (found before any tick needs them)."""


class Database:
    """One PostgreSQL database as ticklock uses it (see the module docstring)."""

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
        owner: str = "",
    ) -> None:
        self.dsn = dsn
        """The DSN (``None``: a pool the application passed)."""
        self._given = pool is not None  # a pool the user passed is never closed here
        self.pooler = Pooler()
        self.pool: asyncpg.Pool[Any] | None = pool
        """The pool ticks use: the user's, or the one ticklock creates from ``dsn``."""
        self.namespace = namespace
        self.schema = schema
        self.clock = clock
        self._random = random
        self._require_database = require_database
        self.ready = False
        """Whether the database answered and the schema is migrated."""
        self._down_since: float | None = None  # the outage in progress (monotonic seconds)
        self._down_at: datetime | None = None  # and when it began, for the outages record
        # what kept this replica from its slots, ended and not recorded yet (outages, stalls)
        self._incidents: deque[Incident] = deque(maxlen=KEPT)
        self._ahead: Incident | None = None  # the ticks refused since the last record
        self._stalled_at = -math.inf  # when the event loop was last found blocked (monotonic)
        self._up_at = -math.inf  # when an outage last ended (monotonic)
        self._expire = False  # the pool's connections are from before an outage began or ended
        self.ended: Callable[[], None] = _nothing
        """Called when an outage ends (the heartbeat beats then, to record it)."""
        self.owner = owner
        """The replica this database is for (it records the outages it saw)."""
        self._cause = ""
        self._advice: str | None = None  # the fix an operator makes, if the cause needs one
        self.problem: str | None = None
        """Why the database cannot be used now (its error and the fix), ``None`` when it can."""
        self._retry_at = -math.inf  # when to try to migrate again (while not ready)
        self._retry_delay = RETRY_FIRST
        self.transaction_timeout = False
        """Whether the server has ``transaction_timeout`` (PostgreSQL 17+)."""
        self.terminate_wait: int | None = TERMINATE_WAIT_MS  # None before PostgreSQL 14
        self._time = database_time(clock)  # the reference for "in the database's future"
        self.sql = Statements(schema)

    async def open(self) -> None:
        """Create the pool (unless one was given), then migrate and check the clock, or note
        that the database does not answer yet (see the class docstring)."""
        if self.pool is None:
            self.pool = await create_pool(self.dsn, self.pooler)
        try:
            await self._prepare()
        except Exception as exc:
            if self._require_database or not _answered(exc):
                await self.close()
                raise StartupError(self.explain(exc)) from exc
            self.down(exc)

    async def connect(self) -> None:
        """Return once the database answers and the schema is migrated, trying again with
        capped, jittered backoff (the same attempts a tick makes while not :attr:`ready`)."""
        while not self.ready:
            await self.clock.sleep_until(self._retry_at)
            with contextlib.suppress(DatabaseUnavailable):
                await self.reconnect()

    async def reconnect(self) -> None:
        """From a tick or a beat while not :attr:`ready`: migrate again once the backoff
        allows; raises :class:`DatabaseUnavailable` until then."""
        if self.clock.monotonic() >= self._retry_at:
            try:
                await self._prepare()
                return
            except Exception as exc:
                self.down(exc)
        fix = f": {self._advice}" if self._advice else ""
        raise DatabaseUnavailable(f"the database is not available ({self._cause}){fix}")

    async def _prepare(self) -> None:
        async with self.connection() as conn:
            await migrate(conn, self.schema)
            missing = await conn.fetchval(self.sql.ungranted)
            if missing:
                raise _Ungranted(f"permission denied for {', '.join(missing)}")
            major = conn.get_server_version().major
            self.transaction_timeout = major >= 17
            self.terminate_wait = TERMINATE_WAIT_MS if major >= 14 else None
            await self._check_clock(conn)
        self.ready = True
        self.up()

    def down(self, exc: BaseException, since: datetime | None = None) -> None:
        """Note a failed attempt (``since``: when the call that failed was sent): log the
        start of an outage (or a change of its cause) once, without a traceback, and put off
        the next attempt to migrate (jittered backoff)."""
        wait = self._retry_delay * self._random.uniform(0.5, 1.0)
        self._retry_at = self.clock.monotonic() + wait
        self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)
        cause = describe(exc)
        if self._down_since is None or type(exc).__name__ not in self._cause:
            if isinstance(exc, SchemaBusy):  # a rolling deploy's old runs: they end soon
                was_down = self._down_since is not None and self._advice is None
                self._advice = None
                self.problem = f"waiting to upgrade the schema ({cause})"
                (logger.info if was_down else logger.warning)(
                    "waiting for the runs in flight to end before upgrading ticklock's tables "
                    "(the previous release's ticks hold them until they end); trying again "
                    "with backoff, and ticks end as 'error' until then"
                )
            elif self.classify(exc):  # down, restarting, overloaded: it comes back by itself
                was_down = self._down_since is not None and self._advice is None
                self._advice = None
                self.problem = f"the database is unavailable ({cause})"
                if was_down:  # one outage, one WARNING: "refused", then "starting up"
                    logger.info("the database is still unavailable (%s)", cause)
                else:
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
        began = since or self.clock.now()
        if self._down_since is None:  # since the call that found it was sent
            self._down_since = time.monotonic() - (self.clock.now() - began).total_seconds()
        if self._down_at is None:  # an outage begins: no connection from before it is reused
            self._expire = not self._given
        if self._down_at is None or began < self._down_at:
            self._down_at = began
        self._cause = cause

    def unanswered(self, sent: float, since: datetime) -> None:
        """A call sent at ``sent`` (``time.monotonic()``, real time whatever the scheduler's
        clock; ``since`` on the scheduler's wall clock) was cut off by its
        timeout without an answer: after :data:`UNANSWERED` seconds, the database did not
        answer (an outage begins then, as if the call had failed); unless every connection
        of the pool is in use, as one may have waited for the others, the event loop was
        blocked meanwhile, so that no answer could be read, or an outage ended since."""
        waited = time.monotonic() - sent
        pool = self.pool
        busy = pool is not None and pool.get_idle_size() == 0
        busy = busy and pool is not None and pool.get_size() >= pool.get_max_size()
        stalled = self._stalled_at >= sent  # the loop was blocked: it heard no answer
        answers = self._up_at >= sent  # another call was answered since: no outage now
        if waited >= UNANSWERED and not busy and not stalled and not answers:
            self.down(TimeoutError(f"no answer within {waited:.1f} s"), since)

    def answered(self, asked: float, since: datetime) -> None:
        """A statement sent at ``asked`` (``time.monotonic()``; ``since`` on the wall clock) was
        answered: :meth:`up`; if it waited :data:`SLOW_ANSWER` seconds or more (and not for a
        blocked event loop), the database was unreachable meanwhile, an outage that ends
        now."""
        waited = time.monotonic() - asked
        seen = self._stalled_at < asked and self._up_at < asked  # else not the database's
        if waited >= SLOW_ANSWER and self._down_at is None and seen:
            self._down_at = since
            self._down_since = time.monotonic() - waited
        self.up()

    def up(self) -> None:
        """Note that the database answered: an outage in progress ended (recorded by
        :meth:`record_outages`)."""
        if self._down_at is not None:
            now = self.clock.now()
            self._incidents.append(Incident(self.owner, UNREACHABLE, self._down_at, now))
            self._down_at = None
            self._up_at = time.monotonic()
            self._expire = not self._given  # see connection()
            self.ended()
        self._retry_delay = RETRY_FIRST
        self.problem = None
        if self._down_since is not None:
            logger.info(
                "the database answers again, after %.1f s", time.monotonic() - self._down_since
            )
            self._down_since = None

    def stalled(self, job_id: str | None, seconds: float) -> None:
        """Note that this replica's event loop was blocked for ``seconds``, until now, by
        ``job_id``'s handler (``None``: by other code), for the ledger."""
        now = self.clock.now()
        self._stalled_at = time.monotonic()
        since = now - timedelta(seconds=seconds)
        self._incidents.append(Incident(self.owner, STALLED, since, now, job_id))

    def refused(self, at: datetime) -> None:
        """Note a tick refused because ``at`` lies in the database's future (this replica's
        clock runs ahead): the ticks refused between two beats make one record, from the
        database's time of the first to the latest slot, so that it covers the slots as
        either clock names them."""
        anchor = self.anchor() or at
        ahead = max(0.0, (at - anchor).total_seconds())
        old = self._ahead
        if old is not None:
            anchor, at = min(anchor, old.since), max(at, old.until)
            ahead = max(ahead, float(old.detail or 0))
        self._ahead = Incident(self.owner, AHEAD, anchor, at, f"{ahead:.3f}")

    async def record_outages(self, conn: asyncpg.Connection[Any]) -> None:
        """Record what kept this replica from its slots (for the ledger), on ``conn``: the
        outages it saw end, its loop's stalls and its ticks refused for its clock. Its
        heartbeat does, at each beat (the next one once the database answers)."""
        if self._ahead is not None:
            self._incidents.append(self._ahead)
            self._ahead = None
        if not self._incidents:
            return
        kept = list(self._incidents)
        await conn.execute(
            self.sql.outage,
            self.namespace,
            self.owner,
            [i.since for i in kept],
            [i.until for i in kept],
            [i.kind for i in kept],
            [i.detail for i in kept],
        )
        for _ in kept:  # others may have been noted meanwhile
            self._incidents.popleft()

    def explain(self, exc: BaseException) -> str:
        """One line for an error that fails start-up: its cause, and the fix."""
        return f"ticklock could not start: {describe(exc)}: {self._fix(exc)}"

    def _fix(self, exc: BaseException) -> str:
        """What an operator does about ``exc``."""
        fix = advice(exc, self.schema)
        if fix is not None:
            return fix
        if self.classify(exc):
            return "the database did not answer, and require_database=True fails start-up"
        return "ticklock cannot work with this database as it is"

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
        await self.fresh()
        assert self.pool is not None, "the coordinator is not open"
        async with self.pool.acquire() as proxy:
            try:
                yield cast("asyncpg.Connection[Any]", proxy)
            except BaseException as exc:
                if not isinstance(exc, Exception) or isinstance(exc, OSError):
                    # cut off mid-call (a timeout) or lost: what it would answer later is
                    # not known, so it is never used again
                    proxy.terminate()
                raise

    async def fresh(self) -> None:
        """Once an outage began, and again once it ended, replace every connection of the
        pool ticklock created (as each is next acquired or released): one from before may
        wait for an answer it will never get (its packets lost, while a new connection is
        bounded by its connect timeout), or get one meant for a statement cut off long ago."""
        if self._expire and self.pool is not None:
            self._expire = False
            await self.pool.expire_connections()

    async def release(self, con: asyncpg.Connection[Any]) -> None:
        """Give a tick's connection back to the pool (which replaces it if it was closed)."""
        assert self.pool is not None
        with self.shielded():
            await self.pool.release(cast("PoolConnectionProxy[Any]", con))

    def anchor(self) -> datetime | None:
        """The database's time carried on this replica's clock (see :class:`DatabaseTime`): with
        ``clock_timestamp()``, the reference of every check for "in the database's future"."""
        return self._time.at(self.clock.monotonic())

    async def _check_clock(self, conn: asyncpg.Connection[Any]) -> None:
        """Read the database's clock into the anchor, and warn of a replica clock off by more
        than :data:`SKEW_WARNING` from it."""
        clock = self.clock
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

    def classify(self, exc: BaseException) -> Outcome | None:
        """``ERROR`` when ``exc`` means the session or the server was lost (or not there)."""
        import asyncpg

        if isinstance(exc, asyncpg.ClientConfigurationError):
            return None  # a DSN option asyncpg refuses: waiting cannot fix it
        if isinstance(exc, (OSError, asyncpg.InterfaceError, SlotAlreadyCommitted, TakenOver)):
            return Outcome.ERROR  # SchemaBusy is an OSError too
        if isinstance(exc, asyncpg.PostgresError):
            state = exc.sqlstate or ""
            if state.startswith(_LOST_STATES) or state in _LOST_CODES | _TRANSIENT_CODES:
                return Outcome.ERROR
        return None


def _nothing() -> None:
    """No heartbeat to tell."""


def _answered(exc: BaseException) -> bool:
    """Whether ``exc`` is the database's answer (or its silence), which an operator can fix
    while the app runs, rather than a DSN option asyncpg itself refuses."""
    import asyncpg

    if isinstance(exc, asyncpg.ClientConfigurationError):
        return False
    return isinstance(exc, (OSError, asyncpg.InterfaceError, asyncpg.PostgresError, _Ungranted))


def advice(exc: BaseException, schema: str) -> str | None:
    """What an operator does about ``exc``, an answer of the database that names its cause
    (a wrong password, a missing role, database or grant), or ``None``."""
    import asyncpg

    if isinstance(exc, asyncpg.InvalidPasswordError):
        return "check the password in the DSN (or PGPASSWORD / ~/.pgpass)"
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return "create the role (CREATE ROLE ... LOGIN), or correct the user in the DSN"
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return "create the database, or correct its name in the DSN"
    if isinstance(exc, asyncpg.ObjectNotInPrerequisiteStateError) and "accepting" in str(exc):
        return "let the database accept connections (ALTER DATABASE ... ALLOW_CONNECTIONS true)"
    if isinstance(exc, asyncpg.InsufficientPrivilegeError) and "CONNECT" in str(
        getattr(exc, "detail", None)
    ):
        return "GRANT CONNECT ON DATABASE ... to the DSN's user"
    if isinstance(exc, (asyncpg.InsufficientPrivilegeError, _Ungranted)):
        s = schema
        grants = (
            f"GRANT USAGE ON SCHEMA {s}, GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES "
            f"IN SCHEMA {s} and GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} to it"
        )
        return (
            f"the tables are there: {grants}"
            if isinstance(exc, _Ungranted)
            else f"the DSN's user needs CREATE on the database, for ticklock to create its "
            f"tables in schema {s!r}; or, once 'ticklock migrate' has created them as "
            f"another user: {grants}"
        )
    return None
