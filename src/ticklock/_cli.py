"""The command line: ``ticklock run|jobs|status|migrate|demo`` (also ``python -m ticklock``).

Exit codes: 0 success (``status``: no job overdue), 1 ``status`` found an overdue job,
2 bad usage or an error (unreachable database, an import that fails).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio

from ._errors import ScheduleError
from ._scheduler import Scheduler
from ._triggers import Cron

EXIT_OK, EXIT_OVERDUE, EXIT_ERROR = 0, 1, 2


def redact(dsn: str) -> str:
    """``dsn`` without its password, fit for logs and messages."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<dsn>"
    if parts.password is None:
        return dsn
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def load_scheduler(target: str) -> Scheduler:
    """Import ``MODULE:ATTR`` and return the :class:`Scheduler` it names."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(
            f"ticklock: expected MODULE:ATTR (e.g. myapp.jobs:scheduler), got {target!r}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, Scheduler):
        raise SystemExit(f"ticklock: {target} is a {type(obj).__name__}, not a ticklock.Scheduler")
    return obj


async def serve(scheduler: Scheduler) -> None:
    """Run ``scheduler`` until SIGTERM or SIGINT, then shut down gracefully."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            async for signum in signals:
                logging.getLogger("ticklock").info(
                    "ticklock: %s received, shutting down", signal.Signals(signum).name
                )
                return


def _cmd_run(args: argparse.Namespace) -> int:
    scheduler = load_scheduler(args.target)
    if args.dsn:
        scheduler.use_dsn(args.dsn)
    anyio.run(serve, scheduler)
    return EXIT_OK


def _cmd_jobs(args: argparse.Namespace) -> int:
    scheduler = load_scheduler(args.target)
    now = datetime.now(timezone.utc)
    for job in scheduler.jobs.values():
        state = "" if job.enabled else "  (disabled)"
        print(f"{job.id}: {job.trigger.describe()}, timeout {job.timeout:g}s{state}")
        fire: datetime | None = now
        zone = job.trigger.zone if isinstance(job.trigger, Cron) else None
        for _ in range(args.count):
            assert fire is not None
            fire = job.trigger.next_fire(fire)
            if fire is None:
                break
            local = f"  ({fire.astimezone(zone).isoformat()} {zone.key})" if zone else ""
            print(f"    {fire.isoformat()}{local}")
    return EXIT_OK


async def _status(args: argparse.Namespace) -> int:
    import asyncpg

    from ._schema import quote

    conn = await asyncpg.connect(args.dsn)
    try:
        rows = await conn.fetch(
            "SELECT job_id, last_success_at, last_outcome, consecutive_failures, overdue_at, "
            f"overdue_at < now() AS overdue FROM {quote(args.schema)}.jobs "
            "WHERE namespace = $1 ORDER BY job_id",
            args.namespace,
        )
    finally:
        await conn.close()
    overdue = 0
    print(f"{'job':<40} {'last success':<27} {'last outcome':<12} {'fails':>5}  status")
    for row in rows:
        last = (
            row["last_success_at"].isoformat(timespec="seconds")
            if row["last_success_at"]
            else "never"
        )
        flag = "OVERDUE" if row["overdue"] else "ok"
        overdue += bool(row["overdue"])
        print(
            f"{row['job_id']:<40} {last:<27} {row['last_outcome'] or '-':<12} "
            f"{row['consecutive_failures']:>5}  {flag}"
        )
    if not rows:
        print(f"(no jobs in namespace {args.namespace!r})")
    return EXIT_OVERDUE if overdue else EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    return anyio.run(_status, args)


async def _migrate(args: argparse.Namespace) -> None:
    import asyncpg

    from ._schema import migrate

    conn = await asyncpg.connect(args.dsn)
    try:
        await migrate(conn, args.schema)
    finally:
        await conn.close()
    print(f"ticklock: schema {args.schema!r} is up to date")


def _cmd_migrate(args: argparse.Namespace) -> int:
    anyio.run(_migrate, args)
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import demo

    anyio.run(demo, args.seconds)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ticklock",
        description="Periodic jobs inside your process, once across replicas.",
        epilog="Exit codes: 0 ok; 1 'status' found an overdue job; 2 usage or runtime error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def db_options(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument(
            "--dsn",
            required=required,
            default=os.environ.get("TICKLOCK_DSN") if not required else None,
            help="PostgreSQL connection string, e.g. postgresql://user@host/db",
        )

    p = sub.add_parser("run", help="run a scheduler from your code as a sidecar process")
    p.add_argument(
        "target", help="MODULE:ATTR naming a ticklock.Scheduler, e.g. app.jobs:scheduler"
    )
    db_options(p, required=False)
    p.add_argument("--log-level", default="INFO", help="log level of the 'ticklock' logger")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("jobs", help="list a scheduler's jobs and their next fire times")
    p.add_argument("target", help="MODULE:ATTR naming a ticklock.Scheduler")
    p.add_argument("--count", type=int, default=5, help="how many fire times to show (default 5)")
    p.set_defaults(func=_cmd_jobs)

    for name, helptext, func in (
        ("status", "show the fleet's job state; exit 1 if a job is overdue", _cmd_status),
        ("migrate", "create or update ticklock's tables", _cmd_migrate),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("--dsn", required=True, help="PostgreSQL connection string")
        p.add_argument("--schema", default="ticklock", help="schema of ticklock's tables")
        if name == "status":
            p.add_argument("--namespace", default="default", help="the application namespace")
        p.set_defaults(func=func)

    p = sub.add_parser("demo", help="run a demo scheduler in local mode, printing each run")
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ticklock`` command."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("ticklock").setLevel(getattr(args, "log_level", "INFO").upper())
    try:
        return int(args.func(args))
    except ScheduleError as exc:
        print(f"ticklock: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ImportError) as exc:
        message = str(exc)
        dsn = getattr(args, "dsn", None)
        if dsn:
            message = message.replace(dsn, redact(dsn))
        print(f"ticklock: {type(exc).__name__}: {message}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if type(exc).__module__.startswith("asyncpg"):
            print(f"ticklock: database error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_ERROR
        raise
