"""The connections of PostgreSQL mode: asyncpg's pool, what a handler sees of a tick's
connection (``ctx.conn``), and recognising a transaction-mode pooler.

A tick ends its own transaction with a COMMIT or ROLLBACK that carries the session reset, so
the pool ticklock creates from a DSN resets nothing more when a connection comes back (its
``reset=`` does nothing; asyncpg still drops client-side listeners and rolls back an open
transaction itself). A pool the user passes keeps its own reset.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..._errors import StatementRefused
from .statements import transaction_control

if TYPE_CHECKING:
    import asyncpg

MAX_SIZE = 10
"""Connections of the pool ticklock creates: one per tick in flight, opened on demand."""
IDLE_SECONDS = 20.0
"""Seconds a connection of that pool stays open unused: a replica holds about the connections
its ticks used in the last 20 s (and its LISTEN one), whatever the number of its jobs, not the
most it ever had in flight at once. Longer than the 15 s between a listening replica's
heartbeats, so that its beats keep one connection open instead of opening one each."""
CONNECT_TIMEOUT = 5.0
"""Seconds a new connection may take (asyncpg's default, 60 s, would hold up an app's start
for a minute when the database's host accepts connections and never answers)."""

_PLAIN = frozenset(
    {
        "copy_from_query",
        "copy_from_table",
        "copy_records_to_table",
        "copy_to_table",
        "execute",
        "executemany",
        "fetch",
        "fetchmany",
        "fetchrow",
        "fetchval",
        "get_server_pid",
        "get_server_version",
        "get_settings",
        "is_closed",
        "is_in_transaction",
    }
)
"""Connection methods that leave nothing on the client side once they return. Any other
(``prepare``, ``cursor``, ``add_listener``, ``set_type_codec``, ...) can leave an object or a
callback bound to the connection, which no SQL reset removes: the connection is then closed
after the tick instead of reused, and what the handler kept fails with it."""


_SQL = {
    "copy_from_query": "query",
    "copy_records_to_table": "where",
    "copy_to_table": "where",
    "cursor": "query",
    "execute": "query",
    "executemany": "command",
    "fetch": "query",
    "fetchmany": "query",
    "fetchrow": "query",
    "fetchval": "query",
    "prepare": "query",
}
"""Connection methods that send SQL text of the caller's, and the parameter that holds it
(``where`` is keyword-only; the others come first)."""
_RESETS = re.compile(r"\b(DEALLOCATE|DISCARD)\b", re.IGNORECASE)
"""Statements that drop prepared statements, asyncpg's own among them (its client-side cache
would then name statements the session no longer has). Searched anywhere in the text, in
strings too: a ``DO`` block can run one with ``EXECUTE``."""
_ENDS_SESSION = frozenset({"close", "reset", "terminate"})
"""Connection methods that end the tick's transaction from the client (``reset`` sends a
``ROLLBACK``; the others end the session, and the lock with it)."""
_SHOWN = 200  # characters of a refused statement quoted in the error
_LOCAL = frozenset(
    {"get_server_pid", "get_server_version", "get_settings", "is_closed", "is_in_transaction"}
)
"""Connection methods that send nothing to the server."""
_COPY_WORDS = ("oids", "freeze", "header")
"""COPY options asyncpg writes into the statement as given, unquoted: only a bare word (a
bool, ``"match"``) is passed, so none can carry a statement of its own."""
_COPY_STRINGS = ("format", "delimiter", "null", "quote", "escape", "encoding")
"""COPY options asyncpg quotes as plain ``'...'`` literals, in which a backslash escapes the
quote when the session's ``standard_conforming_strings`` is off."""
_WORD = re.compile(r"[A-Za-z0-9_]+")


class ConnectionLease:
    """A tick's connection as its handler sees it (``ctx.conn``).

    Every attribute is the connection's until the tick ends; after that any use raises
    ``asyncpg.InterfaceError``, a bound method kept from the lease (``ctx.conn.execute``)
    included, so nothing kept past its tick can write into another tick's transaction.
    ``used`` says whether the handler touched the connection at all: if it did not, it can't
    have left session state behind, and the tick needs no reset. ``retire``: the handler
    used a method outside :data:`_PLAIN`; the connection is closed after the tick.

    The connection is already inside the tick's transaction, so :meth:`transaction` opens a
    savepoint of it, as asyncpg does for a nested transaction. Only ticklock ends that
    transaction: SQL text with a statement that would end or change it (``COMMIT``,
    ``ROLLBACK`` without ``TO``, ``BEGIN``, ..., see :mod:`.statements`), COPY options that
    asyncpg would write into its statement unquoted (``header=``, ``oids=``, ``freeze=``)
    unless they are bare words, and ``close()``, ``terminate()`` and ``reset()``, raise
    :class:`StatementRefused` before anything is sent; so does every use that would send
    something once the transaction is no longer open on the server (a COMMIT or ROLLBACK
    that reached it by another route: the seal of :mod:`.tick` makes such a COMMIT fail).
    """

    __slots__ = ("_con", "_savepoints", "retire", "used")

    def __init__(self, con: asyncpg.Connection[Any]) -> None:
        self._con: asyncpg.Connection[Any] | None = con
        self._savepoints = 0
        self.used = False
        self.retire = False

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lent(name), name)
        self.used = True
        if name not in _PLAIN:
            self.retire = True
        if not callable(value):
            return value

        def lent(*args: Any, **kwargs: Any) -> Any:
            con = self._lent(name)  # raises once the tick has ended
            if name in _ENDS_SESSION:
                raise StatementRefused(
                    f"ctx.conn.{name}() would end the tick's transaction, which holds the job's "
                    "lock and carries its writes: refused. The connection is ticklock's until "
                    "the handler returns"
                )
            if name not in _LOCAL:
                self._open(con, name)
            if name.startswith("copy_"):
                _refuse_copy_options(con, name, kwargs)
            sql = _sql_of(name, args, kwargs)
            if sql is not None:
                _refuse_transaction_control(con, name, sql)
                if _RESETS.search(sql):
                    self.retire = True  # it may drop asyncpg's own prepared statements
            result = value(*args, **kwargs)
            # asyncpg's methods send their statement when awaited: check again then
            return self._guard(name, result) if inspect.iscoroutine(result) else result

        return lent

    async def _guard(self, name: str, statement: Coroutine[Any, Any, Any]) -> Any:
        try:
            self._open(self._lent(name), name)
        except BaseException:
            statement.close()
            raise
        return await statement

    def _open(self, con: asyncpg.Connection[Any], name: str) -> None:
        """Refuse to send anything once the tick's transaction is no longer open on the
        server (a COMMIT or ROLLBACK reached it by a route this lease could not see, or the
        server ended it): what would follow would not run under the job's lock."""
        if not con.is_in_transaction():
            raise StatementRefused(
                f"ctx.conn.{name}(): the tick's transaction has ended (a COMMIT or ROLLBACK "
                "reached the server, or the server ended the transaction), and the job's lock "
                "with it: refused, nothing more of this run reaches the database, and the "
                "run does not commit"
            )

    def _lent(self, name: str) -> asyncpg.Connection[Any]:
        con = self._con
        if con is None:
            import asyncpg

            raise asyncpg.InterfaceError(
                f"cannot use Connection.{name}: the tick that lent this connection (ctx.conn) "
                "has ended; use it only inside the handler"
            )
        return con

    def transaction(
        self, *, isolation: str | None = None, readonly: bool = False, deferrable: bool = False
    ) -> Savepoint:
        """A savepoint of the tick's transaction: ``async with ctx.conn.transaction(): ...``
        releases it on success and rolls back to it on an exception; everything still commits
        with the tick, or not at all."""
        self._lent("transaction")
        self.used = True
        if isolation is not None or readonly or deferrable:
            import asyncpg

            raise asyncpg.InterfaceError(
                "ctx.conn.transaction(): inside the tick's transaction it is a savepoint, "
                "which takes no isolation, readonly or deferrable option"
            )
        self._savepoints += 1
        return Savepoint(self, f"ticklock_savepoint_{self._savepoints}")

    def end(self) -> None:
        """Take the connection back: from now on every use raises."""
        self._con = None

    def __repr__(self) -> str:
        state = "ended" if self._con is None else repr(self._con)
        return f"<ticklock.ConnectionLease {state}>"


def _sql_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The SQL text a call of the connection method ``name`` sends, if it takes one."""
    parameter = _SQL.get(name)
    if parameter is None:
        return None
    text = args[0] if args and parameter != "where" else kwargs.get(parameter)
    return text if isinstance(text, str) else None


def _refuse_copy_options(con: asyncpg.Connection[Any], name: str, options: dict[str, Any]) -> None:
    """Raise :class:`StatementRefused` if a COPY option of ``options`` could end asyncpg's
    COPY statement early (and carry one of its own, a COMMIT say): one it writes in unquoted
    that is not a bare word, or, while ``standard_conforming_strings`` is off, one it quotes
    that holds a backslash."""
    standard = con.get_settings().standard_conforming_strings != "off"
    for option in _COPY_WORDS:
        value = options.get(option)
        if value is not None and not _WORD.fullmatch(str(value)):
            raise StatementRefused(
                f"ctx.conn.{name}(): {option}={value!r} is written into the COPY statement "
                f"as it is, so it could end the statement and run another: refused before "
                f"it reached the server. Give {option} a bool"
            )
    for option in () if standard else _COPY_STRINGS:
        value = options.get(option)
        if isinstance(value, str) and "\\" in value:
            raise StatementRefused(
                f"ctx.conn.{name}(): {option}={value!r} holds a backslash, which with "
                "standard_conforming_strings off could end its literal in the COPY "
                "statement: refused before it reached the server"
            )


def _refuse_transaction_control(con: asyncpg.Connection[Any], name: str, sql: str) -> None:
    """Raise :class:`StatementRefused` if a statement of ``sql`` would end or change the
    tick's transaction (:func:`.statements.transaction_control`), read as the session reads
    strings now."""
    standard = con.get_settings().standard_conforming_strings != "off"
    statement = transaction_control(sql, standard_strings=standard)
    if statement is None:
        return
    text = statement.text
    shown = repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")
    hint = (
        " (the END of a CREATE FUNCTION ... BEGIN ATOMIC body reads as a statement here: "
        "write the body as AS $$ ... $$)"
        if statement.words[:1] == ("END",)
        else ""
    )
    raise StatementRefused(
        f"ctx.conn.{name}(): {shown} would end or change the tick's transaction, which holds "
        f"the job's lock and carries its writes{hint}: refused before it reached the server. "
        "ticklock commits the handler's writes with the slot when it returns; for a partial "
        "rollback use 'async with ctx.conn.transaction()' (a savepoint)"
    )


class Savepoint:
    """A savepoint of a tick's transaction, used like an asyncpg transaction."""

    __slots__ = ("_lease", "_name")

    def __init__(self, lease: ConnectionLease, name: str) -> None:
        self._lease = lease  # through the lease: a savepoint kept past its tick fails too
        self._name = name

    def _con(self) -> asyncpg.Connection[Any]:
        con = self._lease._lent("transaction")
        self._lease._open(con, "transaction")
        return con

    async def start(self) -> None:
        """Set the savepoint."""
        await self._con().execute(f"SAVEPOINT {self._name}")

    async def commit(self) -> None:
        """Release the savepoint: its work stays, to commit with the tick."""
        await self._con().execute(f"RELEASE SAVEPOINT {self._name}")

    async def rollback(self) -> None:
        """Undo the work since the savepoint (and release it)."""
        await self._con().execute(
            f"ROLLBACK TO SAVEPOINT {self._name}; RELEASE SAVEPOINT {self._name}"
        )

    async def __aenter__(self) -> Savepoint:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            await self.commit()
        elif issubclass(exc_type, Exception):
            await self.rollback()
        # cancelled (a timeout, shutdown): the whole tick rolls back; nothing to send


async def connect(
    dsn: str | None, unnamed: bool | None = None, **options: Any
) -> tuple[asyncpg.Connection[Any], bool]:
    """Connect to ``dsn``; return the connection and whether it uses unnamed statements.

    Behind a transaction-mode pooler (PgBouncer, say) consecutive transactions may reach
    different server sessions, so asyncpg's named prepared statements fail ("already exists",
    "does not exist"). A pooler answers the start-up with a process id of its own, which
    ``pg_backend_pid()`` on the server does not match: then the connection is made again with
    asyncpg's statement cache off (each statement is prepared unnamed, one more round trip).
    ``unnamed``: the answer from an earlier connection to the same DSN (``None``: find out).
    ``options`` go to ``asyncpg.connect``.
    """
    import asyncpg

    options.setdefault("timeout", CONNECT_TIMEOUT)
    if unnamed is None:
        con = await asyncpg.connect(dsn, **options)
        # a simple query (no statement to prepare): "SELECT 1" when the pids match
        status = await con.execute(f"SELECT 1 WHERE pg_backend_pid() = {con.get_server_pid()}")
        if status == "SELECT 1":
            return con, False
        con.terminate()
    elif not unnamed:
        return await asyncpg.connect(dsn, **options), False
    return await asyncpg.connect(dsn, statement_cache_size=0, **options), True


class Pooler:
    """What the first connection of a pool found: ``unnamed`` is true behind a transaction-mode
    pooler (statements are prepared unnamed), ``None`` until a connection was made."""

    __slots__ = ("unnamed",)

    def __init__(self) -> None:
        self.unnamed: bool | None = None


async def create_pool(dsn: str | None, pooler: Pooler) -> asyncpg.Pool[Any]:
    """asyncpg's pool for ``Scheduler(dsn)``: no connection until one is needed (the database
    may be down at start), pooler detection on the first (into ``pooler``), and no reset of
    its own."""
    import asyncpg

    async def connect_one(*args: Any, **options: Any) -> asyncpg.Connection[Any]:
        con, pooler.unnamed = await connect(dsn, pooler.unnamed, **options)
        return con

    return await asyncpg.create_pool(
        dsn,
        min_size=0,
        max_size=MAX_SIZE,
        max_inactive_connection_lifetime=IDLE_SECONDS,
        connect=connect_one,
        reset=_reset_by_the_tick,
    )


async def _reset_by_the_tick(con: asyncpg.Connection[Any]) -> None:
    """Nothing: a tick resets the session with its COMMIT or ROLLBACK, and ticklock's own
    statements outside a tick leave no session state."""
