"""``ticklock demo``: a local-mode scheduler with a few real jobs, printing each run."""

from __future__ import annotations

import json
import logging
import random
import signal
from datetime import datetime, timezone

import anyio

from ._operators.cli.plan import summary
from ._schedule.job import JobContext
from ._schedule.triggers import cron, every
from ._scheduler import Scheduler


class _Printer(logging.Handler):
    """Prints each run line as a row: job, slot (UTC, to the millisecond), outcome, duration,
    and the report as JSON or the error."""

    def emit(self, record: logging.LogRecord) -> None:
        if not hasattr(record, "outcome"):
            return
        try:
            when = datetime.fromisoformat(str(getattr(record, "slot", None)))
            slot = f"{when:%H:%M:%S.%f}"[:12]
        except ValueError:
            slot = "-"
        detail = ""
        if error := getattr(record, "error", None):
            detail = f" error={error}"
        elif (report := getattr(record, "report", None)) is not None:
            detail = f" report={json.dumps(report)}"
        print(
            f"{record.job_id:<10} slot={slot:<12} {record.outcome:<8} "  # type: ignore[attr-defined]
            f"{record.duration * 1000:7.1f} ms{detail}",  # type: ignore[attr-defined]
            flush=True,
        )


def build() -> Scheduler:
    """The demo's scheduler: a jittered heartbeat, a job that sometimes fails, a cron job."""
    scheduler = Scheduler(shutdown_grace=2)
    rng = random.Random()

    @scheduler.job(every(2, jitter=0.5), id="heartbeat")
    async def heartbeat(ctx: JobContext) -> dict[str, int]:
        # after its slot by the jitter drawn for this run (0-500 ms), not by lateness
        return {"jitter_ms": round((ctx.started_at - ctx.slot).total_seconds() * 1000)}

    @scheduler.job(every(3), id="flaky", timeout=1)
    async def flaky(ctx: JobContext) -> dict[str, int]:
        await anyio.sleep(rng.uniform(0, 0.2))
        if rng.random() < 0.3:
            raise RuntimeError("simulated failure (the next run still comes)")
        return {"processed": rng.randint(1, 50)}

    @scheduler.job(cron("* * * * *", tz="Europe/Berlin"), id="minutely")
    async def minutely(ctx: JobContext) -> dict[str, str]:
        return {"since": ctx.previous_success.isoformat() if ctx.previous_success else "start"}

    return scheduler


async def demo(seconds: float | None = None) -> None:
    """Run the demo until Ctrl-C/SIGTERM (or for ``seconds``)."""
    logger = logging.getLogger("ticklock")
    logger.addHandler(_Printer())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    scheduler = build()
    # the slots as a scheduler started now plans them
    now = datetime.now(timezone.utc)
    print("ticklock demo (local mode). Jobs and their next slots (UTC):")
    width = max(len(job.trigger.describe()) for job in scheduler.jobs.values())
    for job in scheduler.jobs.values():
        print(f"  {job.id:<10} {job.trigger.describe():<{width}}  {summary(job, now, 3)}")
    print("Press Ctrl-C to stop.\n", flush=True)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with scheduler:
            with anyio.move_on_after(seconds if seconds is not None else float("inf")):
                async for _ in signals:
                    break
    print("\nstopped cleanly")
