"""The geometry of the job page's chart: run durations over time, as numbers for an SVG template.

Nothing here writes markup: the template draws the marks and autoescapes every label.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ..fleet import RunRecord

WIDTH, HEIGHT = 760, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 12, 40  # the margins around the plot, for the axes' labels


@dataclass(frozen=True, slots=True)
class Mark:
    """One run: its centre in the SVG, its outcome (the colour) and its tooltip."""

    x: float
    y: float
    outcome: str
    label: str


@dataclass(frozen=True, slots=True)
class Tick:
    """An axis label and where it goes (x for the time axis, y for the duration axis)."""

    at: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    """Everything the template draws; ``plot_*`` bound the area inside the axes."""

    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_top: int
    plot_bottom: int
    marks: tuple[Mark, ...]
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    outcomes: tuple[str, ...]


def duration_chart(runs: Sequence[RunRecord]) -> Chart | None:
    """The chart of ``runs`` (any order), oldest on the left; ``None`` when there is no run."""
    if not runs:
        return None
    ordered = sorted(runs, key=lambda run: run.started_at)
    x0, x1 = LEFT, WIDTH - RIGHT
    y0, y1 = HEIGHT - BOTTOM, TOP  # SVG's y grows downwards: y0 is the axis, y1 the top
    first, last = ordered[0].started_at, ordered[-1].started_at
    if last - first < timedelta(seconds=1):  # one run, or all at once: centre them
        first, last = first - timedelta(minutes=1), last + timedelta(minutes=1)
    span = (last - first).total_seconds()
    top = _nice_ceiling(max(run.duration for run in ordered))

    def x(when: datetime) -> float:
        return round(x0 + (x1 - x0) * (when - first).total_seconds() / span, 1)

    def y(seconds: float) -> float:
        return round(y0 - (y0 - y1) * max(seconds, 0.0) / top, 1)

    marks = tuple(
        Mark(x(run.started_at), y(run.duration), run.outcome, _label(run)) for run in ordered
    )
    x_ticks = tuple(
        Tick(x(when), _time_label(when, span))
        for when in (first + (last - first) * i / 4 for i in range(5))
    )
    y_ticks = tuple(Tick(y(top * i / 4), seconds_label(top * i / 4)) for i in range(5))
    outcomes = tuple(sorted({run.outcome for run in ordered}))
    return Chart(WIDTH, HEIGHT, x0, x1, y1, y0, marks, x_ticks, y_ticks, outcomes)


def seconds_label(seconds: float) -> str:
    """A duration for people: ``0``, ``250 ms``, ``1.5 s``, ``2 min 5 s``, ``1 h 3 min``."""
    if seconds <= 0:
        return "0"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 60:
        return f"{seconds:.3g} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 4 or 5 times a power of ten, divisible in four ticks, ≥ ``value``."""
    if value <= 0:
        return 0.001  # all runs took no measurable time: a 1 ms axis
    power: float = 10.0 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 4, 5, 10) if step * power >= value)


def _time_label(when: datetime, span: float) -> str:
    """A time axis label in UTC, as precise as the axis' span needs."""
    when = when.astimezone(timezone.utc)
    if span < 600:
        return when.strftime("%H:%M:%S")
    if span < 86400:
        return when.strftime("%H:%M")
    return when.strftime("%m-%d %H:%M")


def _label(run: RunRecord) -> str:
    """A run's tooltip: start, outcome, duration, owner, and the start of its error."""
    started = run.started_at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    parts = [started, run.outcome, seconds_label(run.duration), run.owner]
    if run.manual:
        parts.append("manual")
    if run.error:
        parts.append(run.error if len(run.error) <= 200 else run.error[:199] + "…")
    return " · ".join(parts)
