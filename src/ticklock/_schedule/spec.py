"""A job's declaration as the fleet's records keep it: what operators and the ledger need to
know of a job without its code (its trigger, timeout, retries, ``catch_up``, thresholds).

Each replica writes its jobs' specs when it loads them (PostgreSQL: ``jobs.spec``, JSON), so
``ticklock status``, ``ticklock slots`` and a standalone dashboard can describe a job and
compute the slots its schedule owed. A spec that this release cannot read (written by another
one) reads as ``None``: the job is then shown without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .._errors import ScheduleError
from .job import OVERLAPS, Job, Overlap
from .triggers import Cron, Every, Trigger, within


@dataclass(frozen=True, slots=True)
class Spec:
    """What the records keep of a job's declaration."""

    trigger: Trigger
    timeout: float
    retries: int
    catch_up: bool | float
    overdue_grace: float
    failure_threshold: int
    enabled: bool
    start: datetime | None = None
    end: datetime | None = None
    limit: int | None = None
    overlap: Overlap | None = None

    def ended(self, now: datetime) -> bool:
        """Whether the job's window ended before ``now``: no slot is owed any more."""
        return self.end is not None and now > self.end

    def completed(self, successes: int) -> bool:
        """Whether ``successes`` scheduled runs committed reach the job's ``limit``."""
        return self.limit is not None and successes >= self.limit

    @property
    def schedule(self) -> str:
        """The trigger as operators read it (``every 15m``, ``cron '17 3 * * *' UTC``)."""
        return self.trigger.describe()


def of(job: Job) -> Spec:
    """The spec of a declared job."""
    return Spec(
        job.trigger,
        job.timeout,
        job.retries,
        job.catch_up,
        job.overdue_grace,
        job.failure_threshold,
        job.enabled,
        job.start,
        job.end,
        job.limit,
        job.overlap,
    )


def to_json(spec: Spec) -> dict[str, Any]:
    """The spec as the JSON object the records keep."""
    trigger = spec.trigger
    shape: dict[str, Any] = (
        {"every": trigger.interval, "initial_delay": trigger.initial_delay}
        if isinstance(trigger, Every)
        else {"cron": trigger.expr, "tz": trigger.tz}
    )
    return {
        **shape,
        "jitter": trigger.jitter,
        "timeout": spec.timeout,
        "retries": spec.retries,
        "catch_up": spec.catch_up,
        "overdue_grace": spec.overdue_grace,
        "failure_threshold": spec.failure_threshold,
        "enabled": spec.enabled,
        **{
            key: value.isoformat()
            for key, value in (("start", spec.start), ("end", spec.end))
            if value is not None
        },
        **({} if spec.limit is None else {"limit": spec.limit}),
        **({} if spec.overlap is None else {"overlap": spec.overlap}),
    }


def from_json(value: Any) -> Spec | None:
    """The spec a record holds; ``None`` for none, or for one this release cannot read."""
    if not isinstance(value, dict):
        return None
    try:
        trigger: Trigger
        if "every" in value:
            trigger = Every(
                float(value["every"]), float(value["jitter"]), float(value["initial_delay"])
            )
        else:
            trigger = Cron(str(value["cron"]), str(value["tz"]), float(value["jitter"]))
        spec = Spec(
            trigger,
            float(value["timeout"]),
            int(value["retries"]),
            _catch_up(value["catch_up"]),
            float(value["overdue_grace"]),
            int(value.get("failure_threshold", 1)),
            bool(value["enabled"]),
            _instant(value.get("start")),
            _instant(value.get("end")),
            None if value.get("limit") is None else int(value["limit"]),
            _overlap(value.get("overlap")),
        )
        # a ledger walks the schedule: never a zero step; and no limit a job could not have
        sane = trigger.period > 0 and spec.timeout > 0 and spec.overdue_grace >= 0
        return spec if sane and spec.retries >= 0 and spec.failure_threshold >= 1 else None
    except (KeyError, TypeError, ValueError, ScheduleError):
        return None


def _catch_up(value: Any) -> bool | float:
    """A ``catch_up`` as the records keep it: a flag, or seconds."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"not a catch_up: {value!r}")


def _overlap(value: Any) -> Overlap | None:
    """An ``overlap`` as the records keep it."""
    if value is None:
        return None
    for known in OVERLAPS:
        if value == known:
            return known  # type: ignore[return-value]
    raise ValueError(f"not an overlap: {value!r}")


def _instant(value: Any) -> datetime | None:
    """An instant as the records keep it (ISO 8601, with its offset)."""
    if value is None:
        return None
    at = datetime.fromisoformat(str(value))
    if at.tzinfo is None:
        raise ValueError(f"a naive instant: {value!r}")
    return at


def first_due(spec: Spec, now: datetime, started: datetime | None) -> datetime | None:
    """When a job that has not run yet is due, as operators see it: a cron job's next fire;
    an ``every`` job's first slot once a replica runs it (``started``: when its owner
    started), ``None`` while none does."""
    due: datetime | None
    if isinstance(spec.trigger, Every):
        if started is None:
            return None
        due = max(now, started + timedelta(seconds=spec.trigger.initial_delay))
    else:
        due = spec.trigger.next_fire(now)
    return within(spec.trigger, spec.start, spec.end, due)
