"""The ledger's records of one job, read from ticklock's tables (see ``_operators/ledger.py``).

The runs in the window (and the last one before it, and the first success after it), each
with its report and error cut to :data:`~ticklock._operators.ledger.TEXT` characters; the replicas'
presence, what they recorded of themselves (outages, stalls, ticks refused), and the job's
pauses from the audit log: a few indexed reads on one connection, however long the window.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio

from ..._operators.fleet import Action, RunRecord, SlotRecord
from ..._operators.ledger import LIMIT, TEXT, UNREACHABLE, Incident, Records, Span, account
from ..._schedule import spec as _spec
from ..._schedule.caps import HEAD, MARKER_KEY, MARKER_MAX, cut_text, report_marker
from ..._schedule.stored import from_json
from .schema import quote

if TYPE_CHECKING:
    import asyncpg

ACTIONS = 1000
"""The most pauses and resumes of a job that a ledger reads (the latest)."""


class LedgerReader:
    """Reads what :func:`ticklock._operators.ledger.account` needs of a job of ``namespace``."""

    def __init__(self, schema: str, namespace: str) -> None:
        s = quote(schema)
        self.namespace = namespace
        where = "WHERE namespace = $1 AND job_id = $2"
        # a run's report and error as the history gives them with max_text=TEXT: a longer
        # report as its marker (a marker as it is), a longer error's start and its length;
        # OFFSET 0 keeps the report's text one value per row, not one per use
        columns = (
            "job_id, slot, started_at, finished_at, outcome, owner, "
            f"CASE WHEN length(r.t) <= {TEXT} OR (length(r.t) <= {MARKER_MAX} "
            f"AND jsonb_typeof(report) = 'object' AND report ? '{MARKER_KEY}') THEN r.t END "
            f"AS report, length(r.t) AS report_length, left(r.t, {HEAD}) AS report_head, "
            f"left(error, {TEXT}) AS error, length(error) AS error_length, "
            "manual, batches, capped, "
            f"(SELECT b.who FROM {s}.backfilled AS b WHERE b.run_id = runs.id) AS backfilled_by"
        )
        text = "LATERAL (SELECT report::text AS t OFFSET 0) AS r"
        runs = f"SELECT {columns} FROM {s}.runs, {text} {where}"
        # $3, $4: the window; $5: how many of its runs (the latest)
        self._runs = f"""
(SELECT *, true AS inside FROM ({runs} AND finished_at >= $3 AND slot <= $4
    ORDER BY finished_at DESC LIMIT $5) AS inside)
UNION ALL (SELECT *, false FROM ({runs} AND slot < $3
    ORDER BY finished_at DESC LIMIT 1) AS before)
UNION ALL (SELECT *, false FROM ({runs} AND slot > $4 AND outcome = 'success'
    ORDER BY finished_at LIMIT 1) AS after)"""
        self._job = (
            "SELECT now(), spec::text, paused_at, "
            f"coalesce((SELECT c.successes FROM {s}.counts AS c {where}), 0) AS successes "
            f"FROM {s}.jobs {where}"
        )
        # a stored schedule's ($5: its task) are the replicas that had its task
        declared = "($2 = ANY(jobs) OR $2 = ANY(disabled) OR $5 = ANY(tasks))"
        self._presence = (
            "SELECT owner, since, until, $2 = ANY(jobs) OR $5 = ANY(tasks) AS enabled, "
            f"left_at IS NOT NULL AS left FROM {s}.presence WHERE namespace = $1 AND {declared} "
            "AND until >= $3::timestamptz - interval '1 minute' AND since <= $4"
        )
        self._horizon = (
            f"SELECT min(since), min(since) FILTER (WHERE {declared.replace('$5', '$3')}) "
            f"FROM {s}.presence WHERE namespace = $1"
        )
        self._outages = (
            f"SELECT owner, since, until, kind, detail FROM {s}.outages "
            "WHERE namespace = $1 AND until >= $2 AND since <= $3"
        )
        self._steering = (
            f"SELECT job_id, action, who, at, note, changed FROM {s}.audit {where} "
            f"AND changed AND action IN ('pause', 'resume', 'forget', 'put') "
            f"ORDER BY at DESC, id DESC LIMIT {ACTIONS}"
        )

    async def slots(
        self,
        conn: asyncpg.Connection[Any],
        job_id: str,
        since: datetime,
        until: datetime,
        limit: int,
    ) -> list[SlotRecord]:
        """The job's ledger; ``KeyError`` for a job without a row, or one whose schedule
        the records do not hold (no replica of this release declared it yet)."""
        ns = self.namespace
        job = await conn.fetchrow(self._job, ns, job_id)
        if job is None:
            raise KeyError(f"no job {job_id!r} in namespace {ns!r}")
        value = None if job["spec"] is None else json.loads(job["spec"])
        spec = _spec.from_json(value)
        stored = from_json(job_id, value)
        task = None if stored is None else stored.task
        if spec is None:
            raise KeyError(
                f"job {job_id!r} has no schedule recorded: it is written when a replica "
                "that declares the job starts"
            )
        limit = max(1, min(limit, LIMIT))
        most = limit * (spec.retries + 2)  # every attempt of each slot, and manual runs
        runs = await conn.fetch(self._runs, ns, job_id, since, until, most)
        inside = [row["slot"] for row in runs if row["inside"]]
        presence = await conn.fetch(self._presence, ns, job_id, since, until, task)
        outages = await conn.fetch(self._outages, ns, since, until)
        actions = await conn.fetch(self._steering, ns, job_id)
        horizon, declared_since = await conn.fetchrow(self._horizon, ns, job_id, task) or (
            None,
            None,
        )
        if stored is not None and declared_since is not None:  # nothing was owed before it
            declared_since = max(declared_since, stored.created_at)
        records = Records(
            runs=[_run(row) for row in runs],
            actions=[Action(*row) for row in actions],
            presence=[
                Span(r["owner"], r["since"], r["until"], r["enabled"], r["left"]) for r in presence
            ],
            outages=[
                Span(r["owner"], r["since"], r["until"])
                for r in outages
                if r["kind"] == UNREACHABLE
            ],
            incidents=[
                Incident(r["owner"], r["kind"], r["since"], r["until"], r["detail"])
                for r in outages
                if r["kind"] != UNREACHABLE
            ],
            paused_at=job["paused_at"],
            successes=job["successes"],
            version=None if stored is None else stored.version,
            horizon=horizon,
            declared_since=declared_since,
            # only the latest runs were read: the ledger begins with them
            complete_since=min(inside) if len(inside) >= most else None,
            task=task,
        )
        # a long window walks many fires: off the event loop
        return await anyio.to_thread.run_sync(
            account, spec, records, since, until, job["now"], limit
        )


def _run(row: asyncpg.Record) -> RunRecord:
    report: Any = None
    if row["report"] is not None:
        report = json.loads(row["report"])
    elif row["report_length"] is not None:  # over the bound: its marker
        report = report_marker(row["report_head"], row["report_length"])
    error: str | None = row["error"]
    return RunRecord(
        job_id=row["job_id"],
        slot=row["slot"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        outcome=row["outcome"],
        owner=row["owner"],
        report=report,
        error=None if error is None else cut_text(error, row["error_length"], TEXT),
        manual=row["manual"],
        batches=row["batches"],
        capped=row["capped"],
        backfilled_by=row["backfilled_by"],
    )
