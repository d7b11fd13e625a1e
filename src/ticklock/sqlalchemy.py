"""SQLAlchemy 2.0 (asyncio) inside the tick's transaction: :func:`session` and :func:`connection`.

Install with ``pip install 'ticklock[sqlalchemy]'``. Each helper is an async context manager
that gives, for one tick, an ``AsyncSession`` or an ``AsyncConnection`` whose every statement
runs on the tick's own connection (``ctx.db``), inside the transaction that holds the job's
lock, so that its writes commit with the watermark or not at all::

    from ticklock import sqlalchemy as tick_sa

    @scheduler.job(every(minutes=15), id="purge-expired", timeout=60)
    async def purge(ctx: JobContext) -> None:
        async with tick_sa.session(ctx) as session:
            await session.execute(delete(Key).where(Key.expires_at < func.now()))

How it works, in SQLAlchemy's public terms: a small engine per block, made with
``create_async_engine("postgresql+asyncpg://", async_creator=...)`` and a ``StaticPool``,
whose one connection is a handle on ``ctx.db``. ``ctx.db`` opens a savepoint where asyncpg
would begin a transaction (it is already inside the tick's), so SQLAlchemy's transactions are
savepoints of the tick: ``commit()`` releases one (its writes stay, to commit with the tick),
``rollback()`` rolls back to it (the tick goes on). Closing the handle, as SQLAlchemy does when
it discards a connection, never closes the tick's connection. When the block ends the handle is
cut off, and nothing of SQLAlchemy's holds the tick's connection any more: a session or
connection used after its block raises :class:`~ticklock.SchedulerStateError`.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from ._errors import SchedulerStateError
from ._schedule.job import JobContext

if TYPE_CHECKING:
    import asyncpg
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

__all__ = ("connection", "session")

CLEANUP_SECONDS = 5.0
"""Seconds the cleanup of a cancelled block may take (it sends nothing to the server)."""


@asynccontextmanager
async def session(ctx: JobContext, **options: Any) -> AsyncIterator[AsyncSession]:
    """An ``AsyncSession`` on the tick's transaction, for the ``async with`` block.

    Leaving the block normally commits the session; an exception rolls it back. A commit,
    there or through ``session.commit()``, releases a savepoint of the tick's transaction: the
    writes then commit with the tick's watermark, or roll back with the tick (a failure, a
    timeout). ``session.rollback()`` undoes what the session wrote since its last commit and
    the tick goes on. ``options`` go to ``AsyncSession`` (``expire_on_commit`` is ``False``
    unless given: a commit here ends no transaction)::

        async with ticklock.sqlalchemy.session(ctx) as session:
            session.add(Report(slot=ctx.slot))
    """
    _require()
    from sqlalchemy.ext.asyncio import AsyncSession

    if "bind" in options or "binds" in options:
        raise TypeError("ticklock.sqlalchemy.session(): the session's bind is the tick's")
    options.setdefault("expire_on_commit", False)
    async with _engine(ctx, "session") as engine:
        it = AsyncSession(bind=engine, **options)
        try:
            yield it
            await it.commit()
        except Exception:
            await it.close()  # rolls back what the session has not committed
            raise
        except BaseException:  # cancelled: the whole tick rolls back; send nothing
            with anyio.move_on_after(CLEANUP_SECONDS, shield=True):
                await it.invalidate()
            raise
        await it.close()


@asynccontextmanager
async def connection(ctx: JobContext) -> AsyncIterator[AsyncConnection]:
    """An ``AsyncConnection`` (SQLAlchemy Core) on the tick's transaction, for the
    ``async with`` block, which begins its transaction on first use (a savepoint of the
    tick's). Leaving the block normally commits it; an exception rolls it back. Its
    ``commit()`` and ``rollback()`` act on that savepoint only, as :func:`session` says::

        async with ticklock.sqlalchemy.connection(ctx) as conn:
            await conn.execute(insert(audit).values(slot=ctx.slot))
    """
    async with _engine(ctx, "connection") as engine:
        conn = await engine.connect()
        try:
            yield conn
            await conn.commit()
        except Exception:
            await conn.close()  # rolls back what it has not committed
            raise
        except BaseException:
            with anyio.move_on_after(CLEANUP_SECONDS, shield=True):
                await conn.invalidate()
            raise
        await conn.close()


@asynccontextmanager
async def _engine(ctx: JobContext, helper: str) -> AsyncIterator[AsyncEngine]:
    """A throwaway engine whose one connection is a :class:`_Handle` on the tick's."""
    _require()
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.pool import StaticPool

    if not isinstance(ctx, JobContext):
        raise TypeError(
            f"ticklock.sqlalchemy.{helper}(ctx): ctx must be the handler's JobContext, got {ctx!r}"
        )
    if ctx.conn is None:
        raise SchedulerStateError(
            f"job {ctx.job_id!r}: ticklock.sqlalchemy.{helper}() binds to the tick's "
            "PostgreSQL transaction, and this run has none: the scheduler is in local mode "
            "(no dsn or pool). Give the Scheduler a dsn"
        )
    handle = _Handle(ctx.conn, ctx.job_id, helper)

    async def lend() -> Any:
        return handle

    engine = create_async_engine("postgresql+asyncpg://", async_creator=lend, poolclass=StaticPool)
    try:
        yield engine
    finally:
        handle.cut()  # whatever SQLAlchemy kept of it fails from now on


class _Handle:
    """What SQLAlchemy gets as its asyncpg connection: the tick's (``ctx.db``, and so its
    checks), until the block ends. ``close()`` and ``terminate()``, which SQLAlchemy calls
    when it discards a connection, only let go of it: the tick's connection is ticklock's."""

    __slots__ = ("_conn", "_helper", "_job_id")

    def __init__(self, conn: asyncpg.Connection[Any], job_id: str, helper: str) -> None:
        self._conn: asyncpg.Connection[Any] | None = conn
        self._job_id = job_id
        self._helper = helper

    def __getattr__(self, name: str) -> Any:
        conn = self._conn
        if conn is None:
            raise SchedulerStateError(
                f"job {self._job_id!r}: this SQLAlchemy {self._helper} was bound to one tick "
                f"by ticklock.sqlalchemy.{self._helper}(ctx), and its 'async with' block has "
                f"ended: use it only inside the block, and open a new one in each run"
            )
        return getattr(conn, name)

    def transaction(
        self, *, isolation: str | None = None, readonly: bool = False, deferrable: bool = False
    ) -> Any:
        """A savepoint of the tick's transaction, where SQLAlchemy begins one. SQLAlchemy 2.0
        names its default level, read committed, for every transaction: a savepoint has the
        tick's level, and any other option is refused (by ``ctx.db``)."""
        if isolation == "read_committed":
            isolation = None
        return self.__getattr__("transaction")(
            isolation=isolation, readonly=readonly, deferrable=deferrable
        )

    def is_closed(self) -> bool:
        """Whether SQLAlchemy may still use it (asyncpg's ``Connection.is_closed``)."""
        return self._conn is None or self._conn.is_closed()

    async def close(self, *, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Let go of the tick's connection (never closes it)."""
        self._conn = None

    def terminate(self) -> None:
        """Let go of the tick's connection (never terminates it)."""
        self._conn = None

    def cut(self) -> None:
        """End the handle: from now on every use raises."""
        self._conn = None


def _require() -> None:
    """Import SQLAlchemy's asyncio extension, or raise an error naming the extra."""
    try:
        importlib.import_module("sqlalchemy.ext.asyncio")
        importlib.import_module("greenlet")  # what SQLAlchemy's asyncio extension runs on
    except ImportError as exc:
        raise ImportError(
            f"ticklock.sqlalchemy needs SQLAlchemy 2.0 with asyncio support ({exc}): install "
            "it with pip install 'ticklock[sqlalchemy]'"
        ) from exc
