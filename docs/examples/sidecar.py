"""A scheduler as a sidecar: in your own task group, or as its own process.

As a process: ``ticklock run sidecar:scheduler [--dsn ...]`` (SIGTERM/SIGINT: graceful, exit 0).
As a coroutine: ``python sidecar.py`` runs it beside other work in one task group.
"""

from __future__ import annotations

import anyio

from ticklock import JobContext, Scheduler, cron, every

scheduler = Scheduler(shutdown_grace=5)


@scheduler.job(every(minutes=5, jitter=20), id="refresh-cache")
async def refresh_cache(ctx: JobContext) -> dict[str, str]:
    return {"slot": ctx.slot.isoformat()}


@scheduler.job(cron("0 6 * * mon-fri", tz="America/New_York"), id="morning-report")
async def morning_report(ctx: JobContext) -> None: ...


async def other_work() -> None:
    await anyio.sleep(3)


async def main() -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)  # returns once every job is scheduled
        await other_work()
        tg.cancel_scope.cancel()  # stops the scheduler gracefully


if __name__ == "__main__":
    anyio.run(main)
