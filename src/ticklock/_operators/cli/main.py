"""The ``ticklock`` command: its parser, and one line and an exit code for every mistake."""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
from collections.abc import Sequence

import anyio

from ..._errors import ScheduleError, StartupError
from ..._schedule.validate import dsn as valid_dsn
from ..._schedule.validate import redact, surrogate
from ..._version import __version__
from . import app, fleet, ledger, logs, schedules
from .errors import EXIT_ERROR, CommandError
from .hints import advice

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_COMMANDS = (
    ("run", "run a scheduler from your code as a sidecar process", app.run),
    ("jobs", "list a scheduler's jobs and their next fire times", app.jobs),
    ("demo", "run a demo scheduler in local mode, printing each run", app.demo),
    (
        "status",
        "show the fleet's jobs and live replicas; exit 1 if a job is overdue or failing",
        fleet.status,
    ),
    ("history", "show a job's last runs, newest first", fleet.history),
    ("slots", "show every slot a job's schedule owed, and what happened to it", ledger.slots),
    (
        "backfill",
        "run a job's past slots after the fact on the replicas that have it",
        ledger.backfill,
    ),
    ("pause", "pause a job on every replica (a run in flight finishes)", fleet.pause),
    ("resume", "resume a paused job", fleet.resume),
    ("trigger", "ask the fleet to run a job once, now", fleet.trigger),
    ("forget", "delete the state and history of a job no live replica declares", fleet.forget),
    (
        "schedules",
        "list the stored schedules (by id, paged), or delete one: schedules delete ID",
        schedules.schedules,
    ),
    ("migrate", "create or update ticklock's tables", fleet.migrate),
    ("dashboard", "serve the fleet's dashboard (needs ticklock[dashboard])", fleet.dashboard),
)
_ON_DATABASE = {
    "status",
    "history",
    "slots",
    "backfill",
    "pause",
    "resume",
    "trigger",
    "forget",
    "schedules",
    "migrate",
    "dashboard",
}
_ON_JOB = ("history", "slots", "backfill", "pause", "resume", "trigger", "forget")
_AUDITED = ("backfill", "pause", "resume", "trigger", "forget")


_GLOBAL = ("dsn", "schema", "namespace")  # the options also taken before the command
_DEFAULTS = {"schema": "ticklock", "namespace": "default"}
_DSN_HELP = "PostgreSQL connection string, e.g. postgresql://user@host/db (default: $TICKLOCK_DSN)"
_SCHEMA_HELP = "schema of ticklock's tables (default: ticklock)"
_NAMESPACE_HELP = "the application namespace (default: default)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ticklock",
        description="Periodic jobs inside your process, once across replicas.",
        epilog="Exit codes: 0 ok; 1 'status' found an overdue or failing job, a job was not "
        "found, or an operation was refused; 2 usage, import or connection error. The "
        "database commands take the DSN from --dsn or the TICKLOCK_DSN variable. --dsn, "
        "--schema and --namespace go before the command or after it; given in both places, "
        "the one after the command wins.",
    )
    parser.add_argument("--version", action="version", version=f"ticklock {__version__}")
    # before the command: stored apart (a subcommand's own default would overwrite them)
    parser.add_argument("--dsn", dest="global_dsn", metavar="DSN", help=_DSN_HELP)
    parser.add_argument("--schema", dest="global_schema", metavar="SCHEMA", help=_SCHEMA_HELP)
    parser.add_argument(
        "--namespace", dest="global_namespace", metavar="NAMESPACE", help=_NAMESPACE_HELP
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name, helptext, func in _COMMANDS:
        on_database = name in _ON_DATABASE
        p = commands[name] = sub.add_parser(name, help=helptext, description=helptext)
        p.set_defaults(func=func, needs_dsn=on_database)
        if on_database or name == "run":
            p.add_argument("--dsn", help=_DSN_HELP)
        if on_database:
            p.add_argument("--schema", help=_SCHEMA_HELP)
        if on_database and name != "migrate":
            p.add_argument("--namespace", help=_NAMESPACE_HELP)
        if name in _ON_JOB:
            p.add_argument("job", metavar="JOB", help="the job's id")
        if name in ("status", "history", "slots", "schedules"):
            p.add_argument("--json", action="store_true", help="print JSON, for scripts")
        if name in (*_AUDITED, "schedules"):
            p.add_argument(
                "--note",
                help='why, for the audit log (e.g. "INC-42: upstream down"; default: none)',
            )
    commands["pause"].add_argument(
        "--until",
        help="resume by itself at this instant, ISO 8601 with its offset "
        "(e.g. 2026-12-24T08:00+01:00; default: until resumed)",
    )
    commands["run"].add_argument(
        "target", help="MODULE:ATTR naming a ticklock.Scheduler, e.g. app.jobs:scheduler"
    )
    commands["run"].add_argument(
        "--log-level",
        default=None,
        help="log level of the 'ticklock' logger; it wins over a level the module sets "
        "(default: INFO, or the level the module sets with ticklock.log_to_stderr())",
    )
    commands["jobs"].add_argument("target", help="MODULE:ATTR naming a ticklock.Scheduler")
    commands["jobs"].add_argument(
        "--count",
        type=int,
        default=5,
        help="how many fire times of a cron job to show (default: 5); an every job's "
        "first (each next one comes an interval after a run ends)",
    )
    commands["demo"].add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop after this many seconds (default: run until Ctrl-C or SIGTERM)",
    )
    commands["history"].add_argument(
        "--limit", type=int, default=20, help="how many runs to show (default: 20)"
    )
    commands["status"].add_argument(
        "--fail-on",
        default="overdue,failing",
        metavar="STATES",
        help="the states that make it exit 1, comma-separated: overdue (the absence alarm: no "
        "run finished when one was due, failures aside; a watermark in the future counts), "
        "failing (default: overdue,failing)",
    )
    commands["migrate"].add_argument(
        "--wait",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to wait for the runs in flight that hold ticklock's tables (a rolling "
        "deploy's previous release) before giving up (default: 300)",
    )
    listing = commands["schedules"]
    listing.add_argument("action", nargs="?", choices=["delete"], help="delete a schedule")
    listing.add_argument("id", nargs="?", metavar="ID", help="the schedule to delete")
    listing.add_argument("--tenant", help="only this tenant's schedules (default: every tenant)")
    listing.add_argument("--task", help="only the schedules of this task (default: every task)")
    listing.add_argument(
        "--after", metavar="ID", help="the page after this id, by id (default: the first page)"
    )
    listing.add_argument(
        "--limit", type=int, default=100, help="how many schedules to show (default: 100)"
    )
    slots = commands["slots"]
    slots.add_argument(
        "--since",
        default="24h",
        help="the window's start: a duration back from now (90m, 24h, 7d) or an ISO 8601 "
        "instant (default: 24h)",
    )
    slots.add_argument("--until", default=None, help="the window's end, as --since (default: now)")
    slots.add_argument(
        "--limit", type=int, default=200, help="how many slots to show, the latest (default: 200)"
    )
    slots.add_argument(
        "--all", action="store_true", help="show the slots that ran too (default: the others)"
    )
    backfill = commands["backfill"]
    backfill.add_argument(
        "--since",
        required=True,
        help="the window's start (inclusive): a duration back from now (90m, 24h, 7d) or an "
        "ISO 8601 instant (UTC unless it names an offset); no default: it is required",
    )
    backfill.add_argument(
        "--until", default=None, help="the window's end (exclusive), as --since (default: now)"
    )
    backfill.add_argument(
        "--rerun", action="store_true", help="run the slots already committed too"
    )
    backfill.add_argument(
        "--dry-run", action="store_true", help="list each slot and its fate; run nothing"
    )
    backfill.add_argument(
        "--pace",
        type=float,
        default=None,
        help="at most this many slots per second (default: one after the other)",
    )
    dashboard = commands["dashboard"]
    dashboard.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    dashboard.add_argument(
        "--port", type=int, default=8080, help="port to listen on (default: 8080)"
    )
    dashboard.add_argument(
        "--actions", action="store_true", help="add pause, resume and trigger buttons"
    )
    dashboard.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy strips, e.g. /ticklock (default: none)",
    )
    dashboard.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        metavar="NAME",
        help="a host name the dashboard answers (repeatable; '*.example.com' for a domain); "
        "default: the --host address",
    )
    return parser


EXIT_BROKEN_PIPE = 141
"""What a command whose reader closed the pipe exits with: 128 + SIGPIPE, as a shell's tools."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ticklock`` command."""
    args = _parser().parse_args(argv)
    if args.command != "run":  # 'run' does once it has imported the code (which may have)
        logs.configure()
    try:
        _merge(args)
        _check(args)
        func = args.func
        return int(anyio.run(func, args) if inspect.iscoroutinefunction(func) else func(args))
    except (CommandError, ScheduleError) as exc:  # their messages never hold a password
        print(f"ticklock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the reader went away (`ticklock status | head -1`): not an error
        # of the database; say nothing, and let the interpreter's last flush go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except StartupError as exc:  # the scheduler has logged it, as one ERROR line
        if not logging.getLogger("ticklock").isEnabledFor(logging.ERROR):
            print(f"ticklock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        database = type(exc).__module__.startswith("asyncpg")
        if not database and not isinstance(exc, (OSError, ImportError)):
            raise  # a bug, not the user's mistake: the traceback is wanted
        dsn = getattr(args, "dsn", None)
        message = str(exc)
        if dsn:
            message = message.replace(dsn, redact(dsn))
        kind = "database error: " if database else ""
        hint = advice(exc, dsn, getattr(args, "schema", None) or "ticklock")
        print(
            f"ticklock: {kind}{type(exc).__name__}: {message}" + (f": {hint}" if hint else ""),
            file=sys.stderr,
        )
        return EXIT_ERROR


def _merge(args: argparse.Namespace) -> None:
    """Apply ``--dsn``, ``--schema`` and ``--namespace`` given before the command (where the
    command takes them, and unless given after it too: that one wins), then the defaults."""
    for name in _GLOBAL:
        before = getattr(args, f"global_{name}")
        delattr(args, f"global_{name}")
        if not hasattr(args, name):
            if before is not None:
                raise CommandError(f"{args.command} takes no --{name}")
            continue
        if getattr(args, name) is None:
            setattr(args, name, before if before is not None else _DEFAULTS.get(name))


def _check(args: argparse.Namespace) -> None:
    """Refuse a bad ``--log-level``, DSN, job or namespace before anything runs; apply the log
    level."""
    level = getattr(args, "log_level", None)
    if level is not None and level.upper() not in _LEVELS:
        raise CommandError(f"--log-level must be one of {', '.join(_LEVELS)}, got {level!r}")
    logging.getLogger("ticklock").setLevel((level or "INFO").upper())
    for attr, shown in (("job", "JOB"), ("namespace", "--namespace")):
        value = getattr(args, attr, None)
        # a byte that is no UTF-8 in argv arrives as a surrogate: no job or namespace has one
        if isinstance(value, str) and (found := surrogate(value)) is not None:
            raise CommandError(
                f"{shown} must not contain unpaired surrogates (PostgreSQL text cannot store "
                f"them), got {value!r}: {found}"
            )
    if not hasattr(args, "dsn"):
        return
    source = "--dsn"
    if args.dsn is None:
        args.dsn, source = os.environ.get("TICKLOCK_DSN") or None, "TICKLOCK_DSN"
    if args.dsn is not None:
        valid_dsn(args.dsn, source)
    elif args.needs_dsn:
        raise CommandError(f"{args.command} needs --dsn or the TICKLOCK_DSN variable")
