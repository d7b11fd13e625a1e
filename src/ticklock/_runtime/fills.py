"""The backfills this replica runs: each one's slots in order, one tick at a time.

An operator's :meth:`~ticklock._operators.operations.SchedulerFleet.backfill` stores a request
(its slots, in order); every replica that has the job hears of it with its heartbeat (a
:class:`~ticklock._backends.seam.Control`'s ``backfills``) and runs it here. Each slot is a
tick under the job's lock that runs only when it is the backfill's turn (its progress, read
under the lock); its commit, or its failure record, moves the backfill on. So however many
replicas run one backfill, each slot runs once, in order, never beside another run of the job
(a run in flight holds the lock: the slot waits for it, as a trigger does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    def __init__(self, crew: Crew, fleet: Callable[[], Fleet]) -> None:
        self._crew = crew
        self._fleet = fleet
        self._serving: set[int] = set()

    def serve(self, job: Job, requests: Sequence[int]) -> None:
        """Run each of backfills ``requests`` of ``job`` that this replica does not run yet."""
        runs = self._crew.runs
        if runs is None or not self._crew.running:
            return
        for request in requests:
            if request not in self._serving:
                self._serving.add(request)
                runs.start(partial(self._serve, runs, job, request), f"ticklock.backfill {job.id}")

    async def _serve(self, runs: Runs, job: Job, request: int) -> None:
        try:
            await self._fill(job, request)
        except Exception:  # a bug in ticklock itself, or the database gone: said, not raised
            logger.exception("backfill %d of %s stopped", request, job.id)
        finally:
            self._serving.discard(request)
            runs.ended()

    async def _fill(self, job: Job, request: int) -> None:
        crew = self._crew
        clock, runner = crew.clock, crew.runner
        assert runner is not None
        backfill = await self._fleet().backfill_state(request)
        wait, due = WAIT, clock.monotonic()
        while (
            backfill is not None
            and not backfill.finished
            and backfill.done < len(backfill.slots)
            and crew.running
        ):
            await clock.sleep_until(due)
            index = backfill.done
            slot = backfill.slots[index]
            result, _ = await runner.execute(
                job, slot, fill=Fill(request, index, slot, backfill.who)
            )
            runner.telemetry.count(job, result, None, 1, None, retried=False)
            if result.outcome in (Outcome.LOCKED, Outcome.ERROR):  # a run in flight, an outage
                due, wait = clock.monotonic() + wait, min(wait * 2, MAX_WAIT)
            else:  # ran, failed, or another replica had run it: on to the next
                wait = WAIT
                due = max(clock.monotonic(), due + _gap(backfill))
            backfill = await self._fleet().backfill_state(request)


def _gap(backfill: Backfill) -> float:
    """Seconds between two slots of ``backfill`` (its ``pace``: slots per second)."""
    return 0.0 if not backfill.pace else 1.0 / backfill.pace
