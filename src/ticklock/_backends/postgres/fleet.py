"""The fleet of one namespace, read and steered through ticklock's tables.

Any process can use it: a replica (through its scheduler's pool), ``ticklock`` commands (one
connection) and the standalone dashboard. Pause, resume and trigger are single statements that
also NOTIFY the namespace's replicas (:mod:`.control`); the replicas obey them under each job's
lock, so an operation made here reaches the whole fleet.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from ..._operators.fleet import (
    BUILTIN,
    Action,
    Backfill,
    JobDeclared,
    JobRecord,
    JobState,
    Replica,
    RunRecord,
    SlotRecord,
    paused_until,
    said,
    state_of,
)
from ..._operators.ledger import LIMIT
from ..._runtime.sharing import LIVE, Member, owner_of
from ..._schedule import spec as _spec
from ..._schedule.caps import (
    ERROR_LIMIT,
    HEAD,
    MARKER_KEY,
    MARKER_MAX,
    REPORT_LIMIT,
    cut_text,
    report_marker,
)
from ..._schedule.lock_key import lock_key
from ..._schedule.validate import surrogate
from ..seam import FUTURE_LIMIT
from .control import CHANNEL, payload
from .ledger import LedgerReader
from .schedules import Acquire, PostgresSchedules
from .schema import quote
from .sql import audit, resume

if TYPE_CHECKING:
    import asyncpg


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
    """:class:`Fleet` over the tables in ``schema``, for ``namespace``."""

    def __init__(self, acquire: Acquire, *, schema: str, namespace: str) -> None:
        self._acquire = acquire
        self.namespace = namespace
        self.schema = schema
        self._payload = payload(schema, namespace)
        s = quote(schema)
        recent = f"seen_at > now() - make_interval(secs => {LIVE:g})"
        live = (
            "SELECT owner, started_at, jobs, disabled, fingerprints, tasks "
            f"FROM {s}.replicas WHERE namespace = $1 AND {recent}"
        )
        # a stored schedule is declared by the replicas that have its task
        stored = (
            f"SELECT j.job_id, coalesce((j.spec->'options'->>'enabled')::boolean, true) "
            f"FROM {s}.jobs AS j WHERE j.namespace = $1 AND j.spec ? 'task' "
            "AND ($3::text IS NULL OR j.spec->>'tenant' = $3) "
            "AND EXISTS (SELECT FROM live WHERE j.spec->>'task' = ANY(live.tasks))"
        )
        # the declaration most live replicas share rules; between as many, the one whose
        # replicas started first (as in ticklock._runtime.sharing)
        self._jobs = f"""
WITH live AS ({live}), declared AS (
    SELECT job_id, bool_or(enabled) AS enabled FROM (
        SELECT unnest(jobs) AS job_id, true AS enabled FROM live
        UNION ALL SELECT unnest(disabled), false FROM live
        UNION ALL {stored}) AS d
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
    coalesce((SELECT c.successes FROM {s}.counts AS c
        WHERE c.namespace = j.namespace AND c.job_id = j.job_id), 0) AS successes,
    left(j.last_error, {ERROR_LIMIT}) AS last_error, length(j.last_error) AS error_length,
    j.last_owner,
    j.paused_at, j.trigger_at, coalesce(j.overdue_at < now(), false) AS overdue, j.spec::text,
    j.spec->>'task' AS task, j.spec->>'tenant' AS tenant,
    coalesce(greatest(j.last_slot, j.last_end) > now() + make_interval(secs => $2), false)
        AS future,
    EXISTS (SELECT FROM live) AS fleet, d.enabled,
    o.owners AS otherwise,
    (SELECT ARRAY[r.batches, r.capped::int] FROM {s}.runs AS r
        WHERE r.namespace = $1 AND r.job_id = j.job_id
        ORDER BY r.finished_at DESC LIMIT 1) AS last_run
FROM (SELECT * FROM {s}.jobs WHERE namespace = $1 AND NOT coalesce(spec ? 'deleted_at', false))
    AS j FULL JOIN declared AS d USING (job_id)
    LEFT JOIN otherwise AS o USING (job_id)
WHERE $3::text IS NULL OR j.spec->>'tenant' = $3
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
            "length(error) AS error_length, manual, batches, capped, "
            f"(SELECT b.who FROM {s}.backfilled AS b WHERE b.run_id = runs.id) AS backfilled_by "
            f"FROM {s}.runs, LATERAL (SELECT report::text AS t) AS r "
            "WHERE namespace = $1 AND job_id = $2 ORDER BY finished_at DESC, id DESC LIMIT $3"
        )
        self._namespaces = f"SELECT DISTINCT namespace FROM {s}.jobs ORDER BY namespace"
        self._exists = f"SELECT EXISTS (SELECT FROM {s}.jobs WHERE namespace = $1 AND job_id = $2)"
        self._replicas = (
            "SELECT owner, started_at, seen_at, jobs || disabled AS jobs, failing, tasks "
            f"FROM {s}.replicas "
            f"WHERE namespace = $1 AND {recent} ORDER BY owner"
        )
        where = "WHERE namespace = $1 AND job_id = $2"
        self._current = f"SELECT paused_at, trigger_at FROM {s}.jobs {where} FOR UPDATE"
        self._pause = f"UPDATE {s}.jobs SET paused_at = coalesce(paused_at, now()) {where}"
        self._resume = resume(s)
        self._trigger = (
            f"UPDATE {s}.jobs SET trigger_at = coalesce(trigger_at, now()) {where} "
            "RETURNING trigger_at"
        )
        # the instant a pause ends by itself (NULL: none; .control resumes it then)
        self._until = (
            f"INSERT INTO {s}.pauses (namespace, job_id, until) VALUES ($1, $2, $3) "
            "ON CONFLICT (namespace, job_id) DO UPDATE SET until = EXCLUDED.until"
        )
        self._forever = f"DELETE FROM {s}.pauses WHERE namespace = $1 AND job_id = $2"
        self._audit = audit(s)
        # a backfill with no slot is done as it is asked for
        self._backfill = (
            f"INSERT INTO {s}.backfills (namespace, job_id, slots, pace, who, rerun, "
            "finished_at) VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN "
            "cardinality($3::timestamptz[]) = 0 THEN now() END) RETURNING id"
        )
        self._end_backfill = (
            f"UPDATE {s}.backfills SET finished_at = now() WHERE id = $1 AND finished_at IS NULL"
        )
        self._spec_read = f"SELECT spec::text FROM {s}.jobs WHERE namespace = $1 AND job_id = $2"
        self._backfill_read = (
            f"SELECT id, job_id, slots, done, who, pace, finished_at, passed, rerun "
            f"FROM {s}.backfills WHERE id = $1"
        )
        # $4: only if a run committed the slot at done (one another run committed meanwhile)
        self._pass_over = (
            f"UPDATE {s}.backfills AS b SET done = least(done + $3, cardinality(slots)), "
            "passed = passed || slots[done + 1 : done + $3], finished_at = CASE "
            "WHEN done + $3 >= cardinality(slots) THEN now() END "
            "WHERE id = $1 AND done = $2 AND finished_at IS NULL AND (NOT $4::boolean OR "
            f"EXISTS (SELECT FROM {s}.runs AS r WHERE r.namespace = b.namespace "
            "AND r.job_id = b.job_id AND r.slot = b.slots[b.done + 1] "
            "AND r.outcome = 'success'))"
        )
        self._actions = (
            f"SELECT job_id, action, who, at, note, changed FROM {s}.audit "
            "WHERE namespace = $1 AND ($2::text IS NULL OR job_id = $2) "
            "ORDER BY at DESC, id DESC LIMIT $3"
        )
        self._last_actions = (
            f"SELECT DISTINCT ON (job_id) job_id, action, who, at, note, changed FROM {s}.audit "
            "WHERE namespace = $1 AND changed AND action <> 'forget' "
            "AND ($2::text[] IS NULL OR job_id = ANY($2)) ORDER BY job_id, at DESC, id DESC"
        )
        self._members = (
            "SELECT owner, started_at, jobs, fingerprints, failing, tasks "
            f"FROM {s}.replicas WHERE namespace = $1 AND {recent} AND seen_at > started_at"
        )
        self._ledger = LedgerReader(schema, namespace)
        task = (
            f"(SELECT spec->>'task' FROM {s}.jobs WHERE namespace = $1 AND job_id = $2 "
            "AND spec ? 'task')"
        )
        self._declared = (
            f"WITH live AS ({live}) SELECT EXISTS (SELECT FROM live), "
            f"EXISTS (SELECT FROM live WHERE $2 = ANY(jobs) OR {task} = ANY(tasks)), "
            f"EXISTS (SELECT FROM live WHERE $2 = ANY(jobs || disabled) OR {task} = ANY(tasks))"
        )
        self._forget = (
            f"WITH r AS (DELETE FROM {s}.runs WHERE namespace = $1 AND job_id = $2 RETURNING 1), "
            f"j AS (DELETE FROM {s}.jobs WHERE namespace = $1 AND job_id = $2 RETURNING 1), "
            f"c AS (DELETE FROM {s}.counts WHERE namespace = $1 AND job_id = $2), "
            f"p AS (DELETE FROM {s}.pauses WHERE namespace = $1 AND job_id = $2) "
            "SELECT (SELECT count(*) FROM j) + (SELECT count(*) FROM r)"
        )

    async def jobs(self, *, tenant: str | None = None) -> list[JobRecord]:
        """Every job of the namespace that has a row or that a live replica declares; with
        ``tenant``, only that tenant's stored schedules."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._jobs, self.namespace, FUTURE_LIMIT, tenant)
            ids = None if tenant is None else [row["job_id"] for row in rows]
            actions = await conn.fetch(self._last_actions, self.namespace, ids)
            live = await conn.fetch(self._members, self.namespace)
            now = await conn.fetchval("SELECT now()")
        last = {row["job_id"]: Action(*row) for row in actions}
        members = {
            r["owner"]: Member(
                dict(zip(r["jobs"], r["fingerprints"], strict=False)),
                frozenset(r["failing"]),
                r["started_at"],
                frozenset(r["tasks"]),
            )
            for r in live
        }
        records = []
        for row in rows:
            job_id = row["job_id"]
            spec = _spec.from_json(None if row["spec"] is None else json.loads(row["spec"]))
            owner = owner_of(members, job_id, row["task"])
            next_due = row["next_due"]
            if next_due is None and spec is not None and row["enabled"]:
                start = members[owner].started_at if owner is not None else None
                next_due = _spec.first_due(spec, now, start)
            records.append(
                JobRecord(
                    job_id=job_id,
                    state=_state(row, spec, now),
                    last_success=row["last_success_at"],
                    last_outcome=row["last_outcome"],
                    next_due=next_due,
                    consecutive_failures=row["consecutive_failures"],
                    last_error=_error(row, "last_error", ERROR_LIMIT),
                    last_owner=row["last_owner"],
                    paused_at=row["paused_at"],
                    trigger_at=row["trigger_at"],
                    declared_otherwise=tuple(row["otherwise"] or ()),
                    last_batches=(row["last_run"] or (0, 0))[0],
                    last_capped=bool((row["last_run"] or (0, 0))[1]),
                    schedule=None if spec is None else spec.schedule,
                    timeout=None if spec is None else spec.timeout,
                    retries=None if spec is None else spec.retries,
                    owner=owner,
                    builtin=job_id.startswith(BUILTIN),
                    last_action=last.get(job_id),
                    task=row["task"],
                    tenant=row["tenant"],
                )
            )
        return records

    @property
    def schedules(self) -> PostgresSchedules:
        """The namespace's stored schedules."""
        return PostgresSchedules(self._acquire, schema=self.schema, namespace=self.namespace)

    async def namespaces(self) -> list[str]:
        """Every namespace with jobs in the schema (for a status that found none)."""
        async with self._acquire() as conn:
            rows = await conn.fetch(self._namespaces)
        return [row[0] for row in rows]

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        """The job's last ``limit`` runs, newest first; with ``max_text``, no report or error
        longer than that (see :meth:`Fleet.history <ticklock._operators.fleet.Fleet.history>`)."""
        self._storable(job_id)
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
                backfilled_by=row["backfilled_by"],
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
                tuple(row["tasks"]),
            )
            for row in rows
        ]

    async def pause(
        self,
        job_id: str,
        note: str | None = None,
        until: datetime | None = None,
        *,
        who: str,
    ) -> bool:
        """Pause the job fleet-wide (a pause already in force keeps its instant), until
        ``until`` if given; whether it was not paused. Audited."""
        return await self._steer(self._pause, "pause", job_id, note, who, until)

    async def resume(self, job_id: str, note: str | None = None, *, who: str) -> bool:
        """Resume the job fleet-wide; whether it was paused. Audited."""
        return await self._steer(self._resume, "resume", job_id, note, who)

    async def trigger(self, job_id: str, note: str | None = None, *, who: str) -> datetime:
        """Ask the fleet for one run now; refused (``KeyError``) when live replicas run and
        none declares the job enabled. A request not served yet keeps its instant. Audited."""
        note, who = said(note, who)
        self._storable(job_id)
        async with self._acquire() as conn, conn.transaction():
            fleet, enabled, _ = await self._declaration(conn, job_id)
            if fleet and not enabled:
                raise KeyError(
                    f"no live replica runs job {job_id!r} (it is not declared, or declared "
                    "with enabled=False), so none would serve the request"
                )
            before = await conn.fetchrow(self._current, self.namespace, job_id)
            if before is None:
                raise self._unknown(job_id)
            at = await conn.fetchval(self._trigger, self.namespace, job_id)
            changed = before["trigger_at"] is None
            await conn.execute(self._audit, self.namespace, job_id, "trigger", who, note, changed)
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
        return cast(datetime, at)

    async def request_backfill(
        self,
        job_id: str,
        slots: Sequence[datetime],
        pace: float | None,
        note: str | None,
        *,
        who: str,
        rerun: bool = False,
    ) -> int:
        """Ask the replicas that have the job to run ``slots`` of it, in order (they hear of
        it at once); refused (``KeyError``) when no live replica declares it enabled, as a
        trigger is. Audited."""
        note, who = said(note, who)
        self._storable(job_id)
        async with self._acquire() as conn, conn.transaction():
            _, enabled, _ = await self._declaration(conn, job_id)
            if not enabled:
                raise KeyError(
                    f"no live replica runs job {job_id!r} (it is not declared, or declared "
                    "with enabled=False), so none would run its backfill"
                )
            request = await conn.fetchval(
                self._backfill, self.namespace, job_id, list(slots), pace, who, rerun
            )
            await conn.execute(self._audit, self.namespace, job_id, "backfill", who, note, True)
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
        return cast(int, request)

    async def pass_over(
        self, request: int, done: int, count: int, *, committed: bool = False
    ) -> None:
        """Pass over ``count`` slots of backfill ``request`` from ``done``, if still there
        (``committed``: only if a run committed ``slots[done]``)."""
        async with self._acquire() as conn:
            await conn.execute(self._pass_over, request, done, count, committed)

    async def end_backfill(self, request: int) -> None:
        """Finish backfill ``request`` as it stands."""
        async with self._acquire() as conn:
            await conn.execute(self._end_backfill, request)

    async def spec(self, job_id: str) -> _spec.Spec | None:
        """The job's declaration as the records keep it."""
        async with self._acquire() as conn:
            text = await conn.fetchval(self._spec_read, self.namespace, job_id)
        return None if text is None else _spec.from_json(json.loads(text))

    async def backfill_state(self, request: int) -> Backfill | None:
        """Backfill ``request`` as it stands."""
        async with self._acquire() as conn:
            row = await conn.fetchrow(self._backfill_read, request)
        if row is None:
            return None
        return Backfill(
            row["id"],
            row["job_id"],
            tuple(row["slots"]),
            row["done"],
            row["who"],
            row["pace"],
            row["finished_at"] is not None,
            tuple(row["passed"]),
            row["rerun"],
        )

    async def forget(self, job_id: str, note: str | None = None, *, who: str) -> None:
        """Delete the job's state and history, under its lock. Audited (its operations stay
        in the audit log)."""
        note, who = said(note, who)
        self._storable(job_id)
        async with self._acquire() as conn, conn.transaction():
            *_, declared = await self._declaration(conn, job_id)
            if declared:
                raise JobDeclared(
                    f"a live replica declares job {job_id!r}: remove it from the code and "
                    f"deploy first (a replica that stopped drops out after {LIVE:g} s)"
                )
            # the job's locks as a tick takes them (see .sql.locks): no run of it is in flight
            await conn.execute(
                "SELECT pg_advisory_xact_lock($1), pg_advisory_xact_lock_shared($2)",
                lock_key(self.namespace, job_id, schema=self.schema),
                lock_key(self.namespace, job_id),
            )
            if not await conn.fetchval(self._forget, self.namespace, job_id):
                raise self._unknown(job_id)
            await conn.execute(self._audit, self.namespace, job_id, "forget", who, note, True)

    async def audit(self, job_id: str | None = None, limit: int = 100) -> list[Action]:
        """The last ``limit`` operations (of ``job_id``, or of every job), newest first."""
        if job_id is not None and surrogate(job_id) is not None:
            return []  # no job has such an id (PostgreSQL cannot store it)
        async with self._acquire() as conn:
            rows = await conn.fetch(self._actions, self.namespace, job_id, limit)
        return [Action(*row) for row in rows]

    async def slots(
        self, job_id: str, since: datetime, until: datetime, *, limit: int = LIMIT
    ) -> list[SlotRecord]:
        """The job's ledger (see :mod:`ticklock._operators.ledger`), from the records the retention
        keeps."""
        self._storable(job_id)
        async with self._acquire() as conn:
            return await self._ledger.slots(conn, job_id, since, until, limit)

    async def _declaration(self, conn: asyncpg.Connection[Any], job_id: str) -> tuple[bool, ...]:
        """Whether replicas are live; whether one declares the job enabled; or at all."""
        row = await conn.fetchrow(self._declared, self.namespace, job_id)
        assert row is not None
        return tuple(row)

    async def _steer(
        self,
        statement: str,
        action: str,
        job_id: str,
        note: str | None,
        who: str,
        until: datetime | None = None,
    ) -> bool:
        """Pause (until ``until``, if given) or resume, audited, and tell the replicas;
        whether it changed anything."""
        note, who = said(note, who)
        self._storable(job_id)
        async with self._acquire() as conn, conn.transaction():
            before = await conn.fetchrow(self._current, self.namespace, job_id)
            if before is None:
                raise self._unknown(job_id)
            changed = (before["paused_at"] is None) == (action == "pause")
            await conn.execute(statement, self.namespace, job_id)
            if until is None:
                await conn.execute(self._forever, self.namespace, job_id)
            else:
                await conn.execute(self._until, self.namespace, job_id, until)
            note = paused_until(note, until)
            await conn.execute(self._audit, self.namespace, job_id, action, who, note, changed)
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self._payload)
        return changed

    def _unknown(self, job_id: str) -> KeyError:
        return KeyError(f"no job {job_id!r} in namespace {self.namespace!r}")

    def _storable(self, job_id: str) -> None:
        """An id with an unpaired surrogate names no job (declaring one is refused, and
        PostgreSQL cannot store it): unknown, as in memory, rather than a driver's error."""
        if surrogate(job_id) is not None:
            raise self._unknown(job_id)


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


def _state(row: asyncpg.Record, spec: _spec.Spec | None, now: datetime) -> JobState:
    threshold = spec.failure_threshold if spec is not None else 1
    return state_of(
        ended=spec is not None and spec.ended(now),
        completed=spec is not None and spec.completed(row["successes"]),
        undeclared=row["fleet"] and row["enabled"] is None,  # live replicas run, none declares it
        disabled=row["fleet"] and row["enabled"] is False,
        paused=row["paused_at"] is not None,
        future=row["future"],
        overdue=row["overdue"],
        failing=row["consecutive_failures"] >= threshold,
    )
