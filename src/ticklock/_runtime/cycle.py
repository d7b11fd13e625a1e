"""One job's cycle on this replica: wait -> due -> look or tick -> after -> wait.

A :class:`Cycle` is its job's :class:`~.entry.Entry` and the record's only writer. It
asks the planner (:mod:`._plan`) what to do at every step and carries out the tagged value
it returns: it sets its :class:`~ticklock._runtime.loop.Timer` from the plan, starts attempts
through the :class:`~ticklock._runtime.runner.Runner`, and reads its role from the
:class:`~ticklock._runtime.sharing.Share`. The parts the cycles of one scheduler share are its
:class:`Crew`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timedelta
from functools import partial
from typing import NoReturn, cast

from .._backends.seam import NO_STATE, FleetState
from .._operators.health import health
from .._schedule.job import Job, JobHealth, Outcome, RunResult
from .._schedule.triggers import Cron
from .._telemetry import logger
from .crew import Crew
from .entry import Entry
from .loop import Dispatcher, Runs
from .plan import (
    GIVE_UP_FOR,
    NOBODY,
    Attempt,
    Delayed,
    GiveUp,
    Idle,
    LookAgain,
    OnTime,
    Plan,
    Recheck,
    Replan,
    Serve,
    TakeBack,
    after_run,
    busy,
    look,
    plan,
    queued,
    standing,
    steer,
)
from .sharing import GRACE

HORIZON = 60.0
"""Seconds ahead of now within which a job's or stored schedule's next slot gets a cycle (see
:mod:`.roster` and :mod:`.catalog`)."""
LOOK = 30.0
"""Seconds between two looks for the jobs and schedules due within the horizon (less than
it)."""


class Cycle(Entry):
    """The cycle of one job on this replica (see the module docstring). It is the job's
    :class:`~.entry.Entry`, so one object holds the record, the deadline and the
    cycle."""

    __slots__ = ("crew",)

    def __init__(self, job: Job, crew: Crew) -> None:
        super().__init__(job)
        self.crew = crew

    # -- waiting -------------------------------------------------------------------------

    def start(self, state: FleetState | None, now: datetime) -> None:
        """Begin the cycle at ``now`` from the fleet's ``state`` (``None``: not known yet)."""
        self.state, self.since = state, now
        self.own_failures, self.given_up_at = 0, None
        if self.job.enabled:
            self.wait(plan(self.job, state or NO_STATE, now))

    def reload(self, state: FleetState | None, now: datetime) -> None:
        """The database answers again: plan from the fleet's ``state``."""
        self.state = state
        if self.job.enabled and not self.running:
            self.wait(plan(self.job, state or NO_STATE, now))

    def stop(self) -> None:
        """Wait for nothing (shutdown, or the job was removed)."""
        self.crew.dispatcher.forget(self)

    def remove(self) -> None:
        """The job was removed: a run in flight finishes, nothing new starts."""
        self.removed = True
        self.stop()

    def wait(self, plan: Plan, now: datetime | None = None) -> None:
        """Wait for ``plan``: as the job's owner (or to serve a trigger), to attempt it; as a
        backup, to look at it a grace after its slot's latest fire (see :mod:`._sharing`).
        ``now``: the wall clock read just before, if any."""
        crew = self.crew
        self.stage = 0
        self.manual = isinstance(plan, Serve)  # a trigger request: this replica serves it
        self.attempt = plan.attempt if isinstance(plan, Delayed) else 1
        self.ahead, self.observer = self._role(self.attempt)
        lag = GRACE if self.ahead and isinstance(plan, (OnTime, Delayed, Serve)) else 0.0
        clock, jitter = crew.clock, 0.0
        # The wall clock first: the time between the two reads then makes the deadline late,
        # never early (a fixed delay must be at least the interval).
        if now is None and isinstance(plan, OnTime):
            now = clock.now()
        now_m = clock.monotonic()
        match plan:
            case Idle():  # paused, or the schedule is over
                self.slot = self.fire_at = None
                crew.dispatcher.forget(self)
                return
            case Recheck(delay):  # read the fleet's state again (no slot)
                self.slot = self.fire_at = None
                base = now_m + delay
            case Delayed(slot, delay):  # a retry
                self.slot = self.fire_at = slot
                base = now_m + delay
            case Serve(slot):  # a trigger request, at once
                self.slot = self.fire_at = slot
                base = now_m
            case OnTime(slot):
                jitter_max = self.job.trigger.jitter
                if lag:  # the owner's jitter is its own: the slot's latest fire
                    jitter = jitter_max
                elif jitter_max:
                    jitter = crew.random.uniform(0.0, jitter_max)
                self.slot = slot
                self.fire_at = slot + timedelta(seconds=jitter) if jitter else slot
                assert now is not None
                base = now_m + (self.fire_at - now).total_seconds()  # past: due now
        cron = isinstance(self.job.trigger, Cron) and isinstance(plan, OnTime)
        wall = self.fire_at if cron else None
        crew.dispatcher.set(self, base, lag=lag, wall=wall)

    def _role(self, attempt: int) -> tuple[tuple[str, ...], bool]:
        """The replicas ahead of this one for the next attempt (none: it attempts), and
        whether it only observes the job. A retry passes over the replica whose attempt
        failed; a trigger request is served by whichever replica hears of it."""
        if self.manual:
            self.role_version = -1
            return (), False
        state = self.state
        failed_by = state.last_owner if attempt > 1 and state is not None else None
        share = self.crew.share
        if failed_by is not None:
            self.role_version = -1
        elif self.role_version == share.version:  # nothing it depends on changed
            return self.ahead, self.observer
        else:
            self.role_version = share.version
        return share.role(self.job.id, failed_by)

    def fire(self) -> None:
        """The deadline came: attempt, or (a backup) look with the others due now."""
        if self.running:
            return
        self.running = True
        # a backup looks; so does a replica that found the lock held and looks again (a
        # recheck, no slot): the state read says whether a run ended meanwhile (health)
        if self.ahead or (self.slot is None and self.held_at is not None):
            self.crew.look(self)
        else:
            self._attempt()

    def _attempt(self) -> None:
        self.running = True
        assert self.crew.runs is not None
        runs = self.crew.runs
        runs.start(partial(self._tick, runs), f"ticklock.run {self.job.id}")

    def _live(self) -> bool:
        """Whether the cycle goes on (the job declared, the scheduler running); asks the
        watch to look again if operators steered the job while a run or look was out."""
        if self.steered:  # paused, resumed or triggered meanwhile
            self.steered = False
            self.crew.session.poke()
        return not self.removed and self.crew.running

    # -- a backup's look -----------------------------------------------------------------

    def look_later(self) -> None:
        """A backup's read waited behind this replica's own runs (see :func:`~.plan.queued`)."""
        if not self._live():
            return
        crew = self.crew
        match queued(self.slot, crew.clock.now()):
            case LookAgain(after):
                crew.dispatcher.again(self, crew.clock.monotonic() - self.base + after)
            case Attempt():
                self.looked(None, held=False)  # as a read that failed: attempt

    def looked(
        self, state: FleetState | None, *, held: bool, behind: Mapping[str, datetime] = NOBODY
    ) -> None:
        """A backup read the job's ``state`` (``None``: the read failed) and whether its lock
        is ``held``: plan from it if the fleet moved past the slot, else decide whether to
        attempt the slot now (see :mod:`._sharing`)."""
        if not self._live():
            return
        try:
            if state is None:
                self._attempt()
            else:
                self._looked(state, held, behind)
        except Exception:  # a bug in ticklock itself must not stop the job
            logger.exception("internal error in a look at %s", self.job.id)
            self.wait(Recheck(self.job.trigger.period))

    def _looked(self, state: FleetState, held: bool, behind: Mapping[str, datetime]) -> None:
        crew = self.crew
        self.state = state
        if crew.share.silenced:  # a replica passed over may be back
            crew.share.ran(state.last_owner, state.last_end)
        if self.own_failures:
            self._stand()
        now, now_m = crew.clock.now(), crew.clock.monotonic()
        running = held or busy(state, now)  # holding the lock, or the job between batches
        if running:
            self.held_at = self.held_at or now  # presume the run succeeds (health)
        held_for = 0.0 if self.held_at is None else (now - self.held_at).total_seconds()
        latest = behind.get(self.ahead[0]) if self.ahead else None  # behind up to that slot
        decision = look(
            self.job,
            state,
            self.slot,
            self.attempt,
            held=held,
            held_for=held_for,
            ahead=self.ahead,
            observer=self.observer,
            second=self.stage == 1,
            now=now,
            owner_behind=latest is not None and self.slot is not None and self.slot <= latest,
        )
        if not running:
            self.held_at = None
        match decision:
            case Replan():
                # the fleet moved past the slot: a run holding the lock now is another one;
                # a re-alignment (no slot) keeps when this replica first found it held
                if self.slot is not None:
                    self.held_at = None
                self.wait(plan(self.job, state, now))
            case LookAgain(after, second, missed):
                self._missed(missed, now)
                self.stage = 1 if second else self.stage
                crew.dispatcher.again(self, now_m - self.base + after)
            case Attempt(missed):
                self._missed(missed, now)
                crew.dispatcher.forget(self)
                self._attempt()

    def _missed(self, owners: tuple[str, ...], at: datetime) -> None:
        share = self.crew.share
        news = [owner for owner in owners if not share.silent(owner)]
        share.missed(owners, at)
        if news:
            logger.info(
                "%s: slot %s was still open %.2f s after its latest fire, its lock free: "
                "%s missed it; this replica passes %s over until %s again",
                self.job.id,
                self.slot,
                self.crew.clock.monotonic() - self.base,
                ", ".join(news),
                "it" if len(news) == 1 else "them",
                "it beats" if len(news) == 1 else "they beat",
                extra={"job_id": self.job.id},
            )

    # -- a tick --------------------------------------------------------------------------

    async def _tick(self, runs: Runs) -> None:
        """A run of the job: a task of ``runs`` (see :meth:`_attempt`)."""
        try:
            await self._run()
        except Exception:  # the run's own errors are recorded: this is ticklock's
            logger.exception("a run task failed")
        finally:
            runs.ended()

    async def _run(self) -> None:
        runner = self.crew.runner
        assert runner is not None
        before, attempt = self.state, self.attempt
        try:
            result, state = await runner.execute(
                self.job,
                self.slot,
                self.fire_at,
                self._jitter(),
                attempt=self.attempt,
                manual=self.manual,
            )
        except Exception:  # a bug in ticklock itself must not stop the job
            logger.exception("internal error in a tick of %s", self.job.id)
            if self._live():
                self.wait(Recheck(self.job.trigger.period))
            return
        finally:
            self.running = False
        self._observe(result, state)
        self._count(result)
        live = self._live()
        now = self.crew.clock.now()
        nxt = after_run(self.job, self.state or NO_STATE, now, result)
        retried = live and isinstance(nxt, Delayed) and nxt.slot == result.slot
        runner.telemetry.count(self.job, result, before, attempt, self.credit[2], retried=retried)
        if live:
            self.wait(nxt, now)

    def _jitter(self) -> float:
        """The jitter this replica added to the slot it runs (kept as ``fire_at``)."""
        slot, fire_at = self.slot, self.fire_at
        if slot is None or fire_at is None or fire_at is slot:
            return 0.0
        return (fire_at - slot).total_seconds()

    async def run_now(self) -> RunResult:
        """Run one tick now (slot = now), and plan from the state it read."""
        runner = self.crew.runner
        assert runner is not None
        self.by_hand += 1
        try:
            result, state = await runner.execute(self.job, None, manual=True)
        finally:
            self.by_hand -= 1
        self._observe(result, state)
        # not once the scheduler stops: its drain must start no new tick (G7)
        live = not self.removed and self.crew.running
        if state is not None and self.job.enabled and not self.running and live:
            self.wait(plan(self.job, state, self.crew.clock.now()))
        return result

    def _observe(self, result: RunResult, state: FleetState | None) -> None:
        if state is not None:
            self.state = state
            # locked with a state read: a batched run holds the job between its batches
            self.held_at = result.finished_at if result.outcome is Outcome.LOCKED else None
            if self.crew.share.silenced:  # a replica passed over may be back
                self.crew.share.ran(state.last_owner, state.last_end)
        elif result.outcome is Outcome.LOCKED:
            # when this replica first found it held, until a state read says otherwise: a
            # lock held attempt after attempt is not a run that ends within its timeout
            self.held_at = self.held_at or result.finished_at

    def _count(self, result: RunResult) -> None:
        """Count this replica's failed scheduled runs of the job in a row (since when), and
        ask the planner whether to give the job up or take it back."""
        if result.manual:
            return
        if result.outcome is Outcome.SUCCESS:
            self.own_failures = 0
        elif result.outcome in (Outcome.FAILURE, Outcome.TIMEOUT):
            self.own_failures += 1
        if self.own_failures or self.given_up_at is not None:  # else the standing is kept
            self._stand(result.error)

    def _stand(self, error: str | None = None) -> None:
        crew = self.crew
        job_id = self.job.id
        now = crew.clock.now()
        match standing(
            self.job,
            now,
            own_failures=self.own_failures,
            given_up_at=self.given_up_at,
            others_can_run=lambda: crew.share.others_can_run(job_id),
        ):
            case TakeBack():
                self.given_up_at, self.own_failures = None, 0
                logger.info("%s: this replica runs it again", job_id, extra={"job_id": job_id})
                crew.session.poke()
            case GiveUp():
                self.given_up_at = now
                logger.warning(
                    "%s: %d run%s of it in a row failed on this replica%s, while other "
                    "replicas can run it: this replica gives it up, ranking after every other "
                    "one for it, for %g minutes or until a run of it here succeeds",
                    job_id,
                    self.own_failures,
                    "" if self.own_failures == 1 else "s",
                    f" (last: {error})" if error else "",
                    GIVE_UP_FOR / 60,
                    extra={"job_id": job_id},
                )
                crew.session.poke()

    # -- what the fleet says -------------------------------------------------------------

    def control(self, paused_at: datetime | None, trigger_at: datetime | None) -> None:
        """Obey the operators: stop planning a paused job, plan a resumed one again from the
        fleet's state (its ``catch_up`` rule), and serve a trigger request."""
        if not self.job.enabled:
            return
        old = self.state or NO_STATE
        if paused_at is trigger_at is old.paused_at is old.trigger_at is None and not self.manual:
            return  # neither paused nor triggered, before or now: nothing to obey (each beat)
        now = self.crew.clock.now()
        was, asked = old.paused_at, old.trigger_at
        state = self.state = replace(old, paused_at=paused_at, trigger_at=trigger_at)
        if was is not None and paused_at is None:  # resumed: the pause is not overdue
            base, paused, _ = self.credit
            if base != state.last_end:
                base, paused = state.last_end, 0.0
            self.credit = (base, paused + max(0.0, (now - was).total_seconds()), now)
        if self.running:
            # the run's end plans from the state it read under the lock, which may be older
            # than this: it asks the watch to look again then
            self.steered |= was != paused_at or asked != trigger_at
            return
        if self.removed:
            return
        toggled = (was is None) != (paused_at is None)
        steered = steer(self.job, state, now, toggled=toggled, serving=self.manual)
        if steered is not None:
            self.wait(steered)

    def view_changed(self) -> None:
        """A new view of the live replicas: wait for the same slot, as owner or as backup as
        the view now says."""
        if self.running or self.removed or self.manual or not self.queued:
            return
        self.role_version = -1  # taken anew, in the view that changed
        role = self._role(self.attempt)
        if role == (self.ahead, self.observer):
            return
        self.ahead, self.observer = role  # the role its version was taken at
        if self.slot is not None and self.attempt == 1:  # a slot, not a retry's delay
            # the same slot: an owner at it plus its own jitter, a backup a grace after its
            # latest fire (the owner's jitter is not this replica's)
            self.wait(OnTime(self.slot))
        else:
            self.crew.dispatcher.again(self, GRACE if self.ahead and self.slot else 0.0)

    def health(self, now: datetime, clock_now: datetime, *, problem: str | None) -> JobHealth:
        """The job's health at ``now`` as this replica sees it."""
        return health(self, now, clock_now, running=self.crew.running, problem=problem)


async def drive(dispatcher: Dispatcher) -> NoReturn:
    """The runtime's loop, forever: each job's timer that comes due fires its cycle (every
    timer of the dispatcher is a :class:`Cycle`), after the pass that found them due, so that
    a deadline a fire sets is served by the next pass."""
    while True:
        for timer in await dispatcher.due():
            cast(Cycle, timer).fire()
