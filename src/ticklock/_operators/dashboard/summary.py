"""The index's fleet summary: jobs counted by state, the most urgent first, and the replicas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..fleet import JobRecord, JobState, Replica

URGENCY = (
    JobState.FAILING,
    JobState.OVERDUE,
    JobState.FUTURE,
    JobState.UNDECLARED,
    JobState.PAUSED,
    JobState.OK,
    JobState.ENDED,
    JobState.COMPLETED,
    JobState.DISABLED,
)
"""States in the order an operator reads them: what needs a look first, what is off last."""
ALARMS = frozenset({JobState.FAILING, JobState.OVERDUE, JobState.FUTURE})
"""States that make ``/health`` answer 503."""


@dataclass(frozen=True, slots=True)
class Summary:
    """What the top of the index says."""

    counts: tuple[tuple[JobState, int], ...]
    """How many jobs are in each state that occurs, in :data:`URGENCY` order."""
    jobs: int
    alarms: int
    """Jobs failing, overdue or in the future."""
    replicas: int
    """Live replicas."""
    builtin: int


def by_urgency(jobs: Sequence[JobRecord]) -> list[JobRecord]:
    """``jobs`` in :data:`URGENCY` order of their state, the operators' before ticklock's own,
    then by id."""
    rank = {state: i for i, state in enumerate(URGENCY)}
    return sorted(jobs, key=lambda j: (rank.get(j.state, len(rank)), j.builtin, j.job_id))


def fleet_summary(jobs: Sequence[JobRecord], replicas: Sequence[Replica]) -> Summary:
    """The summary of a namespace's ``jobs`` and live ``replicas``."""
    seen = Counter(job.state for job in jobs)
    return Summary(
        counts=tuple((state, seen[state]) for state in URGENCY if seen[state]),
        jobs=len(jobs),
        alarms=sum(seen[state] for state in ALARMS),
        replicas=len(replicas),
        builtin=sum(job.builtin for job in jobs),
    )
