"""Five-field Vixie cron: parsing, matching in naive local wall time, and the DST rule.

Each matching wall time maps to UTC with :mod:`zoneinfo` by the Vixie/ISC cron rule (as in
cronie): a repeated wall time (fall back) fires at every occurrence for *wildcard* expressions
(the minute or the hour field starts with ``*``: ``*``, ``*/2``, ``*/15``), else once, at the
first; a wall time in a gap (spring forward) is skipped by wildcard expressions, else fires
once at the first real instant after the gap, collapsing with any other fire then. A day
matches if either the day of month or the day of week does when neither field starts with
``*``, else it must match both.
"""

from __future__ import annotations

import bisect
import itertools
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from ._errors import ScheduleError

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# (name, low, high, names) of the five fields, in order.
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day-of-month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day-of-week", 0, 7, _DAYS),
)
# The longest DST shift searched around an instant (historic double summer time was 2 h).
_SHIFT = timedelta(hours=3)
_MINUTE = timedelta(minutes=1)
_STEADY = timedelta(
    days=2
)  # no zone has two transitions this close: one offset, checked at both ends
_LAST_MINUTE = datetime(9999, 12, 31, 23, 59)  # the last wall time a datetime holds
# A schedule that finds no fire in a full 28-year calendar cycle never fires.
_HORIZON_YEARS = 29
# Fields are printable ASCII, separated by spaces or tabs (as in a crontab line). Anything
# else is refused rather than read: str.split() would take a no-break space, a newline or
# another Unicode space for a separator, and an expression that looks like one schedule
# would be read as another.
_REFUSED_CHARACTER = re.compile(r"[^\x21-\x7e \t]")


def _field_error(field: str, problem: str) -> ScheduleError:
    return ScheduleError(f"cron {field} field: {problem}", field="expr")


def _check_characters(expr: str) -> None:
    """Refuse any character other than printable ASCII, spaces and tabs, naming it."""
    refused = _REFUSED_CHARACTER.search(expr)
    if refused is None:
        return
    char = refused.group()
    name = unicodedata.name(char, "")
    shown = f"U+{ord(char):04X}" + (f" {name}" if name else "")
    raise ScheduleError(
        f"cron expression {expr!r}: character {shown} at index {refused.start()} is not "
        "allowed; write the fields in ASCII, separated by spaces or tabs",
        field="expr",
    )


def _is_number(token: str) -> bool:
    """Whether ``token`` is ASCII digits (``int()`` would also read ``²`` or ``１``)."""
    return token.isascii() and token.isdigit()


def _value(token: str, field: str, low: int, high: int, names: tuple[str, ...]) -> int:
    lowered = token.lower()
    if names and lowered in names:
        return names.index(lowered) + (1 if field == "month" else 0)
    if not _is_number(token):
        extra = f" or a name ({', '.join(names)})" if names else ""
        raise _field_error(field, f"{token!r} is not a number{extra}")
    number = int(token)
    if not low <= number <= high:
        raise _field_error(field, f"{number} is out of range {low}-{high}")
    return number


def _parse_field(text: str, field: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    result: set[int] = set()
    for part in text.split(","):
        if not part:
            raise _field_error(field, f"empty list element in {text!r}")
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not _is_number(step_text) or int(step_text) == 0:
                raise _field_error(field, f"step {step_text!r} must be a positive number")
            step = int(step_text)
        if base == "*":
            start, stop = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start = _value(first, field, low, high, names)
            stop = _value(last, field, low, high, names)
            if start > stop:
                raise _field_error(field, f"range {base!r} runs backwards")
        else:
            if slash:
                raise _field_error(
                    field,
                    f"a step needs a range or '*' ({part!r}: write '{base}-{high}/{step}' "
                    f"or '*/{step}')",
                )
            start = stop = _value(base, field, low, high, names)
        result.update(range(start, stop + 1, step))
    return result


@dataclass(frozen=True, slots=True)
class CronSpec:
    """A parsed, validated five-field expression (sets of allowed values per field)."""

    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday .. 6 = Saturday
    day_or: bool  # neither day field starts with '*': a day matches if either does
    wildcard: bool  # minute or hour field starts with '*': the DST rule for wildcards

    @classmethod
    def parse(cls, expr: str) -> CronSpec:
        """Parse ``expr`` (five fields or an ``@`` alias), raising :class:`ScheduleError`."""
        if not isinstance(expr, str):
            raise ScheduleError(f"cron expression must be a string, got {expr!r}", field="expr")
        _check_characters(expr)
        text = expr.strip(" \t")
        if text.startswith("@"):
            if text.lower() not in _ALIASES:
                raise ScheduleError(
                    f"cron expression {expr!r}: unknown alias (use one of {', '.join(_ALIASES)})",
                    field="expr",
                )
            text = _ALIASES[text.lower()]
        fields = text.split()
        if len(fields) != 5:
            raise ScheduleError(
                f"cron expression {expr!r} has {len(fields)} fields; expected 5 "
                "(minute hour day-of-month month day-of-week)",
                field="expr",
            )
        sets = [_parse_field(f, *spec) for f, spec in zip(fields, _FIELDS, strict=True)]
        return cls(
            minutes=tuple(sorted(sets[0])),
            hours=tuple(sorted(sets[1])),
            days=frozenset(sets[2]),
            months=frozenset(sets[3]),
            weekdays=frozenset(d % 7 for d in sets[4]),
            day_or=not fields[2].startswith("*") and not fields[4].startswith("*"),
            wildcard=fields[0].startswith("*") or fields[1].startswith("*"),
        )

    def day_matches(self, day: datetime) -> bool:
        """Whether the calendar day of ``day`` matches the day-of-month/day-of-week rule."""
        dom = day.day in self.days
        dow = (day.isoweekday() % 7) in self.weekdays
        return (dom or dow) if self.day_or else (dom and dow)

    def matches(self, local: datetime) -> bool:
        """Whether the naive wall time ``local`` (whole minute) matches."""
        return (
            local.minute in self.minutes
            and local.hour in self.hours
            and local.month in self.months
            and self.day_matches(local)
        )

    def next_naive(self, start: datetime) -> datetime | None:
        """The first matching naive wall time at or after ``start`` (a whole minute), or
        ``None`` if none comes within the horizon or before the end of year 9999."""
        t = start
        try:  # a step past 9999-12-31 raises: the calendar is over
            while t.year <= start.year + _HORIZON_YEARS:
                i = bisect.bisect_left(self.hours, t.hour)
                if t.month not in self.months:
                    t = datetime(t.year + t.month // 12, t.month % 12 + 1, 1)
                elif not self.day_matches(t) or i == len(self.hours):
                    t = datetime(t.year, t.month, t.day) + timedelta(days=1)
                else:
                    if self.hours[i] != t.hour:
                        t = t.replace(hour=self.hours[i], minute=0)
                    j = bisect.bisect_left(self.minutes, t.minute)
                    if j < len(self.minutes):
                        return t.replace(minute=self.minutes[j])
                    t = t.replace(minute=0) + timedelta(hours=1)
        except (OverflowError, ValueError):
            return None
        return None

    def naive_matches(self, start: datetime) -> Iterator[datetime]:
        """Every matching naive wall time at or after ``start``, in order."""
        t = self.next_naive(start)
        while t is not None:
            yield t
            t = self.next_naive(t + _MINUTE) if t < _LAST_MINUTE else None


def instants(local: datetime, zone: ZoneInfo, wildcard: bool) -> tuple[datetime, ...]:
    """The UTC instants at which the naive wall time ``local`` fires in ``zone``.

    Two for a repeated wall time with a wildcard expression, one otherwise; for a wall time
    in a gap, none (wildcard) or the first instant after the gap.
    """
    try:
        early = local.replace(tzinfo=zone, fold=0).astimezone(timezone.utc)
        late = local.replace(tzinfo=zone, fold=1).astimezone(timezone.utc)
    except OverflowError:  # before year 1 or after 9999 in UTC: not an instant a datetime holds
        return ()
    low, high = sorted((early, late))
    early_ok = early.astimezone(zone).replace(tzinfo=None) == local
    late_ok = late.astimezone(zone).replace(tzinfo=None) == local
    if early_ok and late_ok:
        return (low,) if low == high or not wildcard else (low, high)
    if early_ok or late_ok:  # pragma: no cover - zoneinfo keeps fold=0 valid for normal times
        return (early if early_ok else late,)
    return () if wildcard else (_gap_end(low, high, zone),)


def _gap_end(low: datetime, high: datetime, zone: ZoneInfo) -> datetime:
    """The transition instant in ``(low, high]`` at which ``zone``'s offset grows."""
    offset = low.astimezone(zone).utcoffset()
    # Binary search on whole seconds: the offset is ``offset`` before, larger after.
    lo, hi = 0, int((high - low).total_seconds())
    while lo < hi:
        mid = (lo + hi) // 2
        if (low + timedelta(seconds=mid)).astimezone(zone).utcoffset() == offset:
            lo = mid + 1
        else:
            hi = mid
    return low + timedelta(seconds=lo)


def next_fire(spec: CronSpec, zone: ZoneInfo, after: datetime) -> datetime | None:
    """The first fire instant strictly after the aware ``after``, in UTC; ``None`` if none
    comes before the end of year 9999."""
    steady = _steady_fire(spec, zone, after)
    return steady if steady is not None else _walk(spec, zone, after)


def _steady_fire(spec: CronSpec, zone: ZoneInfo, after: datetime) -> datetime | None:
    """:func:`next_fire` where ``zone``'s offset is the same :data:`_SHIFT` before ``after``,
    at ``after`` and :data:`_SHIFT` after a fire at most :data:`_STEADY` away (no DST
    transition near: wall time is UTC plus one offset, and the rules for repeated and skipped
    wall times have nothing to decide); ``None`` elsewhere, for :func:`_walk`."""
    try:
        utc = after.astimezone(timezone.utc)
        offset = (utc - _SHIFT).astimezone(zone).utcoffset()
        if offset is None or utc.astimezone(zone).utcoffset() != offset:
            return None
        local = (utc + offset).replace(tzinfo=None)
        fire = spec.next_naive(local.replace(second=0, microsecond=0) + _MINUTE)
        if fire is None or fire - local > _STEADY:
            return None
        instant = (fire - offset).replace(tzinfo=timezone.utc)
        if (instant + _SHIFT).astimezone(zone).utcoffset() != offset:
            return None
    except OverflowError:  # near year 1 or 9999: the walk knows the edges
        return None
    return instant


def _walk(spec: CronSpec, zone: ZoneInfo, after: datetime) -> datetime | None:
    """:func:`next_fire` by the rules for DST: walk the wall times from :data:`_SHIFT` before
    ``after`` and map each to its instants (:func:`instants`)."""
    try:
        local_after = after.astimezone(zone).replace(tzinfo=None, second=0, microsecond=0)
    except OverflowError:  # ``after`` is a local time beyond year 9999 (or before year 1)
        if after.year > 1:
            return None
        local_after = datetime.min
    best: datetime | None = None
    best_local: datetime | None = None
    start = local_after - _SHIFT if local_after > datetime.min + _SHIFT else datetime.min
    for local in spec.naive_matches(start):
        if best_local is not None and local - best_local > _SHIFT:
            break
        for instant in instants(local, zone, spec.wildcard):
            if instant > after and (best is None or instant < best):
                best = instant
                best_local = local
    return best


def shortest_period(spec: CronSpec, samples: int = 512) -> timedelta | None:
    """The shortest gap between consecutive fires (ignoring DST), or ``None`` if it never fires."""
    fires = list(itertools.islice(spec.naive_matches(datetime(2001, 1, 1)), samples + 1))
    if not fires:
        return None
    return min((b - a for a, b in itertools.pairwise(fires)), default=timedelta(days=366))
