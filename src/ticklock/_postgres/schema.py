"""ticklock's tables in PostgreSQL and their idempotent migration.

``jobs`` holds one row of fleet state per ``(namespace, job_id)`` (and the job's spec, see
:mod:`ticklock._spec`); ``runs`` the history; ``replicas`` one row per live scheduler (its
heartbeat and the jobs it declares). The ledger's records: ``presence`` (when each replica was
live, and what it declared), ``outages`` (what kept a replica from running its slots, recorded
by the replica itself: the database unreachable from it, its event loop blocked, its ticks
refused for its clock; ``kind`` says which) and ``audit`` (operators' operations); the
retention sweep prunes them with the history.
The schema name is validated as a plain identifier and always quoted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._lock_key import lock_key

if TYPE_CHECKING:
    import asyncpg

VERSION = 8
_TABLES = ("schema_version", "jobs", "runs", "replicas", "presence", "outages", "audit")
_MIGRATION_LOCK = "ticklock.migrate"
MIGRATION_LOCK_TIMEOUT_MS = 5000
"""How long a migration's DDL may wait for a table's lock before it gives up (and is retried)."""


def quote(schema: str) -> str:
    """The schema as a quoted SQL identifier (it was validated as a plain identifier)."""
    return '"' + schema.replace('"', '""') + '"'


def literal(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def migration(schema: str, tables: frozenset[str] = frozenset(_TABLES)) -> str:
    """The DDL that creates ``tables`` (all of ticklock's by default) in ``schema``, at the
    current version, with their indexes. Only absent tables are given: DDL on a table that
    exists would take a lock that waits behind the ticks in flight and holds up every tick."""
    s = quote(schema)
    ddl = {
        "jobs": f"""
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
    paused_at timestamptz,
    trigger_at timestamptz,
    next_due timestamptz,
    last_owner text,
    last_error text,
    batch_cursor jsonb,
    fence bigint NOT NULL DEFAULT 0,
    busy_until timestamptz,
    spec jsonb,
    PRIMARY KEY (namespace, job_id)
);
CREATE INDEX IF NOT EXISTS jobs_steered ON {s}.jobs (namespace)
    WHERE paused_at IS NOT NULL OR trigger_at IS NOT NULL;""",
        "runs": f"""
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
    error text,
    manual boolean NOT NULL DEFAULT false,
    batches integer NOT NULL DEFAULT 0,
    capped boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS runs_job_finished ON {s}.runs (namespace, job_id, finished_at);
CREATE INDEX IF NOT EXISTS runs_finished ON {s}.runs (finished_at);""",
        "replicas": f"""
CREATE TABLE IF NOT EXISTS {s}.replicas (
    namespace text NOT NULL,
    owner text NOT NULL,
    jobs text[] NOT NULL DEFAULT '{{}}',
    disabled text[] NOT NULL DEFAULT '{{}}',
    started_at timestamptz NOT NULL DEFAULT now(),
    seen_at timestamptz NOT NULL DEFAULT now(),
    declared_at timestamptz NOT NULL DEFAULT now(),
    fingerprints text[] NOT NULL DEFAULT '{{}}',
    failing text[] NOT NULL DEFAULT '{{}}',
    PRIMARY KEY (namespace, owner)
);""",
        "presence": f"""
CREATE TABLE IF NOT EXISTS {s}.presence (
    namespace text NOT NULL,
    owner text NOT NULL,
    started_at timestamptz NOT NULL,
    since timestamptz NOT NULL,
    until timestamptz NOT NULL,
    jobs text[] NOT NULL,
    disabled text[] NOT NULL,
    left_at timestamptz,
    PRIMARY KEY (namespace, owner, started_at, since)
);
CREATE INDEX IF NOT EXISTS presence_until ON {s}.presence (namespace, until);""",
        "outages": f"""
CREATE TABLE IF NOT EXISTS {s}.outages (
    id bigserial PRIMARY KEY,
    namespace text NOT NULL,
    owner text NOT NULL,
    since timestamptz NOT NULL,
    until timestamptz NOT NULL,
    kind text NOT NULL DEFAULT 'unreachable',
    detail text
);
CREATE INDEX IF NOT EXISTS outages_until ON {s}.outages (namespace, until);""",
        "audit": f"""
CREATE TABLE IF NOT EXISTS {s}.audit (
    id bigserial PRIMARY KEY,
    namespace text NOT NULL,
    job_id text NOT NULL,
    at timestamptz NOT NULL DEFAULT now(),
    action text NOT NULL,
    who text NOT NULL,
    note text,
    changed boolean NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_job ON {s}.audit (namespace, job_id, at);""",
        "schema_version": f"""
CREATE TABLE IF NOT EXISTS {s}.schema_version (version integer NOT NULL);
INSERT INTO {s}.schema_version (version)
    SELECT {VERSION} WHERE NOT EXISTS (SELECT 1 FROM {s}.schema_version);""",
    }
    return f"CREATE SCHEMA IF NOT EXISTS {s};" + "".join(
        ddl[table] for table in _TABLES if table in tables
    )


def upgrades(schema: str) -> dict[int, str]:
    """The DDL that brings tables of each earlier version to the next one."""
    s = quote(schema)
    return {
        1: f"ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS failed_slot timestamptz, "
        "ADD COLUMN IF NOT EXISTS failed_attempts integer NOT NULL DEFAULT 0",
        # the replicas table comes with migration(): a schema of version 2 lacks it
        2: f"ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS manual boolean NOT NULL DEFAULT false; "
        f"ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS paused_at timestamptz, "
        "ADD COLUMN IF NOT EXISTS trigger_at timestamptz, "
        "ADD COLUMN IF NOT EXISTS next_due timestamptz, "
        "ADD COLUMN IF NOT EXISTS last_owner text, "
        "ADD COLUMN IF NOT EXISTS last_error text; "
        f"CREATE INDEX IF NOT EXISTS jobs_steered ON {s}.jobs (namespace) "
        "WHERE paused_at IS NOT NULL OR trigger_at IS NOT NULL",
        3: f"ALTER TABLE {s}.replicas "
        "ADD COLUMN IF NOT EXISTS declared_at timestamptz NOT NULL DEFAULT now()",
        4: f"ALTER TABLE {s}.replicas "
        "ADD COLUMN IF NOT EXISTS fingerprints text[] NOT NULL DEFAULT '{}', "
        "ADD COLUMN IF NOT EXISTS failing text[] NOT NULL DEFAULT '{}'",
        # batched runs: the cursor, the fence and the hold between batches (see .tick)
        5: f"ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS batch_cursor jsonb, "
        "ADD COLUMN IF NOT EXISTS fence bigint NOT NULL DEFAULT 0, "
        "ADD COLUMN IF NOT EXISTS busy_until timestamptz; "
        f"ALTER TABLE {s}.runs ADD COLUMN IF NOT EXISTS batches integer NOT NULL DEFAULT 0, "
        "ADD COLUMN IF NOT EXISTS capped boolean NOT NULL DEFAULT false",
        # the ledger: the jobs' specs (its new tables come with migration())
        6: f"ALTER TABLE {s}.jobs ADD COLUMN IF NOT EXISTS spec jsonb",
        # the ledger: what else kept a replica from its slots (a stalled loop, a clock ahead)
        7: f"ALTER TABLE {s}.outages "
        "ADD COLUMN IF NOT EXISTS kind text NOT NULL DEFAULT 'unreachable', "
        "ADD COLUMN IF NOT EXISTS detail text",
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
        # an upgrade's DDL waits behind the ticks in flight, and every tick behind it: give
        # up after a while instead (the caller tries again), never stall the fleet
        await conn.execute(f"SET LOCAL lock_timeout = {MIGRATION_LOCK_TIMEOUT_MS}")
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(schema, _MIGRATION_LOCK))
        rows = await conn.fetch(
            "SELECT t FROM unnest($1::text[]) AS t WHERE to_regclass($2 || '.' || t) IS NULL",
            list(_TABLES),
            s,
        )
        absent = frozenset(row["t"] for row in rows)
        if absent:  # a new schema, one from before a table was added, or tables dropped
            await conn.execute(migration(schema, absent))
            if len(absent) == len(_TABLES):
                return "created"
        version = await conn.fetchval(f"SELECT max(version) FROM {s}.schema_version")
        if version is None:  # the table was emptied: the tables are those of this version
            await conn.execute(f"INSERT INTO {s}.schema_version (version) VALUES ($1)", VERSION)
            return "upgraded"
        if version >= VERSION:
            return "upgraded" if absent else "current"
        steps = upgrades(schema)
        for step in range(version, VERSION):
            await conn.execute(steps[step])
        await conn.execute(f"UPDATE {s}.schema_version SET version = $1", VERSION)
        return "upgraded"
