"""``ticklock slots JOB``: every slot a job's schedule owed in a window, and its fate."""

from __future__ import annotations

import argparse
import re
from datetime import datetime, timedelta, timezone

from ..._errors import ScheduleError
from ..._schedule.validate import visible
from .. import backfill as _backfill
from ..fleet import Fate, SlotRecord, json_text, slots_json
from .errors import EXIT_OK, CommandError
from .fleet import note_of, one_line, open_fleet, refused, when, who

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def instant(text: str, now: datetime, option: str) -> datetime:
    """``text`` as an instant: a duration back from ``now`` (``90m``, ``24h``, ``7d``) or an
    ISO 8601 instant (UTC if it names no offset)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text)
    if match:
        try:
            return now - timedelta(seconds=float(match[1]) * _UNITS[match[2]])
        except OverflowError:
            raise CommandError(f"{option} {text!r} reaches before the year 1") from None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            f"{option} must be a duration back from now (90m, 24h, 7d) or an ISO 8601 instant "
            f"(2026-12-01T03:00:00+00:00), got {text!r}"
        ) from None
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


async def slots(args: argparse.Namespace) -> int:
    """The job's ledger for the window, oldest first."""
    if args.limit < 1:
        raise CommandError(f"--limit must be at least 1, got {args.limit}")
    now = datetime.now(timezone.utc)
    since = instant(args.since, now, "--since")
    until = now if args.until is None else instant(args.until, now, "--until")
    if until < since:
        raise CommandError(f"--until ({when(until)}) is before --since ({when(since)})")
    async with open_fleet(args) as fleet:
        try:
            ledger = await fleet.slots(args.job, since, until, limit=args.limit)
        except KeyError as exc:
            return refused(exc)
    if args.json:
        print(json_text(slots_json(args.job, since, until, ledger), indent=2))
        return EXIT_OK
    counts: dict[Fate, int] = {}
    late: dict[Fate, int] = {}
    for slot in ledger:
        counts[slot.fate] = counts.get(slot.fate, 0) + 1
        late[slot.fate] = late.get(slot.fate, 0) + slot.late
    summary = (
        ", ".join(
            f"{n} {fate.value}" + (f" ({late[fate]} late)" if late[fate] else "")
            for fate, n in counts.items()
        )
        or "none"
    )
    print(f"slots of {args.job!r} from {when(since)} to {when(until)}: {summary}")
    # hidden unless --all: the slots that ran as due, the ones nobody asks about
    shown = [s for s in ledger if args.all or s.fate is not Fate.RAN or s.late or s.change]
    if not shown:
        print("(every slot ran; --all lists them)" if ledger else "(no slot was owed)")
        return EXIT_OK
    print(f"{'slot':<25}  {'fate':<9}  {'run':<25}  {'late':>8}  {'owner':<20}  why")
    for slot in shown:
        run = slot.run
        error = run.error if run is not None and run.slot == slot.slot else None
        why = "; ".join(text for text in (slot.reason, error, slot.change) if text)
        print(
            f"{when(slot.slot):<25}  {slot.fate.value:<9}  "
            f"{when(run.started_at) if run else '-':<25}  {_late(slot):>8}  "
            f"{visible(run.owner) if run else '-':<20}  {one_line(why, 100)}"
        )
    return EXIT_OK


def _late(slot: SlotRecord) -> str:
    """How long after the slot its run started: ``0.2 s``, ``89 s``, ``26 min``, ``2 h 5 min``."""
    if slot.lateness is None:
        return "-"
    seconds = slot.lateness.total_seconds()
    if abs(seconds) < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    if hours == 0:
        return f"{minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if days else f"{hours} h {minutes} min"


async def backfill(args: argparse.Namespace) -> int:
    """Run the job's slots in ``[--since, --until)`` after the fact (``--dry-run``: list each
    slot and its fate, and run nothing)."""
    now = datetime.now(timezone.utc)
    since = instant(args.since, now, "--since")
    until = now if args.until is None else instant(args.until, now, "--until")
    if args.pace is not None and args.pace <= 0:
        raise CommandError(f"--pace must be a positive number of slots per second, got {args.pace}")
    async with open_fleet(args) as fleet:
        try:
            ledger = await _backfill.backfill(
                fleet,
                args.job,
                since,
                until,
                now,
                rerun=args.rerun,
                dry_run=args.dry_run,
                pace=args.pace,
                who=who(),
                note=note_of(args),
            )
        except (KeyError, ValueError, TimeoutError) as exc:
            if isinstance(exc, ScheduleError):
                raise CommandError(str(exc)) from None
            return refused(exc)
    runs = [s for s in ledger if args.rerun or s.fate not in _backfill.COMMITTED]
    if args.dry_run:
        print(
            f"backfill of {args.job!r} from {when(since)} to {when(until)} would run "
            f"{len(runs)} of its {len(ledger)} slots (a dry run: nothing ran)"
        )
    else:
        print(f"backfilled {args.job!r} from {when(since)} to {when(until)}: {len(ledger)} slots")
    print(f"{'slot':<25}  {'fate':<9}  {'run':<25}  {'owner':<20}  why")
    for slot in ledger:
        run = slot.run
        error = run.error if run is not None and run.slot == slot.slot else None
        why = "; ".join(text for text in (slot.reason, error) if text)
        print(
            f"{when(slot.slot):<25}  {slot.fate.value:<9}  "
            f"{when(run.started_at) if run else '-':<25}  "
            f"{visible(run.owner) if run else '-':<20}  {one_line(why, 100)}"
        )
    return EXIT_OK
