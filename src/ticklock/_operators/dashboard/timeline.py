"""The job page's slot timeline: the ledger (:meth:`Fleet.slots <ticklock.Fleet.slots>`)
as numbers for an SVG template, expected against actual.

Two lanes share one time axis: the top one has a mark per slot the schedule owed, at its
expected instant, coloured and shaped by its fate; the bottom one a mark per run, at the instant
it actually started, joined to the slots it served (its own, or those it covered). Nothing here
writes markup: the template draws the marks and autoescapes every label.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ..fleet import Fate, RunRecord, SlotRecord
from .chart import seconds_label

WINDOWS = {
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(days=1),
    "7d": timedelta(days=7),
}
"""The windows a job page offers (``?window=``)."""
DEFAULT_WINDOW = "24h"
MAX_SLOTS = 300
"""The most slots a page shows: the latest of the window (a minutely job's day is 1,440)."""
WIDTH, HEIGHT = 760, 112
LEFT, RIGHT = 64, 16
OWED_TOP, OWED_BOTTOM = 10, 42  # the lane of the owed slots
RAN_TOP, RAN_BOTTOM = 62, 78  # the lane of the runs
AXIS = 84
ORDER = (
    Fate.MISSED,
    Fate.FAILED,
    Fate.TIMED_OUT,
    Fate.SKIPPED,
    Fate.COVERED,
    Fate.PENDING,
    Fate.RAN,
)
"""Fates in the order the legend counts them: those an operator looks into first."""
NOTABLE = frozenset({Fate.MISSED, Fate.FAILED, Fate.TIMED_OUT, Fate.SKIPPED, Fate.COVERED})
"""Fates of slots that did not run as due: listed above the table of every slot, with the
slots whose run started late."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One owed slot: where its mark goes, its fate (``css``: the fate as a class name), its
    tooltip, and where the run that served it started (``None``: no run)."""

    x: float
    top: float
    height: float
    css: str
    label: str
    run_x: float | None
    anchor: str
    """The id of its row in the table of every slot: a tap on the mark goes there."""


@dataclass(frozen=True, slots=True)
class Row:
    """One slot as the table below the timeline reads: expected and actual side by side."""

    slot: SlotRecord
    css: str
    late: str
    """How late its run started after the slot (``""``: no run of its own)."""
    anchor: str


@dataclass(frozen=True, slots=True)
class Timeline:
    """Everything the template draws; ``rows`` are newest first."""

    width: int
    height: int
    plot_left: int
    plot_right: int
    axis: int
    owed: tuple[int, int]
    ran: tuple[int, int]
    cells: tuple[Cell, ...]
    mark: float
    """The width of a slot's mark: narrower as slots crowd, never under 2 px."""
    runs: tuple[float, ...]
    """The x of each distinct run's start."""
    x_ticks: tuple[tuple[float, str], ...]
    counts: tuple[tuple[str, str, int], ...]
    """``(fate, css class, how many)``, in :data:`ORDER`, only fates that occur."""
    rows: tuple[Row, ...]
    since: datetime
    until: datetime
    cut: bool
    """The window held more than :data:`MAX_SLOTS` slots: the oldest are not shown."""
    notable: tuple[Row, ...]
    """The rows of the slots that did not run as due (:data:`NOTABLE`, and those whose run
    started late), newest first."""


def css(fate: Fate) -> str:
    """A fate as a class name: ``f-ran``, ``f-timed-out``."""
    return "f-" + fate.value.replace(" ", "-")


def slot_timeline(
    slots: Sequence[SlotRecord], since: datetime, until: datetime, cut: bool = False
) -> Timeline:
    """The timeline of ``slots`` (oldest first, as the ledger gives them) from ``since`` to
    ``until``; ``cut``: older slots of the window were left out (the axis starts at the first)."""
    if cut and slots:
        since = slots[0].slot
    x0, x1 = LEFT, WIDTH - RIGHT
    span = max((until - since).total_seconds(), 1.0)

    def x(when: datetime) -> float:
        offset = (when - since).total_seconds() / span
        return round(x0 + (x1 - x0) * min(max(offset, 0.0), 1.0), 1)

    cells = tuple(_cell(slot, x) for slot in slots)
    runs = sorted({x(s.run.started_at) for s in slots if s.run is not None})
    ticks = tuple(
        (x(since + (until - since) * i / 4), _time_label(since + (until - since) * i / 4, span))
        for i in range(5)
    )
    seen = Counter(slot.fate for slot in slots)
    counts = tuple((fate.value, css(fate), seen[fate]) for fate in ORDER if seen[fate])
    rows = tuple(Row(s, css(s.fate), _late(s), anchor(s)) for s in reversed(slots))
    return Timeline(
        WIDTH,
        HEIGHT,
        x0,
        x1,
        AXIS,
        (OWED_TOP, OWED_BOTTOM),
        (RAN_TOP, RAN_BOTTOM),
        cells,
        round(min(max((x1 - x0) / max(len(slots), 1) * 0.7, 2.0), 8.0), 1),
        tuple(runs),
        ticks,
        counts,
        rows,
        since,
        until,
        cut,
        tuple(row for row in rows if row.slot.fate in NOTABLE or row.slot.late),
    )


def _cell(slot: SlotRecord, x: Callable[[datetime], float]) -> Cell:
    """A slot's mark: full height for what ran or failed, taller for a miss, half for a skip
    (the shape tells fates apart without colour too)."""
    top, height = {
        Fate.MISSED: (OWED_TOP - 6, OWED_BOTTOM - OWED_TOP + 6),
        Fate.SKIPPED: ((OWED_TOP + OWED_BOTTOM) / 2, (OWED_BOTTOM - OWED_TOP) / 2),
        Fate.COVERED: (OWED_TOP + 8, OWED_BOTTOM - OWED_TOP - 8),
    }.get(slot.fate, (OWED_TOP, OWED_BOTTOM - OWED_TOP))
    run_x = None if slot.run is None else x(slot.run.started_at)
    return Cell(x(slot.slot), top, height, css(slot.fate), label(slot), run_x, anchor(slot))


def anchor(slot: SlotRecord) -> str:
    """A slot's id in the page: ``slot-20261201T053000Z``."""
    return "slot-" + slot.slot.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def label(slot: SlotRecord) -> str:
    """A slot's tooltip: when it was due, its fate, its run, and why."""
    parts = [_stamp(slot.slot), slot.fate.value]
    run = slot.run
    if run is not None:
        parts.append(_run_text(slot, run))
    if slot.reason:
        parts.append(slot.reason if len(slot.reason) <= 300 else slot.reason[:299] + "…")
    if slot.change:
        parts.append(slot.change)
    return " · ".join(parts)


def _run_text(slot: SlotRecord, run: RunRecord) -> str:
    if run.slot != slot.slot:  # a later run covered it
        return f"covered by the run of {_stamp(run.slot)} on {run.owner}"
    late = _late(slot)
    when = "on time" if late == "0" else f"{late} late"
    took = seconds_label(run.duration)
    return f"started {when} on {run.owner}, took {'0 s' if took == '0' else took}"


def _late(slot: SlotRecord) -> str:
    run = slot.run
    if run is None or run.slot != slot.slot:
        return ""
    late = slot.lateness if slot.lateness is not None else run.started_at - slot.slot
    return seconds_label(max(late.total_seconds(), 0.0))


def _stamp(when: datetime | None) -> str:
    return "" if when is None else when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time_label(when: datetime, span: float) -> str:
    """An axis label in UTC, as precise as the axis' span needs."""
    when = when.astimezone(timezone.utc)
    if span < 600:
        return when.strftime("%H:%M:%S")
    if span <= 86400:
        return when.strftime("%H:%M")
    return when.strftime("%m-%d %H:%M")
