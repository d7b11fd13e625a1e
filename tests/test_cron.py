"""Cron parsing, matching and the Vixie DST rule, table-driven and against a brute force."""

from __future__ import annotations

import copy
import functools
import itertools
import os
import pickle
import random
import re
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from importlib import resources
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ticklock import Cron, Every, ScheduleError, cron, every
from ticklock._schedule.cron import CronSpec

UTC = timezone.utc


def z(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def fires(expr: str, tz: str, after: str, count: int) -> list[str]:
    trigger = cron(expr, tz=tz)
    out, t = [], z(after)
    for _ in range(count):
        nxt = trigger.next_fire(t)
        assert nxt is not None
        assert nxt.tzinfo is UTC
        out.append(nxt.strftime("%Y-%m-%dT%H:%MZ"))
        t = nxt
    return out


DST_CASES = [
    # Europe/Berlin: spring forward 2026-03-29 02:00 CET -> 03:00 CEST (01:00Z)
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-03-28T12:00Z",
        ["2026-03-29T01:00Z", "2026-03-30T00:30Z"],
        id="berlin_spring_fixed_fires_at_gap_end",
    ),
    pytest.param(
        "*/30 * * * *",
        "Europe/Berlin",
        "2026-03-29T00:00Z",
        ["2026-03-29T00:30Z", "2026-03-29T01:00Z", "2026-03-29T01:30Z"],
        id="berlin_spring_wildcard_skips_missing_hour",
    ),
    pytest.param(
        "0,30 1-3 * * *",
        "Europe/Berlin",
        "2026-03-28T23:30Z",
        [
            "2026-03-29T00:00Z",
            "2026-03-29T00:30Z",
            "2026-03-29T01:00Z",
            "2026-03-29T01:30Z",
            "2026-03-29T23:00Z",
        ],
        id="berlin_spring_fixed_list_collapses_at_gap_end",
    ),
    # Europe/Berlin: fall back 2026-10-25 03:00 CEST -> 02:00 CET (01:00Z)
    pytest.param(
        "30 2 * * *",
        "Europe/Berlin",
        "2026-10-24T12:00Z",
        ["2026-10-25T00:30Z", "2026-10-26T01:30Z"],
        id="berlin_fall_fixed_fires_once",
    ),
    pytest.param(
        "*/30 * * * *",
        "Europe/Berlin",
        "2026-10-24T23:50Z",
        [
            "2026-10-25T00:00Z",
            "2026-10-25T00:30Z",
            "2026-10-25T01:00Z",
            "2026-10-25T01:30Z",
            "2026-10-25T02:00Z",
        ],
        id="berlin_fall_wildcard_fires_every_occurrence",
    ),
    pytest.param(
        "0 0-23 * * *",
        "Europe/Berlin",
        "2026-10-24T23:00Z",
        ["2026-10-25T00:00Z", "2026-10-25T02:00Z"],
        id="berlin_fall_hour_range_is_not_wildcard",
    ),
    pytest.param(
        "0 */2 * * *",
        "Europe/Berlin",
        "2026-10-24T23:30Z",
        ["2026-10-25T00:00Z", "2026-10-25T01:00Z", "2026-10-25T03:00Z"],
        id="berlin_fall_hour_step_is_wildcard",
    ),
    # America/New_York: spring 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z); fall 11-01 06:00Z
    pytest.param(
        "30 2 * * *",
        "America/New_York",
        "2026-03-07T12:00Z",
        ["2026-03-08T07:00Z", "2026-03-09T06:30Z"],
        id="new_york_spring_fixed",
    ),
    pytest.param(
        "30 1 * * *",
        "America/New_York",
        "2026-10-31T12:00Z",
        ["2026-11-01T05:30Z", "2026-11-02T06:30Z"],
        id="new_york_fall_fixed_once",
    ),
    pytest.param(
        "*/20 1 * * *",
        "America/New_York",
        "2026-11-01T04:59Z",
        [
            "2026-11-01T05:00Z",
            "2026-11-01T05:20Z",
            "2026-11-01T05:40Z",
            "2026-11-01T06:00Z",
            "2026-11-01T06:20Z",
            "2026-11-01T06:40Z",
            "2026-11-02T06:00Z",
        ],
        id="new_york_fall_minute_wildcard_twice",
    ),
    # Australia/Sydney (southern hemisphere): spring 2026-10-04 02:00 -> 03:00 (10-03T16:00Z),
    # fall 2026-04-05 03:00 AEDT -> 02:00 AEST (04-04T16:00Z)
    pytest.param(
        "30 2 * * *",
        "Australia/Sydney",
        "2026-10-03T00:00Z",
        ["2026-10-03T16:00Z", "2026-10-04T15:30Z"],
        id="sydney_spring_fixed",
    ),
    pytest.param(
        "30 2 * * *",
        "Australia/Sydney",
        "2026-04-04T00:00Z",
        ["2026-04-04T15:30Z", "2026-04-05T16:30Z"],
        id="sydney_fall_fixed_once",
    ),
    pytest.param(
        "30 * * * *",
        "Australia/Sydney",
        "2026-04-04T15:00Z",
        ["2026-04-04T15:30Z", "2026-04-04T16:30Z", "2026-04-04T17:30Z"],
        id="sydney_fall_hour_wildcard_twice",
    ),
    # Australia/Lord_Howe: half-hour shifts. Spring 2026-10-04 02:00 -> 02:30 (10-03T15:30Z);
    # fall 2026-04-05 02:00 LHDT -> 01:30 LHST (04-04T15:00Z)
    pytest.param(
        "15 2 * * *",
        "Australia/Lord_Howe",
        "2026-10-03T00:00Z",
        ["2026-10-03T15:30Z", "2026-10-04T15:15Z"],
        id="lord_howe_spring_half_hour_gap",
    ),
    pytest.param(
        "45 1 * * *",
        "Australia/Lord_Howe",
        "2026-04-04T00:00Z",
        ["2026-04-04T14:45Z", "2026-04-05T15:15Z"],
        id="lord_howe_fall_fixed_once",
    ),
    pytest.param(
        "*/15 1 * * *",
        "Australia/Lord_Howe",
        "2026-04-04T13:59Z",
        [
            "2026-04-04T14:00Z",
            "2026-04-04T14:15Z",
            "2026-04-04T14:30Z",
            "2026-04-04T14:45Z",
            "2026-04-04T15:00Z",
            "2026-04-04T15:15Z",
            "2026-04-05T14:30Z",
        ],
        id="lord_howe_fall_wildcard_repeats_half_hour",
    ),
    # Pacific/Apia skipped 2011-12-30 entirely (UTC-10 -> UTC+14 at 2011-12-30T10:00Z)
    pytest.param(
        "0 3 * * *",
        "Pacific/Apia",
        "2011-12-29T12:00Z",
        ["2011-12-29T13:00Z", "2011-12-30T10:00Z", "2011-12-30T13:00Z"],
        id="apia_skipped_day_fires_once_after_gap",
    ),
    pytest.param(
        "0 * * * *",
        "Pacific/Apia",
        "2011-12-30T08:30Z",
        ["2011-12-30T09:00Z", "2011-12-30T10:00Z", "2011-12-30T11:00Z"],
        id="apia_skipped_day_wildcard_skips",
    ),
]


@pytest.mark.parametrize(("expr", "tz", "after", "expected"), DST_CASES)
def test_dst_rule(expr: str, tz: str, after: str, expected: list[str]) -> None:
    assert fires(expr, tz, after, len(expected)) == expected


FIELD_CASES = [
    pytest.param(
        "5-5 * * * *",
        "2026-01-01T00:00Z",
        ["2026-01-01T00:05Z", "2026-01-01T01:05Z"],
        id="single_value_range",
    ),
    pytest.param(
        "*/15 * * * *", "2026-01-01T00:00Z", ["2026-01-01T00:15Z", "2026-01-01T00:30Z"], id="step"
    ),
    pytest.param(
        "10-20/5 * * * *",
        "2026-01-01T00:12Z",
        ["2026-01-01T00:15Z", "2026-01-01T00:20Z", "2026-01-01T01:10Z"],
        id="range_step",
    ),
    pytest.param(
        "0 12 * * mon-fri",
        "2026-01-02T13:00Z",  # Friday
        ["2026-01-05T12:00Z", "2026-01-06T12:00Z"],
        id="weekday_names",
    ),
    pytest.param(
        "0 0 1 jan,jul *",
        "2026-01-01T00:00Z",
        ["2026-07-01T00:00Z", "2027-01-01T00:00Z"],
        id="month_names",
    ),
    pytest.param(
        "0 0 13 * 5",
        "2026-02-01T00:00Z",  # the 13th OR a Friday
        ["2026-02-06T00:00Z", "2026-02-13T00:00Z", "2026-02-20T00:00Z"],
        id="day_of_month_or_day_of_week",
    ),
    pytest.param(
        "0 0 */10 * 5",
        "2026-02-01T00:00Z",  # dom starts with *: both must match
        ["2026-05-01T00:00Z", "2026-07-31T00:00Z"],
        id="star_day_field_means_and",
    ),
    pytest.param("0 0 * * 7", "2026-01-01T00:00Z", ["2026-01-04T00:00Z"], id="sunday_is_7"),
    pytest.param("0 0 29 2 *", "2026-01-01T00:00Z", ["2028-02-29T00:00Z"], id="leap_day"),
    pytest.param("@hourly", "2026-01-01T00:30Z", ["2026-01-01T01:00Z"], id="alias_hourly"),
    pytest.param("@daily", "2026-01-01T00:30Z", ["2026-01-02T00:00Z"], id="alias_daily"),
    pytest.param("@midnight", "2026-01-01T00:30Z", ["2026-01-02T00:00Z"], id="alias_midnight"),
    pytest.param("@weekly", "2026-01-01T00:30Z", ["2026-01-04T00:00Z"], id="alias_weekly"),
    pytest.param("@monthly", "2026-01-01T00:30Z", ["2026-02-01T00:00Z"], id="alias_monthly"),
    pytest.param("@yearly", "2026-01-01T00:30Z", ["2027-01-01T00:00Z"], id="alias_yearly"),
    pytest.param("@annually", "2026-01-01T00:30Z", ["2027-01-01T00:00Z"], id="alias_annually"),
]


@pytest.mark.parametrize(("expr", "after", "expected"), FIELD_CASES)
def test_fields(expr: str, after: str, expected: list[str]) -> None:
    assert fires(expr, "UTC", after, len(expected)) == expected


def test_next_fire_is_strictly_after() -> None:
    trigger = cron("0 * * * *")
    assert trigger.next_fire(z("2026-01-01T01:00Z")) == z("2026-01-01T02:00Z")
    assert trigger.next_fire(z("2026-01-01T00:59:59.999999Z")) == z("2026-01-01T01:00Z")


def test_next_fire_accepts_any_aware_zone_and_returns_utc() -> None:
    berlin = datetime(2026, 6, 1, 12, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    nxt = cron("0 * * * *").next_fire(berlin)
    assert nxt == z("2026-06-01T11:00Z")
    assert nxt is not None and nxt.tzinfo is UTC


def test_next_fire_refuses_naive() -> None:
    with pytest.raises(ValueError, match=r"^next_fire\(after\): after must be an aware datetime"):
        cron("* * * * *").next_fire(datetime(2026, 1, 1))


BAD = [
    ("* * * *", r"^cron expression '\* \* \* \*' has 4 fields; expected 5 "),
    ("0 * * * * *", r"has 6 fields; expected 5"),
    ("60 * * * *", r"^cron minute field: 60 is out of range 0-59$"),
    ("* 24 * * *", r"^cron hour field: 24 is out of range 0-23$"),
    ("* * 0 * *", r"^cron day-of-month field: 0 is out of range 1-31$"),
    ("* * * 13 *", r"^cron month field: 13 is out of range 1-12$"),
    ("* * * * 8", r"^cron day-of-week field: 8 is out of range 0-7$"),
    ("5-1 * * * *", r"^cron minute field: range '5-1' runs backwards$"),
    ("*/0 * * * *", r"^cron minute field: step '0' must be a positive number$"),
    ("5/10 * * * *", r"^cron minute field: a step needs a range or '\*'"),
    ("L * * * *", r"^cron minute field: 'L' is not a number$"),
    ("* * L * *", r"^cron day-of-month field: 'L' is not a number$"),
    ("* * ? * *", r"^cron day-of-month field: '\?' is not a number$"),
    ("* * * * 1#2", r"^cron day-of-week field: '1#2' is not a number or a name"),
    ("* * 1W * *", r"^cron day-of-month field: '1W' is not a number$"),
    ("1,,2 * * * *", r"^cron minute field: empty list element in '1,,2'$"),
    ("@reboot", r"^cron expression '@reboot': unknown alias"),
    ("0 0 30 2 *", r"^cron expression '0 0 30 2 \*' never fires$"),
    ("0 0 31 4,6,9,11 *", r"^cron expression '0 0 31 4,6,9,11 \*' never fires$"),
    ("0 0 30,31 2 */2", r"^cron expression '0 0 30,31 2 \*/2' never fires$"),
    # only printable ASCII, spaces and tabs: int() reads any Unicode digit, and str.split()
    # takes any Unicode space (or a newline) for a separator
    (
        "1\xa0* * * *",
        r"^cron expression '1\\xa0\* \* \* \*': character U\+00A0 NO-BREAK SPACE "
        r"at index 1 is not allowed; write the fields in ASCII, separated by spaces or tabs$",
    ),
    ("\u00b2 * * * *", r"^cron expression .*: character U\+00B2 SUPERSCRIPT TWO at index 0 "),
    ("\uff11 * * * *", r": character U\+FF11 FULLWIDTH DIGIT ONE at index 0 "),
    ("* \u0663 * * *", r": character U\+0663 ARABIC-INDIC DIGIT THREE at index 2 "),
    ("*/\u0663 * * * *", r": character U\+0663 ARABIC-INDIC DIGIT THREE at index 2 "),
    ("* * 1-\uff13 * *", r": character U\+FF13 FULLWIDTH DIGIT THREE at index 6 "),
    ("0\u2003* * * *", r": character U\+2003 EM SPACE at index 1 "),
    ("0\u3000* * * *", r": character U\+3000 IDEOGRAPHIC SPACE at index 1 "),
    ("0\u200b* * * *", r": character U\+200B ZERO WIDTH SPACE at index 1 "),
    ("0 * * * *\n", r": character U\+000A at index 9 "),
    ("0\n* * * *", r": character U\+000A at index 1 "),
    ("0\r* * * *", r": character U\+000D at index 1 "),
    ("0\v* * * *", r": character U\+000B at index 1 "),
    ("0\f* * * *", r": character U\+000C at index 1 "),
    ("0\x1c* * * *", r": character U\+001C at index 1 "),
    ("0 * * * *\x00", r": character U\+0000 at index 9 "),
    ("@daily\xa0", r": character U\+00A0 NO-BREAK SPACE at index 6 "),
]


@pytest.mark.parametrize(("expr", "message"), BAD, ids=[ascii(b[0]) for b in BAD])
def test_bad_expressions_are_refused_at_declaration(expr: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        cron(expr)
    assert info.value.field == "expr"


@pytest.mark.parametrize(
    ("trigger", "after"),
    [
        pytest.param(every(60), datetime(9999, 12, 31, 23, 59, tzinfo=UTC), id="every"),
        pytest.param(every(1), datetime.max.replace(tzinfo=UTC), id="every_max"),
        pytest.param(cron("* * * * *"), datetime(9999, 12, 31, 23, 59, tzinfo=UTC), id="cron"),
        pytest.param(cron("0 0 1 1 *"), datetime(9999, 6, 1, tzinfo=UTC), id="cron_yearly"),
        pytest.param(  # local wall time is already past 9999-12-31 23:59 (UTC+14)
            cron("* * * * *", tz="Pacific/Kiritimati"),
            datetime(9999, 12, 31, 9, 59, tzinfo=UTC),
            id="cron_ahead_of_utc",
        ),
        pytest.param(  # the last local minute would be in year 10000 in UTC
            cron("59 23 31 12 *", tz="America/New_York"),
            datetime(9999, 12, 31, 12, 0, tzinfo=UTC),
            id="cron_behind_utc",
        ),
    ],
)
def test_next_fire_is_none_past_the_last_date_a_datetime_holds(
    trigger: Every | Cron, after: datetime
) -> None:
    assert trigger.next_fire(after) is None


def test_next_fire_works_up_to_the_end_of_the_calendar_and_from_its_start() -> None:
    end = datetime(9999, 12, 31, 23, 57, tzinfo=UTC)
    assert every(60).next_fire(end) == datetime(9999, 12, 31, 23, 58, tzinfo=UTC)
    assert cron("* * * * *").next_fire(end) == datetime(9999, 12, 31, 23, 58, tzinfo=UTC)
    berlin = cron("*/5 * * * *", tz="Europe/Berlin")
    assert berlin.next_fire(datetime(9999, 12, 31, 9, 59, tzinfo=UTC)) == datetime(
        9999, 12, 31, 10, 0, tzinfo=UTC
    )
    start = datetime.min.replace(tzinfo=UTC)
    assert cron("*/5 * * * *").next_fire(start) == datetime(1, 1, 1, 0, 5, tzinfo=UTC)
    assert cron("0 0 1 1 *").next_fire(start) == datetime(2, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("expr", "same_as"),
    [
        ("0\t3 * * *", "0 3 * * *"),
        ("\t0 3 * * *\t", "0 3 * * *"),
        (" 0  3\t\t* * * ", "0 3 * * *"),
        ("0 3 *\t*\t*", "0 3 * * *"),
        ("@daily\t", "0 0 * * *"),
        (" \t@daily", "0 0 * * *"),
    ],
    ids=ascii,
)
def test_spaces_and_tabs_separate_fields(expr: str, same_as: str) -> None:
    assert cron(expr).spec == cron(same_as).spec


@pytest.mark.parametrize(
    "tz", ["Mars/Olympus", "europe/berlin", "Europe", "../../etc/passwd", "Europe/__init__.py"]
)
def test_unknown_zone(tz: str) -> None:
    message = (
        rf"^cron\(\): tz '{re.escape(tz)}' is not a known IANA zone \(e.g. 'Europe/Berlin', "
        r"'UTC'\); ticklock reads zones from tzdata 20\d\d[a-z]$"
    )
    with pytest.raises(ScheduleError, match=message) as info:
        cron("* * * * *", tz=tz)
    assert info.value.field == "tz"


def test_zones_come_from_the_tzdata_package_not_the_system(tmp_path: Path) -> None:
    # A system database that disagrees with tzdata: "Europe/Berlin" holds Tokyo's rules, and
    # a zone tzdata does not ship exists. A fresh process reads it as its TZPATH.
    tokyo = resources.files("tzdata.zoneinfo").joinpath("Asia", "Tokyo").read_bytes()
    (tmp_path / "Europe").mkdir()
    (tmp_path / "Europe" / "Berlin").write_bytes(tokyo)
    (tmp_path / "Mars").mkdir()
    (tmp_path / "Mars" / "Olympus").write_bytes(tokyo)
    script = textwrap.dedent(
        """
        from datetime import datetime, timezone
        from zoneinfo import ZoneInfo
        from ticklock import ScheduleError, cron

        june = datetime(2026, 6, 1, tzinfo=timezone.utc)
        # the fake database is the one zoneinfo reads: Berlin at UTC+9, Mars exists
        print(june.astimezone(ZoneInfo("Europe/Berlin")).utcoffset(), ZoneInfo("Mars/Olympus"))
        print(cron("0 12 * * *", tz="Europe/Berlin").next_fire(june).isoformat())
        try:
            cron("0 12 * * *", tz="Mars/Olympus")
        except ScheduleError as exc:
            print(exc.field, exc)
        """
    )
    env = {**os.environ, "PYTHONTZPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    control, berlin, mars = done.stdout.splitlines()
    assert control == "9:00:00 Mars/Olympus"
    assert berlin == "2026-06-01T10:00:00+00:00"  # 12:00 CEST, as tzdata has it
    assert mars.startswith("tz cron(): tz 'Mars/Olympus' is not a known IANA zone "), mars


def test_a_cron_pickles_and_copies_by_its_declaration() -> None:
    trigger = cron("17 3 * * *", tz="Europe/Berlin", jitter=5)
    for again in (pickle.loads(pickle.dumps(trigger)), copy.deepcopy(trigger)):
        assert again == trigger
        assert again.zone is trigger.zone  # one shared zone per name
        assert again.next_fire(z("2026-06-01T00:00Z")) == z("2026-06-01T01:17Z")


def test_cron_jitter_must_be_smaller_than_the_shortest_gap() -> None:
    with pytest.raises(ScheduleError, match=r"jitter \(60 s\) must be smaller than the shortest"):
        cron("* * * * *", jitter=60)
    assert cron("0,1 * * * *").period == 60
    assert cron("*/15 * * * *").period == 900


# -- the shortest gap between fires, from the fields ---------------------------------------


@functools.cache
def _calendar() -> tuple[datetime, ...]:
    """Every day of a Gregorian cycle from 2001 (the calendar repeats after it), and of the
    48 years after it: a gap that starts in the cycle ends there."""
    first = datetime(2001, 1, 1)
    return tuple(first + timedelta(days=n) for n in range((datetime(2449, 1, 1) - first).days))


def brute_period(spec: CronSpec) -> timedelta | None:
    """The shortest gap between consecutive fires in wall time, day by day by the matcher's
    own rule; ``None`` if no day matches."""
    days = [d.toordinal() for d in _calendar() if d.month in spec.months and spec.day_matches(d)]
    if not days:
        return None
    times = sorted(hour * 60 + minute for hour in spec.hours for minute in spec.minutes)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    gaps += [(b - a) * 1440 + times[0] - times[-1] for a, b in itertools.pairwise(days)]
    return timedelta(minutes=min(gaps))


@st.composite
def cron_field(draw: st.DrawFn, low: int, high: int) -> str:
    """One field: ``*``, ``*/step`` or a list of values, ranges and stepped ranges."""
    shape = draw(st.sampled_from(["*", "*/", "list", "list", "list"]))
    if shape == "*":
        return "*"
    if shape == "*/":
        return f"*/{draw(st.integers(1, high - low + 1))}"
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(low, high))
        kind = draw(st.sampled_from(["value", "range", "stepped"]))
        if kind == "value":
            parts.append(str(start))
            continue
        part = f"{start}-{draw(st.integers(start, high))}"
        parts.append(part + (f"/{draw(st.integers(1, 12))}" if kind == "stepped" else ""))
    return ",".join(parts)


ZONES = ["UTC", "Europe/Berlin", "Pacific/Apia", "Australia/Lord_Howe", "America/New_York"]


@settings(max_examples=120, deadline=None)
@given(
    minute=cron_field(0, 59),
    hour=cron_field(0, 23),
    dom=cron_field(1, 31),
    month=cron_field(1, 12),
    dow=cron_field(0, 7),
    tz=st.sampled_from(ZONES),
)
# rare gaps: Feb 29 on a Thursday, then Mar 1 (1 h, 5 min); gaps over years with no fire
@example("0", "0,23", "*/7", "*", "4,5", "Europe/Berlin")
@example("0,55", "0,23", "*/7", "*", "4,5", "Pacific/Apia")
@example("0", "0", "29", "2", "*", "Australia/Lord_Howe")
@example("0", "0", "29", "2", "*/7", "UTC")  # Feb 29 on a Sunday: 28 years apart at least
@example("0", "0", "13", "2", "5", "UTC")
@example("0", "0", "1", "1", "1-6", "UTC")
@example("0", "0", "31", "2", "*", "Pacific/Apia")  # never
@example("0", "0", "30", "2", "1", "UTC")  # either day rule: Mondays in February
def test_the_shortest_gap_between_fires_is_exact(
    minute: str, hour: str, dom: str, month: str, dow: str, tz: str
) -> None:
    expr = f"{minute} {hour} {dom} {month} {dow}"
    expected = brute_period(CronSpec.parse(expr))
    if expected is None:
        with pytest.raises(ScheduleError, match=r" never fires$"):
            cron(expr, tz=tz)
    else:
        assert cron(expr, tz=tz).period == expected.total_seconds(), expr


def test_a_rare_shortest_gap_is_the_gap() -> None:
    """Odd weeks' Thursdays and Fridays at 00:00 and 23:00: 23 h apart, except on a leap day
    that is a Thursday (2024-02-29), followed by 1 March."""
    trigger = cron("0 0,23 */7 * 4,5", tz="Europe/Berlin")
    assert trigger.period == 3600
    fire = trigger.next_fire(z("2024-02-29T20:00Z"))
    assert fire == z("2024-02-29T22:00Z")
    assert trigger.next_fire(fire) == z("2024-02-29T23:00Z")


def test_building_a_cron_walks_no_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: CronSpec, start: datetime) -> datetime | None:
        raise AssertionError(f"a fire was walked from {start}")

    monkeypatch.setattr(CronSpec, "next_naive", refuse)
    for expr in ("*/5 * * * *", "0 0 1 1 *", "0 0 29 2 *", "0 0 29 2 */7", "0 0,23 */7 * 4,5"):
        for tz in ("UTC", "Europe/Berlin", "Pacific/Apia", "Australia/Lord_Howe"):
            cron(expr, tz=tz)
    with pytest.raises(ScheduleError, match=r"^cron expression '0 0 31 2 \*' never fires$"):
        cron("0 0 31 2 *", tz="Pacific/Apia")


def test_no_two_matching_days_are_further_apart_than_the_search_goes() -> None:
    """Every expression's matching days are a union of (month, day, weekday) triples (and
    the either-day rule adds a weekday in every week): no triple's gap exceeds 40 years."""
    seen: dict[tuple[int, int, int], int] = {}
    longest = 0
    for day in _calendar():
        key = (day.month, day.day, day.isoweekday())
        if key in seen:
            longest = max(longest, day.year - seen[key])
        seen[key] = day.year
    assert longest == 40  # 29 February on a Sunday: 2088, then 2128
    trigger = cron("0 0 29 2 */7")
    assert trigger.next_fire(z("2088-02-29T00:00Z")) == z("2128-02-29T00:00Z")
    assert trigger.next_fire(z("2001-01-01T00:00Z")) == z("2004-02-29T00:00Z")


# -- property test against an independent brute force -----------------------------------

TRANSITIONS = {
    "Europe/Berlin": ["2026-03-29T01:00Z", "2026-10-25T01:00Z"],
    "America/New_York": ["2026-03-08T07:00Z", "2026-11-01T06:00Z"],
    "Australia/Sydney": ["2026-10-03T16:00Z", "2026-04-04T16:00Z"],
    "Australia/Lord_Howe": ["2026-10-03T15:30Z", "2026-04-04T15:00Z"],
    "UTC": ["2026-06-01T00:00Z"],
}
MINUTES = ["*", "*/15", "0", "30", "0,30", "5-10", "*/7", "59"]
HOURS = ["*", "*/2", "1", "2", "1-3", "0-23", "2,3", "*/5"]
DOMS = ["*", "*", "1", "4,5", "*/2", "1-7"]
DOWS = ["*", "*", "0", "1-5", "sun", "6"]


def brute_next(expr: str, zone: ZoneInfo, after: datetime, horizon: timedelta) -> datetime | None:
    """Minute by minute in UTC: the rule stated directly, not the library's walk."""
    spec = CronSpec.parse(expr)
    fields = expr.split()
    wildcard = fields[0].startswith("*") or fields[1].startswith("*")
    start = (after + timedelta(minutes=1)).replace(second=0, microsecond=0)
    u = start - timedelta(minutes=1)
    end = after + horizon
    while u <= end:
        local = u.astimezone(zone)
        matched = u > after and spec.matches(local.replace(tzinfo=None))
        if matched and (wildcard or local.fold == 0):
            return u
        # a forward transition between u and u+1min skips wall times: fixed expressions
        # whose skipped wall time matches fire at the instant after the gap
        nxt = u + timedelta(minutes=1)
        before_off, after_off = local.utcoffset(), nxt.astimezone(zone).utcoffset()
        assert before_off is not None and after_off is not None
        if after_off > before_off and not wildcard and nxt > after:
            wall = local.replace(tzinfo=None) + timedelta(minutes=1)
            stop = nxt.astimezone(zone).replace(tzinfo=None)
            while wall < stop:
                if spec.matches(wall):
                    return nxt
                wall += timedelta(minutes=1)
        u = nxt
    return None


@settings(max_examples=150, deadline=None)
@given(
    zone_name=st.sampled_from(sorted(TRANSITIONS)),
    which=st.integers(0, 1),
    offset=st.integers(-26 * 60, 26 * 60),
    seconds=st.integers(0, 59),
    minute=st.sampled_from(MINUTES),
    hour=st.sampled_from(HOURS),
    dom=st.sampled_from(DOMS),
    dow=st.sampled_from(DOWS),
)
def test_next_fire_matches_brute_force(
    zone_name: str,
    which: int,
    offset: int,
    seconds: int,
    minute: str,
    hour: str,
    dom: str,
    dow: str,
) -> None:
    expr = f"{minute} {hour} {dom} * {dow}"
    points = TRANSITIONS[zone_name]
    after = z(points[which % len(points)]) + timedelta(minutes=offset, seconds=seconds)
    trigger = cron(expr, tz=zone_name)
    expected = brute_next(expr, trigger.zone, after, timedelta(days=3))
    got = trigger.next_fire(after)
    if expected is None:
        assert got is None or got > after + timedelta(days=3)
    else:
        assert got == expected, (expr, zone_name, after)


@pytest.mark.parametrize(
    "tz",
    [
        "UTC",
        "Europe/Berlin",
        "Europe/Dublin",  # negative DST in tzdata
        "America/Sao_Paulo",
        "Australia/Lord_Howe",  # a half-hour shift
        "Pacific/Apia",  # a skipped day
        "Africa/Casablanca",  # DST suspended each Ramadan
        "Asia/Tehran",
        "Pacific/Chatham",
    ],
)
def test_the_steady_path_gives_what_the_walk_gives(tz: str) -> None:
    from ticklock._schedule import cron as _cron
    from ticklock._schedule.zones import zone as load

    rng = random.Random(tz)
    zone = load(tz)
    exprs = [
        "* * * * *",
        "*/7 1-3 * * *",
        "30 2 * * *",
        "0 0-23 * * *",
        "59 23 * * 0",
        "0 12 1 * *",
    ]
    start = datetime(2011, 1, 1, tzinfo=timezone.utc).timestamp()
    end = datetime(2031, 1, 1, tzinfo=timezone.utc).timestamp()
    transitions = _transitions(zone, datetime(2024, 1, 1, tzinfo=timezone.utc).timestamp(), end)
    for expr in exprs:
        spec = _cron.CronSpec.parse(expr)
        for _ in range(50):
            after = datetime.fromtimestamp(rng.uniform(start, end), tz=timezone.utc)
            assert _cron.next_fire(spec, zone, after) == _cron._walk(spec, zone, after), (
                expr,
                after,
            )
        # and at each of the zone's transitions in the range, from just before and after them
        for when in transitions[:6]:
            for delta in (-7200, -61, -1, 0, 1, 59, 3600):
                after = when + timedelta(seconds=delta)
                assert _cron.next_fire(spec, zone, after) == _cron._walk(spec, zone, after)


def _transitions(zone: Any, start: float, end: float) -> list[datetime]:
    """The instants in the range where ``zone``'s offset changes (to the hour)."""
    found, t = [], start
    before = datetime.fromtimestamp(t, tz=timezone.utc).astimezone(zone).utcoffset()
    while t < end:
        t += 3600
        now = datetime.fromtimestamp(t, tz=timezone.utc).astimezone(zone).utcoffset()
        if now != before:
            found.append(datetime.fromtimestamp(t - 3600, tz=timezone.utc))
        before = now
    return found
