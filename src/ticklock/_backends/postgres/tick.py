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
trigger refuses every COMMIT but the one that first sets the token (:func:`.begin.sealed_commit`),
however a COMMIT reached the server; each batch's transaction has a seal of its own.

The commit statement itself checks that the transaction is still the one that took the lock
(a handler's ``COMMIT AND CHAIN`` would start another one, without the lock), that the
server-side timeouts are still in force, and that the slot and end are not in the future of
the database's clock beyond :data:`FUTURE_LIMIT` (a replica whose clock runs ahead would
otherwise stop the fleet until its clock's "now" comes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
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
from ..._runtime.slots import next_due, overdue_at
from ..._schedule.caps import ERROR_LIMIT, cut_text
from ..._schedule.job import Job, RunResult, shut_down
from ..._schedule.lock_key import lock_key
from ..seam import FUTURE_LIMIT, Fill, FleetState
from . import database
from .begin import begin_batch, sealed_commit
from .connection import ConnectionLease
from .sql import LEFTOVERS

logger = logging.getLogger("ticklock")

if TYPE_CHECKING:
    import asyncpg

    from .database import Database

SERVER_GRACE = 1.0
"""Seconds the server-side timeouts add to the job's timeout, so that the client's own
timeout normally fires first and the server's is the backstop for a paused process."""
HOLD_GRACE = 1.0
"""Seconds a batched run's hold between its batches lasts past its server-side bound: from
the tick's start on the database's clock, the job's timeout plus :data:`SERVER_GRACE` plus
this. No batch of the run commits after it; another replica may take the job over then."""
STALE_GRACE = 1.0
"""Seconds past a holder's server-side bound after which another replica may end its session:
its deadline, which each of its transactions records in a lock (see :func:`.begin.locks`). What
bounds a frozen holder whose handler switched the server-side timeouts off."""


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
        "fill",
        "turn",
        "replacing",
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
        self.fill: Fill | None = None  # the slot of a backfill this tick runs
        self.turn = False  # with the lock: whether that slot is the backfill's next
        self.replacing: datetime | None = None  # the slot its locks name (overlap "replace")

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
        await self._seal(prepared)
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
            slot=self.replacing,
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
                if self.fill is not None:
                    await self._write_fill(result, report, self.fill)
                else:
                    await self._write(
                        result,
                        report,
                        overdue_at(job, result.finished_at),
                        next_due(job, result),
                        cursor,
                        job.limit is not None,
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
        counted: bool,
    ) -> None:
        """Commit the run (``counted``: its job has a limit, which it counts toward)."""
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
            counted,
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
        await self._seal(prepared)

    async def _write_fill(self, result: RunResult, report: str | None, fill: Fill) -> None:
        """Commit a slot of a backfill: its run, marked so, the watermark moved forward only,
        and the backfill on to its next slot."""
        assert self.con is not None
        c = self._db
        row = await self._checked(
            c.sql.fill_commit,
            c.namespace,
            self._job_id,
            result.slot,
            result.finished_at,
            result.started_at,
            result.owner,
            report,
            result.batches,
            fill.request,
            fill.index,
            fill.who,
            self.tx,
            self._limit_ms,
            c.anchor(),
            self.seal,
            self._lease.used,
        )
        assert row is not None  # the statement returns one row
        written, same_tx, bounded, ahead, prepared = row
        self._check(same_tx, bounded)
        if ahead > FUTURE_LIMIT:
            raise ClockAhead(
                f"this replica's clock is {ahead:.1f} s ahead of the database's: nothing was "
                "committed. Synchronise the replica's clock (NTP)"
            )
        if written != 1:
            raise SlotAlreadyCommitted(
                f"slot {result.slot} of {self._job_id} was run by another replica's backfill"
            )
        await self._seal(prepared)

    async def _seal(self, prepared: bool) -> None:
        """ticklock's own COMMIT of the checked transaction; first, if the handler used the
        connection, the reset (inside the transaction: if it failed, nothing would commit),
        and the connection retired if it keeps SQL prepared statements (``prepared``)."""
        assert self.con is not None
        if self._lease.used:  # no session state left behind on this server session
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
                if self.fill is not None:
                    await conn.execute(
                        c.sql.fill_failure,
                        c.namespace,
                        result.job_id,
                        result.slot,
                        result.finished_at,
                        result.started_at,
                        result.outcome.value,
                        result.owner,
                        None if result.error is None else storable(result.error),
                        self.fill.request,
                        self.fill.index,
                        self.fill.who,
                        result.batches,
                        not shut_down(result),
                    )
                else:
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
