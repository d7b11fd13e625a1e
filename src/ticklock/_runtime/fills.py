"""The backfills this replica runs: each one's slots in order, one tick at a time.

An operator's :meth:`~ticklock._operators.operations.SchedulerFleet.backfill` stores a request
(its slots, in order); every replica that has the job hears of it with its heartbeat (a
:class:`~ticklock._backends.seam.Control`'s ``backfills``) and runs it here. Each slot is a
tick under the job's lock that runs only when it is the backfill's turn (its progress, read
under the lock); its commit, or its failure record, moves the backfill on. So however many
replicas run one backfill, each slot runs once, in order, never beside another run of the job
(a run in flight holds the lock: the slot waits for it, as a trigger does).

With a ``pace``, slot ``i`` is due ``i / pace`` seconds after the replica began, and the job's
``overlap`` says what a slot that came due while the one before still ran does, as for a cron
fire: ``"skip"`` passes it over, ``"buffer_one"`` runs the latest such slot once the run ends
and passes over the others, ``"replace"`` ends the run when the next slot comes due.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from functools import partial

from .._backends.seam import Fill
from .._operators.fleet import Backfill, Fleet
from .._schedule.job import Job, Outcome
from .._telemetry import logger
from .crew import Crew
from .loop import Runs

WAIT = 0.2
"""Seconds before a slot whose job's lock was held is tried again (doubling, up to
:data:`MAX_WAIT`)."""
MAX_WAIT = 5.0


class Fills:
    """The backfills one scheduler runs (see the module docstring)."""

    def __init__(
        self,
        crew: Crew,
        fleet: Callable[[], Fleet],
        job_of: Callable[[str], Awaitable[Job | None]],
    ) -> None:
        self._crew = crew
        self._fleet = fleet
        self._job_of = job_of  # the job this replica has of that id (None: none, or disabled)
        self._serving: set[int] = set()

    def serve(self, job_id: str, requests: Sequence[int]) -> None:
        """Run each of backfills ``requests`` of job ``job_id`` that this replica does not
        run yet (if it has the job)."""
        runs = self._crew.runs
        if runs is None or not self._crew.running:
            return
        for request in requests:
            if request not in self._serving:
                self._serving.add(request)
                runs.start(
                    partial(self._serve, runs, job_id, request), f"ticklock.backfill {job_id}"
                )

    async def _serve(self, runs: Runs, job_id: str, request: int) -> None:
        try:
            job = await self._job_of(job_id)
            if job is not None and job.enabled:
                await self._fill(job, request)
        except Exception:  # a bug in ticklock itself, or the database gone: said, not raised
            logger.exception("backfill %d of %s stopped", request, job_id)
        finally:
            self._serving.discard(request)
            runs.ended()

    async def _fill(self, job: Job, request: int) -> None:
        crew, fleet = self._crew, self._fleet
        clock, runner = crew.clock, crew.runner
        assert runner is not None
        backfill = await fleet().backfill_state(request)
        if backfill is None:
            return
        pace = _Pace(backfill, clock.monotonic(), job.overlap or "skip")
        wait = WAIT
        while _open(backfill) and crew.running:
            assert backfill is not None
            index = backfill.done
            await clock.sleep_until(max(pace.due(index), clock.monotonic()))
            slot = backfill.slots[index]
            replaced_by, cut_at = pace.cut(backfill, index)
            fill = Fill(request, index, slot, backfill.who, replaced_by, cut_at)
            result, _ = await runner.execute(job, slot, fill=fill)
            runner.telemetry.count(job, result, None, 1, None, retried=False)
            backfill = await fleet().backfill_state(request)
            if backfill is not None and backfill.done == index and _open(backfill):
                # not run: a run of the job in flight (or between its batches), an outage,
                # or another run committed the slot meanwhile (then it is passed over)
                if result.outcome is Outcome.SKIPPED:
                    await fleet().pass_over(request, index, 1, committed=True)
                    backfill = await fleet().backfill_state(request)
                if backfill is not None and backfill.done == index:
                    await clock.sleep_until(clock.monotonic() + wait)
                    wait = min(wait * 2, MAX_WAIT)
                    pace.restart(index, clock.monotonic())  # that wait passes no slot over
                continue
            wait = WAIT
            if _open(backfill) and backfill is not None and backfill.done == index + 1:
                passed = pace.passed(backfill, clock.monotonic())
                if passed:
                    await fleet().pass_over(request, backfill.done, passed)
                    backfill = await fleet().backfill_state(request)


def _open(backfill: Backfill | None) -> bool:
    return backfill is not None and not backfill.finished and backfill.done < len(backfill.slots)


class _Pace:
    """When each slot of a paced backfill is due, and what its ``overlap`` does with those
    that came due while the slot before ran."""

    def __init__(self, backfill: Backfill, start: float, overlap: str) -> None:
        self.gap = 0.0 if not backfill.pace else 1.0 / backfill.pace
        self.start, self.first, self.overlap = start, backfill.done, overlap

    def restart(self, index: int, now: float) -> None:
        """Slot ``index`` is due ``now``, and the ones after it from there."""
        self.start, self.first = now, index

    def due(self, index: int) -> float:
        return self.start + (index - self.first) * self.gap

    def cut(self, backfill: Backfill, index: int) -> tuple[datetime | None, float | None]:
        """The next slot and when it ends the run of ``index`` (``overlap="replace"``)."""
        after = index + 1
        if not self.gap or self.overlap != "replace" or after >= len(backfill.slots):
            return None, None
        return backfill.slots[after], self.due(after)

    def passed(self, backfill: Backfill, now: float) -> int:
        """How many slots from ``backfill.done`` to pass over at ``now``: those due by now
        (``"skip"``), all but the latest of them (``"buffer_one"``)."""
        if not self.gap or self.overlap == "replace":
            return 0
        latest = self.first + math.floor((now - self.start) / self.gap)
        late = min(latest, len(backfill.slots) - 1) - backfill.done + 1
        if late <= 0:
            return 0
        return late if self.overlap == "skip" else late - 1
