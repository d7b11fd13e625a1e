"""One tick's transaction on PostgreSQL: it holds the job's lock, lends its connection to the
handler, and commits the watermark, the success and the run record with the handler's writes,
or rolls everything back.

A handler that used ``ctx.conn`` may have left session state: settings, a role, temporary
tables, cursors, listeners, advisory locks (``sql.RESET`` undoes them all), or SQL prepared
statements (``PREPARE``, which no statement can drop without also dropping asyncpg's own):
the commit statement (or, on the way out of a failed tick, a query after the reset) says
whether any is left, and such a connection is closed instead of reused. The reset rides in the
same simple query as the tick's COMMIT (just before it, inside the transaction) or its
ROLLBACK (just after it): no extra round trip, and a tick that commits is one transaction.

Only ticklock's own COMMIT can commit a tick: its transaction inserts a seal (the SHA-256 of
a random token of the tick's, kept in this process) before the handler runs, whose deferred
trigger refuses every COMMIT but the one that first sets the token (:func:`sealed_commit`),
however a COMMIT reached the server; each batch's transaction has a seal of its own.

The commit statement itself checks that the transaction is still the one that took the lock
(a handler's ``COMMIT AND CHAIN`` would start another one, without the lock), that the
server-side timeouts are still in force, and that the slot and end are not in the future of
the database's clock beyond :data:`FUTURE_LIMIT` (a replica whose clock runs ahead would
otherwise stop the fleet until its clock's "now" comes).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from ..._errors import (
    ClockAhead,
    LimitsChanged,
    SlotAlreadyCommitted,
    TakenOver,
    TransactionChanged,
    TransactionEnded,
)
from ..._runtime.plan import next_due, overdue_at
from ..._schedule.caps import ERROR_LIMIT, cut_text
from ..._schedule.job import Job, RunResult
from ..._schedule.lock_key import lock_key
from ..seam import FUTURE_LIMIT, FleetState
from . import database
from .connection import ConnectionLease
from .schema import SEAL_SETTING
from .sql import DEADLINE_TAG, LEFTOVERS

logger = logging.getLogger("ticklock")

if TYPE_CHECKING:
    import asyncpg

    from .database import Database

KEYS_CACHED = 4096
"""The jobs whose lock keys a coordinator keeps computed."""
SERVER_GRACE = 1.0
"""Seconds the server-side timeouts add to the job's timeout, so that the client's own
timeout normally fires first and the server's is the backstop for a paused process."""
HOLD_GRACE = 1.0
"""Seconds a batched run's hold between its batches lasts past its server-side bound: from
the tick's start on the database's clock, the job's timeout plus :data:`SERVER_GRACE` plus
this. No batch of the run commits after it; another replica may take the job over then."""
STALE_GRACE = 1.0
"""Seconds past a holder's server-side bound after which another replica may end its session:
its deadline, which each of its transactions records in a lock (see :func:`locks`). What
bounds a frozen holder whose handler switched the server-side timeouts off."""
GRACE_MS = int(STALE_GRACE * 1000)


def sealed_commit(token: str) -> str:
    """ticklock's own COMMIT of a tick's (or batch's) transaction: the one that sets the
    token whose SHA-256 is the transaction's seal (see :mod:`.schema`), so the seal's trigger
    lets it commit. ``token`` is ticklock's own hex text: safe to inline."""
    if not token.isalnum():
        raise ValueError(f"a hex token is needed, got {token!r}")
    return f"SET LOCAL {SEAL_SETTING} = '{token}'; COMMIT"


class Begun(enum.IntEnum):
    """What a tick's first query found, as the row count of its status tag (``SELECT n``)."""

    HELD = 0
    """Another session holds the job's lock."""
    ACQUIRED = 1
    """The lock is this tick's."""
    AHEAD = 2
    """The slot lies in the database's future: refused, the lock not tried."""


class Holder(enum.IntEnum):
    """What :func:`end_stale_holder` did, as the row count of its status tag."""

    LIVE = 0
    """No ticklock holder past its deadline (or none at all any more)."""
    ENDED = 1
    """The holder was past its deadline: its session was ended."""
    REFUSED = 2
    """The holder is past its deadline, and this role may not end its session: it is not a
    member of the holder's role, nor of ``pg_signal_backend``."""
    SUPERUSER = 3
    """The holder is past its deadline and runs as a superuser, which only a superuser may
    end."""


def locks(key: int, legacy: int, limit_ms: int, grace_ms: int, *, wait: bool) -> str:
    """The SQL expression that takes a tick's locks: ``key`` (the job's key in this
    installation, :func:`ticklock.lock_key` with its schema) exclusively, ``legacy`` (the key
    without a schema, which earlier releases take exclusively) in shared mode, and the
    deadline lock (:data:`DEADLINE_TAG`): the transaction's start plus ``limit_ms`` (its
    server-side bound) and ``grace_ms``, in whole seconds (rounded down, so never more than
    ``grace_ms`` past the bound). ``wait``: wait for the locks (``pg_advisory_xact_lock``,
    bounded by the transaction's ``lock_timeout``) and return them, else try them and return
    whether the job's were taken (the deadline lock is taken only then). The keys are ints:
    safe to inline."""
    deadline = f"floor(extract(epoch FROM now()) + {(limit_ms + grace_ms) / 1000!r})::int8"
    dated = f"(({deadline} + 2147483648) % 4294967296 - 2147483648)::int4"
    if wait:
        return (
            f"pg_advisory_xact_lock({key}), pg_advisory_xact_lock_shared({legacy}), "
            f"pg_advisory_xact_lock_shared({DEADLINE_TAG}, {dated})"
        )
    return (
        f"pg_try_advisory_xact_lock({key}) AND pg_try_advisory_xact_lock_shared({legacy}) "
        f"AND pg_try_advisory_xact_lock_shared({DEADLINE_TAG}, {dated}) IS NOT NULL"
    )


def _limits(limit_ms: int, *, transaction_timeout: bool) -> str:
    """The server-side timeouts of a tick or batch: ``transaction_timeout`` on PostgreSQL 17+
    (it bounds the transaction idle or busy), else the other two."""
    if transaction_timeout:
        return f"SET LOCAL transaction_timeout = {limit_ms}; "
    return (
        f"SET LOCAL statement_timeout = {limit_ms}; "
        f"SET LOCAL idle_in_transaction_session_timeout = {limit_ms}; "
    )


def begin_batch(
    key: int, legacy: int, limit_ms: int, grace_ms: int, *, transaction_timeout: bool
) -> str:
    """A later batch's first query: BEGIN, the server-side timeouts from what is left of the
    run's budget, and the job's locks (see :func:`locks`), waited for up to
    :data:`BATCH_LOCK_WAIT_MS` (a rival's attempt holds them a moment to read the job's state,
    and finds the job held between batches)."""
    limits = _limits(limit_ms, transaction_timeout=transaction_timeout)
    wait = min(limit_ms, BATCH_LOCK_WAIT_MS)
    taken = locks(key, legacy, limit_ms, grace_ms, wait=True)
    return f"BEGIN; {limits}SET LOCAL lock_timeout = {wait}; SELECT {taken}"


BATCH_LOCK_WAIT_MS = 5000
"""How long a later batch waits for the job's lock before its run gives up."""


def timestamp(value: datetime) -> str:
    """``value`` (aware) as a ``timestamptz`` literal: ticklock's own value, safe to inline."""
    if value.utcoffset() is None:
        raise ValueError(f"an aware datetime is needed, got {value!r}")
    return f"'{value.isoformat()}'::timestamptz"


def begin(
    key: int,
    legacy: int,
    limit_ms: int,
    grace_ms: int,
    *,
    transaction_timeout: bool,
    at: datetime,
    anchor: datetime | None,
) -> str:
    """A tick's first query: BEGIN, the server-side timeouts (``transaction_timeout`` on
    PostgreSQL 17+, which bounds the transaction idle or busy; the other two before), the
    future check and the locks (see :func:`locks`). Its status tag is a :class:`Begun` (a held
    lock raises no error, so the server logs nothing).

    ``at`` (the slot, or the tick's start if later) more than ``FUTURE_LIMIT`` seconds beyond
    ``greatest(clock_timestamp(), anchor)`` (see :class:`.database.DatabaseTime`) is refused
    before the lock is tried, and so before the handler could start. ``key`` is an int and
    the timestamps are ticklock's own (:func:`timestamp`): safe to inline.
    """
    limits = _limits(limit_ms, transaction_timeout=transaction_timeout)
    reference = "clock_timestamp()" if anchor is None else f"{timestamp(anchor)}, clock_timestamp()"
    taken = locks(key, legacy, limit_ms, grace_ms, wait=False)
    # OFFSET 0: the check is evaluated once, and before the lock is tried
    return (
        f"BEGIN; {limits}SELECT 1 FROM (SELECT {timestamp(at)} > greatest({reference}) + "
        f"interval '{FUTURE_LIMIT:g} s' AS ahead OFFSET 0) AS c, generate_series(1, CASE "
        f"WHEN c.ahead THEN {Begun.AHEAD:d} WHEN {taken} "
        f"THEN {Begun.ACQUIRED:d} ELSE {Begun.HELD:d} END)"
    )


def end_stale_holder(key: int, wait_ms: int | None) -> str:
    """End the session of the holder of lock ``key`` (the job's key in this installation) if
    it is a tick of ticklock's past its deadline, waiting up to ``wait_ms`` for it to go
    (``None``: PostgreSQL before 14, no wait). Its status tag is a :class:`Holder`.

    Everything the judge reads is visible to every role: the holder is found through
    ``pg_locks`` (an advisory lock on an int8 key has the key's high and low 32 bits as
    ``classid`` and ``objid``, and ``objsubid`` 1), its deadline is the second key of the
    deadline lock it holds (:data:`DEADLINE_TAG`, ``objsubid`` 2; the earliest, should there be
    more), and its role is ``pg_stat_activity.usesysid`` (``xact_start`` and ``state`` are
    hidden from other roles without ``pg_read_all_stats``; the session's user is not). A
    session that holds the key without a deadline lock is not a ticklock tick: never ended.
    Only a session this role may end is ended, by the server's own rule (a role with the
    privileges of the holder's role or of ``pg_signal_backend``; a superuser for a superuser's
    session), so the statement never fails on privileges.
    """
    hi, lo = (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF
    end = f"pg_terminate_backend(s.pid, {wait_ms})" if wait_ms else "pg_terminate_backend(s.pid)"
    here = "(SELECT oid FROM pg_database WHERE datname = current_database())"
    superuser = "(SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
    signal = "(pg_has_role(a.usesysid, 'USAGE') OR pg_has_role('pg_signal_backend', 'USAGE'))"
    # OFFSET 0: each holder is judged, then ended, once
    return f"""SELECT 1 FROM generate_series(1, (
    SELECT CASE WHEN bool_or(h.ended) THEN {Holder.ENDED:d}
        WHEN bool_or(h.superuser) THEN {Holder.SUPERUSER:d}
        WHEN count(*) > 0 AND NOT bool_or(h.may) THEN {Holder.REFUSED:d}
        ELSE {Holder.LIVE:d} END
    FROM (SELECT s.may, s.superuser, CASE WHEN s.may THEN {end} ELSE false END AS ended
        FROM (SELECT k.pid, r.rolsuper AND NOT {superuser} AS superuser,
                {signal} AND (NOT r.rolsuper OR {superuser}) AS may
            FROM pg_locks AS k JOIN pg_stat_activity AS a ON a.pid = k.pid
            JOIN pg_roles AS r ON r.oid = a.usesysid
            WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 1
                AND k.classid = {hi} AND k.objid = {lo} AND k.pid <> pg_backend_pid()
                AND k.database = {here}
                AND extract(epoch FROM clock_timestamp()) > (
                    SELECT min(m.objid::int8) FROM pg_locks AS m
                    WHERE m.pid = k.pid AND m.locktype = 'advisory' AND m.granted
                        AND m.objsubid = 2 AND m.classid = {DEADLINE_TAG}
                        AND m.database = {here})
            OFFSET 0) AS s
        OFFSET 0) AS h))"""


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


class Tick:
    """One tick's hold on its job: the lock (or not), the fleet state, the connection."""

    __slots__ = (
        "con",
        "_db",
        "_job_id",
        "_lease",
        "_limit_ms",
        "_hold_ms",
        "fence",
        "open",
        "tx",
        "acquired",
        "conn",
        "state",
        "_token",
    )

    def __init__(
        self,
        db: Database,
        job_id: str,
        con: asyncpg.Connection[Any],
        limit_ms: int,
    ) -> None:
        self._db = db
        self._job_id = job_id
        self._limit_ms = limit_ms  # the server-side timeouts the tick (or batch) set
        self._hold_ms = limit_ms + int(HOLD_GRACE * 1000)  # a batched run's hold
        self.fence: int | None = None  # the job's fence once a batch of this run committed
        self.tx: datetime | None = None  # the start of the transaction that took the lock
        self.open = True  # until our own COMMIT or ROLLBACK ends the transaction
        self.con: asyncpg.Connection[Any] | None = con
        # What the handler gets: a lease on the connection (or on a given pool's proxy).
        self._lease = ConnectionLease(con)
        self.conn: asyncpg.Connection[Any] | None = cast("asyncpg.Connection[Any]", self._lease)
        self.acquired = False
        self.state = FleetState()
        self._token = secrets.token_hex(16)  # the current transaction's: see the module

    @property
    def seal(self) -> bytes:
        """The seal the current transaction inserts (the SHA-256 of its token)."""
        return hashlib.sha256(self._token.encode()).digest()

    async def commit_batch(self, cursor: str | None) -> None:
        """Commit the batch in flight with ``cursor``, if the run still holds the job; the
        first batch takes the job (moves its fence, holds it between batches)."""
        with self._db.shielded():  # a timeout now would leave unknown whether it committed
            try:
                await self._commit_batch(cursor)
            except Exception as exc:
                self._db.lost(exc)
                raise
        if self.open:
            raise TimeoutError(
                f"the commit of a batch did not finish within {database.CLEANUP_SECONDS:g} s "
                "(a stalled server or network): the batch is rolled back, unless its COMMIT "
                "had reached the server"
            )

    async def _commit_batch(self, cursor: str | None) -> None:
        assert self.con is not None
        c = self._db
        row = await self._checked(
            c.sql.batch,
            c.namespace,
            self._job_id,
            cursor,
            self.tx,
            self.fence,
            self._hold_ms,
            self._limit_ms,
            self._lease.used,
            self.seal,
        )
        assert row is not None  # the statement returns one row
        fence, same_tx, bounded, prepared = row
        self._check(same_tx, bounded)
        if fence is None:
            raise self._taken_over()
        if self._lease.used:  # no session state left behind on this server session
            self._lease.retire |= prepared
            await self.con.execute(c.reset() + sealed_commit(self._token))
        else:
            await self.con.execute(sealed_commit(self._token))
        self.open = False
        self.fence = fence

    async def begin_batch(self, budget: float) -> None:
        """Begin the next batch: BEGIN, timeouts from the ``budget`` left, the job's lock,
        and the check that the run still holds the job (its fence, its hold)."""
        assert self.con is not None and self.fence is not None
        c = self._db
        self._limit_ms = limit_ms(budget)
        self.open = True  # from BEGIN on, until a COMMIT or ROLLBACK of ours
        statement = begin_batch(
            lock_key(c.namespace, self._job_id, schema=c.schema),
            lock_key(c.namespace, self._job_id),
            self._limit_ms,
            int(STALE_GRACE * 1000),
            transaction_timeout=c.transaction_timeout,
        )
        try:
            await self.con.execute(statement)
        except Exception as exc:
            import asyncpg

            if isinstance(exc, asyncpg.LockNotAvailableError):
                raise TakenOver(
                    f"job {self._job_id!r}: the next batch could not take the job's lock: "
                    "another session holds it (another replica took the job over, or an "
                    "operator's forget); nothing more of this run commits"
                ) from exc
            c.lost(exc)
            raise
        self._token = secrets.token_hex(16)  # the batch's transaction's own
        row = await self.con.fetchrow(
            c.sql.batch_hold, c.namespace, self._job_id, self.fence, self.seal
        )
        assert row is not None
        self.tx, ours = row
        if not ours:
            raise self._taken_over()

    def _taken_over(self) -> TakenOver:
        return TakenOver(
            f"job {self._job_id!r}: another replica took the job over since this run's last "
            "committed batch (this run outlived its hold: paused, or past its budget): this "
            "batch is rolled back and nothing more of the run commits"
        )

    def _check(self, same_tx: bool, bounded: bool) -> None:
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

    async def commit(self, result: RunResult, job: Job, cursor: str | None = None) -> None:
        # The handler has returned: nothing it left running may use the connection now,
        # between the commit statement's checks and the COMMIT.
        self._lease.end()
        report = None if result.report is None else json.dumps(result.report)
        with self._db.shielded():
            try:
                await self._write(
                    result,
                    report,
                    overdue_at(job, result.finished_at),
                    next_due(job, result),
                    cursor,
                )
            except Exception as exc:
                self._db.lost(exc)
                raise
        if self.open:  # the cleanup bound cut it short: never report that as a success
            raise TimeoutError(
                f"the commit did not finish within {database.CLEANUP_SECONDS:g} s (a stalled "
                "server or network): the tick is rolled back, unless its COMMIT had reached "
                "the server"
            )

    async def _write(
        self,
        result: RunResult,
        report: str | None,
        overdue_at: datetime | None,
        next_due: datetime | None,
        cursor: str | None,
    ) -> None:
        assert self.con is not None
        c = self._db
        row = await self._checked(
            c.sql.commit,
            c.namespace,
            self._job_id,
            result.slot,
            result.finished_at,
            result.started_at,
            result.owner,
            report,
            overdue_at,
            self.tx,
            self._limit_ms,
            result.manual,
            next_due,
            self._lease.used,
            c.anchor(),
            self.fence,
            cursor,
            result.batches,
            result.capped,
            self.seal,
        )
        assert row is not None  # the statement returns one row
        written, same_tx, bounded, ahead, prepared, fenced = row
        self._check(same_tx, bounded)
        if not fenced:
            raise self._taken_over()
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
            await self.con.execute(self._db.reset() + sealed_commit(self._token))
        else:
            await self.con.execute(sealed_commit(self._token))
        self.open = False

    async def _checked(self, statement: str, *args: object) -> asyncpg.Record | None:
        """The row of a commit statement; a transaction the handler made read-only (which
        the server refuses the statement in) raises :class:`TransactionChanged`."""
        import asyncpg

        assert self.con is not None
        try:
            return await self.con.fetchrow(statement, *args)
        except asyncpg.ReadOnlySQLTransactionError as exc:  # the seal's INSERT was not refused
            raise TransactionChanged(
                "the handler made the tick's transaction read-only (transaction_read_only), "
                "so ticklock could not record the run with the handler's writes: nothing was "
                "committed. For a read-only handler, just write nothing"
            ) from exc

    def abandon(self) -> None:
        """The connection was cut off mid-call (no answer in time): :meth:`close` closes it
        without a word, as what it would answer later is not known."""
        self.open = False
        self._lease.retire = True

    async def close(self) -> None:
        con, self.con, self.conn = self.con, None, None
        if con is None:
            return
        lease = self._lease
        lease.end()
        c = self._db
        if self.open and not con.is_closed():
            with c.shielded():
                try:
                    # after ROLLBACK: an aborted transaction accepts no other statement
                    if lease.used:
                        reset = c.reset()
                        status = await con.execute("ROLLBACK; " + reset + LEFTOVERS[2:])
                        lease.retire |= status == "SELECT 1"
                    else:
                        await con.execute("ROLLBACK")
                    self.open = False
                except Exception:
                    con.terminate()
        if self.open or lease.retire:
            con.terminate()  # never reused: still in a transaction, or with state left
        await c.release(con)

    async def record_failure(self, result: RunResult, job: Job) -> None:
        """Record a run that did not commit, in its own short transaction (a batched run's
        hold between batches ends with it, if it is still this run's fence)."""
        c = self._db
        with c.shielded() as scope:
            async with c.connection() as conn:
                await conn.execute(
                    c.sql.failure,
                    c.namespace,
                    result.job_id,
                    result.slot,
                    result.finished_at,
                    result.started_at,
                    result.outcome.value,
                    result.owner,
                    None if result.error is None else storable(result.error),
                    result.manual,
                    next_due(job, result),
                    c.anchor(),
                    self.fence,
                    result.batches,
                    overdue_at(job, result.finished_at),
                )
        if scope.cancelled_caught:
            raise TimeoutError(f"the record did not finish within {database.CLEANUP_SECONDS:g} s")


def limit_ms(budget: float) -> int:
    """The server-side timeouts of a tick whose job has ``budget`` seconds, in ms."""
    return int((budget + SERVER_GRACE) * 1000)


def storable(text: str) -> str:
    """``text`` as PostgreSQL can store it: NUL and unpaired surrogates escaped, and still
    within :data:`~ticklock._schedule.caps.ERROR_LIMIT` once escaped."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode()
    return cut_text(text, len(text), ERROR_LIMIT)


class Ticking:
    """How a coordinator begins its ticks: BEGIN, the timeouts, the future check and the locks
    in one query, then the job's state under the lock (the half of
    :class:`~.coordinator.PostgresCoordinator` that a tick goes through)."""

    db: Database
    namespace: str
    schema: str
    _refused: set[Holder]
    """Why a stale holder may not be ended: said once per cause."""
    _keys: Callable[[str], tuple[int, int]]
    """A job's lock keys: in this installation's schema, and the legacy one (cached)."""

    def _lock_keys(self) -> Callable[[str], tuple[int, int]]:
        """A job's two lock keys, computed once per job while it runs often (a bounded
        cache: a namespace may hold many stored schedules)."""

        @functools.lru_cache(maxsize=KEYS_CACHED)
        def keys(job_id: str) -> tuple[int, int]:
            return (
                lock_key(self.namespace, job_id, schema=self.schema),
                lock_key(self.namespace, job_id),
            )

        return keys

    async def _begin(
        self, conn: asyncpg.Connection[Any], job_id: str, budget: float, at: datetime
    ) -> Begun:
        statement = begin(
            *self._keys(job_id),
            limit_ms(budget),
            GRACE_MS,
            transaction_timeout=self.db.transaction_timeout,
            at=at,
            anchor=self.db.anchor(),
        )
        status = await conn.execute(statement)
        return Begun(int(status.rsplit(" ", 1)[1]))

    async def _take_over(self, attempt: Tick, job_id: str, budget: float, at: datetime) -> Begun:
        """The lock is held: roll back, and end the holder's session if it is a tick past its
        deadline (a frozen replica whose handler switched the server-side timeouts off), then
        try once more. The common path (the lock taken) never pays this."""
        assert attempt.con is not None
        conn = attempt.con
        key, _ = self._keys(job_id)
        status = await conn.execute("ROLLBACK; " + end_stale_holder(key, self.db.terminate_wait))
        attempt.open = False
        holder = Holder(int(status.rsplit(" ", 1)[1]))
        if holder in (Holder.REFUSED, Holder.SUPERUSER) and holder not in self._refused:
            self._refused.add(holder)  # said once per cause
            logger.warning(
                "%s: the replica holding the lock is past its deadline (its tick began more "
                "than its timeout + %.0f s ago: its handler switched off the server-side "
                "timeouts, and it is frozen or stuck), and %s: no replica can run the job "
                "until it lets go. %s",
                job_id,
                SERVER_GRACE + STALE_GRACE,
                *_refusal(holder, _role(conn)),
                extra={"job_id": job_id},
            )
        if holder is not Holder.ENDED:
            return Begun.HELD
        logger.warning(
            "%s: ended the session of the replica holding the lock past its deadline (its "
            "handler had switched off the server-side timeouts, and it is frozen or stuck): "
            "its writes are rolled back, and this replica runs the job",
            job_id,
            extra={"job_id": job_id},
        )
        attempt.open = True
        return await self._begin(conn, job_id, budget, at)

    async def attempt(self, job_id: str, budget: float, at: datetime) -> Tick:
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
        answered = False
        try:
            asked, when = time.monotonic(), self.db.clock.now()
            begun = await self._begin(conn, job_id, budget, at)
            answered = True
            self.db.answered(asked, when)
            if begun is Begun.HELD:
                begun = await self._take_over(attempt, job_id, budget, at)
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
