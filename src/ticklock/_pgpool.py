"""The connections ticklock opens itself from a DSN: a small pool whose release does not wait.

A tick ends its own transaction with a COMMIT or ROLLBACK that carries the session reset, so
its connection comes back clean and can go straight back on the idle stack. asyncpg's
``Pool.release`` would run a task under ``asyncio.shield`` (two more passes of the event
loop) and a reset of its own on every tick; a pool the user passes keeps that behaviour.

Idle connections are reused last-in first-out, so a quiet scheduler keeps using the same one;
those that stay unused for :data:`MAX_IDLE` seconds are closed when a later one comes back,
and a connection older than :data:`MAX_LIFETIME` is closed when it comes back (a server
process's caches grow with what its sessions touched; asyncpg's pool recycles a connection
after 50,000 queries for the same reason).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    import asyncpg

    _Base = object
else:
    import asyncpg.connection

    # Lets isinstance(lease, asyncpg.Connection) hold, as it does for asyncpg's pool proxy.
    _Base = getattr(asyncpg.connection, "_ConnectionProxy", object)

MAX_IDLE = 300.0
"""Seconds an idle connection (other than the most recently used) is kept open."""
MAX_LIFETIME = 3600.0
"""Seconds after which a connection is closed when it comes back, and a new one opened."""
CLOSE_TIMEOUT = 5.0
"""Seconds a graceful close may take before the connection is dropped."""
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


class ConnectionLease(_Base):
    """A tick's connection as its handler sees it (``ctx.conn``).

    Every attribute is the connection's until the tick ends; after that any use raises
    ``asyncpg.InterfaceError``, a bound method kept from the lease (``ctx.conn.execute``)
    included, so nothing kept past its tick can write into another tick's transaction.
    ``used`` says whether the handler touched the connection at all: if it did not, it can't
    have left session state behind, and the tick needs no reset. ``retire``: the handler
    used a method outside :data:`_PLAIN`; the connection is closed after the tick.

    The connection is already inside the tick's transaction, so :meth:`transaction` opens a
    savepoint of it, as asyncpg does for a nested transaction.
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
            self._lent(name)  # raises once the tick has ended
            return value(*args, **kwargs)

        return lent

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


class Savepoint:
    """A savepoint of a tick's transaction, used like an asyncpg transaction."""

    __slots__ = ("_lease", "_name")

    def __init__(self, lease: ConnectionLease, name: str) -> None:
        self._lease = lease  # through the lease: a savepoint kept past its tick fails too
        self._name = name

    async def start(self) -> None:
        """Set the savepoint."""
        await self._lease._lent("transaction").execute(f"SAVEPOINT {self._name}")

    async def commit(self) -> None:
        """Release the savepoint: its work stays, to commit with the tick."""
        await self._lease._lent("transaction").execute(f"RELEASE SAVEPOINT {self._name}")

    async def rollback(self) -> None:
        """Undo the work since the savepoint (and release it)."""
        await self._lease._lent("transaction").execute(
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


class ConnectionPool:
    """Up to ``max_size`` connections to ``dsn``, opened on demand and reused."""

    def __init__(self, dsn: str | None, max_size: int) -> None:
        self._dsn = dsn
        self._slots = anyio.Semaphore(max_size)
        self._idle: list[tuple[asyncpg.Connection[Any], float]] = []  # (conn, idle since)
        self._opened: dict[asyncpg.Connection[Any], float] = {}  # conn: when it was opened
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self._unnamed: bool | None = None  # unnamed statements (behind a pooler); None: unknown

    async def acquire(self) -> asyncpg.Connection[Any]:
        """An idle connection, or a new one; waits while ``max_size`` are in use."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            await self._slots.acquire()
        try:
            while self._idle:
                con = self._idle.pop()[0]
                if not con.is_closed():
                    return con
                self._opened.pop(con, None)  # closed while idle (a server restart, say)
            con, self._unnamed = await connect(self._dsn, self._unnamed)
            self._opened[con] = time.monotonic()
            return con
        except BaseException:
            self._slots.release()
            raise

    def release(self, con: asyncpg.Connection[Any], clean: bool) -> None:
        """Give ``con`` back. ``clean``: no transaction is open and the session was reset;
        otherwise the connection is dropped (closed, if the pool is closed)."""
        self._slots.release()
        if not clean or con.is_closed():
            self._opened.pop(con, None)
            con.terminate()
            return
        now = time.monotonic()
        if self._closed or now - self._opened.get(con, now) > MAX_LIFETIME:
            self._retire(con)
            return
        idle = self._idle
        while idle and now - idle[0][1] > MAX_IDLE:  # the oldest idle at the bottom
            self._retire(idle.pop(0)[0])
        idle.append((con, now))

    def _retire(self, con: asyncpg.Connection[Any]) -> None:
        """Close ``con`` gracefully, in the background."""
        self._opened.pop(con, None)
        task = asyncio.get_running_loop().create_task(_close(con))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the idle connections gracefully (within :data:`CLOSE_TIMEOUT`); those in use
        are closed when they come back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for con, _ in idle:
            self._retire(con)
        if self._closing:
            with anyio.CancelScope(shield=True):
                await asyncio.wait(set(self._closing))


async def _close(con: asyncpg.Connection[Any]) -> None:
    try:
        await con.close(timeout=CLOSE_TIMEOUT)
    except Exception:  # broken already, or too slow: drop it
        con.terminate()


async def connect(
    dsn: str | None, unnamed: bool | None = None
) -> tuple[asyncpg.Connection[Any], bool]:
    """Connect to ``dsn``; return the connection and whether it uses unnamed statements.

    Behind a transaction-mode pooler (PgBouncer, say) consecutive transactions may reach
    different server sessions, so asyncpg's named prepared statements fail ("already exists",
    "does not exist"). A pooler answers the start-up with a process id of its own, which
    ``pg_backend_pid()`` on the server does not match: then the connection is made again with
    asyncpg's statement cache off (each statement is prepared unnamed, one more round trip).
    ``unnamed``: the answer from an earlier connection to the same DSN (``None``: find out).
    """
    import asyncpg

    if unnamed is None:
        con = await asyncpg.connect(dsn)
        # a simple query (no statement to prepare): "SELECT 1" when the pids match
        status = await con.execute(f"SELECT 1 WHERE pg_backend_pid() = {con.get_server_pid()}")
        if status == "SELECT 1":
            return con, False
        con.terminate()
    elif not unnamed:
        return await asyncpg.connect(dsn), False
    return await asyncpg.connect(dsn, statement_cache_size=0), True
