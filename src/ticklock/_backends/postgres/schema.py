"""ticklock's tables in PostgreSQL and their idempotent migration.

``jobs`` holds one row of fleet state per ``(namespace, job_id)`` (and the job's spec, see
:mod:`ticklock._schedule.spec`); ``runs`` the history; ``replicas`` one row per live scheduler (its
heartbeat and the jobs it declares). The ledger's records: ``presence`` (when each replica was
live, and what it declared), ``outages`` (what kept a replica from running its slots, recorded
by the replica itself: the database unreachable from it, its event loop blocked, its ticks
refused for its clock; ``kind`` says which) and ``audit`` (operators' operations); the
retention sweep prunes them with the history. ``seals`` holds, for each tick's transaction in
flight, one row whose deferred constraint trigger lets only ticklock's own COMMIT commit it
(see :mod:`.tick`); the row is deleted by that commit, so the table stays empty.
The schema name is validated as a plain identifier and always quoted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from ..._errors import SchemaBusy
from ..._schedule.lock_key import lock_key

if TYPE_CHECKING:
    import asyncpg

VERSION = 12
_TABLES = (
    "schema_version",
    "jobs",
    "runs",
    "replicas",
    "presence",
    "outages",
    "audit",
    "seals",
    "schedule_log",
    "counts",
    "pauses",
    "firsts",
    "backfills",
    "backfilled",
)
CHECKED = tuple(t for t in _TABLES if t not in ("schema_version", "schedule_log"))
"""The tables on which a starting scheduler checks that it may select, insert, update and
delete (``schema_version`` it only reads)."""
_MIGRATION_LOCK = "ticklock.migrate"
LOCK_TIMEOUT_MS = 200
"""How long one attempt of a migration waits for a lock before it gives up (and is tried
again): the longest a DDL queued behind a run in flight holds up other sessions' statements."""
RETRY_FIRST, RETRY_MAX = 0.2, 2.0
"""Seconds between a migration's attempts: the first wait, doubling up to the cap."""
START_WAIT = 2.0
"""Seconds a starting scheduler's migration tries before it reports that it waits (then its
database's backoff tries again)."""
CLEANUP_SECONDS = 5.0
"""How long the rollback of a failed attempt may take, shielded."""
SEAL_SETTING = "ticklock.commit"
"""The setting ticklock's own COMMIT of a tick sets (``SET LOCAL``) to the tick's token."""
SEAL_REFUSED = (
    "ticklock: a COMMIT that is not ticklock's own reached a tick's transaction (through "
    "ctx.db): refused, and the transaction is rolled back with everything it wrote"
)
SEAL_HINT = (
    "Leave the transaction to ticklock: it commits the handler's writes with the slot when "
    "the handler returns"
)


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
    WHERE paused_at IS NOT NULL OR trigger_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_due ON {s}.jobs (namespace, next_due) WHERE spec ? 'task';
CREATE INDEX IF NOT EXISTS jobs_tenant ON {s}.jobs (namespace, (spec->>'tenant'), job_id)
    WHERE spec ? 'task';""",
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
    tasks text[] NOT NULL DEFAULT '{{}}',
    PRIMARY KEY (namespace, owner)
);""",
        # the stored schedules' writes, numbered in the order they committed (see .schedules)
        "schedule_log": f"""
CREATE TABLE IF NOT EXISTS {s}.schedule_log (
    seq bigserial PRIMARY KEY,
    namespace text NOT NULL,
    schedule_id text NOT NULL,
    at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS schedule_log_namespace ON {s}.schedule_log (namespace, seq);""",
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
    tasks text[] NOT NULL DEFAULT '{{}}',
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
        # A tick's transaction inserts a row (the SHA-256 of a random token only ticklock
        # knows) before its handler runs. Every COMMIT of that transaction, however it is
        # sent, fires the deferred trigger, which refuses it unless ticklock set the token
        # with SET LOCAL just before its own COMMIT; SET CONSTRAINTS ... IMMEDIATE fires it
        # early, with the same check. Deleting or changing the row fires it too. It runs
        # with pg_catalog's functions and operators only: a search_path a handler set
        # cannot put others first.
        # each job's scheduled runs that committed, counted in the tick's transaction (a limit)
        "counts": f"""
CREATE TABLE IF NOT EXISTS {s}.counts (
    namespace text NOT NULL,
    job_id text NOT NULL,
    successes bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, job_id)
);""",
        # the instant each job paused until an instant resumes by itself (see .control)
        "pauses": f"""
CREATE TABLE IF NOT EXISTS {s}.pauses (
    namespace text NOT NULL,
    job_id text NOT NULL,
    until timestamptz NOT NULL,
    PRIMARY KEY (namespace, job_id)
);""",
        # the declarations (their fingerprints, the latest first) each job declared
        # immediately ran for
        "firsts": f"""
CREATE TABLE IF NOT EXISTS {s}.firsts (
    namespace text NOT NULL,
    job_id text NOT NULL,
    fingerprints text[] NOT NULL,
    PRIMARY KEY (namespace, job_id)
);""",
        # the backfills operators asked for: their slots, and how many ran (see .fleet)
        "backfills": f"""
CREATE TABLE IF NOT EXISTS {s}.backfills (
    id bigserial PRIMARY KEY,
    namespace text NOT NULL,
    job_id text NOT NULL,
    slots timestamptz[] NOT NULL,
    done integer NOT NULL DEFAULT 0,
    pace float8,
    who text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    passed timestamptz[] NOT NULL DEFAULT '{{}}',
    rerun boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS backfills_open ON {s}.backfills (namespace)
    WHERE finished_at IS NULL;""",
        # the runs that were slots of a backfill, and who asked for it
        "backfilled": f"""
CREATE TABLE IF NOT EXISTS {s}.backfilled (
    run_id bigint PRIMARY KEY,
    request bigint NOT NULL,
    who text NOT NULL
);""",
        "seals": f"""
CREATE TABLE IF NOT EXISTS {s}.seals (seal bytea PRIMARY KEY);
CREATE OR REPLACE FUNCTION {s}.seal_check() RETURNS trigger LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_catalog.sha256(pg_catalog.convert_to(
        coalesce(pg_catalog.current_setting('{SEAL_SETTING}', true), ''), 'UTF8'))
        IS DISTINCT FROM (CASE TG_OP WHEN 'DELETE' THEN OLD.seal ELSE NEW.seal END) THEN
        RAISE EXCEPTION USING ERRCODE = 'P0001', MESSAGE = {literal(SEAL_REFUSED)},
            HINT = {literal(SEAL_HINT)};
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER seal AFTER INSERT OR UPDATE OR DELETE ON {s}.seals
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE PROCEDURE {s}.seal_check();""",
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
        # the seals: the table, its function and trigger come with migration()
        7: "",
        # the ledger: what else kept a replica from its slots (a stalled loop, a clock ahead)
        8: f"ALTER TABLE {s}.outages "
        "ADD COLUMN IF NOT EXISTS kind text NOT NULL DEFAULT 'unreachable', "
        "ADD COLUMN IF NOT EXISTS detail text",
        # stored schedules: the tasks each replica has (schedule_log comes with migration())
        9: f"ALTER TABLE {s}.replicas "
        "ADD COLUMN IF NOT EXISTS tasks text[] NOT NULL DEFAULT '{}'; "
        f"ALTER TABLE {s}.presence ADD COLUMN IF NOT EXISTS tasks text[] NOT NULL DEFAULT '{{}}'; "
        f"CREATE INDEX IF NOT EXISTS jobs_due ON {s}.jobs (namespace, next_due) "
        "WHERE spec ? 'task'; "
        f"CREATE INDEX IF NOT EXISTS jobs_tenant ON {s}.jobs "
        "(namespace, (spec->>'tenant'), job_id) WHERE spec ? 'task'",
        # a job's limit and a pause until an instant: the counts and pauses tables come with
        # migration() (no DDL on a table a run holds)
        10: "",
        # backfills: the backfills and backfilled tables come with migration()
        11: "",
    }


async def migrate(
    conn: asyncpg.Connection[Any],
    schema: str,
    *,
    wait: float = START_WAIT,
    waiting: Callable[[], None] | None = None,
) -> str:
    """Create or upgrade ticklock's tables; returns ``"created"``, ``"upgraded"`` or
    ``"current"``. Idempotent, and safe when replicas start at once.

    Tables already at the current version are not touched: DDL on them would take locks
    that wait behind ticks in flight. An upgrade's DDL on a table that a run in flight holds
    waits until that run ends, and every other statement on the table queues behind it: so
    each attempt, one transaction, gives up a lock wait after :data:`LOCK_TIMEOUT_MS` and
    changes nothing, and the next is tried after a backoff, for up to ``wait`` seconds;
    then :class:`SchemaBusy`. ``waiting`` is called once, when the first attempt gave up.
    A transaction-level advisory lock serialises concurrent migrations.
    """
    import asyncpg

    deadline = time.monotonic() + wait
    delay = RETRY_FIRST
    told = False
    while True:
        try:
            return await _attempt(conn, schema)
        except asyncpg.LockNotAvailableError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SchemaBusy(
                    f"the upgrade of ticklock's tables in schema {schema!r} waited {wait:g} s "
                    "for the runs in flight to end (a run's transaction holds the tables it "
                    "read until it ends) and changed nothing; it can be run again"
                ) from exc
            if waiting is not None and not told:
                told = True
                waiting()
            await anyio.sleep(min(delay, left))
            delay = min(delay * 2, RETRY_MAX)


async def _attempt(conn: asyncpg.Connection[Any], schema: str) -> str:
    """One attempt of :func:`migrate`, in a transaction of its own: rolled back (shielded,
    so that a cancelled attempt returns its connection clean) unless it succeeds."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}")
        done = await _migrate(conn, schema)
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_SECONDS):
            await transaction.rollback()
        raise
    await transaction.commit()
    return done


async def _migrate(conn: asyncpg.Connection[Any], schema: str) -> str:
    s = quote(schema)
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
        if steps[step]:
            await conn.execute(steps[step])
    await conn.execute(f"UPDATE {s}.schema_version SET version = $1", VERSION)
    return "upgraded"
