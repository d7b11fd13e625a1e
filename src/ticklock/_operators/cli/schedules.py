"""``ticklock schedules``: list the namespace's stored schedules, or delete one."""

from __future__ import annotations

import argparse

from ..._schedule.validate import visible
from ..fleet import json_text, schedule_json
from ..schedules import MAX_PAGE
from .app import label
from .errors import EXIT_NOT_OK, EXIT_OK, CommandError
from .fleet import note_of, open_fleet, when, who


async def schedules(args: argparse.Namespace) -> int:
    """``ticklock schedules [--tenant T] [--task X] [--after ID] [--limit N] [--json]``, or
    ``ticklock schedules delete ID [--note TEXT]``."""
    if args.action == "delete":
        return await _delete(args)
    if args.action is not None or args.id is not None:
        raise CommandError("schedules takes no argument but 'delete ID'")
    if not 1 <= args.limit <= MAX_PAGE:
        raise CommandError(f"--limit must be from 1 to {MAX_PAGE}, got {args.limit}")
    async with open_fleet(args) as fleet:
        page = await fleet.schedules.page(args.tenant, args.task, args.after, args.limit)
    after = page[-1].id if len(page) == args.limit else None
    if args.json:
        shown = {"namespace": args.namespace, "schedules": [schedule_json(s) for s in page]}
        print(json_text({**shown, "after": after}, indent=2))
        return EXIT_OK
    if not page:
        print("ticklock: no stored schedules" + _filters(args))
        return EXIT_OK
    width = max(24, *(len(label(s.id)) for s in page))
    print(
        f"{'schedule':<{width}}  {'task':<20}  {'tenant':<20}  {'version':>7}  "
        f"{'updated':<25}  trigger"
    )
    for s in page:
        print(
            f"{label(s.id):<{width}}  {visible(s.task):<20}  {visible(s.tenant or '-'):<20}  "
            f"{s.version:>7}  {when(s.updated_at):<25}  {s.schedule}"
        )
    if after is not None:
        print(f"\nmore: ticklock schedules --after {label(after)}" + _filters(args, " "))
    return EXIT_OK


async def _delete(args: argparse.Namespace) -> int:
    if args.id is None:
        raise CommandError("schedules delete needs the schedule's ID")
    note = note_of(args)
    async with open_fleet(args) as fleet:
        deleted = await fleet.schedules.delete(args.id, who=who(), note=note)
    if not deleted:
        print(f"ticklock: no stored schedule {label(args.id)} in namespace {args.namespace!r}")
        return EXIT_NOT_OK
    print(
        f"ticklock: deleted {label(args.id)}: no replica starts a run of it from now on "
        "(its history stays until retention prunes it)"
    )
    return EXIT_OK


def _filters(args: argparse.Namespace, lead: str = "") -> str:
    given = [f"--{name} {visible(v)}" for name in ("tenant", "task") if (v := getattr(args, name))]
    if not given:
        return ""
    return (lead + " ".join(given)) if lead else f" ({', '.join(given)})"
