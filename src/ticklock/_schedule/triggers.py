"""Triggers: frozen values whose pure ``next_fire(after)`` is the same on every replica.

Jitter is never part of ``next_fire``: the scheduler draws it per run.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from .._errors import ScheduleError
from .validate import Duration, seconds

if TYPE_CHECKING:  # imported when a cron trigger is first built: an app without one skips them
    from zoneinfo import ZoneInfo

    from . import cron as _cron


@functools.lru_cache(maxsize=1024)
def _delta(seconds: float) -> timedelta:
    """One shared ``timedelta`` per interval (one per job costs 48 bytes each; P3)."""
    return timedelta(seconds=seconds)


def _require_aware(after: datetime) -> None:
    if not isinstance(after, datetime) or after.tzinfo is None or after.utcoffset() is None:
        raise ValueError(f"next_fire(after): after must be an aware datetime, got {after!r}")


@dataclass(frozen=True, slots=True)
class Every:
    """An interval trigger with fixed-delay semantics; build it with :func:`every`."""

    interval: float
    jitter: float = 0.0
    initial_delay: float = 0.0
    delta: timedelta = field(init=False, repr=False, compare=False)
    """The interval as a ``timedelta``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", _delta(self.interval))

    @property
    def period(self) -> float:
        """The shortest time between two fires, in seconds: the interval."""
        return self.interval

    def next_fire(self, after: datetime) -> datetime | None:
        """The instant one interval after ``after`` (the end of the previous run), in UTC;
        ``None`` past the last date a datetime holds."""
        _require_aware(after)
        try:
            return (after + self.delta).astimezone(timezone.utc)
        except OverflowError:
            return None

    def describe(self) -> str:
        """A short human description, e.g. ``every 15m (jitter 30s)``."""
        text = f"every {_human(self.interval)}"
        return text + (f" (jitter {_human(self.jitter)})" if self.jitter else "")


@dataclass(frozen=True, slots=True)
class Cron:
    """A five-field Vixie cron trigger in an IANA zone; build it with :func:`cron`.

    The zone's rules come from the ``tzdata`` package, never the system's database, so every
    replica with the same ``tzdata`` computes the same instants.
    """

    expr: str
    tz: str = "UTC"
    jitter: float = 0.0
    spec: _cron.CronSpec = field(init=False, repr=False, compare=False)
    zone: ZoneInfo = field(init=False, repr=False, compare=False)
    period: float = field(init=False, repr=False, compare=False)
    """The shortest gap between two consecutive fires, in seconds."""

    def __post_init__(self) -> None:
        from . import cron as _cron
        from . import zones as _zones

        spec = _cron.CronSpec.parse(self.expr)
        if not isinstance(self.tz, str) or not self.tz:
            raise _error("cron()", f"tz must be an IANA zone name, got {self.tz!r}", "tz")
        try:
            zone = _zones.zone(self.tz)
        except _zones.UnknownZone as exc:
            raise _error(
                "cron()",
                f"tz {self.tz!r} is not a known IANA zone (e.g. 'Europe/Berlin', 'UTC'); {exc}",
                "tz",
            ) from None
        shortest = _cron.shortest_period(spec)
        if shortest is None:
            raise ScheduleError(f"cron expression {self.expr!r} never fires", field="expr")
        period = shortest.total_seconds()
        if self.jitter >= period:
            raise _error(
                "cron()",
                f"jitter ({self.jitter:g} s) must be smaller than the shortest gap between fires "
                f"({period:g} s)",
                "jitter",
            )
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "zone", zone)
        object.__setattr__(self, "period", period)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle and copy by the declaration: a zone read from a file pickles by no key."""
        return (Cron, (self.expr, self.tz, self.jitter))

    def next_fire(self, after: datetime) -> datetime | None:
        """The first fire instant strictly after ``after``, aware, in UTC (jitter not included)."""
        _require_aware(after)
        from . import cron as _cron  # loaded by __post_init__ already

        return _cron.next_fire(self.spec, self.zone, after)

    def describe(self) -> str:
        """A short human description, e.g. ``cron '17 3 * * *' Europe/Berlin``."""
        text = f"cron {self.expr!r} {self.tz}"
        return text + (f" (jitter {_human(self.jitter)})" if self.jitter else "")


Trigger = Every | Cron
"""Either trigger."""


def within(
    trigger: Trigger, start: datetime | None, end: datetime | None, slot: datetime | None
) -> datetime | None:
    """``slot`` within the window ``start``..``end`` (both inclusive): one before ``start``
    moves to the window's first slot (``every``: ``start`` plus the initial delay; ``cron``:
    its first fire at or after ``start``), and none is owed after ``end``."""
    if slot is None:
        return None
    if start is not None and slot < start:
        if isinstance(trigger, Every):
            slot = start + timedelta(seconds=trigger.initial_delay)
        else:
            slot = trigger.next_fire(start - timedelta(microseconds=1))
            if slot is None:
                return None
    if end is not None and slot > end:
        return None
    return slot


def every(
    interval: Duration | None = None,
    *,
    days: float = 0,
    hours: float = 0,
    minutes: float = 0,
    seconds: float = 0,
    jitter: Duration = 0,
    initial_delay: Duration | None = None,
) -> Every:
    """An interval trigger: the next run starts ``interval`` (+ jitter) after the previous ended.

    Give the interval as seconds or a timedelta, or as ``days/hours/minutes/seconds``::

        @scheduler.job(every(minutes=15, jitter=30), timeout=60)
        async def purge(ctx: JobContext) -> None: ...

    A run's slot is the fleet's last end + ``interval`` (jitter not included). Anything that
    could not run (a non-positive or infinite interval, jitter not smaller than the interval)
    raises :class:`~ticklock.ScheduleError`.

    :param interval: Seconds or a ``timedelta``; or leave it out and give the parts below.
    :param days: Part of the interval, added to the others.
    :param hours: Part of the interval.
    :param minutes: Part of the interval.
    :param seconds: Part of the interval.
    :param jitter: Up to this many seconds added at random to each wait, to spread the load
        of many jobs and replicas; smaller than the interval.
    :param initial_delay: When the first run of a job that never ran is due, after start.
        Default: 0, a new job runs at once.
    """
    if interval is not None and days == hours == minutes == seconds == 0:
        given: Duration = interval  # the interval alone (the common case): no parts to add
    else:
        parts = _parts(interval, days, hours, minutes, seconds)
        given = interval if interval is not None else parts
    total = _seconds(given, "interval", "every()", allow_zero=False)
    jitter_s = _seconds(jitter, "jitter", "every()")
    if jitter_s >= total:
        message = f"jitter ({jitter_s:g} s) must be smaller than the interval ({total:g} s)"
        raise _error("every()", message, "jitter")
    delay = 0.0 if initial_delay is None else _seconds(initial_delay, "initial_delay", "every()")
    return Every(interval=total, jitter=jitter_s, initial_delay=delay)


def _parts(
    interval: Duration | None, days: float, hours: float, minutes: float, seconds: float
) -> timedelta:
    """The interval given as days/hours/minutes/seconds (refused beside ``interval``)."""
    shown = {"days": days, "hours": hours, "minutes": minutes, "seconds": seconds}
    for part, value in shown.items():
        if isinstance(value, float) and not math.isfinite(value):  # timedelta raises a bare error
            raise _error("every()", f"interval must be positive and finite, got {part}={value}")
    try:
        parts = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        raise _error(
            "every()",
            "interval must be at most 100 years, got days/hours/minutes/seconds beyond what a "
            "timedelta holds",
        ) from None
    except TypeError:
        message = f"interval must be seconds (a number) or a timedelta, got {shown!r}"
        raise _error("every()", message) from None
    if interval is not None and parts:
        raise _error(
            "every()",
            "give the interval either positionally or as days/hours/minutes/seconds, not both",
        )
    return parts


def cron(expr: str, *, tz: str = "UTC", jitter: Duration = 0) -> Cron:
    """A cron trigger: five Vixie fields or an ``@`` alias, in the IANA zone ``tz``::

    @scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), timeout=1800)
    async def nightly(ctx: JobContext) -> None: ...

    Daylight saving time follows Vixie cron's rule. A bad field, an expression that never
    fires or an unknown zone raises :class:`~ticklock.ScheduleError`.

    :param expr: Minute, hour, day of month, month, day of week (``"17 3 * * *"``), or
        ``@hourly``, ``@daily``, ``@midnight``, ``@weekly``, ``@monthly``, ``@yearly``,
        ``@annually``.
    :param tz: The IANA zone the fields are read in, as the installed ``tzdata`` package
        defines it.
    :param jitter: Up to this many seconds added at random to each fire; smaller than the
        shortest gap between two fires.
    """
    return Cron(expr=expr, tz=tz, jitter=_seconds(jitter, "jitter", "cron()"))


def _error(where: str, message: str, field: str = "interval") -> ScheduleError:
    return ScheduleError(f"{where}: {message}", field=field)


def _seconds(value: Duration, name: str, where: str, allow_zero: bool = True) -> float:
    try:
        return seconds(value, name, allow_zero=allow_zero)
    except ScheduleError as exc:
        raise _error(where, str(exc), name) from None


def _human(value: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value:g}s"
