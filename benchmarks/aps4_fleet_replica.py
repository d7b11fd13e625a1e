"""One replica of P7's peer: APScheduler 4 with its SQLAlchemy (asyncpg) data store.

python benchmarks/aps4_fleet_replica.py DSN SCHEMA JOBS OWNER OUT     (SIGTERM stops it)

Runs in APScheduler 4's own virtual environment (``benchmarks/.venvs/py3.X/aps4``, with
SQLAlchemy and asyncpg). The replicas share one data store and an asyncpg event broker, so the
schedules are shared: every replica adds the same JOBS ``IntervalTrigger(seconds=1)`` schedules
(the first to add one wins, ``ConflictPolicy.do_nothing``) and runs whatever jobs it acquires.
Each run appends ``schedule_id scheduled_fire_time started_at owner`` (epoch seconds) to OUT.
It prints ``ready`` once its scheduler runs.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import TextIO

import anyio

_OUT: list[TextIO] = []
_OWNER: list[str] = []


async def body() -> None:
    """A no-op job that records when it started against its scheduled fire time."""
    from apscheduler import current_job

    started = time.time()
    job = current_job.get()
    fire = job.scheduled_fire_time
    line = f"{job.schedule_id} {fire.timestamp() if fire else 'nan'} {started} {_OWNER[0]}\n"
    _OUT[0].write(line)


async def main(dsn: str, schema: str, jobs: int, owner: str) -> None:
    from apscheduler import AsyncScheduler, ConflictPolicy
    from apscheduler.datastores.sqlalchemy import SQLAlchemyDataStore
    from apscheduler.eventbrokers.asyncpg import AsyncpgEventBroker
    from apscheduler.triggers.interval import IntervalTrigger
    from sqlalchemy.ext.asyncio import create_async_engine

    url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    engine = create_async_engine(url)
    data_store = SQLAlchemyDataStore(engine, schema=schema)
    event_broker = AsyncpgEventBroker.from_async_sqla_engine(engine)
    _OWNER[:] = [owner]
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with AsyncScheduler(data_store, event_broker, identity=owner) as scheduler:
            for i in range(jobs):
                await scheduler.add_schedule(
                    body,
                    IntervalTrigger(seconds=1),
                    id=f"job-{i}",
                    conflict_policy=ConflictPolicy.do_nothing,
                )
            await scheduler.start_in_background()
            print("ready", flush=True)  # its store is set up: the next replica may start
            async for _ in signals:
                break
    await engine.dispose()


if __name__ == "__main__":
    dsn, schema, jobs, owner, out = sys.argv[1:6]
    with open(out, "a", buffering=1) as sink:
        _OUT[:] = [sink]
        anyio.run(main, dsn, schema, int(jobs), owner)
