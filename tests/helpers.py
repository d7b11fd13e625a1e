"""Helpers shared by the tests."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

import anyio

from ticklock import Scheduler

UTC = timezone.utc
PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
)


@dataclass
class Seen:
    job_id: str
    slot: str
    outcome: str
    error: str | None


class RunLog(logging.Handler):
    """Collects the one log record ticklock writes per tick attempt."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.runs: list[Seen] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "outcome"):
            self.runs.append(
                Seen(
                    record.__dict__["job_id"],
                    record.__dict__["slot"],
                    record.__dict__["outcome"],
                    record.__dict__["error"],
                )
            )

    def outcomes(self, job_id: str) -> list[str]:
        return [r.outcome for r in self.runs if r.job_id == job_id]


@contextmanager
def run_log() -> Iterator[RunLog]:
    logger = logging.getLogger("ticklock")
    handler = RunLog()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await anyio.sleep(0.05)


def add_lock_holder(scheduler: Scheduler, entered: anyio.Event, gate: anyio.Event) -> None:
    """Declare job "shared": its run signals ``entered`` and holds the lock until ``gate``."""
    from ticklock import JobContext, every

    @scheduler.job(every(3600), id="shared")
    async def shared(ctx: JobContext) -> None:
        entered.set()
        await gate.wait()
