"""ticklock's exceptions.

Hierarchy::

    ValueError
    └── ScheduleError      a misdeclared job, trigger or scheduler, raised where it is written
    RuntimeError
    ├── SchedulerStateError   a scheduler used out of order (entered twice, run_now before
    │                         start), or ``ctx.db`` in local mode
    ├── StatementRefused      a statement through ``ctx.db`` that would end or change the
    │                         tick's transaction, refused before it reached the server
    ├── StartupError          the database refused the scheduler in a way that cannot fix itself
    ├── SlotAlreadyCommitted  a commit refused: the watermark is at or past the slot
    ├── TransactionEnded      a commit refused: the handler ended the tick's transaction
    ├── LimitsChanged         a commit refused: the handler loosened the server-side timeouts
    ├── TransactionChanged    a commit refused: the handler made the transaction read-only
    ├── ClockAhead            a tick or commit refused: the slot or end lies in the database's
    │                         future
    ├── TakenOver             a batch refused: another replica took the job over between two
    │                         batches of this run (it was paused past its budget)
    └── BatchesEntered        ``ctx.batches()`` entered a second time in one run
    ConnectionError
    ├── DatabaseUnavailable   the database does not answer
    └── SchemaBusy            a schema upgrade waited too long for runs in flight to end

``SlotAlreadyCommitted``, ``TransactionEnded``, ``LimitsChanged``, ``TransactionChanged``,
``ClockAhead``, ``TakenOver``, ``DatabaseUnavailable`` and ``SchemaBusy`` end a run as
``error`` (with their message); they are not exported. ``StatementRefused`` and
``BatchesEntered`` are raised inside the handler, so their run is a ``failure``; they are not
exported either.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """A declaration that cannot run: raised when it is written, never at the first tick.

    The message names the field, and the job id once there is one::

        >>> every(seconds=0)
        Traceback (most recent call last):
        ScheduleError: every(): interval must be positive, got 0 s
    """

    def __init__(
        self,
        message: str,
        *,
        job_id: str | None = None,
        field: str | None = None,
        what: str = "job",
    ):
        if job_id is not None:
            message = f"{what} {job_id!r}: {message}"
        super().__init__(message)
        self.job_id = job_id
        self.field = field


class SchedulerStateError(RuntimeError):
    """The scheduler was used in a state that does not allow it (for example entered twice)."""


class StatementRefused(RuntimeError):
    """The handler sent, through ``ctx.db``, a statement that would end or change the tick's
    transaction (``COMMIT``, ``ROLLBACK``, ``BEGIN``, ...): it was not sent, and the
    transaction, its lock and its writes are as they were."""


class StartupError(RuntimeError):
    """Start-up failed for a reason that waiting cannot fix: a failed login, a missing
    database, no permission to create ticklock's tables (or, with ``require_database=True``,
    a database that does not answer). The message names the cause and the fix.

    A database that is down, restarting or refusing connections does not raise this: the
    scheduler starts, ends ticks as ``error`` and connects when the database answers.
    """


class SlotAlreadyCommitted(RuntimeError):
    """The watermark was already at or past this slot: the commit was refused."""


class TransactionEnded(RuntimeError):
    """The handler ended the tick's transaction itself: the lock went with it."""


class LimitsChanged(RuntimeError):
    """The handler changed the tick's server-side timeouts: a paused holder would keep the lock."""


class TransactionChanged(RuntimeError):
    """A commit refused: the handler made the tick's transaction read-only."""


class ClockAhead(RuntimeError):
    """The replica's slot or end lies in the database's future: its clock runs ahead. A slot
    is refused before its handler starts; an end (the clock stepped during the run) at the
    commit."""


class TakenOver(RuntimeError):
    """A batch of a batched run found that another replica took the job over since the
    run's previous batch (the run outlived its budget, paused): nothing of it commits."""


class BatchesEntered(RuntimeError):
    """``ctx.batches()`` was entered a second time in one run."""


class SchemaBusy(ConnectionError):
    """A schema upgrade gave up waiting for the runs in flight (the previous release's ticks
    hold ticklock's tables until they end): it changed nothing, and can be run again."""


class DatabaseUnavailable(ConnectionError):
    """The database does not answer: ticks end as ``error`` until it does."""


def describe(exc: BaseException) -> str:
    """``exc`` as one line for a run's record and the logs: ``Type: message``."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
