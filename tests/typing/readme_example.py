import os

from fastapi import FastAPI

import ticklock
from ticklock import JobContext, Scheduler, every

ticklock.log_to_stderr()  # one line per run (uvicorn shows only its own lines)

# TICKLOCK_DSN unset: local mode, in-process, and no database is needed to list the jobs
scheduler = Scheduler(os.environ.get("TICKLOCK_DSN"))


@scheduler.job(every(seconds=5), timeout=3, id="heartbeat")
async def heartbeat(ctx: JobContext) -> dict[str, str]:
    if scheduler.postgres:
        # ctx.db holds the job's lock, inside the tick's transaction: the row commits
        # together with the schedule's watermark, or not at all
        await ctx.db.execute(
            "INSERT INTO heartbeats (slot, owner) VALUES ($1, $2)", ctx.slot, ctx.owner
        )
    return {"owner": ctx.owner}  # the run's report: logged, and stored with the run


app = FastAPI(lifespan=scheduler.lifespan)
