"""The fleet of one namespace, read and steered through ticklock's tables.

Any process can use it: a replica (through its scheduler's pool), ``ticklock`` commands (one
connection) and the standalone dashboard. Pause, resume and trigger are single statements that
also NOTIFY the namespace's replicas (:mod:`.control`); the replicas obey them under each job's
lock, so an operation made here reaches the whole fleet.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from .._caps import (
    ERROR_LIMIT,
    HEAD,
    MARKER_KEY,
    MARKER_MAX,
    REPORT_LIMIT,
    cut_text,
    report_marker,
)
from .._coordination import FUTURE_LIMIT
from .._fleet import JobDeclared, JobRecord, JobState, Replica, RunRecord
from .._lock_key import lock_key
from .control import CHANNEL, LIVE, payload
from .schema import quote

if TYPE_CHECKING:
    import asyncpg

Acquire = Callable[[], AbstractAsyncContextManager["asyncpg.Connection[Any]"]]


def from_pool(pool: asyncpg.Pool[Any]) -> Acquire:
    """``acquire`` for :class:`PostgresFleet` from an asyncpg pool."""

    @asynccontextmanager
    async def acquire() -> AsyncIterator[asyncpg.Connection[Any]]:
        async with pool.acquire() as proxy:
            yield cast("asyncpg.Connection[Any]", proxy)

    return acquire


def from_connection(conn: asyncpg.Connection[Any]) -> Acquire:
    """``acquire`` for :class:`PostgresFleet` that lends one connection (the CLI's)."""

    @asynccontextmanager
    async def acquire() -> AsyncIterator[asyncpg.Connection[Any]]:
        yield conn

    return acquire


class PostgresFleet:
    """:class:`~ticklock._fleet.Fleet` over the tables in ``schema``, for ``namespace``."""

    def __init__(self, acquire: Acquire, *, schema: str, namespace: str) -> None:
        self._acquire = acquire
        self.namespace = namespace
        self._payload = payload(schema, namespace)
        s = quote(schema)
        recent = f"seen_at > now() - make_interval(secs => {LIVE:g})"
        live = (
            "SELECT owner, started_at, jobs, disabled, fingerprints "
            f"FROM {s}.replicas WHERE namespace = $1 AND {recent}"
        )
        # the declaration most live replicas share rules; between as many, the one whose
        # replicas started first (as in ticklock._sharing)
        self._jobs = f"""
WITH live AS ({live}), declared AS (
    SELECT job_id, bool_or(enabled) AS enabled FROM (
        SELECT unnest(jobs) AS job_id, true AS enabled FROM live
        UNION ALL SELECT unnest(disabled), false FROM live) AS d
    GROUP BY job_id
), prints AS (
    SELECT owner, started_at, unnest(jobs) AS job_id, unnest(fingerprints) AS fp FROM live
), ruling AS (
    SELECT DISTINCT ON (job_id) job_id, fp FROM (
        SELECT job_id, fp, count(*) AS n, min(started_at) AS first,
            (array_agg(owner ORDER BY started_at, owner COLLATE "C"))[1] AS first_owner
        FROM prints GROUP BY job_id, fp) AS g
    ORDER BY job_id, n DESC, first, first_owner COLLATE "C", fp COLLATE "C"
), otherwise AS (
    SELECT p.job_id, array_agg(p.owner ORDER BY p.owner) AS owners
    FROM prints AS p JOIN ruling AS r USING (job_id) WHERE p.fp <> r.fp GROUP BY p.job_id
)
SELECT job_id, j.last_success_at, j.last_outcome, j.next_due,
    coalesce(j.consecutive_failures, 0) AS consecutive_failures,
    left(j.last_error, {ERROR_LIMIT}) AS last_error, length(j.last_error) AS error_length,
    j.last_owner,
    j.paused_at, j.trigger_at, coalesce(j.overdue_at < now(), false) AS overdue,
    coalesce(greatest(j.last_slot, j.last_end) > now() + make_interval(secs => $2), false)
        AS future,
    EXISTS (SELECT FROM live) AS fleet, d.enabled,
    o.owners AS otherwise,
    (SELECT ARRAY[r.batches, r.capped::int] FROM {s}.runs AS r
        WHERE r.namespace = $1 AND r.job_id = j.job_id
        ORDER BY r.finished_at DESC LIMIT 1) AS last_run
FROM (SELECT * FROM {s}.jobs WHERE namespace = $1) AS j FULL JOIN declared AS d USING (job_id)
    LEFT JOIN otherwise AS o USING (job_id)
ORDER BY job_id"""
        # Reads at most $4 characters of a report and $5 of an error per run (rows recorded
        # before the caps, or a display's shorter bound): a longer report comes as its marker,
        # and a marker as it is.
        self._history = (
            "SELECT job_id, slot, started_at, finished_at, outcome, owner, "
            "CASE WHEN length(r.t) <= $4 OR (length(r.t) <= "
            f"{MARKER_MAX} AND jsonb_typeof(report) = 'object' AND report ? '{MARKER_KEY}') "
            "THEN r.t END AS report, length(r.t) AS report_length, "
            f"left(r.t, {HEAD}) AS report_head, left(error, $5) AS error, "
            "length(error) AS error_length, manual, batches, capped "
            f"FROM {s}.runs, LATERAL (SELECT report::text AS t) AS r "
            "WHERE namespace = $1 AND job_id = $2 ORDER BY finished_at DESC, id DESC LIMIT $3"
        )
        self._namespaces = f"SELECT DISTINCT namespace FROM {s}.jobs ORDER BY namespace"
        self._exists = f"SELECT EXISTS (SELECT FROM {s}.jobs WHERE namespace = $1 AND job_id = $2)"
        self._replicas = (
            "SELECT owner, started_at, seen_at, jobs || disabled AS jobs, failing "
            f"FROM {s}.replicas "
            f"WHERE namespace = $1 AND {recent} ORDER BY owner"
        )
        notify = "SELECT pg_notify($3, $4)::text FROM u"  # one row if the job exists
        where = "WHERE namespace = $1 AND job_id = $2 RETURNING 1"
        self._pause = (
            f"WITH u AS (UPDATE {s}.jobs SET paused_at = coalesce(paused_at, now()) {where}) "
            + notify
        )
        # the time spent paused does not count toward overdue
        self._resume = (
            f"WITH u AS (UPDATE {s}.jobs SET paused_at = NULL, overdue_at = CASE WHEN "
            "paused_at IS NULL THEN overdue_at ELSE overdue_at + (now() - paused_at) END "
            f"{where}) " + notify
        )
        self._trigger = (
            f"WITH u AS (UPDATE {s}.jobs SET trigger_at = coalesce(trigger_at, now()) "
            "WHERE namespace = $1 AND job_id = $2 RETURNING trigger_at) "
            "SELECT trigger_at, pg_notify($3, $4)::text FROM u"
        )
        self._declared = (
            f"WITH live AS ({live}) SELECT EXISTS (SELECT FROM live), "
            "EXISTS (SELECT FROM live WHERE $2 = ANY(jobs)), "
            "EXISTS (SELECT FROM live WHERE $2 = ANY(jobs || disabled))"
        )
        self._forget = (
            f"WITH r AS (DELETE FROM {s}.runs WHERE namespace = $1 AND job_id = $2 RETURNING 1), "
            f"j AS (DELETE FROM {s}.jobs WHERE namespace = $1 AND job_id = $2 RETURNING 1) "
            "SELECT (SELECT count(*) FROM j) + (SELECT count(*) FROM r)"
        )

    async def jobs(self) -> list[JobRecord]:
        """Every job of the namespace that has a row or that a live replica declares."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._jobs, self.namespace, FUTURE_LIMIT)
        return [
            JobRecord(
                job_id=row["job_id"],
                state=_state(row),
                last_success=row["last_success_at"],
                last_outcome=row["last_outcome"],
                next_due=row["next_due"],
                consecutive_failures=row["consecutive_failures"],
                last_error=_error(row, "last_error", ERROR_LIMIT),
                last_owner=row["last_owner"],
                paused_at=row["paused_at"],
                trigger_at=row["trigger_at"],
                declared_otherwise=tuple(row["otherwise"] or ()),
                last_batches=(row["last_run"] or (0, 0))[0],
                last_capped=bool((row["last_run"] or (0, 0))[1]),
            )
            for row in rows
        ]

    async def namespaces(self) -> list[str]:
        """Every namespace with jobs in the schema (for a status that found none)."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._namespaces)
        return [row[0] for row in rows]

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first; with ``max_text``, no report or error
        longer than that (see :meth:`Fleet.history <ticklock._fleet.Fleet.history>`)."""
        report_limit = REPORT_LIMIT if max_text is None else min(max_text, REPORT_LIMIT)
        error_limit = ERROR_LIMIT if max_text is None else min(max_text, ERROR_LIMIT)
        async with self._acquire() as conn:
            rows = await conn.fetch(
                self._history, self.namespace, job_id, limit, report_limit, error_limit
            )
            if not rows and not await conn.fetchval(self._exists, self.namespace, job_id):
                raise self._unknown(job_id)
        return [
            RunRecord(
                job_id=row["job_id"],
                slot=row["slot"],
                started_at=row["started_at"],
                finished_at=row["finished_at"],
                outcome=row["outcome"],
                owner=row["owner"],
                report=_report(row),
                error=_error(row, "error", error_limit),
                manual=row["manual"],
                batches=row["batches"],
                capped=row["capped"],
            )
            for row in rows
        ]

    async def replicas(self) -> list[Replica]:
        """The live replicas: those that reported in within the last minute."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._replicas, self.namespace)
        return [
            Replica(
                row["owner"],
                row["started_at"],
                row["seen_at"],
                tuple(row["jobs"]),
                tuple(row["failing"]),
            )
            for row in rows
        ]

    async def pause(self, job_id: str) -> None:
        """Pause the job fleet-wide (a pause already in force keeps its instant)."""
        await self._steer(self._pause, job_id)

    async def resume(self, job_id: str) -> None:
        """Resume the job fleet-wide."""
        await self._steer(self._resume, job_id)

    async def trigger(self, job_id: str) -> datetime:
        """Ask the fleet for one run now; refused (``KeyError``) when live replicas run and
        none declares the job enabled. A request not served yet keeps its instant."""
        async with self._acquire() as conn:
            fleet, enabled, _ = await self._declaration(conn, job_id)
            if fleet and not enabled:
                raise KeyError(
                    f"no live replica runs job {job_id!r} (it is not declared, or declared "
                    "with enabled=False), so none would serve the request"
                )
            row = await conn.fetchrow(self._trigger, self.namespace, job_id, CHANNEL, self._payload)
        if row is None:
            raise self._unknown(job_id)
        return cast(datetime, row["trigger_at"])

    async def forget(self, job_id: str) -> None:
        """Delete the job's state and history, under its lock."""
        async with self._acquire() as conn, conn.transaction():
            *_, declared = await self._declaration(conn, job_id)
            if declared:
                raise JobDeclared(
                    f"a live replica declares job {job_id!r}: remove it from the code and "
                    f"deploy first (a replica that stopped drops out after {LIVE:g} s)"
                )
            await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(self.namespace, job_id))
            if not await conn.fetchval(self._forget, self.namespace, job_id):
                raise self._unknown(job_id)

    async def _declaration(self, conn: asyncpg.Connection[Any], job_id: str) -> tuple[bool, ...]:
        """Whether replicas are live; whether one declares the job enabled; or at all."""
        row = await conn.fetchrow(self._declared, self.namespace, job_id)
        assert row is not None
        return tuple(row)

    async def _steer(self, statement: str, job_id: str) -> None:
        async with self._acquire() as conn:
            done = await conn.fetch(statement, self.namespace, job_id, CHANNEL, self._payload)
        if not done:
            raise self._unknown(job_id)

    def _unknown(self, job_id: str) -> KeyError:
        return KeyError(f"no job {job_id!r} in namespace {self.namespace!r}")


def _report(row: asyncpg.Record) -> Any:
    """A run's report as read: the stored value, or the marker of one over the read bound."""
    if row["report"] is not None:
        return json.loads(row["report"])
    if row["report_length"] is None:
        return None  # the run has no report
    return report_marker(row["report_head"], row["report_length"])


def _error(row: asyncpg.Record, column: str, limit: int) -> str | None:
    """An error text as read (its first ``limit`` characters and its length), cut if longer."""
    error: str | None = row[column]
    return None if error is None else cut_text(error, row["error_length"], limit)


def _state(row: asyncpg.Record) -> JobState:
    if row["fleet"] and row["enabled"] is None:
        return JobState.UNDECLARED  # live replicas run, none declares it
    if row["fleet"] and not row["enabled"]:
        return JobState.DISABLED
    if row["paused_at"] is not None:
        return JobState.PAUSED
    if row["future"]:
        return JobState.FUTURE
    if row["overdue"]:
        return JobState.OVERDUE
    return JobState.OK
