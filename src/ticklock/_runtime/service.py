"""One run of a scheduler: open its coordinator, load the fleet's state, start every job's
cycle, hand the cycles what the fleet says (operators' changes, the live replicas), and drain
the runs in flight at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from functools import partial
from itertools import chain

import anyio
from anyio.abc import TaskGroup, TaskStatus

from .._backends.seam import Control, Coordinator, Declared, FleetState
from .._errors import StartupError
from .._operators.fleet import Fleet
from .._schedule.job import Job, declaration
from .._telemetry import logger
from .catalog import Catalog
from .crew import UNOPENED, Crew
from .cycle import Cycle, drive
from .fills import Fills
from .loop import Runs
from .roster import Roster
from .runner import Runner
from .sharing import Member, Share

LOAD_RETRY = 30.0
"""Seconds before reading the fleet's state again after an error."""
VIEW_CHUNK = 100
"""Jobs that take their role in a new view between two passes of the event loop."""
_NO_CONTROL = Control(None, None)


class Service:
    """Runs the cycles of one scheduler (its ``cycles``, which may change while it runs)."""

    def __init__(
        self,
        crew: Crew,
        roster: Roster,
        catalog: Catalog,
        coordinator: Coordinator,
        runner: Runner,
        owner: str,
        *,
        require_database: bool,
        shutdown_grace: float,
        mode: str,
        builtin: str,
        tasks: Mapping[str, object],
        fleet: Callable[[], Fleet],
    ) -> None:
        self._crew = crew
        self._roster = roster
        self._catalog = catalog
        self._coordinator = coordinator
        self.owner = owner
        self._require_database = require_database
        self._shutdown_grace = shutdown_grace
        self._mode = mode
        self._builtin = builtin  # the built-in job's id (said apart in the start line)
        self._tasks = tasks
        self._fills = Fills(crew, fleet, self._job_of)  # the backfills this replica runs
        crew.coordinator, crew.runner = coordinator, runner
        crew.share = Share(owner, catalog.task_of)  # no view until this run's first heartbeat
        self._disagree: dict[str, tuple[str, ...]] = {}  # replicas declaring a job otherwise

    async def run(self, task_status: TaskStatus[None]) -> None:
        """Until cancelled (see :meth:`Scheduler.run <ticklock.Scheduler.run>`)."""
        crew, coordinator = self._crew, self._coordinator
        try:
            async with coordinator.session() as session:
                crew.session = session
                crew.dispatcher.stalled = session.stalled  # the ledger names its loop's stalls
                states = await self._first_load()
                async with anyio.create_task_group() as tg:
                    runs = crew.runs = Runs()
                    await tg.start(runs.serve)
                    # beside the runs, so that their timeouts fire while they drain
                    runs.service(partial(drive, crew.dispatcher), "ticklock.dispatcher")
                    try:
                        await self._serve(tg, states, task_status)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self._drain(runs)
        except StartupError as exc:
            logger.error("%s", exc)  # one line: the message names the cause and the fix
            raise
        except Exception:
            logger.exception("the scheduler stopped on an error")
            raise
        finally:
            crew.running = False
            crew.runs = None
            crew.session = UNOPENED
            for cycle in self._all():
                cycle.stop()

    async def _first_load(self) -> dict[str, FleetState] | None:
        """The fleet's state at start (``None`` while the database does not answer, or refuses
        the read: logged, and read again later); with ``require_database=True`` a refusal
        fails the start."""
        coordinator = self._coordinator
        if coordinator.problem is not None:
            return None
        try:
            return await self._load()
        except Exception as exc:
            if self._require_database:
                raise StartupError(coordinator.diagnose(exc).text) from exc
            logger.error("%s", coordinator.diagnose(exc).text)
            return None

    async def _serve(
        self, tg: TaskGroup, states: dict[str, FleetState] | None, task_status: TaskStatus[None]
    ) -> None:
        self._crew.running = True
        # Plan from when the fleet's state is known, not from before it was read: a first
        # slot planned before the load would start late by however long the load took.
        self._roster.start(states, self._crew.clock.now())
        if states is None:  # the database did not answer: its ticks end as error meanwhile
            tg.start_soon(self._connect, name="ticklock.connect")
        tg.start_soon(self._roster.follow, name="ticklock.jobs")
        tg.start_soon(self._catalog.follow, name="ticklock.schedules")
        tg.start_soon(self._coordinator.watch, self, name="ticklock.watch")
        jobs = self._roster.jobs
        user = sum(1 for job_id in jobs if job_id != self._builtin)
        logger.info(
            "scheduler started (%s mode, %d job%s%s, owner %s)",
            self._mode,
            user,
            "" if user == 1 else "s",
            f" and the built-in {self._builtin}" if self._builtin in jobs else "",
            self.owner,
        )
        task_status.started()
        await anyio.sleep_forever()

    async def _load(self) -> dict[str, FleetState] | None:
        """The fleet's state of every job declared here (``None`` if the database stopped
        answering): the enabled ones registered, the disabled ones read (their health)."""
        declared = self._roster.jobs
        jobs = {job_id: job for job_id, job in declared.items() if job.enabled}
        disabled = [job_id for job_id in declared if job_id not in jobs]
        try:
            states = await self._coordinator.load(jobs, self._crew.clock.now())
            if disabled:
                states = {**(await self._coordinator.read(disabled))[0], **states}
            return states
        except Exception as exc:
            if not self._coordinator.diagnose(exc).lost:
                raise
            return None  # the coordinator is no longer ready

    async def _connect(self) -> None:
        """Wait for the database, then re-plan every job from the fleet's state."""
        clock = self._crew.clock
        states = None
        while states is None:
            await self._crew.session.connected()
            try:
                states = await self._load()
            except Exception as exc:  # e.g. no permission on the tables: say so, try later
                logger.error("%s", self._coordinator.diagnose(exc).text)
                await clock.sleep_until(clock.monotonic() + LOAD_RETRY)
        self._roster.reload(states, clock.now())
        await self._catalog.reload()

    async def _drain(self, runs: Runs) -> None:
        self._crew.running = False
        for cycle in self._all():
            cycle.stop()
        await runs.drain(self._shutdown_grace)
        logger.info("scheduler stopped")

    def _all(self) -> Iterator[Cycle]:
        """Every cycle held here: of the jobs declared in code, and of stored schedules."""
        return chain(self._roster.cycles.values(), self._catalog.cycles.values())

    # -- the runtime's side of the coordinator's watch (a Watcher) --------------------------

    def declared(self) -> Declared:
        """What this replica publishes: its jobs, their fingerprints, those it gave up, and
        its tasks."""
        roster = self._roster
        enabled = tuple(i for i, job in roster.jobs.items() if job.enabled)
        return Declared(
            enabled,
            tuple(i for i, job in roster.jobs.items() if not job.enabled),
            roster.fingerprints(enabled),
            tuple(sorted(c.job.id for c in self._all() if c.given_up_at is not None)),
            tuple(sorted(self._tasks)),
        )

    def apply(self, controls: Mapping[str, Control]) -> None:
        """Hand each job what operators asked of it (paused since, a trigger request)."""
        if not self._crew.running:
            return
        for job_id in controls:  # a sleeping job operators steer is held from now
            self._roster.wake(job_id)
        for cycle in self._all():
            control = controls.get(cycle.job.id, _NO_CONTROL)
            cycle.control(control.paused_at, control.trigger_at)
        self._catalog.beat(controls)
        for job_id, control in controls.items():
            if control.backfills:
                self._fills.serve(job_id, control.backfills)

    async def _job_of(self, job_id: str) -> Job | None:
        """The job of that id this replica has: declared in code, or a stored schedule of
        one of its tasks (its cycle built now if it is not held)."""
        held = self._roster.cycles.get(job_id) or self._catalog.cycles.get(job_id)
        if held is not None:
            return held.job
        job = self._roster.jobs.get(job_id)
        if job is not None:
            return job
        cycle = await self._catalog.hold(job_id)
        return None if cycle is None else cycle.job

    async def members(self, members: Mapping[str, Member], seen: Mapping[str, datetime]) -> None:
        """A new view of the live replicas: each waiting job takes its role in it, a chunk of
        :data:`VIEW_CHUNK` jobs at a time, so that the runs and timers due meanwhile are not
        held up (a job not reached yet waits as the view before had it, as when this replica
        hears of a change later than the others; a job that plans meanwhile plans in the new
        view)."""
        if not self._crew.share.update(members, seen) or not self._crew.running:
            return
        roster, catalog = self._roster, self._catalog
        jobs = [*roster.jobs.values(), *(c.job for c in catalog.cycles.values())]
        for i, job in enumerate(jobs):
            if i and not i % VIEW_CHUNK:
                await anyio.lowlevel.checkpoint()
                if not self._crew.running:
                    return
            if job.enabled and job.task is None:
                self._disagreement(job)
            if (cycle := roster.cycles.get(job.id) or catalog.cycles.get(job.id)) is not None:
                cycle.view_changed()

    def _disagreement(self, job: Job) -> None:
        """Log once per change when live replicas declare ``job`` otherwise than the ruling
        declaration (the one most of them share; between as many, the one whose replicas
        started first)."""
        share = self._crew.share
        others = share.disagreement(job.id)
        if others == self._disagree.get(job.id, ()):
            return
        if others:
            self._disagree[job.id] = others
            logger.warning(
                "%s: the live replicas declare it differently: %s declare it otherwise than "
                "%s, whose declaration rules (most replicas share it): only they run it; this "
                "replica declares %s",
                job.id,
                ", ".join(others),
                ", ".join(sorted(share.ranking(job.id))),
                declaration(job),
                extra={"job_id": job.id},
            )
        else:
            del self._disagree[job.id]
            logger.info("%s: the live replicas declare it alike again", job.id)
