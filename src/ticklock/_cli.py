"""The command line: ``ticklock run|jobs|status|migrate|demo`` (also ``python -m ticklock``)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from functools import reduce
from itertools import islice

import anyio

from ._errors import ScheduleError, StartupError
from ._job import Job
from ._logging import FORMAT
from ._scheduler import Scheduler
from ._triggers import Cron, Every
from ._validate import dsn as valid_dsn
from ._validate import redact

EXIT_OK, EXIT_NOT_OK, EXIT_ERROR = 0, 1, 2  # 1: ``status`` found an overdue job, or no job
BUILT_IN = ("ticklock.retention",)  # the jobs ticklock adds itself (in PostgreSQL mode)
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class CommandError(Exception):
    """A mistake in the command line or the code it names: one line on stderr, exit 2."""


def load_scheduler(target: str) -> Scheduler:
    """Import ``MODULE:ATTR`` and return the :class:`Scheduler` it names."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise CommandError(f"expected MODULE:ATTR (e.g. myapp.jobs:scheduler), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: report it in one line, not a traceback
        raise CommandError(
            f"cannot import {module_name}{_where(exc)}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        obj = reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise CommandError(f"module {module_name} has no attribute {attr!r}") from None
    if not isinstance(obj, Scheduler):
        raise CommandError(
            f"{target} is not a ticklock.Scheduler: its type is {type(obj).__name__}"
        )
    return obj


def _where(exc: BaseException) -> str:
    """`` (file:line)`` of ``exc``'s innermost frame outside importlib and ticklock, or ``""``."""
    machinery = tuple(os.path.join(os.path.dirname(f), "") for f in (importlib.__file__, __file__))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if not frame.filename.startswith(("<", *machinery)):
            return f" ({frame.filename}:{frame.lineno})"
    return ""


async def serve(scheduler: Scheduler) -> None:
    """Run ``scheduler`` until SIGTERM or SIGINT, then shut down gracefully."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            async for signum in signals:
                logging.getLogger("ticklock").info(
                    "%s received, shutting down", signal.Signals(signum).name
                )
                return


def _cmd_run(args: argparse.Namespace) -> int:
    scheduler = load_scheduler(args.target)
    if args.dsn:
        scheduler.use_dsn(args.dsn)
    anyio.run(serve, scheduler)
    return EXIT_OK


def first_fires(job: Job, now: datetime) -> Iterator[datetime]:
    """The fire instants of a job that never ran, as a scheduler started at ``now`` plans them:
    ``every``: now + ``initial_delay``, then one interval after each (runs taking no time);
    ``cron``: its next fires. Without jitter."""
    trigger = job.trigger
    fire: datetime | None
    if isinstance(trigger, Every):
        fire = now + timedelta(seconds=trigger.initial_delay)
    else:
        fire = trigger.next_fire(now)
    while fire is not None:
        yield fire
        fire = trigger.next_fire(fire)


def label(job_id: str) -> str:
    """``job_id``, with `` (built-in)`` for a job ticklock adds itself."""
    return f"{job_id} (built-in)" if job_id in BUILT_IN else job_id


def _cmd_jobs(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CommandError(f"--count must be at least 1, got {args.count}")
    scheduler = load_scheduler(args.target)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    for job in scheduler.jobs.values():
        state = "" if job.enabled else "  (disabled: never runs)"
        print(f"{label(job.id)}: {job.trigger.describe()}, timeout {job.timeout:g}s{state}")
        if not job.enabled:
            continue
        for n, fire in enumerate(islice(first_fires(job, now), args.count)):
            note = ""
            if isinstance(job.trigger, Cron):
                zone = job.trigger.zone
                note = f"  ({fire.astimezone(zone).isoformat(timespec='seconds')} {zone.key})"
            elif n == 0 and isinstance(job.trigger, Every):
                note = "  (if started now; then one interval after each run ends)"
            print(f"    {fire.isoformat(timespec='seconds')}{note}")
    return EXIT_OK


async def _status(args: argparse.Namespace) -> int:
    import asyncpg

    from ._coordination import FUTURE_LIMIT
    from ._postgres.connection import connect
    from ._postgres.sql import quote

    conn, _ = await connect(args.dsn)
    try:
        # a watermark or end in the database's future (a replica whose clock ran ahead)
        # stops every replica until then: flagged as overdue, whatever overdue_at says
        rows = await conn.fetch(
            "SELECT job_id, last_success_at, last_outcome, consecutive_failures, overdue_at, "
            "overdue_at < now() AS overdue, greatest(last_slot, last_end) > now() + "
            f"make_interval(secs => $2) AS future FROM {quote(args.schema)}.jobs "
            "WHERE namespace = $1 ORDER BY job_id",
            args.namespace,
            FUTURE_LIMIT,
        )
        if not rows:
            others = await conn.fetch(
                f"SELECT DISTINCT namespace FROM {quote(args.schema)}.jobs ORDER BY namespace"
            )
            found = ", ".join(repr(r["namespace"]) for r in others)
            print(
                f"ticklock: no jobs in namespace {args.namespace!r} (schema {args.schema!r}): "
                "no scheduler of that namespace has started on this database"
                + (f"; namespaces with jobs: {found}" if found else ""),
                file=sys.stderr,
            )
            return EXIT_NOT_OK
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
        raise CommandError(
            f"no ticklock tables in schema {args.schema!r} of this database: run "
            "'ticklock migrate' (a scheduler also creates them when it starts), or give "
            "--schema the schema your schedulers use"
        ) from None
    finally:
        await conn.close()
    width = max(40, *(len(label(row["job_id"])) for row in rows))
    print(f"{'job':<{width}} {'last success':<25} {'last outcome':<12} {'fails':>5}  status")
    for row in rows:
        when = row["last_success_at"]
        last = when.isoformat(timespec="seconds") if when else "never"
        flag = "FUTURE" if row["future"] else "OVERDUE" if row["overdue"] else "ok"
        print(
            f"{label(row['job_id']):<{width}} {last:<25} {row['last_outcome'] or '-':<12} "
            f"{row['consecutive_failures']:>5}  {flag}"
        )
    return EXIT_NOT_OK if any(row["overdue"] or row["future"] for row in rows) else EXIT_OK


async def _migrate(args: argparse.Namespace) -> int:
    from ._postgres.connection import connect
    from ._postgres.sql import VERSION, migrate

    conn, _ = await connect(args.dsn)
    try:
        done = await migrate(conn, args.schema)
    finally:
        await conn.close()
    where = f"ticklock's tables in schema {args.schema!r}"
    if done == "created":
        print(f"ticklock: created {where} (version {VERSION})")
    elif done == "upgraded":
        print(f"ticklock: upgraded {where} to version {VERSION}")
    else:
        print(f"ticklock: {where} are already at version {VERSION}; nothing to do")
    return EXIT_OK


async def _demo(args: argparse.Namespace) -> int:
    from ._demo import demo

    await demo(args.seconds)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ticklock",
        description="Periodic jobs inside your process, once across replicas.",
        epilog="Exit codes: 0 ok; 1 'status' found an overdue job, or no job; 2 usage or runtime "
        "error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for name, helptext, func in (
        ("run", "run a scheduler from your code as a sidecar process", _cmd_run),
        ("jobs", "list a scheduler's jobs and their next fire times", _cmd_jobs),
        ("status", "show the fleet's job state; exit 1 if a job is overdue or none", _status),
        ("migrate", "create or update ticklock's tables", _migrate),
        ("demo", "run a demo scheduler in local mode, printing each run", _demo),
    ):
        described = name in ("status", "migrate")
        commands[name] = sub.add_parser(
            name, help=helptext, description=helptext if described else None
        )
        commands[name].set_defaults(func=func, needs_dsn=described)
    run, jobs, status, migrate, demo = commands.values()
    run.add_argument(
        "target", help="MODULE:ATTR naming a ticklock.Scheduler, e.g. app.jobs:scheduler"
    )
    jobs.add_argument("target", help="MODULE:ATTR naming a ticklock.Scheduler")
    for p in (run, status, migrate):
        p.add_argument(
            "--dsn",
            help="PostgreSQL connection string, e.g. postgresql://user@host/db "
            "(default: $TICKLOCK_DSN)",
        )
    run.add_argument("--log-level", default="INFO", help="log level of the 'ticklock' logger")
    jobs.add_argument(
        "--count", type=int, default=5, help="how many fire times to show (default 5)"
    )
    for p in (status, migrate):
        p.add_argument("--schema", default="ticklock", help="schema of ticklock's tables")
    status.add_argument("--namespace", default="default", help="the application namespace")
    demo.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ticklock`` command."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    try:
        _check(args)
        func = args.func
        return int(anyio.run(func, args) if inspect.iscoroutinefunction(func) else func(args))
    except (CommandError, ScheduleError) as exc:  # their messages never hold a password
        print(f"ticklock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except StartupError as exc:  # the scheduler has logged it, as one ERROR line
        if not logging.getLogger("ticklock").isEnabledFor(logging.ERROR):
            print(f"ticklock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        database = type(exc).__module__.startswith("asyncpg")
        if not database and not isinstance(exc, (OSError, ImportError)):
            raise  # a bug, not the user's mistake: the traceback is wanted
        message = str(exc)
        if getattr(args, "dsn", None):
            message = message.replace(args.dsn, redact(args.dsn))
        kind = "database error: " if database else ""
        print(f"ticklock: {kind}{type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_ERROR


def _check(args: argparse.Namespace) -> None:
    """Refuse a bad ``--log-level`` or DSN before anything runs; apply the log level."""
    level = getattr(args, "log_level", "INFO")
    if level.upper() not in _LEVELS:
        raise CommandError(f"--log-level must be one of {', '.join(_LEVELS)}, got {level!r}")
    logging.getLogger("ticklock").setLevel(level.upper())
    if not hasattr(args, "dsn"):
        return
    source = "--dsn"
    if args.dsn is None:
        args.dsn, source = os.environ.get("TICKLOCK_DSN") or None, "TICKLOCK_DSN"
    if args.dsn is not None:
        valid_dsn(args.dsn, source)
    elif args.needs_dsn:
        raise CommandError(f"{args.command} needs --dsn or the TICKLOCK_DSN variable")
