"""An aiohttp app whose jobs run in its cleanup context, with a /health endpoint.

Run it: ``python aiohttp_app.py --port 8080`` (from docs/examples). SIGTERM or Ctrl-C stops
the app, and the scheduler with it, gracefully.
"""

from __future__ import annotations

import argparse
import os

from aiohttp import web

from ticklock import JobContext, Scheduler, every

scheduler = Scheduler(os.environ.get("TICKLOCK_DSN") or None, shutdown_grace=5)
processed = {"count": 0}


@scheduler.job(every(1), id="tidy", timeout=0.5)
async def tidy(ctx: JobContext) -> dict[str, int]:
    processed["count"] += 1
    return {"processed": processed["count"]}


async def index(request: web.Request) -> web.Response:
    return web.json_response({"processed": processed["count"]})


async def health(request: web.Request) -> web.Response:
    jobs = scheduler.health()
    body = {
        job.job_id: {
            "last_success": job.last_success.isoformat() if job.last_success else None,
            "overdue": job.overdue,
        }
        for job in jobs
    }
    return web.json_response(body, status=503 if any(j.overdue for j in jobs) else 200)


def make_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(scheduler.aiohttp_ctx)
    app.add_routes([web.get("/", index), web.get("/health", health)])
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    web.run_app(make_app(), host="127.0.0.1", port=args.port)
