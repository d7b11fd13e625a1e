"""Stored schedules in PostgreSQL: each is the row of its job in ``jobs``, its declaration in
the row's ``spec`` (the keys of :func:`~ticklock._schedule.stored.to_json`), beside its state.

A write (``put``, ``delete``) is one transaction: it takes the namespace's schedule lock, so
that writes commit in the order of their numbers in ``schedule_log``; it changes the row,
appends the write to the log and the audit, and NOTIFYs the namespace's replicas (see
:mod:`.control`), which read the log from the last number they applied. A deleted schedule's
row stays as a tombstone (its spec says when it was deleted and its last version) so that a
run in flight at the delete finishes against it, and its history stays until retention
prunes both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..._operators.fleet import BY_TICKLOCK, IMMEDIATELY
from ..._runtime.sharing import LIVE
from ..._runtime.slots import first, overdue_at
from ..._schedule.lock_key import lock_key
from ..._schedule.stored import (
    Definition,
    Schedule,
    declared_in_code,
    from_json,
    to_json,
    unknown_task,
)
from ..seam import FleetState
from .control import CHANNEL, payload
from .schema import quote

if TYPE_CHECKING:
    import asyncpg

Acquire = Callable[[], AbstractAsyncContextManager["asyncpg.Connection[Any]"]]
"""Lends a connection for one statement or transaction (a pool's, or the CLI's one)."""

_WRITES = "ticklock.schedules"
"""The advisory lock (with the namespace) that orders the writes of a namespace."""


class PostgresSchedules:
    """The stored schedules of ``namespace`` in the tables of ``schema``."""

    def __init__(self, acquire: Acquire, *, schema: str, namespace: str) -> None:
        self._acquire = acquire
        self._schema = schema
        self._namespace = namespace
        self._payload = payload(schema, namespace, "schedules")
        s = quote(schema)
        live = f"namespace = $1 AND seen_at > now() - make_interval(secs => {LIVE:g})"
        self._lock = "SELECT pg_advisory_xact_lock($1), now()"
        self._known = (
            f"SELECT coalesce(bool_or($2 = ANY(jobs || disabled)), false), "
            f"coalesce(bool_or($3 = ANY(tasks)), false) FROM {s}.replicas WHERE {live}"
        )
        self._row = (
            f"SELECT spec::text, last_end, last_slot FROM {s}.jobs "
            "WHERE namespace = $1 AND job_id = $2 FOR UPDATE"
        )
        self._write = (
            f"INSERT INTO {s}.jobs AS j (namespace, job_id, spec, overdue_at, next_due) "
            "VALUES ($1, $2, $3::text::jsonb, $4, $5) ON CONFLICT (namespace, job_id) DO UPDATE "
            "SET spec = EXCLUDED.spec, overdue_at = EXCLUDED.overdue_at, "
            "next_due = EXCLUDED.next_due"
        )
        self._immediately = (
            f"UPDATE {s}.jobs SET trigger_at = coalesce(trigger_at, now()) "
            "WHERE namespace = $1 AND job_id = $2"
        )
        # what a deleted schedule's lifecycle kept: its run count and its pause's end
        self._lifecycle = (
            f"WITH c AS (DELETE FROM {s}.counts WHERE namespace = $1 AND job_id = $2) "
            f"DELETE FROM {s}.pauses WHERE namespace = $1 AND job_id = $2"
        )
        self._bury = (
            f"UPDATE {s}.jobs SET spec = $3::text::jsonb, paused_at = NULL, trigger_at = NULL, "
            "overdue_at = NULL, next_due = NULL WHERE namespace = $1 AND job_id = $2"
        )
        self._log = f"INSERT INTO {s}.schedule_log (namespace, schedule_id) VALUES ($1, $2)"
        self._audit = (
            f"INSERT INTO {s}.audit (namespace, job_id, action, who, note, changed) "
            "VALUES ($1, $2, $3, $4, $5, true)"
        )
        stored = "spec ? 'task'"
        self._get = f"SELECT spec::text FROM {s}.jobs WHERE namespace = $1 AND job_id = $2"
        self._page = (
            f"SELECT job_id, spec::text FROM {s}.jobs WHERE namespace = $1 AND {stored} "
            "AND ($2::text IS NULL OR spec->>'tenant' = $2) "
            "AND ($3::text IS NULL OR spec->>'task' = $3) "
            """AND ($4::text IS NULL OR job_id COLLATE "C" > $4) """
            """ORDER BY job_id COLLATE "C" LIMIT $5"""
        )
        self._changes = (
            f"SELECT (SELECT coalesce(max(seq), 0) FROM {s}.schedule_log WHERE namespace = $1), "
            f"ARRAY(SELECT DISTINCT schedule_id FROM {s}.schedule_log "
            "WHERE namespace = $1 AND seq > $2)"
        )
        self._read = (
            f"SELECT job_id, spec::text FROM {s}.jobs WHERE namespace = $1 AND {stored} "
            "AND spec->>'task' = ANY($2::text[]) AND job_id = ANY($3::text[])"
        )
        # by the next slot the last run or write recorded (see .schema's jobs_due index)
        self._due = (
            f"SELECT job_id, spec::text FROM {s}.jobs WHERE namespace = $1 AND {stored} "
            "AND spec->>'task' = ANY($2::text[]) AND paused_at IS NULL "
            "AND (next_due <= $3 OR next_due IS NULL OR trigger_at IS NOT NULL) "
            "AND job_id > $5 ORDER BY job_id LIMIT $4"
        )

    async def put(
        self,
        definition: Definition,
        *,
        who: str,
        note: str | None,
        tasks: Collection[str],
        jobs: Collection[str],
    ) -> Schedule:
        """Create or replace the schedule (see :class:`~ticklock._backends.seam.ScheduleStore`)."""
        sid, ns = definition.id, self._namespace
        async with self._acquire() as conn, conn.transaction():
            now = (await conn.fetchrow(self._lock, self._key()))[1]  # type: ignore[index]
            code, has_task = await conn.fetchrow(self._known, ns, sid, definition.task)  # type: ignore[misc]
            if code or sid in jobs:
                raise declared_in_code(sid)
            if not has_task and definition.task not in tasks:
                raise unknown_task(sid, definition.task)
            row = await conn.fetchrow(self._row, ns, sid)
            spec = None if row is None or row[0] is None else json.loads(row[0])
            old = from_json(sid, spec)
            if old is not None and definition.same(old):
                return old
            if old is not None:
                version, created = old.version + 1, old.created_at
            else:  # new, or put again after a delete: the versions go on
                version = int((spec or {}).get("last_version", 0)) + 1
                created = now
            value = to_json(definition, version, created, now)
            state = FleetState() if row is None else FleetState(last_end=row[1], last_slot=row[2])
            job = replace(definition.job, defined_at=now)
            alarm = overdue_at(job, state.last_end or now)
            nxt = first(job, state, now)
            await conn.execute(self._write, ns, sid, json.dumps(value), alarm, nxt)
            await self._written(conn, sid, "put", who, note)
            if job.immediately:  # new or changed: one run at once, asked for with the write
                await conn.execute(self._immediately, ns, sid)
                await conn.execute(self._audit, ns, sid, "trigger", BY_TICKLOCK, IMMEDIATELY)
        schedule = from_json(sid, value)
        assert schedule is not None
        return schedule

    async def get(self, schedule_id: str) -> Schedule | None:
        """The stored schedule, or ``None``."""
        async with self._acquire() as conn:
            text = await conn.fetchval(self._get, self._namespace, schedule_id)
        return None if text is None else from_json(schedule_id, json.loads(text))

    async def delete(self, schedule_id: str, *, who: str, note: str | None) -> bool:
        """Delete the schedule: its row stays as a tombstone, with its history."""
        ns = self._namespace
        async with self._acquire() as conn, conn.transaction():
            now = (await conn.fetchrow(self._lock, self._key()))[1]  # type: ignore[index]
            row = await conn.fetchrow(self._row, ns, schedule_id)
            spec = None if row is None or row[0] is None else json.loads(row[0])
            old = from_json(schedule_id, spec)
            if old is None:
                return False
            tomb = {"deleted_at": now.isoformat(), "version": 0, "last_version": old.version}
            await conn.execute(self._bury, ns, schedule_id, json.dumps(tomb))
            await conn.execute(self._lifecycle, ns, schedule_id)  # a new one starts afresh
            await self._written(conn, schedule_id, "delete", who, note)
        return True

    async def page(
        self, tenant: str | None, task: str | None, after: str | None, limit: int
    ) -> list[Schedule]:
        """Up to ``limit`` schedules by id after ``after``, of ``tenant`` and ``task``."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._page, self._namespace, tenant, task, after, limit)
        return _schedules(rows)

    async def changes(self, since: int) -> tuple[int, list[str]]:
        """The last write's number, and the ids written after ``since``."""
        async with self._acquire() as conn:
            row = await conn.fetchrow(self._changes, self._namespace, since)
        assert row is not None
        return int(row[0]), list(row[1])

    async def read(self, tasks: Collection[str], ids: Collection[str]) -> list[Schedule]:
        """The schedules of ``tasks`` among ``ids``."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._read, self._namespace, list(tasks), list(ids))
        return _schedules(rows)

    async def due(
        self,
        tasks: Collection[str],
        now: datetime,
        until: datetime,
        limit: int,
        after: str | None = None,
    ) -> tuple[list[Schedule], str | None]:
        """The schedules of ``tasks`` due by ``until``, by ``jobs.next_due``."""
        async with self._acquire() as conn:
            rows = await conn.fetch(
                self._due, self._namespace, list(tasks), until, limit, after or ""
            )
        # the next page follows the last row read, even one this release cannot read
        return _schedules(rows), rows[-1][0] if len(rows) >= limit else None

    def _key(self) -> int:
        return lock_key(self._namespace, _WRITES, schema=self._schema)

    async def _written(
        self, conn: Any, schedule_id: str, action: str, who: str, note: str | None
    ) -> None:
        ns = self._namespace
        await conn.execute(self._log, ns, schedule_id)
        await conn.execute(self._audit, ns, schedule_id, action, who, note)
        await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)


def _schedules(rows: list[Any]) -> list[Schedule]:
    found = (from_json(row[0], json.loads(row[1])) for row in rows)
    return [s for s in found if s is not None]
