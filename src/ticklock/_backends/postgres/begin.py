"""A tick's own statements: its first query (BEGIN, the server-side timeouts, the check that
its slot is not in the database's future, the job's locks), a later batch's, ticklock's sealed
COMMIT, and the end of a holder past its deadline. Every value inlined is ticklock's own (ints,
its timestamps, a hex token): the statements go as one simple query, as transaction-mode
poolers need."""

from __future__ import annotations

import enum
from datetime import datetime

from ..seam import FUTURE_LIMIT
from .schema import SEAL_SETTING
from .sql import DEADLINE_TAG, SLOT_TAG


def sealed_commit(token: str) -> str:
    """ticklock's own COMMIT of a tick's (or batch's) transaction: the one that sets the
    token whose SHA-256 is the transaction's seal (see :mod:`.schema`), so the seal's trigger
    lets it commit. ``token`` is ticklock's own hex text: safe to inline."""
    if not token.isalnum():
        raise ValueError(f"a hex token is needed, got {token!r}")
    return f"SET LOCAL {SEAL_SETTING} = '{token}'; COMMIT"


class Begun(enum.IntEnum):
    """What a tick's first query found, as the row count of its status tag (``SELECT n``)."""

    HELD = 0
    """Another session holds the job's lock."""
    ACQUIRED = 1
    """The lock is this tick's."""
    AHEAD = 2
    """The slot lies in the database's future: refused, the lock not tried."""


class Holder(enum.IntEnum):
    """What :func:`end_stale_holder` did, as the row count of its status tag."""

    LIVE = 0
    """No ticklock holder past its deadline (or none at all any more)."""
    ENDED = 1
    """The holder was past its deadline: its session was ended."""
    REFUSED = 2
    """The holder is past its deadline, and this role may not end its session: it is not a
    member of the holder's role, nor of ``pg_signal_backend``."""
    SUPERUSER = 3
    """The holder is past its deadline and runs as a superuser, which only a superuser may
    end."""


def unix32(at: datetime) -> int:
    """``at`` in whole unix seconds as the unsigned 32-bit value ``pg_locks`` shows of an
    advisory lock's second int4 key."""
    return int(at.timestamp()) % 2**32


def _int4(value: int) -> int:
    """An unsigned 32-bit value as the int4 whose bits it is."""
    return (value + 2**31) % 2**32 - 2**31


def locks(
    key: int, legacy: int, limit_ms: int, grace_ms: int, *, wait: bool, slot: datetime | None = None
) -> str:
    """The SQL expression that takes a tick's locks: ``key`` (the job's key in this
    installation, :func:`ticklock.lock_key` with its schema) exclusively, ``legacy`` (the key
    without a schema, which earlier releases take exclusively) in shared mode, and the
    deadline lock (:data:`DEADLINE_TAG`): the transaction's start plus ``limit_ms`` (its
    server-side bound) and ``grace_ms``, in whole seconds (rounded down, so never more than
    ``grace_ms`` past the bound). ``wait``: wait for the locks (``pg_advisory_xact_lock``,
    bounded by the transaction's ``lock_timeout``) and return them, else try them and return
    whether the job's were taken (the deadline lock is taken only then). ``slot``: the slot
    lock (:data:`SLOT_TAG`) of a job whose ``overlap`` is "replace", taken with the deadline
    lock. The keys are ints: safe to inline."""
    deadline = f"floor(extract(epoch FROM now()) + {(limit_ms + grace_ms) / 1000!r})::int8"
    dated = f"(({deadline} + 2147483648) % 4294967296 - 2147483648)::int4"
    slot_key = None if slot is None else _int4(unix32(slot))
    named = (
        ""
        if slot_key is None
        else f" AND pg_try_advisory_xact_lock_shared({SLOT_TAG}, {slot_key}) IS NOT NULL"
    )
    if wait:
        return (
            f"pg_advisory_xact_lock({key}), pg_advisory_xact_lock_shared({legacy}), "
            f"pg_advisory_xact_lock_shared({DEADLINE_TAG}, {dated})"
            + (
                ""
                if slot_key is None
                else f", pg_advisory_xact_lock_shared({SLOT_TAG}, {slot_key})"
            )
        )
    return (
        f"pg_try_advisory_xact_lock({key}) AND pg_try_advisory_xact_lock_shared({legacy}) "
        f"AND pg_try_advisory_xact_lock_shared({DEADLINE_TAG}, {dated}) IS NOT NULL{named}"
    )


def _limits(limit_ms: int, *, transaction_timeout: bool) -> str:
    """The server-side timeouts of a tick or batch: ``transaction_timeout`` on PostgreSQL 17+
    (it bounds the transaction idle or busy), else the other two."""
    if transaction_timeout:
        return f"SET LOCAL transaction_timeout = {limit_ms}; "
    return (
        f"SET LOCAL statement_timeout = {limit_ms}; "
        f"SET LOCAL idle_in_transaction_session_timeout = {limit_ms}; "
    )


def begin_batch(
    key: int,
    legacy: int,
    limit_ms: int,
    grace_ms: int,
    *,
    transaction_timeout: bool,
    slot: datetime | None = None,
) -> str:
    """A later batch's first query: BEGIN, the server-side timeouts from what is left of the
    run's budget, and the job's locks (see :func:`locks`), waited for up to
    :data:`BATCH_LOCK_WAIT_MS` (a rival's attempt holds them a moment to read the job's state,
    and finds the job held between batches)."""
    limits = _limits(limit_ms, transaction_timeout=transaction_timeout)
    wait = min(limit_ms, BATCH_LOCK_WAIT_MS)
    taken = locks(key, legacy, limit_ms, grace_ms, wait=True, slot=slot)
    return f"BEGIN; {limits}SET LOCAL lock_timeout = {wait}; SELECT {taken}"


BATCH_LOCK_WAIT_MS = 5000
"""How long a later batch waits for the job's lock before its run gives up."""


def timestamp(value: datetime) -> str:
    """``value`` (aware) as a ``timestamptz`` literal: ticklock's own value, safe to inline."""
    if value.utcoffset() is None:
        raise ValueError(f"an aware datetime is needed, got {value!r}")
    return f"'{value.isoformat()}'::timestamptz"


def begin(
    key: int,
    legacy: int,
    limit_ms: int,
    grace_ms: int,
    *,
    transaction_timeout: bool,
    at: datetime,
    anchor: datetime | None,
    slot: datetime | None = None,
) -> str:
    """A tick's first query: BEGIN, the server-side timeouts (``transaction_timeout`` on
    PostgreSQL 17+, which bounds the transaction idle or busy; the other two before), the
    future check and the locks (see :func:`locks`). Its status tag is a :class:`Begun` (a held
    lock raises no error, so the server logs nothing).

    ``at`` (the slot, or the tick's start if later) more than ``FUTURE_LIMIT`` seconds beyond
    ``greatest(clock_timestamp(), anchor)`` (see :class:`.database.DatabaseTime`) is refused
    before the lock is tried, and so before the handler could start. ``key`` is an int and
    the timestamps are ticklock's own (:func:`timestamp`): safe to inline. ``slot``: the
    slot a tick of a job whose ``overlap`` is "replace" runs (its lock, see :func:`locks`).
    """
    limits = _limits(limit_ms, transaction_timeout=transaction_timeout)
    reference = "clock_timestamp()" if anchor is None else f"{timestamp(anchor)}, clock_timestamp()"
    taken = locks(key, legacy, limit_ms, grace_ms, wait=False, slot=slot)
    # OFFSET 0: the check is evaluated once, and before the lock is tried
    return (
        f"BEGIN; {limits}SELECT 1 FROM (SELECT {timestamp(at)} > greatest({reference}) + "
        f"interval '{FUTURE_LIMIT:g} s' AS ahead OFFSET 0) AS c, generate_series(1, CASE "
        f"WHEN c.ahead THEN {Begun.AHEAD:d} WHEN {taken} "
        f"THEN {Begun.ACQUIRED:d} ELSE {Begun.HELD:d} END)"
    )


def end_stale_holder(key: int, wait_ms: int | None, replacing: datetime | None = None) -> str:
    """End the session of the holder of lock ``key`` (the job's key in this installation) if
    it is a tick of ticklock's past its deadline, or (``replacing``: the slot of a job whose
    ``overlap`` is "replace") the tick of an older slot (its slot lock, :data:`SLOT_TAG`),
    waiting up to ``wait_ms`` for it to go (``None``: PostgreSQL before 14, no wait). Its
    status tag is a :class:`Holder`.

    Everything the judge reads is visible to every role: the holder is found through
    ``pg_locks`` (an advisory lock on an int8 key has the key's high and low 32 bits as
    ``classid`` and ``objid``, and ``objsubid`` 1), its deadline is the second key of the
    deadline lock it holds (:data:`DEADLINE_TAG`, ``objsubid`` 2; the earliest, should there be
    more), and its role is ``pg_stat_activity.usesysid`` (``xact_start`` and ``state`` are
    hidden from other roles without ``pg_read_all_stats``; the session's user is not). A
    session that holds the key without a deadline lock is not a ticklock tick: never ended.
    Only a session this role may end is ended, by the server's own rule (a role with the
    privileges of the holder's role or of ``pg_signal_backend``; a superuser for a superuser's
    session), so the statement never fails on privileges.
    """
    hi, lo = (key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF
    end = f"pg_terminate_backend(s.pid, {wait_ms})" if wait_ms else "pg_terminate_backend(s.pid)"
    here = "(SELECT oid FROM pg_database WHERE datname = current_database())"
    superuser = "(SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
    signal = "(pg_has_role(a.usesysid, 'USAGE') OR pg_has_role('pg_signal_backend', 'USAGE'))"
    older = (
        ""
        if replacing is None
        else f""" OR EXISTS (SELECT FROM pg_locks AS o
                    WHERE o.pid = k.pid AND o.locktype = 'advisory' AND o.granted
                        AND o.objsubid = 2 AND o.classid = {SLOT_TAG} AND o.database = {here}
                        AND o.objid::int8 < {unix32(replacing)})"""
    )
    # OFFSET 0: each holder is judged, then ended, once
    return f"""SELECT 1 FROM generate_series(1, (
    SELECT CASE WHEN bool_or(h.ended) THEN {Holder.ENDED:d}
        WHEN bool_or(h.superuser) THEN {Holder.SUPERUSER:d}
        WHEN count(*) > 0 AND NOT bool_or(h.may) THEN {Holder.REFUSED:d}
        ELSE {Holder.LIVE:d} END
    FROM (SELECT s.may, s.superuser, CASE WHEN s.may THEN {end} ELSE false END AS ended
        FROM (SELECT k.pid, r.rolsuper AND NOT {superuser} AS superuser,
                {signal} AND (NOT r.rolsuper OR {superuser}) AS may
            FROM pg_locks AS k JOIN pg_stat_activity AS a ON a.pid = k.pid
            JOIN pg_roles AS r ON r.oid = a.usesysid
            WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 1
                AND k.classid = {hi} AND k.objid = {lo} AND k.pid <> pg_backend_pid()
                AND k.database = {here}
                AND (extract(epoch FROM clock_timestamp()) > (
                    SELECT min(m.objid::int8) FROM pg_locks AS m
                    WHERE m.pid = k.pid AND m.locktype = 'advisory' AND m.granted
                        AND m.objsubid = 2 AND m.classid = {DEADLINE_TAG}
                        AND m.database = {here}){older})
            OFFSET 0) AS s
        OFFSET 0) AS h))"""
