"""What a job does next, from the fleet's state: pure functions, the same on every replica.

- :func:`plan`: what a job waits for next (:data:`Plan`), at start, after a run, after a
  pause, resume or view change;
- :func:`look`: what a backup does when it has read a slot's state (:data:`Look`, see
  :mod:`._sharing`);
- :func:`admit`: whether a tick that holds the lock runs its handler, and for which slot
  (:data:`Admission`);
- :func:`busy`: whether a batched run holds the job between two of its batches;
- :func:`fold`: the fleet's state once a run that executed is recorded (the one fold: the
  memory backend applies it, and PostgreSQL's statements are held to it by
  ``tests/test_contract.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from types import MappingProxyType

from .._backends.seam import FleetState
from .._schedule.job import Job, Outcome, RunResult
from .sharing import GRACE, STEP
from .slots import completed, first, next_slot, stale, windowed


@dataclass(frozen=True, slots=True)
class OnTime:
    """Run ``slot`` at its instant (plus this replica's jitter)."""

    slot: datetime


@dataclass(frozen=True, slots=True)
class Delayed:
    """Run ``slot`` ``delay`` seconds from now, without jitter, as attempt ``attempt``: a
    retry."""

    slot: datetime
    delay: float
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class Serve:
    """Serve the trigger request made at ``slot``: one manual run, at once."""

    slot: datetime


@dataclass(frozen=True, slots=True)
class Recheck:
    """Read the fleet's state again in ``delay`` seconds (the lock was held elsewhere)."""

    delay: float


@dataclass(frozen=True, slots=True)
class Idle:
    """Wait for nothing: the job is paused, or its schedule is over."""


Plan = OnTime | Delayed | Serve | Recheck | Idle
"""What a job waits for next."""
IDLE = Idle()


def plan(job: Job, state: FleetState, now: datetime, result: RunResult | None = None) -> Plan:
    """What ``job`` does next, given the fleet's ``state`` (with ``result`` folded in) and the
    ``result`` of the attempt that just ended (``None``: at start, or when re-aligning).
    A paused job waits for nothing."""
    if state.paused_at is not None or completed(job, state):
        return IDLE
    if result is not None and result.outcome is Outcome.LOCKED:
        if busy(state, now):  # a batched run elsewhere: look again once its hold has ended
            assert state.busy_until is not None
            return Recheck(max(STEP, (state.busy_until - now).total_seconds() + STEP))
        # running elsewhere: look again once that run must have ended, or its holder (paused,
        # frozen) is past its bound and the attempt ends it; never later than a period, nor
        # (overlap "replace") than the next fire, which replaces the run of an older slot
        delay = min(job.trigger.period, hold_limit(job))
        fire = job.trigger.next_fire(now) if job.overlap == "replace" else None
        if fire is not None:
            delay = min(delay, (fire - now).total_seconds() + STEP)
        return Recheck(delay)
    retry = _retry(job, state, now)
    if retry is not None:
        return retry
    if result is None or result.outcome is Outcome.SKIPPED:
        return on_time(first(job, state, now))
    return on_time(windowed(job, next_slot(job, result.finished_at, result.slot)))


def after_run(job: Job, state: FleetState, now: datetime, result: RunResult) -> Plan:
    """What ``job`` waits for once an attempt ended with ``result`` (``state``: the fleet's,
    as read under the lock, with ``result`` folded in)."""
    if result.manual:
        if state.trigger_at is None or result.outcome is Outcome.SUCCESS:
            # served (or not ours to serve): back to the schedule, from the fleet's state
            executed = result.outcome not in (Outcome.LOCKED, Outcome.SKIPPED)
            return plan(job, state, now, result if executed else None)
        return plan(job, state, now)  # it failed to start: again at the next beat, not in a loop
    if state.trigger_at is not None:
        return Serve(state.trigger_at)  # asked for while this run ran
    return plan(job, state, now, result)


def steer(
    job: Job, state: FleetState, now: datetime, *, toggled: bool, serving: bool
) -> Plan | None:
    """What ``job`` waits for once operators changed its pause or trigger request (``state``
    holds the new ones; ``toggled``: paused or resumed; ``serving``: it waits to serve a
    request already), or ``None`` to keep waiting as it does."""
    if state.trigger_at is not None:
        return None if serving else Serve(state.trigger_at)
    if toggled or serving:  # resumed by the catch_up rule, paused, or the request was served
        return plan(job, state, now)
    return None


def hold_limit(job: Job) -> float:
    """Seconds a run of ``job`` can hold its lock: its timeout, the server's bound on a paused
    holder (a second more) and a grace. A holder found past it is ended by the next attempt
    (see ``_postgres``), so a replica that found the lock held looks again by then."""
    return job.timeout + 2 * GRACE


def on_time(slot: datetime | None) -> OnTime | Idle:
    """Run ``slot`` on time; idle when there is none (the schedule is over)."""
    return IDLE if slot is None else OnTime(slot)


def _retry(job: Job, state: FleetState, now: datetime) -> Delayed | None:
    """The retry of the fleet's last failed slot, if it has attempts left and fits before the
    next slot (which then covers it, through ``previous_success``)."""
    failed, done = state.failed_slot, state.failed_attempts
    if failed is None or done > job.retries or state.last_end is None:
        return None
    if state.last_slot is not None and state.last_slot >= failed:
        return None
    at = state.last_end + timedelta(seconds=job.retry_backoff * 2 ** (done - 1))
    nxt = next_slot(job, state.last_end, failed)
    if nxt is not None and max(at, now) >= nxt:
        return None
    return Delayed(failed, max(0.0, (at - now).total_seconds()), done + 1)


@dataclass(frozen=True, slots=True)
class Replan:
    """The fleet moved past the slot (committed it, ran it, or paused the job): plan again
    from the state read."""


@dataclass(frozen=True, slots=True)
class LookAgain:
    """Read the slot's state again ``after`` seconds from now (``second``: the second look at
    an open slot), passing over the replicas in ``missed``."""

    after: float
    second: bool = False
    missed: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Attempt:
    """Attempt the slot now, passing over the replicas in ``missed``."""

    missed: tuple[str, ...] = ()


BEHIND_FOR = 30.0
"""Seconds after its slot that a backup leaves an open slot to an owner that is behind."""
WORKING = 2.0
"""Seconds since a replica's last late commit during which it counts as behind, not gone:
more than the stalls of a loop working through a burst on a busy host."""
NOBODY: Mapping[str, datetime] = MappingProxyType({})
"""No replica is behind."""
BURST = 10
"""Late commits within :data:`WORKING` seconds that show a replica working through a burst."""
LATE = 0.5
"""Seconds after its slot past which a commit shows its replica behind: half the grace, so
that a backup's first look, a grace after the slot, sees an owner working through a burst
(its commits of the last :data:`WORKING` seconds came that late) before it attempts."""


def behind(states: Iterable[FleetState], now: datetime) -> dict[str, datetime]:
    """The replicas working through a burst, as the ``states`` read together show: each
    committed at least :data:`BURST` slots late (more than :data:`LATE` after them) within
    :data:`WORKING` seconds of ``now``, with the latest of those slots. An owner is behind on
    the slots up to it, not on later ones; a few slow runs of one instant are no burst."""
    late: dict[str, list[datetime]] = {}
    for st in states:
        owner, end, slot = st.last_owner, st.last_end, st.last_slot
        if owner is None or end is None or slot is None:
            continue
        if 0.0 <= (now - end).total_seconds() < WORKING and (end - slot).total_seconds() > LATE:
            late.setdefault(owner, []).append(slot)
    return {owner: max(slots) for owner, slots in late.items() if len(slots) >= BURST}


def queued(slot: datetime | None, now: datetime) -> LookAgain | Attempt:
    """What a backup does when its read waited behind its own replica's runs and got no
    answer: look again a grace later, for up to :data:`BEHIND_FOR` seconds after the slot
    (an attempt would wait behind the same runs), then attempt."""
    if slot is not None and (now - slot).total_seconds() >= BEHIND_FOR:
        return Attempt()
    return LookAgain(GRACE)


Look = Replan | LookAgain | Attempt
"""What a backup does once it has read a slot's state."""
REPLAN = Replan()


def look(
    job: Job,
    state: FleetState,
    slot: datetime | None,
    attempt: int,
    *,
    held: bool,
    held_for: float,
    ahead: tuple[str, ...],
    observer: bool,
    second: bool,
    now: datetime | None = None,
    owner_behind: bool = False,
) -> Look:
    """What a backup does after reading the state of the slot it waits for (``None``: a
    re-alignment), whether its lock is ``held`` (for ``held_for`` seconds as this replica has
    seen it), given the replicas ``ahead`` of it, whether it only observes the job, and
    whether this is its ``second`` look at the slot open (see :mod:`._sharing`). A batched
    run that holds the job between its batches (:func:`busy` at ``now``) counts as holding
    its lock: looked at again a grace later, or when its hold ends if that comes first.
    ``owner_behind``: the owner committed another slot of the same instant (or a later one)
    late just now (a burst: many slots due at once), so it is behind, not gone: its open
    slot is looked at again a grace later, for up to :data:`BEHIND_FOR` seconds after the
    slot, instead of attempted beside it."""
    if state.paused_at is not None or slot is None or stale(job, state, slot, attempt):
        return REPLAN
    if observer:  # declared otherwise: never attempts
        return LookAgain(job.trigger.period)
    if now is not None and not held and busy(state, now):
        assert state.busy_until is not None
        return LookAgain(min(GRACE, max(STEP, (state.busy_until - now).total_seconds() + STEP)))
    if held and job.overlap == "replace" and attempt == 1:
        return Attempt()  # the attempt ends a run of an older slot (never one of this slot)
    if held:  # a run is in progress: look again a grace later, until it must have ended
        if held_for < hold_limit(job):
            return LookAgain(GRACE)
        return Attempt()  # held past any run's bound: the attempt ends its holder
    if owner_behind and now is not None and (now - slot).total_seconds() < BEHIND_FOR:
        return LookAgain(GRACE)
    if not second:  # the owner missed it; the first backup attempts, the others look again
        if len(ahead) > 1:
            return LookAgain(STEP, second=True, missed=ahead[:1])
        return Attempt(missed=ahead[:1])
    return Attempt(missed=ahead)  # those ahead missed it too: every backup attempts


@dataclass(frozen=True, slots=True)
class Run:
    """Run the handler for ``slot``."""

    slot: datetime


@dataclass(frozen=True, slots=True)
class Skip:
    """Do not run the handler: ``why``."""

    why: str


@dataclass(frozen=True, slots=True)
class Busy:
    """Do not run the handler: a batched run holds the job between its batches until
    ``until`` (the outcome is ``locked``, as for a held lock)."""

    until: datetime


Admission = Run | Skip | Busy
"""Whether a tick that holds the job's lock runs its handler."""


def busy(state: FleetState, now: datetime) -> bool:
    """Whether a batched run holds the job between two of its batches at ``now``: it
    committed a batch, and its hold (its start on the database's clock plus its budget and a
    grace) has not ended. Its run's end, or its failure record, ends the hold at once."""
    return state.busy_until is not None and state.busy_until > now


def admit(
    job: Job,
    state: FleetState,
    slot: datetime | None,
    attempt: int,
    *,
    manual: bool,
    started: datetime,
) -> Admission:
    """Whether a tick of ``job`` that took its lock and read ``state`` at ``started`` runs,
    for ``slot`` (``None``: the one the state says is due) as its ``attempt``-th attempt.

    A manual run (``slot``: the trigger request it serves, ``None`` for ``run_now``) runs
    whatever the schedule says, unless another replica served the request; a scheduled one
    runs unless the job is paused, or the fleet moved past its slot. Neither runs while a
    batched run holds the job between its batches (:func:`busy`)."""
    if job.version is not None and state.version != job.version:
        return Skip(_changed(state.version))
    if busy(state, started):
        assert state.busy_until is not None
        return Busy(state.busy_until)
    if manual:
        if slot is not None and state.trigger_at is None:
            return Skip("another replica served the trigger request")
        run = slot or started
        if state.last_slot is not None and state.last_slot >= run:
            run = started  # a scheduled run committed a later slot meanwhile
        return Run(run)
    if state.paused_at is not None:
        return Skip("paused")
    if completed(job, state):
        return Skip("limit reached")
    if slot is not None and windowed(job, slot) != slot:  # a declaration from before a change
        return Skip("before start" if job.start is not None and slot < job.start else "after end")
    if slot is None:  # re-align: the fleet's state says which slot is due
        due = first(job, state, started)
        if due is None or due > started:
            return Skip("no slot is due")
        return Run(due)
    if stale(job, state, slot, attempt):
        return Skip("the fleet has moved past the slot")
    return Run(slot)


def _changed(version: int | None) -> str:
    """Why a stored schedule's tick does not run: the records hold another definition
    (this replica hears of the change within a beat, and runs that one)."""
    if not version:
        return "the schedule was deleted"
    return f"the schedule changed (version {version})"


GIVE_UP_FOR = 900.0
"""Seconds after which a replica takes back a job it gave up."""


@dataclass(frozen=True, slots=True)
class GiveUp:
    """This replica's runs of the job keep failing while another replica can run it: rank
    after every other replica for it."""


@dataclass(frozen=True, slots=True)
class TakeBack:
    """Run the job here again (a run here succeeded, or the give-up has lasted long enough)."""


@dataclass(frozen=True, slots=True)
class Keep:
    """Nothing changes."""


Standing = GiveUp | TakeBack | Keep
"""Whether this replica gives a job up, takes it back, or keeps its standing."""
KEEP = Keep()


def standing(
    job: Job,
    now: datetime,
    *,
    own_failures: int,
    given_up_at: datetime | None,
    others_can_run: Callable[[], bool],
) -> Standing:
    """Give ``job`` up after its ``failure_threshold`` failed runs here in a row while another
    live replica can run it (one that declares it alike and has not given it up too); take it
    back after a success here, or :data:`GIVE_UP_FOR` seconds after giving it up (the host may
    have been fixed). ``others_can_run`` is asked last (it ranks the live replicas).

    Whether the job succeeds elsewhere is not asked: with no retries, no other replica runs
    a slot the owner failed, so the fleet would never learn that it does. A job that fails on
    every replica (a shared dependency down) is given up by each in turn and stays on the
    last, which no other can take it from."""
    if given_up_at is not None:
        if own_failures == 0 or (now - given_up_at).total_seconds() > GIVE_UP_FOR:
            return TakeBack()
        return KEEP
    if own_failures >= job.failure_threshold and others_can_run():
        return GiveUp()
    return KEEP


# -- the fold -------------------------------------------------------------------------------


def fold(state: FleetState, result: RunResult, *, counted: bool) -> FleetState:
    """``state`` once ``result`` (a run that executed) is recorded: a success commits its slot
    (the watermark), a failure counts toward its slot's retries and the job's failures.
    ``counted``: the job has a ``limit``, which a scheduled success counts toward."""
    if result.outcome is Outcome.SUCCESS:
        last_end = state.last_end
        # built directly (every other field at its default), not with replace: once a run
        return FleetState(
            last_slot=result.slot,
            # the latest end: a run that ended later elsewhere keeps its end (fixed delay)
            last_end=last_end
            if last_end is not None and last_end > result.finished_at
            else result.finished_at,
            last_success_at=result.finished_at,
            paused_at=state.paused_at,
            trigger_at=_served(state, result),
            last_owner=result.owner,
            cursor=state.cursor,
            version=state.version,
            successes=state.successes + (counted and not result.manual),
        )
    if result.slot is not None and state.last_slot is not None and state.last_slot >= result.slot:
        # A later slot committed meanwhile (its run began once this one let go of the lock):
        # this failure changes nothing but the trigger request a manual run served (else the
        # request would be served again, and fail again, at every beat); it stays in the
        # history.
        served = _served(state, result)
        return state if served is state.trigger_at else replace(state, trigger_at=served)
    last_end = state.last_end
    if last_end is None or result.finished_at > last_end:
        last_end = result.finished_at
    failed = replace(state, last_end=last_end, trigger_at=_served(state, result))
    if result.manual:  # a manual run is not retried
        return replace(
            failed, consecutive_failures=state.consecutive_failures + 1, last_owner=result.owner
        )
    same = state.failed_slot == result.slot
    return replace(
        failed,
        consecutive_failures=state.consecutive_failures + 1,
        failed_slot=result.slot,
        failed_attempts=state.failed_attempts + 1 if same else 1,
        last_owner=result.owner,
    )


def _served(state: FleetState, result: RunResult) -> datetime | None:
    """The trigger request left once ``result`` ran: a manual run that executed serves the
    requests made up to its slot."""
    pending = state.trigger_at
    if result.manual and pending is not None and result.slot and pending <= result.slot:
        return None
    return pending
