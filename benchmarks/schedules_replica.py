"""One replica of P13 (``benchmarks.schedules``): a scheduler with the task ``report`` and no
jobs of its own, running the stored schedules of that task.

python benchmarks/schedules_replica.py DSN SCHEMA OWNER OUT_DIR (SIGTERM stops it)

It writes to ``OUT_DIR``: ``OWNER.started`` (the unix time at which the scheduler had
started) and ``OWNER.seen``, a line ``unix-time number`` each time its catalog applied the
stored schedules' writes up to that write number (ticklock's debug log says so).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import anyio

from ticklock import JobContext, Scheduler

APPLIED = "stored schedules: applied the writes up to "


class Seen(logging.Handler):
    """Writes the time and the write number of each 'applied the writes' debug record."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(APPLIED):
            self.out.write(f"{time.time():.4f} {message[len(APPLIED) :]}\n")


async def main(dsn: str, schema: str, owner: str, out: str) -> None:
    log = logging.getLogger("ticklock")
    log.setLevel(logging.DEBUG)
    log.addHandler(Seen(os.path.join(out, f"{owner}.seen")))
    quiet = logging.StreamHandler()
    quiet.setLevel(logging.WARNING)
    log.addHandler(quiet)
    log.propagate = False
    scheduler = Scheduler(dsn, schema=schema, owner=owner, shutdown_grace=2)

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None:
        pass

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            with open(os.path.join(out, f"{owner}.started"), "w") as started:  # noqa: ASYNC230
                started.write(f"{time.time():.4f}\n")
            async for _ in signals:
                break


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    anyio.run(main, *sys.argv[1:5])
