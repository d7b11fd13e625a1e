"""ticklock's tables in PostgreSQL and their idempotent migration.

``jobs`` holds one row of fleet state per ``(namespace, job_id)``; ``runs`` the history.
The schema name is validated as a plain identifier and always quoted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
        if await conn.fetchval("SELECT to_regclass($1) IS NULL", f"{s}.schema_version"):
            await conn.execute(migration(schema))
            return "created"
        version = await conn.fetchval(f"SELECT max(version) FROM {s}.schema_version")
        if version >= VERSION:
            return "current"
        steps = upgrades(schema)
        for step in range(version, VERSION):
            await conn.execute(steps[step])
        await conn.execute(f"UPDATE {s}.schema_version SET version = $1", VERSION)
        return "upgraded"
