"""A PostgreSQL job that covers "everything due" from the fleet's watermark, exactly once.

Each run aggregates the window (ctx.previous_success, ctx.slot]. The totals, the watermark and
the run record commit in one transaction, so each window is counted once, and after an outage
the first run covers the whole missed window. Run it: ``ticklock run watermark:scheduler``
with TICKLOCK_DSN set.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from ticklock import JobContext, Scheduler, every

scheduler = Scheduler(os.environ.get("TICKLOCK_DSN", "postgresql://localhost/app"))
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@scheduler.job(every(minutes=5), timeout=60, id="usage-totals")
async def usage_totals(ctx: JobContext) -> dict[str, int]:
    since = ctx.previous_success or EPOCH
    # ctx.db: the connection that holds the lock, inside the tick's transaction
    accounts = await ctx.db.fetchval(
        """
        WITH totals AS (
            INSERT INTO usage_totals (account_id, window_end, amount)
            SELECT account_id, $2, sum(amount) FROM usage
            WHERE recorded_at > $1 AND recorded_at <= $2
            GROUP BY account_id
            RETURNING 1
        )
        SELECT count(*) FROM totals
        """,
        since,
        ctx.slot,
    )
    return {"accounts": accounts}
