"""A replica's link to its operators: its heartbeat, and the pauses and triggers it obeys.

One statement per beat records that the replica is alive and which jobs it declares, and reads
the namespace's paused jobs and pending trigger requests (a partial index keeps that read
small however many jobs there are). ``pause``, ``resume`` and ``trigger`` send a NOTIFY on
:data:`CHANNEL`; a replica that can LISTEN on a connection of its own beats at once on it, and
otherwise every :data:`BEAT_SLOW` seconds. Where LISTEN cannot work (behind a transaction-mode
pooler such as PgBouncer, which does not forward notifications, or with a pool the application
passed, for which ticklock has no DSN to listen with) it beats every :data:`BEAT_FAST` seconds,
so that a request is seen within that.

A paused job is also refused in the tick itself, under its lock: no scheduled run of a paused
job starts once the pause has committed, whenever the replica hears of it.

Each beat also returns the other live replicas and when their job lists last changed; a list
is read again only when it changed, and the view goes to the scheduler, which shares the jobs
over it (see ``_runtime/sharing.py``). A replica that joins, changes its jobs or leaves sends
a NOTIFY, so that the replicas listening update their view at once. A replica counts as live
for the others once it beat twice (a process that dies at start never enters their view: a
crash-looping pod leaves no live rows), and it beats the second time :data:`CONFIRM` seconds
after it joined; a row not seen for :data:`PRUNE` seconds is deleted by the next beat.

Anyone who can connect may NOTIFY the channel. What notifications cause is bounded: a beat at
most every :data:`MIN_GAP` seconds, and a replica that receives more than :data:`STORM`
notifications within :data:`STORM_WINDOW` seconds (:data:`WRITES_STORM` of stored schedules'
writes) closes its LISTEN connection for
:data:`STORM_QUIET` seconds (a WARNING says so) and beats every :data:`BEAT_FAST` seconds
meanwhile, as behind a pooler.

A beat that finds one of ticklock's tables missing (dropped, or a schema restored without it)
creates the tables again at once and beats again; every beat carries the whole set of paused
and triggered jobs, so a notification or a beat that is lost delays an operator's change by
one beat interval at most, and loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import deque
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from ..._errors import DatabaseUnavailable
from ..._operators.fleet import BY_TICKLOCK, expired
from ..._runtime.clock import Clock
from ..._runtime.sharing import LIVE, Member
from ..seam import Control, Declared, Watcher
from .connection import connect
from .schema import migrate

if TYPE_CHECKING:
    import asyncpg

    from .database import Database

logger = logging.getLogger("ticklock")

CHANNEL = "ticklock"
"""The NOTIFY channel; the payload names the schema and the namespace."""
BEAT_SLOW = 15.0
"""Seconds between beats while a LISTEN connection is up."""
BEAT_FAST = 3.0
"""Seconds between beats without one: the bound for a pause or trigger to be seen."""
CONFIRM = 1.0
"""Seconds after a replica's first beat before its second, which makes it live for the others."""
PRUNE = 600.0
"""Seconds after its last beat before a replica's row is deleted."""
BEAT_LIMIT = 5.0
"""Seconds a beat may take: one that gets no answer sooner fails (the database is noted
unreachable from this replica), and the next beat comes :data:`BEAT_FAST` seconds later."""
MIN_GAP = 0.5
"""The least seconds between two beats that notifications cause."""
STORM, STORM_WINDOW, STORM_QUIET = 1000, 10.0, 60.0
"""More than ``STORM`` notifications within ``STORM_WINDOW`` seconds: stop listening for
``STORM_QUIET`` seconds."""
WRITES_STORM = 20_000
"""The same for the notifications of stored schedules' writes, which an application sends
by the thousand when it imports schedules (they commit one at a time, under the namespace's
lock: about 750 a second on a 2-core machine)."""
_MISSING = frozenset({"42P01", "3F000"})  # undefined table, invalid schema name


_WRITES_TAIL = ', "schedules"]'
"""How the payload of a stored schedule's write ends, whatever its schema and namespace."""


def payload(schema: str, namespace: str, what: str | None = None) -> str:
    """The NOTIFY payload for ``namespace`` in ``schema`` (``what``: ``"schedules"`` for a
    stored schedule's write)."""
    return json.dumps([schema, namespace] if what is None else [schema, namespace, what])


class Watch:
    """Beats for one replica and hands each beat's pauses and triggers to ``apply``."""

    def __init__(
        self,
        coordinator: Database,
        dsn: str | None,
        clock: Clock,
        replica: Watcher,
    ) -> None:
        self._coordinator = coordinator
        self._dsn = dsn  # None: a pool the application passed, no LISTEN
        self._clock = clock
        self._owner = replica.owner
        self._declared = replica.declared
        self._apply = replica.apply
        self._members = replica.members
        # the other live replicas: when their job lists last changed, and what they declare
        self._others: dict[str, tuple[datetime, Member]] = {}
        self._payload = payload(coordinator.schema, coordinator.namespace)
        self._sent: Declared | None = None  # what the replicas row says this replica declares
        self._fresh = True  # the first beat of this run: it restarts the row's started_at
        self._listener: asyncpg.Connection[Any] | None = None
        self._wake: anyio.CancelScope | None = None
        self._woken = False
        self._soon: float | None = None  # a beat due before the regular one (monotonic)
        self._pause_ends: float | None = None  # when the next pause ends (monotonic)
        self._written = payload(coordinator.schema, coordinator.namespace, "schedules")
        self._heard: deque[float] = deque()  # when the last notifications came (monotonic)
        self._heard_writes: deque[float] = deque()  # the same, of schedules' writes
        self._quiet_until = -math.inf  # no LISTEN until then: a storm of notifications
        self._failed = False  # the last beat failed
        coordinator.ended = self.poke  # an outage ended: record it at once

    def poke(self) -> None:
        """Beat now (the listener was lost, or this replica steered a job)."""
        self._woken = True
        if self._wake is not None:
            self._wake.cancel()

    async def run(self) -> NoReturn:
        """Beat until cancelled; then close the listener and remove this replica's row."""
        clock = self._clock
        try:
            while True:
                self._woken = False
                last = clock.monotonic()
                await self._beat()
                if self._soon is not None and self._soon <= clock.monotonic():
                    # the confirming beat failed (it returned before moving _soon): try it
                    # again CONFIRM seconds on, not at once (a busy loop until the database
                    # answers)
                    self._soon = clock.monotonic() + CONFIRM
                listening = await self._listen()
                if self._woken:  # at most one beat a MIN_GAP for what woke it
                    await clock.sleep_until(last + MIN_GAP)
                    continue
                # a beat that failed: the next one soon, to see the database answer again
                slow = listening and not self._failed
                due = last + (BEAT_SLOW if slow else BEAT_FAST)
                if self._soon is not None:
                    due = min(due, self._soon)
                if self._pause_ends is not None:  # that pause ends: resume it then
                    due = min(due, max(self._pause_ends, last + MIN_GAP))
                with anyio.CancelScope() as scope:
                    self._wake = scope
                    await clock.sleep_until(due)
                self._wake = None
                if self._woken:
                    await clock.sleep_until(last + MIN_GAP)
        finally:
            with self._coordinator.shielded():
                await self._leave()

    async def _beat(self) -> None:
        self._failed = True  # until it succeeds
        c = self._coordinator
        if not c.ready:  # the database was lost: try it now (with the ticks' backoff)
            with contextlib.suppress(DatabaseUnavailable):
                await c.reconnect()
            if not c.ready:
                return
        declared = self._declared()
        send = declared if declared != self._sent else None
        sent, since = time.monotonic(), self._clock.now()
        try:
            with anyio.fail_after(BEAT_LIMIT) as limit:
                row, others = await self._send(send)
        except Exception as exc:
            if getattr(exc, "sqlstate", None) in _MISSING:
                await self._repair("a table was missing")
            elif limit.cancelled_caught:  # no answer within BEAT_LIMIT
                c.unanswered(sent, since)
            elif c.classify(exc):
                c.down(exc, since)
            else:
                logger.warning("the replica's heartbeat failed", exc_info=True)
            return
        self._failed = False
        await self._took(row, others, send, declared)

    async def _send(self, send: Declared | None) -> tuple[asyncpg.Record, dict[str, Member]]:
        """One beat's statements; what this replica kept for the ledger goes with it."""
        c = self._coordinator
        async with c.connection() as conn:
            await self._end_pauses(conn)
            asked, when = time.monotonic(), self._clock.now()
            row = await conn.fetchrow(
                c.sql.beat,
                c.namespace,
                self._owner,
                None if send is None else send.enabled,
                None if send is None else send.disabled,
                LIVE,
                None if send is None else send.fingerprints,
                None if send is None else send.failing,
                PRUNE,
                self._fresh,
                None if send is None else send.tasks,
            )
            assert row is not None  # the statement returns one row
            c.answered(asked, when)  # an outage it ends is recorded below
            # changed its jobs, or its second beat made it live: the others look now
            if send is not None or self._soon is not None:
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
            others = await self._view(conn, row["owners"] or [], row["declared"] or [])
            await c.record_outages(conn)
        return row, others

    async def _end_pauses(self, conn: asyncpg.Connection[Any]) -> None:
        """Resume the jobs whose pause ended, audited as resumed by ``ticklock``: once
        fleet-wide (the replica whose statement takes a pause's row resumes it), before the
        beat reads what operators asked; and beat again when the next pause ends."""
        c = self._coordinator
        async with conn.transaction():
            ended = 0
            for (job_id,) in await conn.fetch(c.sql.pauses_ending, c.namespace):
                await conn.execute(c.sql.lock_job, c.namespace, job_id)
                until = await conn.fetchval(c.sql.pause_ended, c.namespace, job_id)
                if until is None:
                    continue  # another replica ended it, or an operator changed it
                ended += 1
                await conn.execute(c.sql.resume, c.namespace, job_id)
                note = expired(until)
                await conn.execute(
                    c.sql.audit, c.namespace, job_id, "resume", BY_TICKLOCK, note, True
                )
            if ended:  # every replica hears of it at once
                await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
            left = await conn.fetchval(c.sql.next_pause_end, c.namespace)
        self._pause_ends = (
            None if left is None else self._clock.monotonic() + max(0.0, left.total_seconds())
        )

    async def _took(
        self,
        row: asyncpg.Record,
        others: dict[str, Member],
        send: Declared | None,
        declared: Declared,
    ) -> None:
        """Take in what a beat read."""
        if not row["whole"]:
            await self._repair("a table was missing")
        if row["inserted"] or self._fresh:  # joined: beat again soon, to be live for the others
            self._soon = self._clock.monotonic() + CONFIRM
        else:
            self._soon = None
        self._fresh = False
        if send is not None:
            self._sent = declared
        elif row["inserted"]:  # our row was gone: beat again now, with the job list
            self._sent, self._woken = None, True
        seen = dict(zip(row["owners"] or [], row["seen"] or [], strict=True))
        me = Member(
            dict(zip(declared.enabled, declared.fingerprints, strict=False)),
            frozenset(declared.failing),
            row["started_at"],
            frozenset(declared.tasks),
        )
        # what operators asked first, as read: the new view's roles take passes of the loop
        controls = {
            job_id: Control(paused_at, trigger_at)
            for job_id, paused_at, trigger_at in zip(
                row["ids"] or [], row["paused"] or [], row["triggered"] or [], strict=True
            )
        }
        filling: dict[str, list[int]] = {}
        for job_id, request in zip(row["fill_jobs"] or [], row["fill_ids"] or [], strict=True):
            filling.setdefault(job_id, []).append(request)
        for job_id, requests in filling.items():
            paused_at, trigger_at, _ = controls.get(job_id, Control(None, None))
            controls[job_id] = Control(paused_at, trigger_at, tuple(requests))
        self._apply(controls)
        await self._members({self._owner: me, **others}, seen)

    async def _repair(self, why: str) -> None:
        """Create ticklock's tables again (some were dropped), then beat again at once."""
        c = self._coordinator
        try:
            async with c.connection() as conn:
                done = await migrate(conn, c.schema)
        except Exception as exc:
            logger.warning("%s, and creating ticklock's tables again failed: %s", why, exc)
            return
        logger.warning(
            "%s in schema %r (dropped while the fleet ran?): ticklock's tables were %s",
            why,
            c.schema,
            "created again" if done != "current" else "found in place",
        )
        self._sent, self._woken = None, True

    async def _view(
        self, conn: asyncpg.Connection[Any], owners: list[str], declared: list[datetime]
    ) -> dict[str, Member]:
        """The other live replicas' declarations: read again only those that changed."""
        known = self._others
        changed = [
            owner
            for owner, at in zip(owners, declared, strict=True)
            if owner not in known or known[owner][0] != at
        ]
        if changed:
            c = self._coordinator
            for row in await conn.fetch(c.sql.declared, c.namespace, changed):
                member = Member(
                    dict(zip(row["jobs"], row["fingerprints"], strict=False)),
                    frozenset(row["failing"]),
                    row["started_at"],
                    frozenset(row["tasks"]),
                )
                known[row["owner"]] = (row["declared_at"], member)
        live = set(owners)
        self._others = {owner: seen for owner, seen in known.items() if owner in live}
        return {owner: member for owner, (_, member) in self._others.items()}

    async def _listen(self) -> bool:
        """Whether a LISTEN connection is up (opened here if it can be)."""
        if self._listener is not None and not self._listener.is_closed():
            return True
        self._listener = None
        c = self._coordinator
        if self._dsn is None or not c.ready or c.pooler.unnamed is not False:
            return False  # no DSN, or a pooler (which would not forward notifications)
        if self._clock.monotonic() < self._quiet_until:
            return False
        try:
            conn, _ = await connect(self._dsn, unnamed=False)
        except Exception as exc:
            logger.debug("no LISTEN connection: %s", exc)
            return False
        try:
            await conn.add_listener(CHANNEL, self._notified)
        except BaseException as exc:  # cancelled (shutdown) too: never leak the connection
            conn.terminate()
            if not isinstance(exc, Exception):
                raise
            return False
        conn.add_termination_listener(self._lost)
        self._listener = conn
        self.poke()  # a request may have come while nobody listened
        return True

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        now = self._clock.monotonic()
        # any namespace's schedule writes (the channel is the database's): counted apart
        writes = isinstance(payload, str) and payload.endswith(_WRITES_TAIL)
        heard, limit = (self._heard_writes, WRITES_STORM) if writes else (self._heard, STORM)
        heard.append(now)
        while heard and heard[0] < now - STORM_WINDOW:
            heard.popleft()
        if len(heard) > limit and self._listener is not None:
            listener, self._listener = self._listener, None
            self._quiet_until = now + STORM_QUIET
            heard.clear()
            logger.warning(
                "more than %d notifications on channel %r within %g s (ticklock's replicas send "
                "a few per join, leave, pause, resume or trigger, and one per schedule "
                "written): not listening for %g s (beating every %g s meanwhile); find what "
                "sends them in pg_stat_activity",
                limit,
                CHANNEL,
                STORM_WINDOW,
                STORM_QUIET,
                BEAT_FAST,
            )
            listener.terminate()
            return
        if payload in (self._written, self._payload):
            self.poke()

    def _lost(self, conn: object) -> None:
        if conn is self._listener:
            self._listener = None
            self.poke()

    async def _leave(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.terminate()
        c = self._coordinator
        if c.ready and c.pool is not None:
            with contextlib.suppress(Exception):  # not there: it drops out when not seen
                async with c.connection() as conn:
                    await c.record_outages(conn)  # what it kept since its last beat
                    await conn.execute(
                        c.sql.leave, c.namespace, self._owner, CHANNEL, self._payload
                    )
