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
over it (see :mod:`ticklock._sharing`). A replica that joins, changes its jobs or leaves sends
a NOTIFY, so that the replicas listening update their view at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .._clock import Clock
from .._coordination import Control, Declared
from .connection import connect

if TYPE_CHECKING:
    import asyncpg

    from .coordinator import PostgresCoordinator

logger = logging.getLogger("ticklock")

CHANNEL = "ticklock"
"""The NOTIFY channel; the payload names the schema and the namespace."""
BEAT_SLOW = 15.0
"""Seconds between beats while a LISTEN connection is up."""
BEAT_FAST = 3.0
"""Seconds between beats without one: the bound for a pause or trigger to be seen."""
LIVE = 60.0
"""A replica whose last beat is older than this is not live (a killed replica drops out)."""


def payload(schema: str, namespace: str) -> str:
    """The NOTIFY payload for ``namespace`` in ``schema``."""
    return json.dumps([schema, namespace])


class Watch:
    """Beats for one replica and hands each beat's pauses and triggers to ``apply``."""

    def __init__(
        self,
        coordinator: PostgresCoordinator,
        dsn: str | None,
        clock: Clock,
        owner: str,
        declared: Callable[[], Declared],
        apply: Callable[[Mapping[str, Control]], None],
        members: Callable[[Mapping[str, frozenset[str]], Mapping[str, datetime]], None],
    ) -> None:
        self._coordinator = coordinator
        self._dsn = dsn  # None: a pool the application passed, no LISTEN
        self._clock = clock
        self._owner = owner
        self._declared = declared
        self._apply = apply
        self._members = members
        # the other live replicas: when their job lists last changed, and those lists
        self._others: dict[str, tuple[datetime, frozenset[str]]] = {}
        self._payload = payload(coordinator.schema, coordinator.namespace)
        self._sent: Declared | None = None  # what the replicas row says this replica declares
        self._listener: asyncpg.Connection[Any] | None = None
        self._wake: anyio.CancelScope | None = None
        self._woken = False

    def poke(self) -> None:
        """Beat now (a NOTIFY came, the listener was lost, or this replica steered a job)."""
        self._woken = True
        if self._wake is not None:
            self._wake.cancel()

    async def run(self) -> NoReturn:
        """Beat until cancelled; then close the listener and remove this replica's row."""
        clock = self._clock
        try:
            while True:
                self._woken = False
                await self._beat()
                listening = await self._listen()
                if self._woken:
                    continue
                with anyio.CancelScope() as scope:
                    self._wake = scope
                    await clock.sleep_until(
                        clock.monotonic() + (BEAT_SLOW if listening else BEAT_FAST)
                    )
                self._wake = None
        finally:
            with self._coordinator.shielded():
                await self._leave()

    async def _beat(self) -> None:
        c = self._coordinator
        if not c.ready:
            return  # the ticks' reconnection brings it back
        declared = self._declared()
        send = declared if declared != self._sent else None
        try:
            async with c.connection() as conn:
                row = await conn.fetchrow(
                    c.sql.beat,
                    c.namespace,
                    self._owner,
                    None if send is None else send.enabled,
                    None if send is None else send.disabled,
                    LIVE,
                )
                assert row is not None  # the statement returns one row
                if send is not None:  # joined, or changed its jobs: the others look now
                    await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
                others = await self._view(conn, row["owners"] or [], row["declared"] or [])
        except Exception as exc:
            if not c.classify(exc):
                logger.warning("the replica's heartbeat failed", exc_info=True)
            return
        if send is not None:
            self._sent = declared
        elif row["inserted"]:  # our row was gone: beat again now, with the job list
            self._sent, self._woken = None, True
        seen = dict(zip(row["owners"] or [], row["seen"] or [], strict=True))
        self._members({self._owner: frozenset(declared.enabled), **others}, seen)
        self._apply(
            {
                job_id: Control(paused_at, trigger_at)
                for job_id, paused_at, trigger_at in zip(
                    row["ids"] or [], row["paused"] or [], row["triggered"] or [], strict=True
                )
            }
        )

    async def _view(
        self, conn: asyncpg.Connection[Any], owners: list[str], declared: list[datetime]
    ) -> dict[str, frozenset[str]]:
        """The other live replicas' job lists: read again only those that changed."""
        known = self._others
        changed = [
            owner
            for owner, at in zip(owners, declared, strict=True)
            if known.get(owner, (None,))[0] != at
        ]
        if changed:
            c = self._coordinator
            for row in await conn.fetch(c.sql.declared, c.namespace, changed):
                known[row["owner"]] = (row["declared_at"], frozenset(row["jobs"]))
        live = set(owners)
        self._others = {owner: seen for owner, seen in known.items() if owner in live}
        return {owner: jobs for owner, (_, jobs) in self._others.items()}

    async def _listen(self) -> bool:
        """Whether a LISTEN connection is up (opened here if it can be)."""
        if self._listener is not None and not self._listener.is_closed():
            return True
        self._listener = None
        c = self._coordinator
        if self._dsn is None or not c.ready or c.pooler.unnamed is not False:
            return False  # no DSN, or a pooler (which would not forward notifications)
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
        if payload == self._payload:
            self.poke()

    def _lost(self, conn: object) -> None:
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
                    await conn.execute(
                        c.sql.leave, c.namespace, self._owner, CHANNEL, self._payload
                    )
