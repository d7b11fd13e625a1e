import os

from fastapi import FastAPI

from ticklock import JobContext, Scheduler, cron, every

scheduler = Scheduler(os.environ["TICKLOCK_DSN"])  # Scheduler() alone: local mode


@scheduler.job(every(minutes=15, jitter=30), timeout=60, id="purge-expired")
async def purge(ctx: JobContext) -> dict[str, int]:
    # ctx.db holds the job's lock, inside the tick's transaction: write through it
    n = await ctx.db.fetchval(
        "WITH d AS (DELETE FROM keys WHERE expires_at < now() RETURNING 1) SELECT count(*) FROM d"
    )
    return {"deleted": n}  # the run's report, stored with the run


@scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), id="nightly")
async def nightly(ctx: JobContext) -> None:
    # covers everything due since ctx.previous_success, up to ctx.slot
    ...


app = FastAPI(lifespan=scheduler.lifespan)  # or: async with scheduler: ...
