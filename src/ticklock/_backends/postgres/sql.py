"""The statements of a tick, of a batch and of the scheduler's start, for ticklock's tables
(:mod:`.schema` creates them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..seam import FIRSTS, FUTURE_LIMIT
from .schema import CHECKED, literal, quote

if TYPE_CHECKING:
    pass


class Statements:
    """The statements of a tick and of the scheduler's start, for the tables in ``schema``.

    ``commit`` writes the watermark, the success and the run record in one statement, and only
    if the transaction is still the one that took the lock (``now()`` is its start, read under
    the lock), the server-side timeouts the tick set still hold, and the slot and end are not
    more than ``FUTURE_LIMIT`` seconds in the database's future (``$14``: the anchor of
    :class:`.database.DatabaseTime`); it says which check failed, and (``$13``: the handler used its
    connection) whether SQL prepared statements are left; it deletes the transaction's seal
    (``$19``). ``failure``'s ``$11`` is the anchor, and ``$14`` the absence alarm's instant,
    from the run's end as for a success.
    """

    def __init__(self, schema: str) -> None:
        s = quote(schema)
        # the state under the lock, and the seal of the tick's transaction ($3, see .tick)
        self.state = (
            f"WITH seal AS (INSERT INTO {s}.seals (seal) VALUES ($3::bytea)) "
            "SELECT now(), j.last_slot, j.last_end, j.last_success_at, "
            "coalesce(j.consecutive_failures, 0), j.failed_slot, "
            "coalesce(j.failed_attempts, 0), j.paused_at, j.trigger_at, j.last_owner, "
            "j.busy_until, j.batch_cursor::text, (j.spec->>'version')::int, "
            f"coalesce((SELECT c.successes FROM {s}.counts AS c "
            "WHERE c.namespace = $1 AND c.job_id = $2), 0) "
            f"FROM (SELECT) AS tick LEFT JOIN {s}.jobs AS j "
            "ON j.namespace = $1 AND j.job_id = $2"
        )
        # the pauses that ended by now, taken (their resume follows in the same transaction),
        # and when the next one ends
        self.pauses_ending = (
            f"SELECT job_id FROM {s}.pauses WHERE namespace = $1 AND until <= now() ORDER BY job_id"
        )
        # one of them: the job's row locked first, then the pause's (an operator's pause or
        # resume takes them in that order too), which another replica may have taken
        self.lock_job = f"SELECT FROM {s}.jobs WHERE namespace = $1 AND job_id = $2 FOR UPDATE"
        self.pause_ended = (
            f"DELETE FROM {s}.pauses WHERE namespace = $1 AND job_id = $2 AND until <= now() "
            "RETURNING until"
        )
        self.next_pause_end = f"SELECT min(until) - now() FROM {s}.pauses WHERE namespace = $1"
        self.resume = resume(s)
        self.audit = audit(s)
        # the jobs declared immediately ($2, their fingerprints $3) whose declaration none of
        # their runs was asked for yet (of the last {FIRSTS}): a trigger request each, audited
        # ($4: who, $5: why); a replica of a release that restarts beside another's asks for
        # nothing (the two declarations take turns, each one known)
        self.immediately = f"""
WITH v AS (SELECT * FROM unnest($2::text[], $3::text[]) AS v(id, fp)), new AS (
    INSERT INTO {s}.firsts AS f (namespace, job_id, fingerprints) SELECT $1, id, ARRAY[fp] FROM v
    ON CONFLICT (namespace, job_id) DO UPDATE
    SET fingerprints = (EXCLUDED.fingerprints || f.fingerprints)[1:{FIRSTS}]
    WHERE NOT EXCLUDED.fingerprints[1] = ANY(f.fingerprints)
    RETURNING job_id
), asked AS (
    UPDATE {s}.jobs AS j SET trigger_at = coalesce(j.trigger_at, now()) FROM new
    WHERE j.namespace = $1 AND j.job_id = new.job_id RETURNING j.job_id
)
INSERT INTO {s}.audit (namespace, job_id, action, who, note, changed)
SELECT $1, job_id, 'trigger', $4, $5, true FROM asked"""
        # the privileges a scheduler needs on its tables, missing ones named (NULL: all held)
        tables = ", ".join(f"'{s}.{t}'" for t in CHECKED)
        self.ungranted = f"""
SELECT array_agg(what ORDER BY what) FROM (
    SELECT format('table %s (%s)', replace(t, '"', ''), p) AS what
    FROM unnest(ARRAY[{tables}]) AS t, unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) AS p
    WHERE NOT has_table_privilege(t, p)
    UNION ALL
    SELECT format('table %s (SELECT)', replace('{s}.schema_version', '"', ''))
    WHERE NOT has_table_privilege('{s}.schema_version', 'SELECT')
    UNION ALL
    SELECT format('sequence %s (USAGE)', q)
    FROM unnest(ARRAY[pg_get_serial_sequence('{s}.runs', 'id'),
        pg_get_serial_sequence('{s}.outages', 'id'),
        pg_get_serial_sequence('{s}.audit', 'id')]) AS q
    WHERE NOT has_sequence_privilege(q, 'USAGE')
) AS missing"""
        self.register = (
            f"INSERT INTO {s}.jobs (namespace, job_id, overdue_at) "
            "SELECT $1, id, due FROM unnest($2::text[], $3::timestamptz[]) AS t(id, due) "
            "ON CONFLICT (namespace, job_id) DO NOTHING"
        )
        # each job's spec, for operators and the ledger; a row a tick holds now is left as
        # it is (waiting for it would hold up the start), and written at the next start
        self.describe = f"""
WITH v AS (SELECT * FROM unnest($2::text[], $3::text[]) AS v(id, spec)),
free AS (
    SELECT j.job_id FROM {s}.jobs AS j JOIN v ON j.job_id = v.id
    WHERE j.namespace = $1 AND j.spec IS DISTINCT FROM v.spec::jsonb
    FOR UPDATE OF j SKIP LOCKED
)
UPDATE {s}.jobs AS j SET spec = v.spec::jsonb FROM v JOIN free ON free.job_id = v.id
WHERE j.namespace = $1 AND j.job_id = v.id"""
        # what kept a replica from its slots (see .database.Incident), recorded by its beat
        self.outage = (
            f"INSERT INTO {s}.outages (namespace, owner, since, until, kind, detail) "
            "SELECT $1, $2, * FROM unnest($3::timestamptz[], $4::timestamptz[], $5::text[], "
            "$6::text[])"
        )
        self.reschedule = (
            f"UPDATE {s}.jobs AS j SET overdue_at = v.due "
            "FROM unnest($2::text[], $3::timestamptz[], $4::timestamptz[]) "
            "AS v(id, ended, due) "
            "WHERE j.namespace = $1 AND j.job_id = v.id AND j.last_end = v.ended "
            "AND j.overdue_at IS DISTINCT FROM v.due"
        )
        columns = (
            "last_slot, last_end, last_success_at, consecutive_failures, failed_slot, "
            "failed_attempts, paused_at, trigger_at, last_owner, busy_until, batch_cursor::text, "
            "(spec->>'version')::int"
        )
        # the job's count of scheduled runs that committed (a limit), after those columns
        counted = (
            f"coalesce((SELECT c.successes FROM {s}.counts AS c "
            "WHERE c.namespace = $1 AND c.job_id = {job}), 0)"
        )
        self.load = (
            f"SELECT job_id, overdue_at, {columns}, {counted.format(job='jobs.job_id')} "
            f"FROM {s}.jobs "
            "WHERE namespace = $1 AND job_id = ANY($2::text[])"
        )
        # the jobs' states, and whether a run holds each one's lock ($3: the lock keys; $4:
        # the keys without a schema, held exclusively by an earlier release's tick or by
        # hand, never by this release's ticks of any schema); a tick past its deadline (see
        # locks()) does not count: an attempt would end it
        self.read = f"""
WITH advisory AS MATERIALIZED (
    SELECT pid, classid::int8 AS high, objid::int8 AS low, objsubid,
        mode = 'ExclusiveLock' AS exclusive FROM pg_locks
    WHERE locktype = 'advisory' AND granted
        AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
), deadline AS (
    SELECT pid, min(low) AS until FROM advisory
    WHERE objsubid = 2 AND high = {DEADLINE_TAG} GROUP BY pid
), held AS MATERIALIZED (
    SELECT a.high, a.low FROM advisory AS a LEFT JOIN deadline AS d ON d.pid = a.pid
    WHERE a.objsubid = 1
        AND (d.until IS NULL OR d.until >= extract(epoch FROM clock_timestamp()))
)
SELECT v.id AS job_id, {", ".join(_qualified(c) for c in columns.split(", "))},
    {counted.format(job="v.id")},
    (EXISTS (SELECT FROM held WHERE high = (v.key >> 32) & 4294967295
        AND low = v.key & 4294967295)
    OR EXISTS (SELECT FROM advisory WHERE objsubid = 1 AND exclusive
        AND high = (v.legacy >> 32) & 4294967295 AND low = v.legacy & 4294967295)) AS held
FROM unnest($2::text[], $3::int8[], $4::int8[]) AS v(id, key, legacy)
LEFT JOIN {s}.jobs AS j ON j.namespace = $1 AND j.job_id = v.id"""
        # a manual run serves the trigger requests made up to its slot
        served = "CASE WHEN {m} AND j.trigger_at <= $3 THEN NULL ELSE j.trigger_at END"
        # A run that committed batches ($15: its fence) ends only if it still holds the job
        # ($17 > 0: it has batches, and its last one's cursor, $16, commits with it). Every
        # commit moves the fence and ends any hold between batches: a holder paused between
        # its batches can commit none after this.
        fenced = (
            f"$15::bigint IS NULL OR EXISTS (SELECT FROM {s}.jobs WHERE namespace = $1 "
            "AND job_id = $2 AND fence = $15 AND busy_until > clock_timestamp())"
        )
        self.commit = f"""
WITH guard AS (
    SELECT now() = $9::timestamptz AS same_tx, {bounded("$10")} AS bounded,
        extract(epoch FROM greatest($3::timestamptz, $4::timestamptz)
            - greatest(clock_timestamp(), $14::timestamptz)) AS ahead,
        {fenced} AS fenced
), j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_slot, last_end, last_success_at,
        last_outcome, consecutive_failures, overdue_at, next_due, last_owner, updated_at,
        batch_cursor)
    SELECT $1, $2, $3, $4, $4, 'success', 0, $8, $12, $6, now(),
        CASE WHEN $17::int > 0 THEN $16::text::jsonb END FROM guard
    WHERE same_tx AND bounded AND ahead <= {FUTURE_LIMIT} AND fenced
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        last_slot = EXCLUDED.last_slot,
        last_end = GREATEST(j.last_end, EXCLUDED.last_end),
        last_success_at = EXCLUDED.last_success_at,
        last_outcome = 'success', consecutive_failures = 0,
        failed_slot = NULL, failed_attempts = 0,
        overdue_at = EXCLUDED.overdue_at, next_due = EXCLUDED.next_due,
        last_owner = EXCLUDED.last_owner, updated_at = now(),
        trigger_at = {served.format(m="$11")},
        batch_cursor = CASE WHEN $17 > 0 THEN EXCLUDED.batch_cursor ELSE j.batch_cursor END,
        fence = j.fence + 1, busy_until = NULL
    WHERE j.last_slot IS NULL OR j.last_slot < EXCLUDED.last_slot
    RETURNING 1
), r AS (
    INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner,
        report, manual, batches, capped)
    SELECT $1, $2, $3, $5, $4, 'success', $6, $7::text::jsonb, $11, $17, $18 FROM j
), c AS (
    INSERT INTO {s}.counts AS c (namespace, job_id, successes)
    SELECT $1, $2, 1 FROM j WHERE NOT $11 AND $20::boolean
    ON CONFLICT (namespace, job_id) DO UPDATE SET successes = c.successes + 1
), sealed AS (
    DELETE FROM {s}.seals WHERE seal = $19::bytea
)
SELECT (SELECT count(*) FROM j)::int, same_tx, bounded, ahead::float8,
    $13::boolean AND {PREPARED}, fenced FROM guard"""
        # A slot of a backfill ($9: the request, $10: its index) is its turn under the job's
        # lock; its commit records the run as backfilled by $11, moves the watermark only
        # forward and the backfill on, under the same checks as a tick's commit
        # ($3: the slot; unless the backfill reruns, a slot a run committed is not run)
        self.fill_turn = (
            f"SELECT EXISTS (SELECT FROM {s}.backfills AS b WHERE id = $1 AND done = $2 "
            f"AND finished_at IS NULL AND (rerun OR NOT EXISTS (SELECT FROM {s}.runs AS r "
            "WHERE r.namespace = b.namespace AND r.job_id = b.job_id AND r.slot = $3 "
            "AND r.outcome = 'success')))"
        )
        advance = (
            f"UPDATE {s}.backfills SET done = done + 1, finished_at = CASE "
            "WHEN done + 1 >= cardinality(slots) THEN now() END "
            "WHERE id = $9 AND done = $10 AND finished_at IS NULL"
        )
        self.fill_commit = f"""
WITH guard AS (
    SELECT now() = $12::timestamptz AS same_tx, {bounded("$13")} AS bounded,
        extract(epoch FROM $4::timestamptz - greatest(clock_timestamp(), $14::timestamptz))
            AS ahead
), p AS (
    {advance} AND (SELECT same_tx AND bounded AND ahead <= {FUTURE_LIMIT} FROM guard)
    RETURNING 1
), j AS (
    UPDATE {s}.jobs SET last_slot = $3, updated_at = now()
    WHERE namespace = $1 AND job_id = $2 AND (last_slot IS NULL OR last_slot < $3)
        AND EXISTS (SELECT FROM p)
), r AS (
    INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner,
        report, manual, batches, capped)
    SELECT $1, $2, $3, $5, $4, 'success', $6, $7::text::jsonb, false, $8, false FROM p
    RETURNING id
), b AS (
    INSERT INTO {s}.backfilled (run_id, request, who) SELECT id, $9, $11 FROM r
), sealed AS (
    DELETE FROM {s}.seals WHERE seal = $15::bytea
)
SELECT (SELECT count(*) FROM p)::int, same_tx, bounded, ahead::float8,
    $16::boolean AND {PREPARED} FROM guard"""
        # a slot of a backfill that did not commit: recorded, and the backfill goes on
        # (not after a shutdown, $13: the slot is left for the next replica)
        self.fill_failure = f"""
WITH p AS ({advance} AND $13::boolean RETURNING 1), r AS (
    INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner,
        error, manual, batches)
    VALUES ($1, $2, $3, $5, $4, $6, $7, $8, false, $12) RETURNING id
)
INSERT INTO {s}.backfilled (run_id, request, who) SELECT id, $9, $11 FROM r"""
        # A batch of a batched run commits its cursor under the job's lock and fence. The
        # first one ($5 IS NULL) takes the job: it moves the fence and holds the job until
        # the run's start on the database's clock plus its budget and a grace ($6 ms, see
        # .tick); a later one only if the fence is still its own ($5) and its hold has not
        # ended. $3: the cursor's JSON text; $4: the transaction's start; $7: the limits the
        # batch set; $8: the handler used the connection; $9: the batch's seal.
        batch_guard = f"SELECT now() = $4::timestamptz AS same_tx, {bounded('$7')} AS bounded"
        self.batch = f"""
WITH guard AS ({batch_guard}), first AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, batch_cursor, fence, busy_until)
    SELECT $1, $2, $3::text::jsonb, 1, now() + $6::int * interval '1 ms' FROM guard
    WHERE same_tx AND bounded AND $5::bigint IS NULL
    ON CONFLICT (namespace, job_id) DO UPDATE SET batch_cursor = EXCLUDED.batch_cursor,
        fence = j.fence + 1, busy_until = EXCLUDED.busy_until
    RETURNING j.fence
), later AS (
    UPDATE {s}.jobs SET batch_cursor = $3::text::jsonb
    WHERE namespace = $1 AND job_id = $2 AND fence = $5::bigint
        AND busy_until > clock_timestamp() AND (SELECT same_tx AND bounded FROM guard)
    RETURNING fence
), sealed AS (
    DELETE FROM {s}.seals WHERE seal = $9::bytea
)
SELECT coalesce((SELECT fence FROM first), (SELECT fence FROM later)), same_tx, bounded,
    $8::boolean AND {PREPARED} FROM guard"""
        # the start of a batch's transaction, and whether the run still holds the job ($3);
        # the seal of the batch's transaction ($4)
        self.batch_hold = (
            f"WITH seal AS (INSERT INTO {s}.seals (seal) VALUES ($4::bytea)) "
            "SELECT now(), EXISTS (SELECT FROM "
            f"{s}.jobs WHERE namespace = $1 AND job_id = $2 AND fence = $3 "
            "AND busy_until > clock_timestamp())"
        )
        # One statement per heartbeat: the replica's row (its job lists only when they
        # changed: NULL keeps them), the namespace's paused and triggered jobs, and the other
        # live replicas with when their job lists last changed.
        self.beat = f"""
WITH beat AS (
    INSERT INTO {s}.replicas AS r (namespace, owner, jobs, disabled, fingerprints, failing,
        tasks)
    VALUES ($1, $2, coalesce($3::text[], '{{}}'), coalesce($4::text[], '{{}}'),
        coalesce($6::text[], '{{}}'), coalesce($7::text[], '{{}}'),
        coalesce($10::text[], '{{}}'))
    ON CONFLICT (namespace, owner) DO UPDATE SET seen_at = now(),
        jobs = coalesce($3::text[], r.jobs), disabled = coalesce($4::text[], r.disabled),
        fingerprints = coalesce($6::text[], r.fingerprints),
        failing = coalesce($7::text[], r.failing), tasks = coalesce($10::text[], r.tasks),
        declared_at = CASE WHEN $3::text[] IS NULL THEN r.declared_at ELSE now() END,
        started_at = CASE WHEN $9::boolean THEN now() ELSE r.started_at END
    RETURNING xmax = 0 AS inserted, started_at, declared_at, jobs, disabled, tasks
), present AS (
    INSERT INTO {s}.presence AS p (namespace, owner, started_at, since, until, jobs, disabled,
        tasks)
    SELECT $1, $2, started_at, declared_at, now(), jobs, disabled, tasks FROM beat
    ON CONFLICT (namespace, owner, started_at, since) DO UPDATE SET until = now()
), pruned AS (
    DELETE FROM {s}.replicas WHERE namespace = $1 AND owner <> $2
        AND seen_at < now() - $8::float8 * interval '1 s'
), steered AS (
    SELECT job_id, paused_at, trigger_at FROM {s}.jobs
    WHERE namespace = $1 AND (paused_at IS NOT NULL OR trigger_at IS NOT NULL)
), fills AS (
    SELECT id, job_id FROM {s}.backfills WHERE namespace = $1 AND finished_at IS NULL
), live AS (
    SELECT owner, declared_at, seen_at FROM {s}.replicas
    WHERE namespace = $1 AND owner <> $2 AND seen_at > now() - $5::float8 * interval '1 s'
        AND seen_at > started_at
)
SELECT beat.inserted, beat.started_at, s.ids, s.paused, s.triggered, l.owners, l.declared,
    l.seen, f.fill_jobs, f.fill_ids, to_regclass({literal(s + ".runs")}) IS NOT NULL
        AND to_regclass({literal(s + ".schema_version")}) IS NOT NULL AS whole
FROM beat,
    (SELECT array_agg(job_id ORDER BY job_id) AS ids,
        array_agg(paused_at ORDER BY job_id) AS paused,
        array_agg(trigger_at ORDER BY job_id) AS triggered FROM steered) AS s,
    (SELECT array_agg(owner ORDER BY owner) AS owners,
        array_agg(declared_at ORDER BY owner) AS declared,
        array_agg(seen_at ORDER BY owner) AS seen FROM live) AS l,
    (SELECT array_agg(job_id ORDER BY id) AS fill_jobs, array_agg(id ORDER BY id) AS fill_ids
        FROM fills) AS f"""
        self.declared = (
            f"SELECT owner, jobs, fingerprints, failing, started_at, declared_at, tasks "
            f"FROM {s}.replicas WHERE namespace = $1 AND owner = ANY($2::text[])"
        )
        # a replica that leaves tells the others at once: they take over its jobs
        self.leave = (
            f"WITH gone AS (DELETE FROM {s}.replicas WHERE namespace = $1 AND owner = $2 "
            "RETURNING started_at, declared_at), "
            f"ended AS (UPDATE {s}.presence AS p SET until = now(), left_at = now() FROM gone "
            "WHERE p.namespace = $1 AND p.owner = $2 AND p.started_at = gone.started_at "
            "AND p.since = gone.declared_at) "
            "SELECT pg_notify($3, $4) FROM gone"
        )
        # A failure from a replica whose clock runs ahead is recorded, but it moves neither
        # the fixed delay nor the slot to retry: the healthy replicas go on running the job.
        sane = (
            "$4::timestamptz <= greatest(clock_timestamp(), $11::timestamptz) "
            f"+ interval '{FUTURE_LIMIT:g} s'"
        )
        stale = "j.last_slot >= $3"  # the failure of a slot already passed
        folded = ",\n        ".join(
            f"{column} = CASE WHEN {stale} THEN j.{column} ELSE {value} END"
            for column, value in (
                ("last_end", "GREATEST(j.last_end, EXCLUDED.last_end)"),
                (
                    "overdue_at",
                    "CASE WHEN j.last_end > EXCLUDED.last_end THEN j.overdue_at "
                    "ELSE EXCLUDED.overdue_at END",
                ),
                ("last_outcome", "EXCLUDED.last_outcome"),
                ("consecutive_failures", "j.consecutive_failures + 1"),
                (
                    "failed_attempts",
                    "CASE WHEN $9 THEN j.failed_attempts WHEN j.failed_slot = $3 "
                    "THEN j.failed_attempts + 1 ELSE 1 END",
                ),
                ("failed_slot", "CASE WHEN $9 THEN j.failed_slot ELSE $3 END"),
                ("next_due", "EXCLUDED.next_due"),
                ("last_owner", "EXCLUDED.last_owner"),
                ("last_error", "EXCLUDED.last_error"),
                ("updated_at", "now()"),
                ("busy_until", "CASE WHEN j.fence = $12::bigint THEN NULL ELSE j.busy_until END"),
            )
        )
        self.failure = f"""
WITH j AS (
    INSERT INTO {s}.jobs AS j (namespace, job_id, last_end, last_outcome,
        consecutive_failures, failed_slot, failed_attempts, next_due, last_owner, last_error,
        updated_at, overdue_at)
    SELECT $1, $2, $4, $6, 1, CASE WHEN $9::boolean THEN NULL ELSE $3::timestamptz END,
        CASE WHEN $9 THEN 0 ELSE 1 END, $10, $7, $8, now(), $14::timestamptz WHERE {sane}
    ON CONFLICT (namespace, job_id) DO UPDATE SET
        {folded},
        trigger_at = {served.format(m="$9")}
    -- a failure of a slot at or before the watermark (a later slot committed meanwhile)
    -- changes nothing but the trigger request a manual run served
    WHERE j.last_slot IS NULL OR j.last_slot < $3 OR ($9 AND j.trigger_at <= $3)
)
INSERT INTO {s}.runs (namespace, job_id, slot, started_at, finished_at, outcome, owner, error,
    manual, batches)
VALUES ($1, $2, $3, $5, $4, $6, $7, $8, $9, $13)"""


def resume(s: str) -> str:
    """Resume job ``$2`` of namespace ``$1`` (the time it spent paused does not count toward
    overdue): an operator's resume, and a pause's end (``s``: the quoted schema)."""
    return (
        f"UPDATE {s}.jobs SET paused_at = NULL, overdue_at = CASE WHEN paused_at IS NULL "
        "THEN overdue_at ELSE overdue_at + (now() - paused_at) END "
        "WHERE namespace = $1 AND job_id = $2"
    )


def audit(s: str) -> str:
    """Record an operation on job ``$2`` of namespace ``$1`` in the audit log."""
    return (
        f"INSERT INTO {s}.audit (namespace, job_id, action, who, note, changed) "
        "VALUES ($1, $2, $3, $4, $5, $6)"
    )


def _qualified(column: str) -> str:
    """A column of :attr:`Statements.load`'s list, of the table aliased ``j``."""
    return column.replace("(spec", "(j.spec") if column.startswith("(") else "j." + column


RESET = (
    "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; "
    "SET SESSION AUTHORIZATION DEFAULT; RESET ROLE; DISCARD TEMP; DISCARD SEQUENCES; "
)
"""Undoes the session state a handler can leave (RESET ALL keeps the role: reset apart)."""
PREPARED = "EXISTS (SELECT FROM pg_prepared_statements WHERE from_sql)"
"""Whether the session holds SQL prepared statements (``PREPARE``), which no reset can drop
without dropping asyncpg's own."""
LEFTOVERS = f"; SELECT 1 WHERE {PREPARED}"
"""After the reset: status ``SELECT 1`` when the handler left SQL prepared statements."""


DEADLINE_TAG = 1528065506
"""The first key of the lock that dates a tick's transaction: ``pg_advisory_xact_lock_shared(
DEADLINE_TAG, deadline)``, ``deadline`` the instant (unix seconds, as an unsigned 32-bit
value) after which the holder is past its server-side bound and another replica may end its
session. ``pg_locks`` shows it to every role, and a handler cannot release it (a
transaction-level lock lasts as long as its transaction)."""


SLOT_TAG = 1528065507
"""The first key of the lock that names the slot a tick of a job whose ``overlap`` is
"replace" runs: ``pg_advisory_xact_lock_shared(SLOT_TAG, slot)``, ``slot`` in unix seconds
(an unsigned 32-bit value). A tick for a newer slot ends the session of a holder whose slot
is older (see :func:`.begin.end_stale_holder`); one for the same slot never does."""


def bounded(limit: str) -> str:
    """Whether the server-side timeouts a tick or batch set (``limit``: the parameter of its
    ms) still hold: ``transaction_timeout`` where the server has it, else the other two."""
    within = f"::interval BETWEEN interval '1 ms' AND {limit}::int * interval '1 ms'"
    return (
        "CASE WHEN current_setting('transaction_timeout', true) IS NULL "
        f"THEN current_setting('statement_timeout'){within} "
        f"AND current_setting('idle_in_transaction_session_timeout'){within} "
        f"ELSE current_setting('transaction_timeout'){within} END"
    )
