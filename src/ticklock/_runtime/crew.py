"""What the job cycles of one scheduler share, and the backups' looks they read together."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from random import Random
from typing import Protocol

import anyio

from .._backends.seam import Coordinator, FleetState, Session
from .._schedule.job import Job
from .._telemetry import logger
from .clock import Clock
from .entry import Entry
from .loop import Dispatcher, Runs
from .plan import NOBODY, behind
from .runner import Runner
from .sharing import Share

READ_LIMIT = 5.0
"""Seconds a backups' look may take before they attempt instead."""


class Looker(Protocol):
    """A job's cycle, as a look sees it."""

    job: Job
    running: bool

    def looked(
        self, state: FleetState | None, *, held: bool, behind: Mapping[str, datetime] = NOBODY
    ) -> None:
        """The look read ``state`` (``None``: the read failed), whether the lock is held,
        and the replicas behind (see :func:`~.plan.behind`)."""
        ...

    def look_later(self) -> None:
        """The read waited behind this replica's own runs: look again a grace later."""
        ...


class _Unopened:
    """The session of a coordinator that is not open: nothing to tell."""

    async def connected(self) -> None:
        """Not open: nothing to wait for."""

    def poke(self) -> None:
        """No watch to wake."""

    def stalled(self, job_id: str | None, seconds: float) -> None:
        """No ledger to keep it for."""


UNOPENED: Session = _Unopened()


@dataclass(eq=False)
class Crew:
    """What the cycles of one scheduler share: its clock, timer, view of the fleet and, while
    it runs, its coordinator, runner and runs."""

    clock: Clock
    random: Random
    dispatcher: Dispatcher
    share: Share
    coordinator: Coordinator
    session: Session = UNOPENED
    """The coordinator while it is open (a run of the scheduler)."""
    runner: Runner | None = None
    runs: Runs | None = None
    running: bool = False
    """The scheduler runs (not starting or stopping): cycles plan only then."""
    looks: list[Looker] = field(default_factory=list)
    """Backups' looks due now, read together in one statement."""

    def look(self, cycle: Looker) -> None:
        """Read ``cycle``'s job with every other look due now."""
        self.looks.append(cycle)
        if len(self.looks) == 1:
            runs = self.runs
            assert runs is not None
            runs.start(partial(self._read, runs), "ticklock.look")

    async def _read(self, runs: Runs) -> None:
        """The looks' read: a task of ``runs`` (see :meth:`look`)."""
        try:
            await self._look()
        except Exception:
            logger.exception("a run task failed")
        finally:
            runs.ended()

    async def _look(self) -> None:
        looks, self.looks = self.looks, []
        states: dict[str, FleetState] | None = None
        held: frozenset[str] = frozenset()
        queued = False  # the read waited behind this replica's own runs
        try:
            with anyio.fail_after(READ_LIMIT):
                states, held = await self.coordinator.read([c.job.id for c in looks])
        except TimeoutError as exc:
            # no answer in time while this replica's own runs are in flight: the read
            # queued for a connection behind them (a burst), as an attempt would
            queued = self.runs is not None and self.runs.in_flight > 1  # > this look
            logger.debug("reading the state of %d jobs timed out: %s", len(looks), exc)
        except Exception as exc:  # the attempts meet the same error, and report it
            logger.debug("reading the state of %d jobs failed: %s", len(looks), exc)
        finally:  # cancelled (shutdown) too: never leave a job marked as running
            for cycle in looks:
                cycle.running = False
        late = NOBODY if states is None else behind(states.values(), self.clock.now())
        for cycle in looks:
            job_id = cycle.job.id
            if queued:  # attempts would queue behind the same runs: look again instead
                cycle.look_later()
            elif states is None:
                cycle.looked(None, held=False)
            else:
                state = states.get(job_id) or FleetState()
                cycle.looked(state, held=job_id in held, behind=late)


def last_successes(entries: list[Entry]) -> list[tuple[str, datetime]]:
    """The last success of every job that has one (the telemetry's gauge)."""
    return [
        (entry.job.id, state.last_success_at)
        for entry in entries
        if (state := entry.state) is not None and state.last_success_at is not None
    ]
