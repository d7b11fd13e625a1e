"""The commands that run a scheduler from your code: ``run``, ``jobs`` and ``demo``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback
from datetime import datetime, timezone
from functools import reduce

import anyio

from ..._schedule.validate import visible
from ..._scheduler import Scheduler
from . import logs, plan
from .errors import EXIT_OK, CommandError

BUILT_IN = ("ticklock.retention",)  # the jobs ticklock adds itself (in PostgreSQL mode)


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
    ticklock = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    machinery = tuple(os.path.join(d, "") for d in (os.path.dirname(importlib.__file__), ticklock))
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


def run(args: argparse.Namespace) -> int:
    scheduler = load_scheduler(args.target)
    logs.configure()  # after the import: a module that configured logging keeps its own
    if args.log_level is not None:  # given: it wins over a level the module set
        logging.getLogger("ticklock").setLevel(args.log_level.upper())
    if args.dsn:
        scheduler.use_dsn(args.dsn)
    anyio.run(serve, scheduler)
    return EXIT_OK


def label(job_id: str) -> str:
    """``job_id`` for a terminal (hidden characters as escapes), with `` (built-in)`` for a
    job ticklock adds itself."""
    return f"{job_id} (built-in)" if job_id in BUILT_IN else visible(job_id)


def jobs(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CommandError(f"--count must be at least 1, got {args.count}")
    scheduler = load_scheduler(args.target)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    for job in scheduler.jobs.values():
        state = "" if job.enabled else "  (disabled: never runs)"
        print(f"{label(job.id)}: {job.trigger.describe()}, timeout {job.timeout:g}s{state}")
        if not job.enabled:
            continue
        for line in plan.lines(job, now, args.count):
            print(line)
    return EXIT_OK


async def demo(args: argparse.Namespace) -> int:
    from ..._demo import demo as run_demo

    await run_demo(args.seconds)
    return EXIT_OK
