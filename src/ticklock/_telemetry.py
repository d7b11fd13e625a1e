"""OpenTelemetry spans and metrics and the stdlib log lines of every tick.

Only ``opentelemetry-api`` is needed: with no SDK configured every call is a no-op.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Span, Status, StatusCode

from ._schedule.job import REPLACED, Job, Outcome, RunResult
from ._schedule.triggers import Every

if TYPE_CHECKING:
    from ._backends.seam import FleetState

logger = logging.getLogger("ticklock")

NAME = "ticklock"
JOB_ID = "ticklock.job.id"
OUTCOME = "ticklock.run.outcome"
SLOT = "ticklock.run.slot"
OWNER = "ticklock.run.owner"
JITTER = "ticklock.run.jitter"
LATENESS = "ticklock.run.lateness"
_ERRORS = frozenset({Outcome.FAILURE, Outcome.TIMEOUT, Outcome.ERROR})
_QUIET = frozenset({Outcome.LOCKED, Outcome.SKIPPED})
_LEVELS = dict.fromkeys(_ERRORS, logging.ERROR) | dict.fromkeys(_QUIET, logging.DEBUG)
_TRACED = frozenset({Outcome.FAILURE, Outcome.TIMEOUT})
_UNCOUNTED = frozenset({Outcome.LOCKED, Outcome.SKIPPED, Outcome.CANCELLED})
REASON = "ticklock.slot.reason"
OVERLAPPED = "the run before was still running"
REPLACED_REASON = "replaced"
OUTSIDE = "outside the catch-up window"

LastSuccesses = Callable[[], Iterable[tuple[str, datetime]]]


class Telemetry:
    """The tracer, the instruments and the logger of one scheduler."""

    def __init__(
        self,
        last_successes: LastSuccesses,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        from . import __version__

        self._last_successes = last_successes
        self._own_tracer_provider = tracer_provider is not None
        self.tracer = trace.get_tracer(NAME, __version__, tracer_provider=tracer_provider)
        meter = metrics.get_meter(NAME, __version__, meter_provider=meter_provider)
        self.duration = meter.create_histogram(
            "ticklock.run.duration", unit="s", description="Duration of tick attempts."
        )
        self.runs = meter.create_counter(
            "ticklock.runs", unit="{run}", description="Tick attempts, by job and outcome."
        )
        slot = "{slot}"
        self.owed = meter.create_counter(
            "ticklock.slots.owed", unit=slot, description="Slots the schedule owed, by job."
        )
        self.committed = meter.create_counter(
            "ticklock.slots.committed", unit=slot, description="Slots committed, by job."
        )
        self.missed = meter.create_counter(
            "ticklock.slots.missed",
            unit=slot,
            description="Slots no run attempted (a later run covered them with catch_up), by job.",
        )
        self.failed = meter.create_counter(
            "ticklock.slots.failed",
            unit=slot,
            description="Slots whose last allowed attempt failed or timed out, by job.",
        )
        self.skipped = meter.create_counter(
            "ticklock.slots.skipped",
            unit=slot,
            description="Slots not run by a policy, by job and reason: the run before was "
            "still running (overlap), replaced, outside the catch-up window.",
        )
        self.backfilled = meter.create_counter(
            "ticklock.slots.backfilled",
            unit=slot,
            description="Slots of a backfill committed, by job.",
        )
        self.capped = meter.create_counter(
            "ticklock.runs.capped",
            unit="{run}",
            description="Successful runs that max_batches stopped with a backlog left, by job.",
        )
        self.lateness = meter.create_histogram(
            "ticklock.run.lateness",
            unit="s",
            description="Start of a run minus its intended instant (slot plus jitter).",
        )
        meter.create_observable_gauge(
            "ticklock.job.last_success",
            callbacks=[self._observe],
            unit="s",
            description="Unix time of each job's last successful run (fleet-wide).",
        )

    def tracing(self) -> bool:
        """Whether spans can be recorded: a provider was given, or a global one was set."""
        return self._own_tracer_provider or not isinstance(
            trace.get_tracer_provider(), trace.ProxyTracerProvider
        )

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(when.timestamp(), {JOB_ID: job_id})
            for job_id, when in self._last_successes()
        ]

    def record(
        self,
        span: Span,
        result: RunResult,
        *,
        jitter: float,
        lateness: float | None,
        exc: BaseException | None,
    ) -> None:
        """Put the outcome on the span, the metrics and the log."""
        outcome = result.outcome.value
        if span.is_recording():
            span.set_attributes({OUTCOME: outcome, OWNER: result.owner, JITTER: jitter})
            if result.slot is not None:
                span.set_attribute(SLOT, result.slot.isoformat())
            if lateness is not None:
                span.set_attribute(LATENESS, lateness)
            if result.outcome in _ERRORS:
                if exc is not None:
                    span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, result.error))
        attributes = {JOB_ID: result.job_id, OUTCOME: outcome}  # with no SDK: no-ops
        self.runs.add(1, attributes)
        self.duration.record((result.finished_at - result.started_at).total_seconds(), attributes)
        if result.capped:
            self.capped.add(1, {JOB_ID: result.job_id})
        if lateness is not None:
            self.lateness.record(lateness, {JOB_ID: result.job_id})
        self._log(result, exc)

    def count(
        self,
        job: Job,
        result: RunResult,
        before: FleetState | None,
        attempt: int,
        resumed: datetime | None,
        *,
        retried: bool,
    ) -> None:
        """Count a run that ended in the slot counters: its slot (owed at its first attempt,
        with the slots missed before it), and its fate; nothing for a run that owes no slot
        (manual, or one that did not execute). ``before``: the fleet's state before it;
        ``resumed``: when this replica last saw the job resumed; ``retried``: the slot runs
        again, so a failure is not its last."""
        outcome = result.outcome
        attributes = {JOB_ID: job.id}
        if result.backfilled_by is not None:  # an operator's, after the fact: not owed now
            if outcome is Outcome.SUCCESS:
                self.backfilled.add(1, attributes)
            return
        replaced = outcome is Outcome.CANCELLED and (result.error or "").startswith(REPLACED)
        if result.manual or (outcome in _UNCOUNTED and not replaced):
            return
        first = attempt == 1
        missed = unattempted(job, before, result, resumed) if first else 0
        overlapped, outside = passed_over(job, before, result) if missed else (0, 0)
        overlapped = min(overlapped, missed)
        outside = min(outside, missed - overlapped)
        missed -= overlapped + outside
        committed = outcome is Outcome.SUCCESS
        failed = not committed and not retried and not replaced
        if first:
            self.owed.add(1 + missed + overlapped + outside, attributes)
        if missed:
            self.missed.add(missed, attributes)
        if overlapped:
            self.skipped.add(overlapped, {JOB_ID: job.id, REASON: OVERLAPPED})
        if outside:
            self.skipped.add(outside, {JOB_ID: job.id, REASON: OUTSIDE})
        if replaced:
            self.skipped.add(1, {JOB_ID: job.id, REASON: REPLACED_REASON})
        if committed:
            self.committed.add(1, attributes)
        elif failed:
            self.failed.add(1, attributes)

    def _log(self, result: RunResult, exc: BaseException | None) -> None:
        level = _LEVELS.get(result.outcome, logging.INFO)
        if not logger.isEnabledFor(level):
            return
        slot = result.slot.isoformat() if result.slot is not None else "-"
        report = json.dumps(result.report) if result.report is not None else "-"
        logger.log(
            level,
            "run %s slot=%s outcome=%s duration=%.3fs%s report=%s%s",
            result.job_id,
            _millis(result.slot) if result.slot is not None else "-",
            result.outcome.value,
            result.duration,
            f" batches={result.batches}{' capped' if result.capped else ''}"
            if result.batches or result.capped
            else "",
            report,
            f" error={result.error}" if result.error else "",
            # No traceback for 'error': the coordinator logs an outage once, with its cause.
            exc_info=_from_user(exc) if result.outcome in _TRACED and exc is not None else None,
            extra={
                "job_id": result.job_id,
                "slot": slot,
                "outcome": result.outcome.value,
                "duration": result.duration,
                "report": result.report,
                "owner": result.owner,
                "error": result.error,
                "batches": result.batches,
                "capped": result.capped,
            },
        )


EXACT_STEPS = 60
"""The fires :func:`unattempted` counts one by one; past them it estimates the rest."""


def unattempted(
    job: Job, state: FleetState | None, result: RunResult, resumed: datetime | None = None
) -> int:
    """How many slots the schedule owed before ``result``'s that no run attempted, not
    counting those before ``resumed`` (the job was paused then): since the fleet's last
    attempted slot (committed or failed) for cron; for ``every``, the intervals that passed
    between the slot and the run's start (jitter aside). They were missed, and with
    ``catch_up`` this run covers them. Past :data:`EXACT_STEPS` fires it estimates the rest
    from their mean gap, so that a long outage costs a run no more than that many steps."""
    slot, trigger = result.slot, job.trigger
    if state is None or slot is None:
        return 0
    if isinstance(trigger, Every):
        start = slot if resumed is None or resumed < slot else resumed
        late = (result.started_at - start).total_seconds() - trigger.jitter
        return max(0, int(late // trigger.interval))
    attempted = [t for t in (state.last_slot, state.failed_slot, resumed) if t is not None]
    base = max(attempted, default=None)
    if base is None or base >= slot:
        return 0
    count, at = 0, trigger.next_fire(base)
    while at is not None and at < slot:
        count += 1
        if count == EXACT_STEPS:
            mean = (at - base) / count
            return count + max(0, math.ceil(round((slot - at) / mean, 6)) - 1)
        at = trigger.next_fire(at)
    return count


def passed_over(job: Job, state: FleetState | None, result: RunResult) -> tuple[int, int]:
    """Of the cron fires before ``result``'s slot that no run attempted (see
    :func:`unattempted`), those that came while the run before ran (the ``overlap`` policy
    skipped them), and those older than a ``catch_up`` duration before the run's start; at
    most :data:`EXACT_STEPS` fires looked at."""
    slot, trigger = result.slot, job.trigger
    if state is None or slot is None or isinstance(trigger, Every):
        return 0, 0
    ran = max((t for t in (state.last_slot, state.failed_slot) if t is not None), default=None)
    if ran is None:
        return 0, 0
    end = state.last_end
    floor = None
    if not isinstance(job.catch_up, bool):
        floor = result.started_at - timedelta(seconds=job.catch_up + trigger.jitter)
    overlapped = outside = 0
    at = trigger.next_fire(ran)
    for _ in range(EXACT_STEPS):
        if at is None or at >= slot:
            break
        if end is not None and at <= end:
            overlapped += 1
        elif floor is not None and at < floor:
            outside += 1
        at = trigger.next_fire(at)
    return overlapped, outside


def _millis(slot: datetime) -> str:
    """``slot`` for the log line, rounded to the millisecond (an ``every`` job's slot has
    microseconds; a whole second shows none); the record's ``slot`` keeps them all."""
    shown = slot + timedelta(microseconds=500)
    shown = shown.replace(microsecond=shown.microsecond // 1000 * 1000)
    return shown.isoformat(timespec="milliseconds" if shown.microsecond else "seconds")


_PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def _from_user(
    exc: BaseException,
) -> tuple[type[BaseException], BaseException, TracebackType | None]:
    """``exc`` for the log, its traceback starting at the first frame outside ticklock (the
    user's handler), without the frames of the machinery that called it (``_runner._hold``,
    ``runner.watch``...); the whole traceback when no frame is the user's. ``exc`` itself,
    and its ``__traceback__`` that OpenTelemetry records, stay as they are."""
    whole = exc.__traceback__
    tb = whole
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
        tb = tb.tb_next
    return type(exc), exc, tb or whole
