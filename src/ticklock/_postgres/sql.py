"""ticklock's tables in PostgreSQL and their idempotent migration.

``jobs`` holds one row of fleet state per ``(namespace, job_id)``; ``runs`` the history.
The schema name is validated as a plain identifier and always quoted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._coordination import FUTURE_LIMIT
from .._lock_key import lock_key

if TYPE_CHECKING:
    import asyncpg

VERSION = 2
_MIGRATION_LOCK = "ticklock.migrate"


def quote(schema: str) -> str:
    """The schema as a quoted SQL identifier (it was validated as a plain identifier)."""
    return '"' + schema.replace('"', '""') + '"'


def migration(schema: str) -> str:
    """The DDL that creates ticklock's tables in ``schema``, at the current version."""
    s = quote(schema)
    return f"""
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.jobs (
    namespace text NOT NULL,
    job_id text NOT NULL,
    last_slot timestamptz,
    last_end timestamptz,
    last_success_at timestamptz,
    last_outcome text,
    consecutive_failures integer NOT NULL DEFAULT 0,
    failed_slot timestamptz,
    failed_attempts integer NOT NULL DEFAULT 0,
    overdue_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, job_id)
);
CREATE TABLE IF NOT EXISTS {s}.runs (
    id bigserial PRIMARY KEY,
    namespace text NOT NULL,
    job_id text NOT NULL,
    slot timestamptz,
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    outcome text NOT NULL,
    owner text NOT NULL,
    report jsonb,
    error text
);
CREATE INDEX IF NOT EXISTS runs_job_finished ON {s}.runs (namespace, job_id, finished_at);
CREATE INDEX IF NOT EXISTS runs_finished ON {s}.runs (finished_at);
CREATE TABLE IF NOT EXISTS {s}.schema_version (version integer NOT NULL);
INSERT INTO {s}.schema_version (version)
    SELECT {VERSION} WHERE NOT EXISTS (SELECT 1 FROM {s}.schema_version);
"""


def upgrades(schema: str) -> dict[int, str]:
    """The DDL that brings tables of each earlier version to the next one."""
    s = quote(schema)
    return {
        1: f"ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS failed_slot timestamptz, "
        "ADD COLUMN IF NOT EXISTS failed_attempts integer NOT NULL DEFAULT 0",
    }


async def migrate(conn: asyncpg.Connection[Any], schema: str) -> str:
    """Create or upgrade ticklock's tables; returns ``"created"``, ``"upgraded"`` or
    ``"current"``. Idempotent, and safe when replicas start at once.

    Tables already at the current version are not touched: DDL on them would take locks
    that wait behind ticks in flight and hold up every other tick meanwhile. A
    transaction-level advisory lock serialises concurrent migrations.
    """
    s = quote(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(schema, _MIGRATION_LOCK))
        absent = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE to_regclass(t) IS NULL) FROM unnest($1::text[]) AS t",
            [f"{s}.{table}" for table in ("schema_version", "jobs", "runs")],
        )
        if absent:  # all of them (a new schema), or some dropped: create what is missing
            await conn.execute(migration(schema))
            if absent == 3:
                return "created"
        version = await conn.fetchval(f"SELECT max(version) FROM {s}.schema_version")
        if version >= VERSION:
            return "upgraded" if absent else "current"
        steps = upgrades(schema)
        for step in range(version, VERSION):
            await conn.execute(steps[step])
        await conn.execute(f"UPDATE {s}.schema_version SET version = $1", VERSION)
        return "upgraded"


class Statements:
    """The statements of a tick and of the scheduler's start, for the tables in ``schema``.

    ``commit`` writes the watermark, the success and the run record in one statement, and only
    if the transaction is still the one that took the lock (``now()`` is its start, read under
    the lock), the server-side timeouts the tick set still hold, and the slot and end are not
    more than ``FUTURE_LIMIT`` seconds in the database's future; it says which check failed.
    """

    def __init__(self, schema: str) -> None:
        s = quote(schema)
        self.state = (
            "SELECT now(), j.last_slot, j.last_end, j.last_success_at, "
            "coalesce(j.consecutive_failures, 0), j.failed_slot, "
            f"coalesce(j.failed_attempts, 0) FROM (SELECT) AS tick LEFT JOIN {s}.jobs AS j "
            "ON j.namespace = $1 AND j.job_id = $2"
        )
        self.register = (
            f"INSERT INTO {s}.jobs (namespace, job_id, overdue_at) "
            "SELECT $1, id, due FROM unnest($2::text[], $3::timestamptz[]) AS t(id, due) "
            "ON CONFLICT (namespace, job_id) DO NOTHING"
        )
        self.reschedule = (
            f"UPDATE {s}.jobs AS j SET overdue_at = v.due "
            "FROM unnest($2::text[], $3::timestamptz[], $4::timestamptz[]) "
            "AS v(id, success, due) "
            "WHERE j.namespace = $1 AND j.job_id = v.id AND j.last_success_at = v.success "
            "AND j.overdue_at IS DISTINCT FROM v.due"
        )
        self.load = (
            "SELECT job_id, overdue_at, last_slot, last_end, last_success_at, "
            "consecutive_failures, failed_slot, failed_attempts "
            f"FROM {s}.jobs WHERE namespace = $1"
        )
        within = "::interval BETWEEN interval '1 ms' AND $10::int * interval '1 ms'"
        self.commit = f"""
WITH guard AS (
    SELECT now() = $9::timestamptz AS same_tx,
        CASE WHEN current_setting('transaction_timeout', true) IS NULL
            THEN current_setting('statement_timeout'){within}
                AND current_setting('idle_in_transaction_session_timeout'){within}
            ELSE current_setting('transaction_timeout'){within} END AS bounded,
        extract(epoch FROM greatest($3::timestamptz, $4::timestamptz) - clock_timestamp())
            AS ahead
), j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_slot, last_end, last_success_at,
        last_outcome, consecutive_failures, overdue_at, updated_at)
    SELECT $1, $2, $3, $4, $4, 'success', 0, $8, now() FROM guard
    WHERE same_tx AND bounded AND ahead <= {FUTURE_LIMIT}
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        last_slot = EXCLUDED.last_slot,
        last_end = GREATEST(j.last_end, EXCLUDED.last_end),
        last_success_at = EXCLUDED.last_success_at,
        last_outcome = 'success', consecutive_failures = 0,
        failed_slot = NULL, failed_attempts = 0,
        overdue_at = EXCLUDED.overdue_at, updated_at = now()
    WHERE j.last_slot IS NULL OR j.last_slot < EXCLUDED.last_slot
    RETURNING 1
), r AS (
    INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner,
        report)
    SELECT $1, $2, $3, $5, $4, 'success', $6, $7::text::jsonb FROM j
)
SELECT (SELECT count(*) FROM j)::int, same_tx, bounded, ahead::float8 FROM guard"""
        # A failure from a replica whose clock runs ahead is recorded, but it moves neither
        # the fixed delay nor the slot to retry: the healthy replicas go on running the job.
        sane = f"$4::timestamptz <= clock_timestamp() + interval '{FUTURE_LIMIT:g} s'"
        self.failure = f"""
WITH j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_end, last_outcome,
        consecutive_failures, failed_slot, failed_attempts, updated_at)
    SELECT $1, $2, $4, $6, 1, $3, 1, now() WHERE {sane}
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        last_end = GREATEST(j.last_end, EXCLUDED.last_end),
        last_outcome = EXCLUDED.last_outcome,
        consecutive_failures = j.consecutive_failures + 1,
        failed_attempts = CASE WHEN j.failed_slot = $3 THEN j.failed_attempts + 1 ELSE 1 END,
        failed_slot = $3, updated_at = now()
    WHERE j.last_slot IS NULL OR j.last_slot < $3
)
INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner, error)
VALUES ($1, $2, $3, $5, $4, $6, $7, $8)"""


RESET = (
    "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; "
    "SET SESSION AUTHORIZATION DEFAULT; RESET ROLE; DISCARD TEMP; DISCARD SEQUENCES; "
)
"""Undoes the session state a handler can leave (RESET ALL keeps the role: reset apart)."""
LEFTOVERS = "; SELECT 1 WHERE EXISTS (SELECT FROM pg_prepared_statements WHERE from_sql)"
"""After the reset: status ``SELECT 1`` when the handler left SQL prepared statements."""


def begin(key: int, limit_ms: int, *, transaction_timeout: bool) -> str:
    """A tick's first query: BEGIN, the server-side timeouts (``transaction_timeout`` on
    PostgreSQL 17+, which bounds the transaction idle or busy; the other two before), and the
    lock. Its status tag says whether the lock was taken: ``SELECT 1`` or ``SELECT 0`` (a held
    lock raises no error, so the server logs nothing). ``key`` is an int: safe to inline."""
    if transaction_timeout:
        limits = f"SET LOCAL transaction_timeout = {limit_ms}; "
    else:
        limits = (
            f"SET LOCAL statement_timeout = {limit_ms}; "
            f"SET LOCAL idle_in_transaction_session_timeout = {limit_ms}; "
        )
    return f"BEGIN; {limits}SELECT 1 WHERE pg_try_advisory_xact_lock({key})"
