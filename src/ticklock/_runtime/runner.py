"""One tick attempt: take the lock, decide, run the handler under its timeout, record.

Whatever the handler does (raise, hang, return garbage), :meth:`Runner.execute` returns a
:class:`RunResult`; only cancellation from outside (shutdown) propagates, after the run was
rolled back and recorded as ``cancelled``.

A handler that blocks the event loop (synchronous work in an ``async def``) stops every job
and the app with it: :func:`watch` times each step of a handler and names the job whose step
held the loop for more than :data:`BLOCKED_WARNING` seconds, for two clock reads per step.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from datetime import datetime, timedelta
from time import monotonic
from typing import Any, TypeVar

import anyio
from opentelemetry.trace import INVALID_SPAN, Span

from .._backends.seam import Attempt, Coordinator, Fill, FleetState
from .._errors import describe
from .._schedule.caps import bound_error, bound_report, jsonb_text
from .._schedule.job import Job, JobContext, Outcome, RunResult, replaced
from .._schedule.triggers import Cron
from .._telemetry import JOB_ID, Telemetry, logger
from . import plan as _plan
from .batch import Batches
from .clock import Clock
from .loop import BLOCKED_WARNING, Dispatcher, Timeout
from .plan import Busy, Run, Skip
from .slots import previous

T = TypeVar("T")


@types.coroutine
def watch(
    awaitable: Awaitable[T], job_id: str, blocked: Callable[[str, float], None]
) -> Generator[Any, Any, T]:
    """Await ``awaitable`` (a run of job ``job_id``), calling ``blocked(job_id, seconds)`` when
    one of its steps holds the event loop for more than :data:`BLOCKED_WARNING` seconds.

    A step is the code between two suspensions, so a step that long is synchronous work on
    the loop. Two clock reads per step, no thread, no timer. The awaitable is driven step by
    step (send, throw, close are passed through), so results, exceptions and cancellation are
    those of the handler.
    """
    steps: Any = awaitable if type(awaitable) is types.CoroutineType else awaitable.__await__()
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        start = monotonic()
        try:
            signal = steps.send(sent) if thrown is None else steps.throw(thrown)
        except StopIteration as stop:
            if (held := monotonic() - start) > BLOCKED_WARNING:
                blocked(job_id, held)
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            thrown = None  # not kept: the traceback holds this frame
            if (held := monotonic() - start) > BLOCKED_WARNING:
                blocked(job_id, held)
            raise
        thrown = None
        if (held := monotonic() - start) > BLOCKED_WARNING:
            blocked(job_id, held)
        try:
            sent = yield signal
        except GeneratorExit:  # closed without finishing: close the handler too
            steps.close()
            raise
        except BaseException as exc:  # cancellation, or anything else thrown in
            sent, thrown = None, exc


@dataclass(slots=True)
class _Run:
    slot: datetime | None
    outcome: Outcome | None = None
    report: Any = None
    error: str | None = None
    exc: BaseException | None = None
    state: FleetState | None = None
    manual: bool = False
    executed: bool = False  # the handler was started: a failure must be recorded
    finished_at: datetime | None = None
    result: RunResult | None = None
    batches: Batches | None = None
    cursor: str | None = None  # the JSON text of the last batch's cursor, for the commit
    replaced_at: float | None = None  # monotonic: the next fire, which replaces this run
    replaced_by: datetime | None = None
    fill: Fill | None = None  # the slot of a backfill this run is

    @property
    def committed(self) -> int:
        """Batches committed (the last one with the run's end, once it succeeded)."""
        return 0 if self.batches is None else self.batches.committed

    def fail(self, outcome: Outcome, exc: BaseException | None, error: str) -> None:
        self.outcome, self.exc, self.error = outcome, exc, error


def _cancel_requested() -> bool:
    """Whether this run's task was asked to cancel (``Task.cancelling()``): by the run's
    timeout, shutdown or its caller's cancel scope. On trio, whose ``Cancelled`` only a
    cancel scope raises, always."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio loop: trio
        return True
    return task is None or task.cancelling() > 0


_check_report = jsonb_text  # testing.run_job checks a report as the runner does


@dataclass(slots=True)
class _Advance:
    """A run's batches, as its attempt commits and begins them within the run's budget."""

    attempt: Attempt
    clock: Clock
    deadline: float  # monotonic

    async def commit_batch(self, cursor: str | None) -> None:
        await self.attempt.commit_batch(cursor)

    async def begin_batch(self) -> None:
        await self.attempt.begin_batch(max(0.001, self.deadline - self.clock.monotonic()))


def replacing(job: Job, run: _Run) -> bool:
    """Whether the next fire ends ``run`` of ``job`` (``overlap="replace"``): a scheduled
    run of a cron job; never one an operator asked for, nor a backfill's."""
    return job.overlap == "replace" and not run.manual and run.fill is None


class Runner:
    """Runs tick attempts for one scheduler: its coordinator, clock, owner and telemetry."""

    def __init__(
        self,
        coordinator: Coordinator,
        clock: Clock,
        dispatcher: Dispatcher,
        namespace: str,
        owner: str,
        telemetry: Telemetry,
    ) -> None:
        self.coordinator = coordinator
        self.clock = clock
        self.dispatcher = dispatcher  # bounds each run by its timeout, names blocking handlers
        self.namespace = namespace
        self.owner = owner
        self.telemetry = telemetry

    async def execute(
        self,
        job: Job,
        slot: datetime | None,
        fire_at: datetime | None = None,
        jitter: float = 0.0,
        *,
        manual: bool = False,
        attempt: int = 1,
        fill: Fill | None = None,
    ) -> tuple[RunResult, FleetState | None]:
        """Run one tick of ``job`` for ``slot`` (``None``: the slot the fleet's state gives),
        as its ``attempt``-th attempt; the state is the fleet's as read under the lock (``None``
        when the lock was not taken). ``fill``: a slot of a backfill (``slot`` is its slot),
        run if it is that backfill's turn.

        ``manual`` runs whatever the schedule says (and whether the job is paused), under the
        same lock, watermark and recording: for ``slot`` (a trigger request's instant, if no
        manual run served it yet), or now if ``slot`` is ``None``.
        """
        if not self.telemetry.tracing():  # no SDK: no span to start
            return await self._execute(
                job, slot, fire_at, jitter, manual, attempt, INVALID_SPAN, fill
            )
        with self.telemetry.tracer.start_as_current_span(
            f"ticklock.run {job.id}",
            attributes={JOB_ID: job.id},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            return await self._execute(job, slot, fire_at, jitter, manual, attempt, span, fill)

    async def _execute(
        self,
        job: Job,
        slot: datetime | None,
        fire_at: datetime | None,
        jitter: float,
        manual: bool,
        number: int,
        span: Span,
        fill: Fill | None,
    ) -> tuple[RunResult, FleetState | None]:
        clock = self.clock
        started = clock.now()
        deadline = clock.monotonic() + job.timeout
        lateness = None if fire_at is None else (started - fire_at).total_seconds()
        run = _Run(slot=(slot or started) if manual else slot, manual=manual, fill=fill)
        attempt: Attempt | None = None
        # a replaced run of an older slot never commits: its tick holds the slot's lock
        replacing = slot if job.overlap == "replace" and not manual and fill is None else None
        try:
            bound = self.dispatcher.bound(deadline)
            with bound as scope:
                # a slot in the database's future is refused here, before the handler starts
                at = started if run.slot is None else max(run.slot, started)
                attempt = await self.coordinator.attempt(job.id, job.timeout, at, replacing, fill)
                await self._hold(job, attempt, run, started, slot, number, deadline, bound)
            now_m = clock.monotonic()
            overran = scope.cancel_called or now_m >= deadline
            cut = run.replaced_at is not None and run.replaced_at <= now_m < deadline
            if overran and attempt is None:  # the database did not answer in time
                run.fail(Outcome.ERROR, None, f"no database connection within {job.timeout:g} s")
            elif overran and cut and run.outcome in (None, Outcome.SUCCESS):
                assert run.replaced_by is not None
                run.fail(Outcome.CANCELLED, None, replaced(run.replaced_by))
            elif overran and run.outcome in (None, Outcome.SUCCESS):
                error = f"timed out after {job.timeout:g} s"
                # the traceback of the cancellation says where the handler was waiting
                where = None if run.exc is None else run.exc.__traceback__
                run.fail(Outcome.TIMEOUT, TimeoutError(error).with_traceback(where), error)
            if run.outcome is Outcome.SUCCESS and attempt is not None:
                result = run.result = self._result(job, run, started)
                await attempt.commit(result, job, run.cursor)
                if run.state is not None and fill is None:
                    run.state = _plan.fold(run.state, result, counted=job.limit is not None)
        except anyio.get_cancelled_exc_class():
            run.fail(Outcome.CANCELLED, None, "cancelled by shutdown")
            with anyio.CancelScope(shield=True):
                await self._finish(job, run, started, attempt, span, jitter, lateness)
            raise
        except Exception as exc:
            kind = Outcome.ERROR
            run.fail(kind, exc, describe(exc))
        return await self._finish(job, run, started, attempt, span, jitter, lateness)

    async def _hold(
        self,
        job: Job,
        attempt: Attempt,
        run: _Run,
        started: datetime,
        requested: datetime | None,
        number: int,
        deadline: float,
        bound: Timeout,
    ) -> None:
        if not attempt.acquired:
            run.outcome = Outcome.LOCKED
            return
        state = run.state = attempt.state
        if run.fill is not None:  # a slot of a backfill: run if it is the backfill's turn
            turn = attempt.turn and not _plan.busy(state, started)
            admission: _plan.Admission = Run(run.fill.slot) if turn else Skip("not its turn")
        else:
            admission = _plan.admit(
                job, state, requested, number, manual=run.manual, started=started
            )
        if isinstance(admission, Busy):  # a batched run holds the job between its batches
            run.outcome = Outcome.LOCKED  # the state read says until when (the planner)
            return
        if isinstance(admission, Skip):
            run.outcome = Outcome.SKIPPED
            return
        run.slot = admission.slot
        assert run.slot is not None
        fill = run.fill
        if fill is not None and fill.cut_at is not None:  # a paced backfill's next slot
            run.replaced_by, run.replaced_at = fill.replaced_by, fill.cut_at
            bound.shorten(fill.cut_at)
        if replacing(job, run) and isinstance(job.trigger, Cron):
            fire = job.trigger.next_fire(run.slot)  # the run ends when that fire comes
            if fire is not None:
                clock = self.clock
                run.replaced_by = fire
                run.replaced_at = clock.monotonic() + (fire - clock.now()).total_seconds()
                bound.shorten(run.replaced_at)

        def open_batches() -> Batches:  # made when the handler asks: most runs never do
            advance = _Advance(attempt, self.clock, deadline)
            batches = Batches(job.id, attempt.conn, state.cursor, job.max_batches, advance)
            run.batches = batches
            return batches

        ctx = JobContext(
            job_id=job.id,
            slot=run.slot,
            # a backfilled slot covers its own interval of the schedule, not the watermark's
            previous_success=state.last_slot
            if run.fill is None
            else previous(job.trigger, run.slot),
            started_at=started,
            deadline=started + timedelta(seconds=job.timeout),
            owner=self.owner,
            conn=attempt.conn,
            namespace=self.namespace,
            attempt=1 if run.manual else number,
            args=job.args,
            backfill=run.fill is not None,
            _batches=open_batches,
        )
        run.executed = True
        try:
            report = await watch(job.func(ctx), job.id, self.dispatcher.blocked)
        except Exception as exc:
            # An OSError is the handler's own I/O (a file, a socket, a timeout of its own): a
            # failure. The loss of the tick's connection comes as the driver's errors; a
            # batch's commit or begin (ticklock's own statements) is judged as they are.
            broken = None if run.batches is None else run.batches.broken
            own = isinstance(exc, OSError) and exc is not broken
            lost = not own and self.coordinator.diagnose(exc).lost
            run.fail(Outcome.ERROR if lost else Outcome.FAILURE, exc, describe(exc))
            return
        except anyio.get_cancelled_exc_class() as exc:
            if _cancel_requested():
                run.exc = exc  # where the handler was waiting, for a timeout's record
                raise  # the run's timeout, shutdown, or its caller's scope
            # Nobody cancelled this run: the handler awaited a task or future that something
            # else cancelled. A failure of the handler, not a shutdown to stop the job for.
            run.fail(
                Outcome.FAILURE,
                exc,
                "CancelledError escaped the handler though the run was not cancelled: it "
                "awaited a task or future that was cancelled",
            )
            return
        run.finished_at = self.clock.now()
        batches = run.batches
        broken = None if batches is None else batches.broken
        if isinstance(broken, Exception):  # the handler swallowed it: the run fails with it
            lost = self.coordinator.diagnose(broken).lost
            run.fail(Outcome.ERROR if lost else Outcome.FAILURE, broken, describe(broken))
            return
        if batches is not None and batches.entered:
            try:
                run.cursor = batches.last_cursor()
            except ValueError as exc:
                run.fail(Outcome.FAILURE, exc, describe(exc))
                return
        try:
            text = None if report is None else _check_report(report)
        except (TypeError, ValueError, RecursionError) as exc:
            run.fail(
                Outcome.FAILURE,
                exc,
                f"the report is not JSON-serialisable ({describe(exc)}); return None, or "
                "a dict/list of str (no NUL, no unpaired surrogate), int, finite float, bool "
                "and None",
            )
            return
        # cut here, once, so that both modes record, log and return the same bounded report
        run.report = None if text is None else bound_report(report, text, job.id, run.slot)
        run.outcome = Outcome.SUCCESS

    def _result(self, job: Job, run: _Run, started: datetime) -> RunResult:
        assert run.outcome is not None
        if run.error is not None:  # cut once: a cut error fits
            run.error = bound_error(run.error, job.id, run.slot)
        batches, success = run.batches, run.outcome is Outcome.SUCCESS
        in_flight = success and batches is not None and batches.current is not None
        return RunResult(
            job_id=job.id,
            outcome=run.outcome,
            slot=run.slot,
            started_at=started,
            finished_at=run.finished_at or self.clock.now(),
            owner=self.owner,
            report=run.report,
            error=run.error,
            manual=run.manual,
            batches=run.committed + (1 if in_flight else 0),
            capped=success and batches is not None and batches.capped,
            backfilled_by=None if run.fill is None else run.fill.who,
        )

    async def _close(self, job: Job, attempt: Attempt | None) -> None:
        """Roll back what did not commit, and let the lock go."""
        if attempt is not None:
            try:
                await attempt.close()
            except Exception:  # a dead connection: the server rolled back already
                logger.debug("closing the tick of %s failed", job.id, exc_info=True)

    async def _record(self, job: Job, attempt: Attempt | None, result: RunResult) -> None:
        """Record ``result``, a run that executed and did not commit."""
        assert attempt is not None  # only an attempt that took the lock executes
        try:
            await attempt.record_failure(result, job)
        except Exception:
            logger.warning("could not record the %s of %s", result.outcome, job.id, exc_info=True)

    async def _finish(
        self,
        job: Job,
        run: _Run,
        started: datetime,
        attempt: Attempt | None,
        span: Any,
        jitter: float,
        lateness: float | None,
    ) -> tuple[RunResult, FleetState | None]:
        # The coordinator shields its own cleanup (rollback, release, failure record).
        committed = run.outcome is Outcome.SUCCESS and run.result is not None
        if run.executed and not committed and run.fill is not None:
            # a backfill's slot that failed moves its backfill on before its lock goes: no
            # other replica takes that slot's turn meanwhile
            result = self._result(job, run, started)
            await self._record(job, attempt, result)
            await self._close(job, attempt)
        elif committed:
            await self._close(job, attempt)
            assert run.result is not None
            result = run.result
        else:
            await self._close(job, attempt)
            run.finished_at = None  # a failure ends when its rollback is done
            result = self._result(job, run, started)
            if run.executed:
                if run.state is not None:
                    run.state = _plan.fold(run.state, result, counted=job.limit is not None)
                await self._record(job, attempt, result)
        self.telemetry.record(
            span,
            result,
            jitter=jitter,
            lateness=None if result.outcome in (Outcome.LOCKED, Outcome.SKIPPED) else lateness,
            exc=run.exc,
        )
        return result, run.state
