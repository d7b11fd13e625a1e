"""Five-field Vixie cron: parsing, matching in naive local wall time, the DST rule, and the
shortest gap between fires.

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
import functools
import itertools
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from .._errors import ScheduleError

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
# The longest gap between two matching days is 40 years (29 February on one weekday, across
# a century year that is not leap: 2088 to 2128), so a search that finds no fire in 41 years
# has reached the end of the calendar (a trigger that never fires is refused when built).
_HORIZON_YEARS = 41
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
        return _parse(expr)

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


@functools.lru_cache(maxsize=1024)
def _parse(expr: str) -> CronSpec:
    """:meth:`CronSpec.parse` of a string, one shared spec per expression."""
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
    return CronSpec(
        minutes=tuple(sorted(sets[0])),
        hours=tuple(sorted(sets[1])),
        days=frozenset(sets[2]),
        months=frozenset(sets[3]),
        weekdays=frozenset(d % 7 for d in sets[4]),
        day_or=not fields[2].startswith("*") and not fields[4].startswith("*"),
        wildcard=fields[0].startswith("*") or fields[1].startswith("*"),
    )


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


def shortest_period(spec: CronSpec) -> timedelta | None:
    """The shortest gap between consecutive fires in local wall time (ignoring DST), or
    ``None`` if the expression never fires, from the fields alone: no fire is walked.

    Fires on one day are the hours x minutes of the expression; between two matching days
    ``n`` days apart the gap is ``n`` days less the day's spread (last fire less first), so
    the shortest is the fewest days between two consecutive matching days (:func:`_day_gap`).
    """
    days = _day_gap(spec.days, spec.months, spec.weekdays, spec.day_or)
    if days is None:
        return None
    minutes, hours = spec.minutes, spec.hours
    spread = (hours[-1] - hours[0]) * 60 + minutes[-1] - minutes[0]
    gap = days * 1440 - spread
    if len(minutes) > 1:  # two fires in one hour
        gap = min(gap, min(b - a for a, b in itertools.pairwise(minutes)))
    if len(hours) > 1:  # the last fire of an hour and the first of the next matching hour
        step = min(b - a for a, b in itertools.pairwise(hours))
        gap = min(gap, step * 60 - (minutes[-1] - minutes[0]))
    return timedelta(minutes=gap)


# Month lengths and the day of the year each month starts on, in a common and a leap year.
_LENGTHS = (
    (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31),
    (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31),
)
_STARTS = tuple(tuple(itertools.accumulate(lengths[:-1], initial=0)) for lengths in _LENGTHS)
# Per month of a common and of a leap year: its days as a mask, and its first day of the year.
_SPANS = tuple(
    tuple(((1 << length) - 1, start) for length, start in zip(lengths, starts, strict=True))
    for lengths, starts in zip(_LENGTHS, _STARTS, strict=True)
)
# Times 1 << weekday: bit j of the product is set when weekday j % 7 is (enough for a year
# that starts on any weekday).
_WEEKS = sum(1 << (7 * week) for week in range(54))


@functools.cache
def _gregorian() -> tuple[tuple[int, ...], tuple[int, ...], frozenset[tuple[int, int]]]:
    """One Gregorian cycle (the 400 years from 2001; the calendar repeats after it): each
    year's kind, the day of the cycle its 1 January falls on, and the pairs of kinds two
    consecutive years have (the last year's successor being the first).

    A year's kind is ``7 * leap + the weekday of its 1 January``: two years of one kind have
    the same days on the same weekdays, so the same matching days.
    """
    kinds, starts = [], []
    weekday, start = 1, 0  # 2001-01-01 was a Monday
    for year in range(2001, 2401):
        leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        kinds.append(7 * leap + weekday)
        starts.append(start)
        weekday, start = (weekday + 365 + leap) % 7, start + 365 + leap
    return tuple(kinds), tuple(starts), frozenset(itertools.pairwise(kinds + kinds[:1]))


_CYCLE_DAYS = 146097  # the days of a Gregorian cycle


@functools.lru_cache(maxsize=1024)
def _day_gap(
    days: frozenset[int], months: frozenset[int], weekdays: frozenset[int], day_or: bool
) -> int | None:
    """The fewest days between two consecutive matching days, or ``None`` if no day matches.

    Each of the 14 kinds of year (:func:`_gregorian`) is a mask of its matching days, bit
    ``i`` for the year's day ``i``; the gaps are those inside one year's mask and those from
    the last matching day of a year to the first of the next year that has one. One
    Gregorian cycle holds every gap there is.
    """
    in_days = sum(1 << (day - 1) for day in days)
    every_weekday = len(weekdays) == 7
    on_weekdays = sum(1 << weekday for weekday in weekdays) * _WEEKS
    masks: list[int] = []
    for spans in _SPANS:
        in_months = on_days = 0
        for month in months:
            whole, start = spans[month - 1]
            in_months |= whole << start
            on_days |= (in_days & whole) << start
        if every_weekday:  # the weekday decides nothing: one mask for the 7 kinds
            masks += [in_months if day_or else on_days] * 7
        elif day_or:
            masks += [on_days | (on_weekdays >> first) & in_months for first in range(7)]
        else:
            masks += [on_days & (on_weekdays >> first) for first in range(7)]
    if not any(masks):
        return None
    firsts = [(mask & -mask).bit_length() - 1 for mask in masks]
    lasts = [mask.bit_length() - 1 for mask in masks]
    kinds, starts, pairs = _gregorian()
    # from one year into the next: 365 or 366 days at most
    best = min(
        (365 + a // 7 - lasts[a] + firsts[b] for a, b in pairs if masks[a] and masks[b]),
        default=_CYCLE_DAYS,
    )
    for mask in set(masks):
        best = _closest(mask, best)
    # a gap over a year with no match is 366 days at least: only then may one be the shortest
    if best > 365:
        years = [year for year, kind in enumerate(kinds) if masks[kind]]
        ends = [starts[year] + lasts[kinds[year]] for year in years]
        begins = [starts[year] + firsts[kinds[year]] for year in years]
        begins.append(begins[0] + _CYCLE_DAYS)  # the first of the next cycle
        best = min(best, *(begin - end for begin, end in zip(begins[1:], ends, strict=True)))
    return best


def _closest(mask: int, bound: int) -> int:
    """The fewest positions between two set bits of ``mask``, or ``bound`` if none are
    closer."""
    count = mask.bit_count()
    if count < 2:
        return bound
    if count > 12:  # dense: two bits are at most 365 / 12 apart, try each distance
        distance = 1
        while distance < bound and not mask & (mask >> distance):
            distance += 1
        return distance
    positions = []
    while mask:
        low = mask & -mask
        positions.append(low.bit_length())
        mask ^= low
    return min(bound, *(b - a for a, b in itertools.pairwise(positions)))
