"""A FastAPI app whose jobs run in its lifespan, with /health and Prometheus /metrics.

Run it: ``uvicorn fastapi_app:app --port 8000`` (from docs/examples). Set TICKLOCK_DSN to
coordinate replicas through PostgreSQL; without it the scheduler runs in local mode.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ticklock import JobContext, Scheduler, every

meter_provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
scheduler = Scheduler(
    os.environ.get("TICKLOCK_DSN") or None, meter_provider=meter_provider, shutdown_grace=5
)
processed = {"count": 0}


@scheduler.job(every(1), id="tidy", timeout=0.5)
async def tidy(ctx: JobContext) -> dict[str, int]:
    processed["count"] += 1
    return {"processed": processed["count"]}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Compose with your own resources: the scheduler starts after them and stops before them.
    async with scheduler:
        yield


app = FastAPI(lifespan=lifespan)  # or simply FastAPI(lifespan=scheduler.lifespan)


@app.get("/")
async def index() -> dict[str, Any]:
    return {"processed": processed["count"]}


@app.get("/health")
async def health(response: Response) -> dict[str, Any]:
    jobs = scheduler.health()
    if any(job.overdue for job in jobs):
        response.status_code = 503
    return {
        job.job_id: {
            "last_success": job.last_success.isoformat() if job.last_success else None,
            "consecutive_failures": job.consecutive_failures,
            "overdue": job.overdue,
        }
        for job in jobs
    }


@app.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
