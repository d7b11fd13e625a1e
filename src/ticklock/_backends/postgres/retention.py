"""The built-in job ``ticklock.retention``: it prunes the run history."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._schedule.triggers import Trigger, every
from .schema import quote

if TYPE_CHECKING:
    from ..._schedule.job import JobContext


class Retention:
    """The built-in job ``ticklock.retention``: deletes run records older than ``keep``, the
    ledger's records (presence, outages, the audit log) that ended before then, the stored
    schedules' log of writes (but the last), and the rows of schedules deleted before then.

    It runs every minute and deletes at most :attr:`BATCH` rows a run, so that a tick stays
    short (about 0.3 s for a full batch on the benchmarks' machine) and still keeps up with
    72 million runs a day (830 a second); ``capped`` in its report says a backlog is left.
    """

    BATCH = 50_000

    @staticmethod
    def trigger() -> Trigger:
        """Its schedule: every minute (an hourly batch of 10,000 kept up with 240,000 runs a
        day, and a fleet running 250 jobs a second records 21 million)."""
        return every(minutes=1, jitter=10)

    def __init__(self, schema: str, namespace: str, keep: float) -> None:
        s = quote(schema)
        old = "namespace = $1 AND {} < now() - make_interval(secs => $2)"
        self._sql = (
            f"WITH d AS (DELETE FROM {s}.runs WHERE id IN ("
            f"SELECT id FROM {s}.runs WHERE {old.format('finished_at')} LIMIT {self.BATCH}) "
            f"RETURNING id), p AS (DELETE FROM {s}.presence WHERE {old.format('until')}), "
            # a backfill's marks go with their runs, a finished backfill with the bound
            f"b AS (DELETE FROM {s}.backfilled WHERE run_id IN (SELECT id FROM d)), "
            f"f AS (DELETE FROM {s}.backfills WHERE {old.format('finished_at')}), "
            f"o AS (DELETE FROM {s}.outages WHERE {old.format('until')}), "
            f"a AS (DELETE FROM {s}.audit WHERE {old.format('at')}), "
            # the stored schedules' writes, but the last (its number is the replicas' mark),
            # and the rows of schedules deleted before then, whose runs are gone with them
            f"l AS (DELETE FROM {s}.schedule_log WHERE {old.format('at')} AND seq < "
            f"(SELECT max(seq) FROM {s}.schedule_log WHERE namespace = $1)), "
            f"t AS (DELETE FROM {s}.jobs AS j WHERE namespace = $1 AND spec ? 'deleted_at' "
            "AND (spec->>'deleted_at')::timestamptz < now() - make_interval(secs => $2) "
            f"AND NOT EXISTS (SELECT FROM {s}.runs AS r "
            "WHERE r.namespace = $1 AND r.job_id = j.job_id)) "
            "SELECT count(*) FROM d"
        )
        self._namespace = namespace
        self._keep = keep

    async def __call__(self, ctx: JobContext) -> dict[str, int | bool]:
        """Delete one batch of expired run records through the tick's connection."""
        if ctx.conn is None:
            return {"deleted": 0, "capped": False}
        deleted = int(await ctx.conn.fetchval(self._sql, self._namespace, self._keep))
        return {"deleted": deleted, "capped": deleted >= self.BATCH}
