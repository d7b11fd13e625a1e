"""The dashboard's stored schedules: a page paged and filtered by tenant and task, its JSON,
the jobs page listing only the stored schedules that need a look, and a schedule's job page."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from test_dashboard import asgi
from ticklock import JobContext, Scheduler, cron
from ticklock.testing import ManualClock

pytestmark = pytest.mark.anyio

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


async def test_the_schedules_page_pages_filters_and_escapes() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, owner="web-1")

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None: ...

    @scheduler.job(cron("0 3 * * *"), id="nightly")
    async def nightly(ctx: JobContext) -> None: ...

    for i in range(130):
        tenant = "<b>evil</b>" if i == 7 else f"t{i % 2}"
        await scheduler.schedules.put(
            f"r{i:03}", task="report", trigger=cron("0 9 * * *"), tenant=tenant
        )
    app = scheduler.dashboard()
    async with scheduler:
        first = await asgi(app, "/schedules")
        assert first.status == 200
        assert first.body.count('<td class="id">') == 100
        assert "r000" in first.body and "r099" in first.body and "r100" not in first.body
        assert "/schedules?after=r099" in first.body  # the next page's link
        second = await asgi(app, "/schedules?after=r099")
        assert second.body.count('<td class="id">') == 30 and "Next page" not in second.body
        t1 = await asgi(app, "/schedules?tenant=t1")
        assert t1.body.count('<td class="id">') == 64  # r007 is the evil tenant's
        assert "&lt;b&gt;evil&lt;/b&gt;" in first.body and "<b>evil</b>" not in first.body
        api = (await asgi(app, "/api/schedules?tenant=t0&task=report")).json()
        assert [s["id"] for s in api["schedules"]][:3] == ["r000", "r002", "r004"]
        assert api["after"] is None and api["schedules"][0]["schedule"] == "cron '0 9 * * *' UTC"
        none = await asgi(app, "/schedules?task=nope")
        assert "No stored schedule matches" in none.body
        # the jobs page: the job declared in code, a count and a link, not 130 rows
        index = await asgi(app, "/")
        assert "nightly" in index.body and "r000" not in index.body
        assert "130 stored schedules" in index.body
        job = await asgi(app, "/jobs/r000")
        assert job.status == 200 and "cron" in job.body
