"""A declared job, the context a run receives, and the records a run leaves."""

from __future__ import annotations

import difflib
import enum
import hashlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypedDict, get_args

from typing_extensions import Unpack

from .._errors import ScheduleError, SchedulerStateError
from .._runtime.batch import Batches
from .triggers import Cron, Every, Trigger
from .validate import Duration, instant, name, seconds

if TYPE_CHECKING:
    import asyncpg

MAX_DEFAULT_TIMEOUT = 300.0
MAX_TIMEOUT = 2_147_483_647 / 1000 - 1.0
MAX_OVERLAP_TIMEOUT = 86_400.0
"""The longest timeout of a cron job declared with an explicit ``overlap`` (24 hours)."""
Overlap = Literal["skip", "buffer_one", "replace"]
"""What a cron slot does when the job's previous run is still running (see ``overlap=``)."""
OVERLAPS: tuple[str, ...] = get_args(Overlap)
"""PostgreSQL's timeouts are int milliseconds; a tick sets them to the timeout plus 1 s."""


class Outcome(str, enum.Enum):
    """How a tick attempt ended."""

    SUCCESS = "success"  #: the handler returned and everything committed
    FAILURE = "failure"  #: the handler raised (or returned a report that is not JSON)
    TIMEOUT = "timeout"  #: the handler ran past its timeout; rolled back
    LOCKED = "locked"  #: another replica holds the job's lock
    SKIPPED = "skipped"  #: the slot was already committed, or is not due fleet-wide yet
    ERROR = "error"  #: coordination failed (the database is unreachable or dropped the session)
    CANCELLED = "cancelled"  #: shutdown cancelled the run; rolled back

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class JobContext:
    """What a run knows: its slot, the fleet's watermark, its deadline and its connection.

    ``db`` is the asyncpg connection that holds the job's lock, inside the tick's
    transaction: write through it and your writes commit with the watermark or not at all.
    It is lent for the tick: any use after the handler returns raises
    ``asyncpg.InterfaceError``. In local mode (no database) it raises an error naming the
    job; ``scheduler.postgres`` tells a handler meant for both modes which one runs::

        @scheduler.job(every(minutes=15), id="purge-expired")
        async def purge(ctx: JobContext) -> dict[str, int]:
            deleted = await ctx.db.fetchval("SELECT count(*) FROM expired")
            return {"deleted": deleted}
    """

    job_id: str
    slot: datetime
    """The scheduled instant this run covers, UTC."""
    previous_success: datetime | None
    """The slot of the last successful run, fleet-wide (the watermark); ``None`` if none. In
    a backfilled slot (:attr:`backfill`), the schedule's slot before it: the window it covers
    is ``(previous_success, slot]``, as a run on time would."""
    started_at: datetime
    deadline: datetime
    """When the run's timeout expires (wall time, UTC)."""
    owner: str
    conn: asyncpg.Connection[Any] | None
    """Deprecated: use :attr:`db`. The same connection, or ``None`` in local mode."""
    namespace: str = "default"
    attempt: int = 1
    """1 for a slot's first attempt, 2 for its first retry, and so on."""
    args: Mapping[str, Any] = field(default_factory=lambda: _NO_ARGS)
    """A stored schedule's ``args`` (read-only); empty for a job declared in code."""
    backfill: bool = False
    """This run is a slot of a backfill (:meth:`Fleet.backfill
    <ticklock._operators.operations.SchedulerFleet.backfill>`): an operator asked for it,
    after the fact; ``slot`` is that slot."""
    _batches: Batches | Callable[[], Batches] | None = field(
        default=None, repr=False, compare=False
    )
    """The run's batches, or what makes them when first asked (the runner's); ``None``: one
    transaction for all of them."""

    def batches(self) -> Batches:
        """The run's batches, an async iterator of :class:`~ticklock.Batch`: each batch's body
        runs in a transaction of its own under the job's exclusion, which commits (with
        ``batch.cursor``) when the loop asks for the next batch; the batch the body leaves
        commits with the run's end, only if the run succeeds. At most ``max_batches``; once
        per run::

            async for batch in ctx.batches():
                n = await batch.db.fetchval("... DELETE ... LIMIT 1000 ...")
                if n < 1000:
                    break
        """
        source = self._batches
        if source is None:  # a context made by hand (testing.run_job): no commits between
            source = Batches(self.job_id, self.conn, None, None, None)
            object.__setattr__(self, "_batches", source)
        elif not isinstance(source, Batches):  # the runner's: made now
            source = source()
            object.__setattr__(self, "_batches", source)
        return source.enter()

    @property
    def db(self) -> asyncpg.Connection[Any]:
        """The tick's connection, inside the tick's transaction, holding the job's lock:
        write through it. Raises :class:`~ticklock.SchedulerStateError`, naming the job, in
        local mode."""
        if self.conn is None:
            raise SchedulerStateError(
                f"job {self.job_id!r}: ctx.db is the tick's PostgreSQL connection, and this "
                "run has none: the scheduler is in local mode (no dsn or pool). Give the "
                "Scheduler a dsn, or use ctx.conn, which is None in local mode"
            )
        return self.conn

    @property
    def idempotency_key(self) -> str:
        """Stable for one job's slot (namespace, job id, slot): use it for side effects
        outside the database, e.g. as an HTTP ``Idempotency-Key``."""
        return idempotency_key(self.namespace, self.job_id, self.slot)


Handler = Callable[[JobContext], Awaitable[Any]]
"""An ``async def handler(ctx: JobContext)`` returning ``None`` or a JSON-serialisable report."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """The record of one tick attempt."""

    job_id: str
    outcome: Outcome
    slot: datetime | None
    started_at: datetime
    finished_at: datetime
    owner: str
    report: Any = None
    error: str | None = None
    manual: bool = False
    """Started by :meth:`~ticklock.Scheduler.trigger` or :meth:`~ticklock.Scheduler.run_now`,
    not by the schedule."""
    batches: int = 0
    """The batches of :meth:`JobContext.batches` this run committed (0 for a run that never
    entered them); with a failure, those committed before it."""
    capped: bool = False
    """The run succeeded and ``max_batches`` stopped its loop: a backlog was left."""
    backfilled_by: str | None = None
    """Who asked for the backfill this run is a slot of (``None``: not a backfill)."""

    @property
    def duration(self) -> float:
        """Seconds from start to finish."""
        return (self.finished_at - self.started_at).total_seconds()


@dataclass(frozen=True, slots=True)
class JobHealth:
    """One job's health: the absence alarm is ``overdue``."""

    job_id: str
    last_success: datetime | None
    """When the last successful run finished (fleet-wide in PostgreSQL mode)."""
    next_fire: datetime | None
    consecutive_failures: int
    overdue: bool
    """The absence alarm: a run was due to finish by (the first fire after the last run that
    finished, of any outcome, or after start) + timeout + overdue grace, and none has. A run
    that fails or times out finished: it makes the job :attr:`failing`, never overdue. A tick
    that never reached the handler (the database unreachable, a clock ahead) finished no run.
    A replica that last found the job running on another replica presumes that run ended
    until its next look or attempt reads it. Never true for a paused, disabled or ended job;
    the time a job spent paused does not count."""
    paused: bool = False
    """Paused by an operator (:meth:`~ticklock.Scheduler.pause`): no scheduled run starts."""
    failing: bool = False
    """Its last ``failure_threshold`` runs (or more) failed: :attr:`consecutive_failures`
    reached the job's threshold. Apart from ``overdue``, the absence alarm, which failures
    never raise."""
    problem: str | None = None
    """Why no run can start now (PostgreSQL mode): the database is down, or refuses this
    scheduler (not accepting connections, a missing database, role or grant), with the
    error and the fix; ``None`` when it can be used."""
    ended: bool = False
    """Its window's ``end`` has passed: no slot is owed any more; never overdue."""
    completed: bool = False
    """Its ``limit`` of scheduled runs committed, fleet-wide: it runs no more; never overdue."""


class JobOptions(TypedDict, total=False):
    """The keywords of :meth:`Scheduler.job <ticklock.Scheduler.job>` and
    :meth:`Scheduler.add <ticklock.Scheduler.add>`, each optional."""

    id: str | None
    """The job's id, unique in the scheduler (default: ``module.qualname`` of the handler)."""
    timeout: Duration | None
    """Seconds a run may take (default: half the shortest period, at most 5 minutes)."""
    enabled: bool
    """``False`` declares and validates a job that never runs (default ``True``)."""
    catch_up: bool | Duration
    """Cover the slots missed while no replica ran with one run at start (default ``True``);
    a duration covers only those missed within it before now."""
    overdue_grace: Duration | None
    """Slack before a missing run is overdue (default: 10 % of the period, 1 s to 5 min)."""
    retries: int
    """How many times a failed slot runs again, never past the next slot (default 0)."""
    retry_backoff: Duration
    """Seconds before the first retry, doubling per retry (default 10)."""
    max_batches: int | None
    """How many batches of :meth:`JobContext.batches` a run may commit (default ``None``:
    no cap); a run stopped by it is ``capped``."""
    failure_threshold: int
    """How many runs in a row must fail before operators see the job ``failing`` (default 1)."""
    start: datetime | None
    """An aware datetime: no slot before it (inclusive; default ``None``: none)."""
    end: datetime | None
    """An aware datetime: no slot after it (inclusive); after it the job is ``ended``, never
    overdue (default ``None``: none)."""
    limit: int | None
    """How many scheduled runs may commit, fleet-wide; then the job is ``completed``, never
    overdue (default ``None``: no limit)."""
    immediately: bool
    """One run at once, fleet-wide, when the declaration is new or changed; never on an
    unchanged restart, a replica joining or a failover (default ``False``)."""
    overlap: Overlap | None
    """What a cron slot does when the job's previous run is still running: ``"skip"`` it,
    ``"buffer_one"`` (run it once that run ends; later ones are skipped), or ``"replace"``
    that run (cancelled, rolled back, never committed). ``every`` takes only ``"skip"``.
    Given, a cron job's timeout may be up to 24 hours (default ``None``: skip, and the
    timeout shorter than the shortest gap between fires)."""


_OPTIONS = frozenset(JobOptions.__annotations__)
_NO_ARGS: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True, eq=False)
class Job:
    """A declared job: its handler, trigger and limits, validated at declaration."""

    id: str
    func: Handler
    trigger: Trigger
    timeout: float
    enabled: bool
    catch_up: bool | float
    """``True``, ``False``, or the seconds before now within which missed slots are covered."""
    overdue_grace: float
    retries: int = 0
    retry_backoff: float = 10.0
    max_batches: int | None = None
    failure_threshold: int = 1
    start: datetime | None = None
    """No slot before it (inclusive)."""
    end: datetime | None = None
    """No slot after it (inclusive): the job has then ended."""
    limit: int | None = None
    """How many scheduled runs may commit, fleet-wide: the job has then completed."""
    immediately: bool = False
    """One run at once when the declaration is new or changed (keyed to its fingerprint)."""
    overlap: Overlap | None = None
    """What a cron slot does while the previous run still runs (``None``: ``"skip"``)."""
    task: str | None = None
    """The task of a stored schedule (``None``: a job declared in code)."""
    args: Mapping[str, Any] = field(default_factory=lambda: _NO_ARGS)
    """A stored schedule's args (``ctx.args``); empty for a job declared in code."""
    tenant: str | None = None
    version: int | None = None
    """A stored schedule's version when this replica built the job (``None``: in code)."""
    defined_at: datetime | None = None
    """When a stored schedule's definition was written: no cron fire before it is owed."""

    @classmethod
    def declare(
        cls,
        func: Handler,
        trigger: Trigger,
        **options: Unpack[JobOptions],
    ) -> Job:
        """Validate a declaration and build the job; raises :class:`ScheduleError`."""
        given = options.get("id")
        job_id = name(given if given is not None else _default_id(func), "id")

        def error(field: str, message: str) -> ScheduleError:
            return ScheduleError(message, job_id=job_id, field=field)

        if not options.keys() <= _OPTIONS:
            unknown = sorted(options.keys() - _OPTIONS)[0]
            close = difflib.get_close_matches(unknown, JobOptions.__annotations__, n=1)
            hint = f"; did you mean {close[0]}=?" if close else ""
            known = ", ".join(JobOptions.__annotations__)
            raise error(unknown, f"unknown keyword {unknown}={hint} (a job takes {known})")
        timeout = options.get("timeout")
        enabled = options.get("enabled", True)
        catch_up = options.get("catch_up", True)
        overdue_grace = options.get("overdue_grace")
        retries = options.get("retries", 0)
        retry_backoff = options.get("retry_backoff", 10.0)
        max_batches = options.get("max_batches")
        failure_threshold = options.get("failure_threshold", 1)
        start, end = (instant(options.get(f), f, job_id=job_id) for f in ("start", "end"))
        if start is not None and end is not None and end < start:
            raise error("end", f"end ({end.isoformat()}) is before start ({start.isoformat()})")
        limit_runs = options.get("limit")
        if limit_runs is not None and (
            not isinstance(limit_runs, int) or isinstance(limit_runs, bool) or limit_runs < 1
        ):
            message = (
                f"limit must be a whole number of runs, 1 or more, or None, got {limit_runs!r}"
            )
            raise error("limit", message)
        overlap = options.get("overlap")
        if overlap is not None and overlap not in OVERLAPS:
            known = ", ".join(repr(o) for o in OVERLAPS)
            raise error("overlap", f"overlap must be one of {known} or None, got {overlap!r}")

        if not isinstance(trigger, (Every, Cron)):
            raise error("trigger", f"trigger must be every(...) or cron(...), got {trigger!r}")
        if not callable(func) or not _is_async(func):
            shown = getattr(func, "__qualname__", None) or repr(func)
            raise error(
                "func",
                f"handler {shown} is not an async function; declare it with 'async def'. To run "
                "blocking code, call it in a worker thread from an async handler: "
                "'await anyio.to_thread.run_sync(blocking_function)'",
            )
        period = trigger.period
        if isinstance(trigger, Every) and overlap not in (None, "skip"):
            raise error(
                "overlap",
                f"overlap={overlap!r} needs a cron trigger: an every job never overlaps itself "
                "(its next run starts an interval after the last one ends), so it takes only "
                "'skip'",
            )
        if timeout is None:
            limit = min(period / 2, MAX_DEFAULT_TIMEOUT)
        else:
            limit = seconds(timeout, "timeout", job_id=job_id, allow_zero=False)
            if limit > MAX_TIMEOUT:
                raise error(
                    "timeout",
                    f"timeout must be at most {MAX_TIMEOUT:.3f} s (about 24.8 days: PostgreSQL "
                    "holds statement and transaction timeouts up to 2147483647 ms, and ticklock "
                    f"adds 1 s), got {limit:g} s",
                )
            if isinstance(trigger, Cron) and overlap is not None:
                if limit > MAX_OVERLAP_TIMEOUT:
                    raise error(
                        "timeout",
                        f"timeout must be at most {MAX_OVERLAP_TIMEOUT:g} s (24 hours) with "
                        f"overlap={overlap!r}, got {limit:g} s",
                    )
            elif limit >= period:
                shape = "interval" if isinstance(trigger, Every) else "shortest gap between fires"
                message = f"timeout ({limit:g} s) must be shorter than the {shape} ({period:g} s)"
                if isinstance(trigger, Cron):  # a longer run needs a policy for the fires in it
                    message += "; declare overlap= to allow up to 24 hours"
                raise error("timeout", message)
        if overdue_grace is None:
            grace = min(max(period * 0.1, 1.0), 300.0)
        else:
            grace = seconds(overdue_grace, "overdue_grace", job_id=job_id)
        immediately = options.get("immediately", False)
        for flag, value in (("enabled", enabled), ("immediately", immediately)):
            if not isinstance(value, bool):
                raise error(flag, f"{flag} must be True or False, got {value!r}")
        if not isinstance(catch_up, bool):
            if not isinstance(catch_up, (int, float, timedelta)):
                message = f"catch_up must be True, False or a duration, got {catch_up!r}"
                raise error("catch_up", message)
            catch_up = seconds(catch_up, "catch_up", job_id=job_id, allow_zero=False)
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            message = f"retries must be a whole number of retries, 0 or more, got {retries!r}"
            raise error("retries", message)
        backoff = seconds(retry_backoff, "retry_backoff", job_id=job_id, allow_zero=False)
        if retries and backoff >= period:
            raise error(
                "retry_backoff",
                f"retry_backoff ({backoff:g} s) must be shorter than the period ({period:g} s): "
                "a retry never runs past the next slot, so none would ever run",
            )
        if max_batches is not None and (
            not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1
        ):
            raise error(
                "max_batches",
                f"max_batches must be a whole number of batches, 1 or more, or None (no cap), "
                f"got {max_batches!r}",
            )
        if (
            not isinstance(failure_threshold, int)
            or isinstance(failure_threshold, bool)
            or failure_threshold < 1
        ):
            raise error(
                "failure_threshold",
                f"failure_threshold must be a whole number of runs, 1 or more, "
                f"got {failure_threshold!r}",
            )
        return cls(
            id=job_id,
            func=func,
            trigger=trigger,
            timeout=limit,
            enabled=enabled,
            catch_up=catch_up,
            overdue_grace=grace,
            retries=retries,
            retry_backoff=backoff,
            max_batches=max_batches,
            failure_threshold=failure_threshold,
            start=start,
            end=end,
            limit=limit_runs,
            immediately=immediately,
            overlap=overlap,
        )


REPLACED = "replaced by the run of slot "
"""How the error of a run that a newer slot replaced begins (``overlap="replace"``)."""


def replaced(fire: datetime) -> str:
    """The error of a run replaced by the run of slot ``fire``."""
    return f"{REPLACED}{fire.isoformat()}"


def shut_down(result: RunResult) -> bool:
    """Whether ``result`` is a run its scheduler's shutdown cancelled (not a replaced one)."""
    replaced_run = (result.error or "").startswith(REPLACED)
    return result.outcome is Outcome.CANCELLED and not replaced_run


def idempotency_key(namespace: str, job_id: str, slot: datetime) -> str:
    """A stable hex key for one job's slot: the same on every replica and every retry."""
    text = f"{namespace}\x00{job_id}\x00{slot.isoformat()}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _is_async(func: object) -> bool:
    return inspect.iscoroutinefunction(func) or (
        not inspect.isroutine(func) and inspect.iscoroutinefunction(type(func).__call__)
    )


def _default_id(func: object) -> str:
    module = getattr(func, "__module__", None) or "?"
    qualname = getattr(func, "__qualname__", None) or type(func).__qualname__
    return f"{module}.{qualname}"


def declaration(job: Job) -> str:
    """What replicas must agree on for ``job``: its trigger and the limits that shape its
    runs, as a short text (logged when replicas disagree)."""
    from . import zones as _zones  # loaded with the first cron trigger

    trigger = job.trigger
    shape = (
        f"every {trigger.interval:g}s jitter {trigger.jitter:g}s delay {trigger.initial_delay:g}s"
        if isinstance(trigger, Every)
        else f"cron {trigger.expr!r} {trigger.tz} (tzdata {_zones.version()}) "
        f"jitter {trigger.jitter:g}s"
    )
    batches = "" if job.max_batches is None else f", max_batches {job.max_batches}"
    window = "".join(
        f", {key} {value.isoformat()}"
        for key, value in (("start", job.start), ("end", job.end))
        if value is not None
    ) + ("" if job.limit is None else f", limit {job.limit}")
    window += "" if job.overlap is None else f", overlap {job.overlap}"
    return (
        f"{shape}, timeout {job.timeout:g}s, retries {job.retries} (backoff "
        f"{job.retry_backoff:g}s), catch_up {job.catch_up}, overdue_grace {job.overdue_grace:g}s"
        f"{batches}{window}"
    )


def fingerprint(job: Job) -> str:
    """A short stable hash of :func:`declaration`, which each replica publishes per job."""
    return hashlib.blake2b(declaration(job).encode(), digest_size=8).hexdigest()
