"""Batched runs: ``ctx.batches()``, each batch a transaction of its own under the job's exclusion.

A run's :class:`Batches` hands out :class:`Batch` objects. Asking for the next batch commits
the one in flight, with its cursor, and begins the next (:class:`Committer`, which the
coordinator's attempt provides: PostgreSQL commits the batch's transaction and begins another
under the job's lock and fence; memory keeps the cursor). The batch in flight when the loop
ends (the body left it, or ``max_batches`` stopped it) is not committed here: it commits with
the run's end, only if the run succeeds, like a plain tick's writes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import BatchesEntered, SchedulerStateError
from .._schedule.caps import jsonb_text

if TYPE_CHECKING:
    import asyncpg


class Committer(Protocol):
    """What a run's batches ask of the coordination: commit one, begin the next."""

    async def commit_batch(self, cursor: str | None) -> None:
        """Commit the batch in flight, with ``cursor`` (JSON text, ``None``: no cursor)."""
        ...

    async def begin_batch(self) -> None:
        """Begin the next batch, under the job's exclusion; raises
        :class:`~ticklock._errors.TakenOver` if the run lost the job."""
        ...


class Batch:
    """One batch of a batched run: its ``number`` (1-based), its connection ``db`` and its
    ``cursor``.

    ``cursor`` starts as the JSON value committed with the job's last committed batch (by this
    run, an earlier one, or another replica; ``None`` at first); assign it to commit a new one
    with this batch. A value that is not JSON fails the batch, naming the cursor::

        async for batch in ctx.batches():
            rows = await batch.db.fetch("... WHERE id > $1 ORDER BY id LIMIT 500", batch.cursor)
            ...
            batch.cursor = rows[-1]["id"]
    """

    __slots__ = ("_conn", "_cursor", "_job_id", "number")

    def __init__(
        self, job_id: str, number: int, conn: asyncpg.Connection[Any] | None, cursor: Any
    ) -> None:
        self._job_id = job_id
        self.number = number
        self._conn = conn
        self._cursor = cursor

    @property
    def conn(self) -> asyncpg.Connection[Any] | None:
        """Deprecated: use :attr:`db`. The same connection, or ``None`` in local mode."""
        return self._conn

    @property
    def db(self) -> asyncpg.Connection[Any]:
        """The batch's connection, inside the batch's transaction (the run's ``ctx.db``):
        write through it. Raises :class:`~ticklock.SchedulerStateError` in local mode."""
        if self._conn is None:
            raise SchedulerStateError(
                f"job {self._job_id!r}: batch.db is the batch's PostgreSQL connection, and this "
                "run has none: the scheduler is in local mode (no dsn or pool). Give the "
                "Scheduler a dsn, or use batch.conn, which is None in local mode"
            )
        return self._conn

    @property
    def cursor(self) -> Any:
        """The job's cursor: the last committed one until this batch assigns its own."""
        return self._cursor

    @cursor.setter
    def cursor(self, value: Any) -> None:
        cursor_text(self._job_id, value)  # fail where it was written
        self._cursor = value

    def __repr__(self) -> str:
        return f"<ticklock.Batch {self.number} of {self._job_id!r} cursor={self._cursor!r}>"


def cursor_text(job_id: str, value: Any) -> str | None:
    """``value``'s JSON text as the cursor is stored (``None`` for ``None``); ``ValueError``
    naming the cursor if it is not JSON that ``jsonb`` can store."""
    if value is None:
        return None
    try:
        return jsonb_text(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(
            f"job {job_id!r}: batch.cursor is not JSON-serialisable ({type(exc).__name__}: "
            f"{exc}); assign a dict/list of str (no NUL, no unpaired surrogate), int, finite "
            "float, bool and None"
        ) from exc


class Batches:
    """The batches of one run, the async iterator ``ctx.batches()`` returns (see the module
    docstring). ``committed`` counts the batches committed so far, ``capped`` says that
    ``max_batches`` stopped the loop."""

    __slots__ = (
        "_committer",
        "_conn",
        "_broken",
        "_cursor",
        "_job_id",
        "_max",
        "capped",
        "committed",
        "current",
        "entered",
    )

    def __init__(
        self,
        job_id: str,
        conn: asyncpg.Connection[Any] | None,
        cursor: str | None,
        max_batches: int | None,
        committer: Committer | None,
    ) -> None:
        self._job_id = job_id
        self._conn = conn
        self._cursor = cursor  # the JSON text of the last committed cursor
        self._max = max_batches
        self._committer = committer  # None: one transaction for all (testing.run_job)
        self.entered = False
        self.committed = 0
        self.capped = False
        self.current: Batch | None = None
        self._broken: BaseException | None = None  # the commit or begin that failed

    def enter(self) -> Batches:
        """``ctx.batches()``: once per run."""
        if self.entered:
            raise BatchesEntered(
                f"job {self._job_id!r}: ctx.batches() was entered a second time in this run; "
                "a run has one sequence of batches: loop over it once (keep the loop's state "
                "in variables, or in batch.cursor)"
            )
        self.entered = True
        return self

    def __aiter__(self) -> Batches:
        return self

    async def __anext__(self) -> Batch:
        if self._broken is not None:
            raise RuntimeError(
                f"job {self._job_id!r}: the run's batches ended with an error "
                f"({type(self._broken).__name__}: {self._broken}); no batch can follow"
            ) from self._broken
        current = self.current
        if current is not None:
            if self.capped or (self._max is not None and current.number >= self._max):
                self.capped = True  # the batch in flight commits with the run's end
                raise StopAsyncIteration
            text = cursor_text(self._job_id, current.cursor)  # in place changes too
            try:
                if self._committer is not None:
                    await self._committer.commit_batch(text)
                self.committed += 1
                self._cursor = text
                if self._committer is not None:
                    await self._committer.begin_batch()
            except BaseException as exc:
                self._broken, self.current = exc, None  # no batch in flight any more
                raise
        number = 1 if current is None else current.number + 1
        cursor = None if self._cursor is None else json.loads(self._cursor)
        self.current = Batch(self._job_id, number, self._conn, cursor)
        return self.current

    @property
    def broken(self) -> BaseException | None:
        """The error with which committing a batch or beginning the next failed, if one did
        (a run whose handler swallowed it fails with it all the same)."""
        return self._broken

    def last_cursor(self) -> str | None:
        """The JSON text of the cursor the batch in flight commits with the run's end."""
        if self.current is None:
            return self._cursor
        return cursor_text(self._job_id, self.current.cursor)
