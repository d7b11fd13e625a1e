"""The jobs of the contract suite's scenarios (``test_contract.py``), declared alike by the
replicas in memory and by the replica processes on PostgreSQL (``contract_app.py``), so that
one scenario runs the same code on both backends.

- ``tick``: a slot every :data:`INTERVAL` seconds, a handler that returns at once;
- ``rare``: a slot an hour away: it runs only when triggered;
- ``sweep``: a batched sweep over :data:`BACKLOG` items, :data:`CHUNK` a batch from the
  cursor on, at most :data:`CAP` batches a run; its report lists the items it swept.
"""

from __future__ import annotations

from ticklock import JobContext, Scheduler, every

INTERVAL = 2.0
"""Seconds between an ``every`` run's end and the next one's slot (kept short: PostgreSQL runs
in real time)."""
BACKLOG, CHUNK, CAP = 9, 2, 2


def declare(scheduler: Scheduler, scenario: str) -> None:
    """Add the jobs of ``scenario`` (``tick``, ``rare`` or ``sweep``) to ``scheduler``."""
    if scenario == "tick":

        @scheduler.job(every(INTERVAL), id="tick", timeout=1)
        async def tick(ctx: JobContext) -> None:
            pass

    elif scenario == "rare":

        @scheduler.job(every(3600, initial_delay=3600), id="rare", timeout=5)
        async def rare(ctx: JobContext) -> None:
            pass

    elif scenario == "sweep":

        @scheduler.job(every(1), id="sweep", timeout=0.9, max_batches=CAP)
        async def sweep(ctx: JobContext) -> dict[str, list[int]]:
            swept: list[int] = []
            async for batch in ctx.batches():
                start = batch.cursor or 0
                chunk = list(range(start, min(start + CHUNK, BACKLOG)))
                swept.extend(chunk)
                batch.cursor = start + len(chunk)
                if len(chunk) < CHUNK:
                    break
            return {"swept": swept}

    else:
        raise ValueError(f"no contract scenario {scenario!r}")
