"""A job's health as one replica sees it: the absence alarm (``overdue``), a pure function of the
job, the fleet's state and what this replica knows of the runs in progress elsewhere.

The absence clock runs from the job's last *finished run*: a run whose handler executed and
ended, whatever its outcome (``success``, ``failure``, ``timeout``, ``cancelled``, or an
``error`` of the database once the handler ran), as the fleet's ``last_end`` records it. A tick
that never reached the handler (the database unreachable, the lock held, the slot committed
elsewhere, a clock ahead) finished no run: it leaves the clock running, so a job that stops
running for any of these reasons turns overdue. Failures make a job ``failing``, never
``overdue``. The instant itself is :func:`.slots.overdue_at`, the one judge: PostgreSQL stores
it with every finished run for ``ticklock status`` (see :mod:`._postgres.tick`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from .._backends.seam import FUTURE_LIMIT, NO_STATE, FleetState
from .._runtime.entry import Entry
from .._runtime.slots import overdue_at
from .._schedule.job import Job, JobHealth


def judge(
    job: Job,
    state: FleetState,
    *,
    now: datetime,
    clock_now: datetime,
    since: datetime | None,
    held_at: datetime | None,
    credit: tuple[datetime | None, float, datetime | None],
    next_fire: datetime | None,
    problem: str | None,
    observer: bool = False,
) -> JobHealth:
    """The health of ``job`` at ``now`` (``clock_now``: the scheduler's own clock).

    ``since``: when this replica scheduled it (the base before any finished run); ``held_at``:
    when this replica last found a run of it in progress elsewhere; ``credit``: the seconds it
    spent paused since the last finished run given (the time paused is not overdue).
    ``observer``: this replica declares the job otherwise than the fleet's ruling declaration,
    whose schedule is not its own to judge by: never overdue here."""
    paused = state.paused_at is not None
    ended = job.end is not None and now > job.end
    completed = job.limit is not None and state.successes >= job.limit
    ended |= completed  # nothing more is owed either way
    overdue = False
    base = state.last_end or since
    if held_at is not None and base is not None:
        # Another replica was running the job when this one last looked. That run ends by the
        # time it was seen plus its timeout, and this replica reads its end at its next look
        # or attempt: until then, presume it ended, or every backup would report a healthy
        # job overdue.
        base = max(base, held_at + timedelta(seconds=job.timeout))
    # judged whether or not the scheduler still runs: one that stopped while the process
    # lives on runs nothing, and must not keep saying every job is fine
    if job.enabled and base is not None and not paused and not observer and not ended:
        limit = overdue_at(job, base)
        credit_base, seconds, _ = credit
        if limit is not None and seconds and credit_base == state.last_end:
            limit += timedelta(seconds=seconds)
        overdue = limit is not None and now > limit
    if job.enabled and not paused and not ended and ahead(state, clock_now):
        # stored by a replica whose clock ran ahead: no replica runs the job until then, so
        # it is overdue now (the database refuses such commits since)
        overdue = True
    return JobHealth(
        job_id=job.id,
        last_success=state.last_success_at,
        next_fire=next_fire,
        consecutive_failures=state.consecutive_failures,
        overdue=overdue,
        paused=paused,
        failing=job.enabled and state.consecutive_failures >= job.failure_threshold,
        problem=problem if job.enabled else None,
        ended=ended and not completed,
        completed=completed,
    )


def ahead(state: FleetState, now: datetime) -> bool:
    """Whether the fleet's watermark or last end lies ahead of ``now`` by more than the skew
    the database accepts."""
    limit = now + timedelta(seconds=FUTURE_LIMIT)
    return any(t is not None and t > limit for t in (state.last_slot, state.last_end))


def health(
    entry: Entry, now: datetime, clock_now: datetime, *, running: bool, problem: str | None
) -> JobHealth:
    """The health of ``entry``'s job at ``now`` as this replica sees it (``running``: the
    scheduler runs, so the entry's next fire is planned)."""
    return judge(
        entry.job,
        entry.state or NO_STATE,
        now=now,
        clock_now=clock_now,
        since=entry.since,
        held_at=entry.held_at,
        credit=entry.credit,
        next_fire=entry.fire_at if running else None,
        problem=problem,
        observer=entry.observer,
    )
