"""The dashboard in a real browser against a real fleet (issues 16 and 25).

PostgreSQL: replica ``web-1`` is a real uvicorn serving ``ops_app.create_app()``: a FastAPI app
whose lifespan runs the scheduler and that mounts ``scheduler.dashboard(actions=True)`` at
``/ticklock``. Replica ``worker-1`` is a plain ``ticklock run`` process of the same scheduler.
Both share a real PostgreSQL; headless Chromium, driven by Playwright, clicks the buttons.
What the fleet did is read from the database: each handler logs its run there.

In memory: two schedulers sharing a ``MemoryDatabase`` on a ``ManualClock`` live through a
virtual day in a second; uvicorn serves ``web-1``'s dashboard in the same event loop, and
Chromium reads the fleet summary and the slot timeline, and pauses a job with a note.

``TICKLOCK_UPDATE_SCREENSHOT=1 pytest tests/test_dashboard_e2e.py -k summary`` rewrites
``docs/dashboard.png`` (the jobs) and ``docs/dashboard-job.png`` (a job's page) from it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import anyio
import pytest

from helpers import Replicas, eventually
from ops_app import HOSTILE_ERROR, HOSTILE_REPORT
from test_operations import BOUND, MARGIN, db_now, job_row, last_run, wait_live, wait_run
from ticklock import JobContext, Scheduler, cron, every
from ticklock._operators.dashboard import create_app
from ticklock.testing import ManualClock, MemoryDatabase

if TYPE_CHECKING:
    from playwright.async_api import Page
    from starlette.types import ASGIApp

pytestmark = [pytest.mark.anyio]
CHROMIUM = shutil.which("chromium")
DOCS = Path(__file__).parent.parent / "docs"
SCREENSHOTS = {"index": DOCS / "dashboard.png", "job": DOCS / "dashboard-job.png"}
"""Written by the summary test when ``TICKLOCK_UPDATE_SCREENSHOT`` is set (not on every run:
a test run leaves the working tree as it found it)."""
OWNERS = {"web-1", "worker-1"}
STEADY = "reports.refresh-cache"
RARE = "maintenance.reindex"
BILLING = "billing.sync-invoices"
FEED = "imports.parse-feed"


@dataclass
class Fleet:
    replicas: Replicas
    base: str
    """The web replica's origin, ``http://127.0.0.1:PORT``."""

    @property
    def schema(self) -> str:
        return self.replicas.schema

    @property
    def dashboard(self) -> str:
        return self.base + "/ticklock"

    def job_url(self, job_id: str) -> str:
        return f"{self.dashboard}/jobs/{quote(job_id, safe='')}"


@pytest.fixture
async def fleet(ops: Replicas, pg_dsn: str, pg_schema: str, pg_conn: Any) -> AsyncIterator[Fleet]:
    if CHROMIUM is None:
        pytest.skip("no `chromium` executable on PATH (Debian: apt-get install chromium)")
    # uvicorn serves a socket bound here (no port race), passed as a file descriptor
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        port = sock.getsockname()[1]
        argv = [sys.executable, "-m", "uvicorn", "--factory", "ops_app:create_app"]
        argv += ["--fd", str(sock.fileno()), "--log-level", "warning"]
        env = ops.env("web-1", "web", dsn=pg_dsn)
        ops.popen("web-1", argv, env, pass_fds=[sock.fileno()])
    finally:
        sock.close()
    ops.start("worker-1", "web")
    f = Fleet(ops, f"http://127.0.0.1:{port}")
    await wait_live(pg_conn, pg_schema, OWNERS)  # the ops fixture kills what still runs

    async def serving() -> bool:
        return (await anyio.to_thread.run_sync(get, f.dashboard + "/"))[0] == 200

    await eventually(serving, 20, "the web replica to serve its dashboard")
    yield f
    assert ops.stop("worker-1") == 0, ops.output("worker-1")
    # uvicorn shuts down gracefully on SIGTERM, then raises it again for its exit status
    assert ops.stop("web-1") in (0, -signal.SIGTERM), ops.output("web-1")
    left = await pg_conn.fetchval(f"SELECT count(*) FROM {pg_schema}.replicas")
    assert left == 0, "a replica did not leave: its scheduler was not shut down gracefully"


@asynccontextmanager
async def browser_page() -> AsyncIterator[tuple[Page, list[str]]]:
    """A Chromium page of 1200×800, and the list that its dialogs, console errors and page
    errors go to (a dialog is dismissed)."""
    from playwright.async_api import Dialog, async_playwright

    problems: list[str] = []

    async def on_dialog(dialog: Dialog) -> None:
        problems.append(f"dialog: {dialog.message}")
        await dialog.dismiss()

    assert CHROMIUM is not None
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = await browser.new_context(viewport={"width": 1200, "height": 800})
            page = await context.new_page()  # the context can open a second tab
            page.on("dialog", on_dialog)
            page.on(
                "console",
                lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            yield page, problems
        finally:
            await browser.close()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 303 is an answer to look at, not to follow


_opener = urllib.request.build_opener(_NoRedirects)


def get(url: str) -> tuple[int, str, str | None]:
    """GET ``url``: status, body and the CSRF cookie's value (if the answer sets one)."""
    return post(url, None)


def post(url: str, form: dict[str, str] | None, **headers: str) -> tuple[int, str, str | None]:
    """POST ``form`` urlencoded (GET if ``None``), with ``headers`` (``Cookie=...``)."""
    data = None if form is None else urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with _opener.open(request, timeout=10) as answer:
            status, message, body = answer.status, answer.headers, answer.read().decode()
    except urllib.error.HTTPError as exc:
        status, message, body = exc.code, exc.headers, exc.read().decode()
    cookies = message.get_all("set-cookie") or []
    token = next((c.split(";")[0].split("=", 1)[1] for c in cookies if "ticklock_csrf=" in c), None)
    return status, body, token


async def runs_by_owner(conn: Any, schema: str, job: str) -> dict[str, int]:
    rows = await conn.fetch(
        f"SELECT owner, count(*) AS n FROM {schema}.log WHERE job = $1 GROUP BY owner", job
    )
    return {row["owner"]: row["n"] for row in rows}


@pytest.mark.postgres
async def test_a_browser_pauses_resumes_and_triggers_jobs_on_both_replicas(
    fleet: Fleet, pg_conn: Any
) -> None:
    s = fleet.schema

    # the replicas share the jobs (rendezvous hashing): worker-1 owns STEADY, so the pause
    # made through web-1's dashboard must reach the other replica
    async def shared() -> bool:
        return "worker-1" in await runs_by_owner(pg_conn, s, STEADY)

    await eventually(shared, 20, f"worker-1 to run {STEADY}")
    async with browser_page() as (page, problems):
        await page.goto(fleet.dashboard + "/")
        for job_id in (STEADY, RARE, BILLING, FEED):
            assert await page.get_by_role("link", name=job_id, exact=True).count() == 1, job_id
        replicas = await page.locator("table.replicas tbody tr td.id").all_inner_texts()
        assert sorted(replicas) == sorted(OWNERS)

        await page.get_by_role("link", name=STEADY, exact=True).click()
        await page.wait_for_url(fleet.job_url(STEADY))
        assert await page.locator("h1").inner_text() == STEADY
        await page.locator(".summary").get_by_role("button", name="Pause").click()
        await page.wait_for_url("**?done=paused")
        assert await page.locator(".summary .state").inner_text() == "PAUSED"
        paused_at = (await job_row(pg_conn, s, STEADY))["paused_at"]
        assert paused_at is not None
        before = await runs_by_owner(pg_conn, s, STEADY)

        # the fleet runs on for longer than the contract's bound; neither replica runs STEADY
        await wait_run(pg_conn, s, FEED, paused_at + BOUND + MARGIN, f"{FEED} to run on")
        last = await last_run(pg_conn, s, STEADY)
        assert last is not None and last <= paused_at + MARGIN, (last, paused_at)
        assert await runs_by_owner(pg_conn, s, STEADY) == before  # worker-1 stopped too

        resumed = await db_now(pg_conn)
        await page.locator(".summary").get_by_role("button", name="Resume").click()
        await page.wait_for_url("**?done=resumed")
        assert await page.locator(".summary .state").inner_text() == "OK"
        back = await wait_run(pg_conn, s, STEADY, resumed, f"{STEADY} to run after resume")
        assert back - resumed <= BOUND

        await page.goto(fleet.dashboard + "/")
        await page.get_by_role("link", name=RARE, exact=True).click()
        await page.wait_for_url(fleet.job_url(RARE))
        asked = await db_now(pg_conn)
        await page.locator(".summary").get_by_role("button", name="Trigger").click()
        await page.wait_for_url("**?done=triggered")
        triggered = f"SELECT * FROM {s}.runs WHERE job_id = '{RARE}'"

        async def served() -> bool:
            return bool(await pg_conn.fetch(triggered))

        await eventually(served, 20, f"the fleet to run {RARE}")
        await anyio.sleep(2)  # the replica that lost the race does not run it again
        runs = await pg_conn.fetch(triggered)
        assert len(runs) == 1, runs
        run = runs[0]
        assert run["manual"] and run["outcome"] == "success" and run["owner"] in OWNERS
        assert asked <= run["slot"] and run["started_at"] - run["slot"] <= BOUND
        assert await pg_conn.fetchval(f"SELECT count(*) FROM {s}.log WHERE job = '{RARE}'") == 1

        await page.goto(fleet.job_url(RARE))
        rows = await page.locator("table.runs tbody tr").all_inner_texts()
        assert len(rows) == 1 and "yes" in rows[0].split("\t"), rows  # the Manual column
    assert problems == []


@pytest.mark.postgres
async def test_hostile_output_is_text_a_post_without_the_token_is_refused_and_a_screenshot(
    fleet: Fleet, pg_conn: Any, tmp_path: Path
) -> None:
    s = fleet.schema

    async def outcomes(job: str) -> dict[str, int]:
        rows = await pg_conn.fetch(
            f"SELECT outcome, count(*) AS n FROM {s}.runs WHERE job_id = $1 GROUP BY outcome",
            job,
        )
        return {row["outcome"]: row["n"] for row in rows}

    async def both(job: str, runs: int) -> None:
        async def done() -> bool:
            seen = await outcomes(job)
            return {"success", "failure"} <= set(seen) and sum(seen.values()) >= runs

        await eventually(done, 25, f"{job} to succeed and fail")

    await both(FEED, 2)
    async with browser_page() as (page, problems):
        await page.goto(fleet.dashboard + "/")
        row = page.locator("tr", has=page.get_by_role("link", name=FEED, exact=True))
        assert HOSTILE_ERROR in await row.locator("td.error").inner_text()
        await page.get_by_role("link", name=FEED, exact=True).click()
        await page.wait_for_url(fleet.job_url(FEED))
        table = await page.locator("table.runs").inner_text()
        assert f'{{"html": "{HOSTILE_REPORT}"}}' in table  # shown as text...
        assert f"ValueError: unexpected markup in the feed: {HOSTILE_ERROR}" in table
        assert HOSTILE_ERROR in await page.locator("dl.record pre.error").inner_text()
        # ...and never parsed as markup (the CSP would stop a script anyway: look at the DOM)
        assert await page.locator("script").count() == 0
        assert await page.locator("img").count() == 0
        chart = await page.locator("svg circle.run title").all_text_contents()
        assert any(HOSTILE_ERROR in label for label in chart), chart

        # a forged POST: right origin, right form, no CSRF token; then a cookie without the
        # form's token; then a wrong one. Refused, and the job is not paused.
        action = fleet.job_url(STEADY) + "/pause"
        origin = {"Origin": fleet.base}
        status, _, token = await anyio.to_thread.run_sync(get, fleet.job_url(STEADY))
        assert status == 200 and token is not None
        cookie = f"ticklock_csrf={token}"
        for form, headers in (
            ({"back": "job"}, origin),
            ({"back": "job"}, {**origin, "Cookie": cookie}),
            ({"back": "job", "csrf": "x" * 43}, {**origin, "Cookie": cookie}),
        ):
            refused = await anyio.to_thread.run_sync(partial(post, action, form, **headers))
            assert refused[0] == 403, refused
            assert "CSRF" in refused[1]
        assert (await job_row(pg_conn, s, STEADY))["paused_at"] is None
        # the same request with the token goes through: the 403s were the token's doing
        form = {"back": "job", "csrf": token}
        allowed = await anyio.to_thread.run_sync(
            lambda: post(action, form, Origin=fleet.base, Cookie=cookie)
        )
        assert allowed[0] == 303, allowed
        assert (await job_row(pg_conn, s, STEADY))["paused_at"] is not None

        # the picture for the docs: a job with some history, a failure and a manual run
        await both(BILLING, 10)
        await page.goto(fleet.job_url(BILLING))
        await page.locator(".summary").get_by_role("button", name="Trigger").click()
        await page.wait_for_url("**?done=triggered")

        async def manual() -> bool:
            return bool(
                await pg_conn.fetchval(
                    f"SELECT count(*) FROM {s}.runs WHERE job_id = $1 AND manual", BILLING
                )
            )

        await eventually(manual, 20, f"the manual run of {BILLING}")
        await page.goto(fleet.job_url(BILLING))
        cells = await page.locator("table.runs tbody tr").all_inner_texts()
        assert any("\tyes\t" in cell for cell in cells), cells
        assert any("failure" in cell for cell in cells) and any("success" in cell for cell in cells)
        shot = tmp_path / "dashboard.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes().startswith(b"\x89PNG")
    assert problems == []


@pytest.mark.asyncio_only  # Playwright's async API runs on asyncio
@pytest.mark.parametrize("spread", [timedelta(minutes=5), timedelta(days=2)], ids=["5min", "2d"])
async def test_the_chart_axis_labels_are_drawn_inside_the_chart(spread: timedelta) -> None:
    # Over an in-memory fleet (the labels depend only on the runs' times): every label of the
    # time axis is inside the SVG, not cut off at its edge.
    if CHROMIUM is None:
        pytest.skip("no `chromium` executable on PATH (Debian: apt-get install chromium)")
    from test_dashboard import MemoryFleet, job, run, serve

    minutes = spread.total_seconds() / 60
    runs = [run(BILLING, minutes * i / 4, 0.1 + i / 10) for i in range(5)]
    memory = MemoryFleet([job(BILLING)], runs, [])
    with serve(create_app(memory)) as base:
        async with browser_page() as (page, problems):
            await page.goto(f"{base}/jobs/{quote(BILLING, safe='')}")
            svg = await page.locator("figure.chart svg").bounding_box()
            assert svg is not None
            labels = page.locator("figure.chart svg text.tick")
            assert await labels.count() == 10
            for i in range(10):
                label = labels.nth(i)
                box = await label.bounding_box()
                assert box is not None
                text = await label.text_content()
                assert box["x"] >= svg["x"] - 0.5, f"{text!r} starts left of the chart"
                assert box["x"] + box["width"] <= svg["x"] + svg["width"] + 0.5, (
                    f"{text!r} ends {box['x'] + box['width'] - svg['x'] - svg['width']:.0f} px "
                    "right of the chart's edge: it is cut off"
                )
    assert problems == []


# --- in memory: the fleet summary, the slot timeline, a pause with a note ------------------------

START = datetime(2026, 12, 1, tzinfo=timezone.utc)
END = START + timedelta(days=1, minutes=31)
"""The virtual instant the browser looks at: a day and a half hour of runs behind."""
FAILED_SLOTS = {
    START + timedelta(hours=5),
    START + timedelta(hours=5, minutes=30),
    END - timedelta(minutes=1),
}
FEED_BROKEN = START + timedelta(hours=22)
"""From here on every run of FEED fails: by END it is failing (its runs finish: not overdue)."""


def declare(scheduler: Scheduler) -> None:
    """The jobs each in-memory replica declares."""

    @scheduler.job(every(minutes=15), id=STEADY, timeout=60)
    async def refresh(ctx: JobContext) -> dict[str, int]:
        return {"entries": 120}

    @scheduler.job(cron("*/30 * * * *", tz="Europe/Berlin"), id=BILLING, retries=1)
    async def invoices(ctx: JobContext) -> dict[str, int]:
        if ctx.slot in FAILED_SLOTS:
            raise ConnectionError("billing API answered 502 Bad Gateway")
        return {"invoices": 7}

    @scheduler.job(every(minutes=20), id=FEED)
    async def parse(ctx: JobContext) -> None:
        if ctx.slot >= FEED_BROKEN:
            raise ValueError("feed: unexpected end of document at line 1")

    @scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), id=RARE)
    async def reindex(ctx: JobContext) -> None:
        return None


@asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[str]:
    """``app`` on a real uvicorn server in this event loop (its fleet lives here), on a socket
    bound here."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", ws="none", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])

            async def started() -> bool:
                return server.started

            await eventually(started, 10, "uvicorn to start")
            try:
                yield f"http://127.0.0.1:{sock.getsockname()[1]}"
            finally:
                server.should_exit = True
    finally:
        sock.close()


async def titles(page: Page, fate: str) -> list[str]:
    """The tooltips of the timeline's marks of ``fate`` (as a class name: ``timed-out``)."""
    return await page.locator(f"figure.timeline rect.slot.f-{fate} title").all_text_contents()


@pytest.mark.asyncio_only  # Playwright's async API runs on asyncio
async def test_a_browser_reads_the_summary_and_the_timeline_and_pauses_a_job_with_a_note(
    tmp_path: Path,
) -> None:
    if CHROMIUM is None:
        pytest.skip("no `chromium` executable on PATH (Debian: apt-get install chromium)")
    clock = ManualClock(START)
    db = MemoryDatabase()
    web = Scheduler(database=db, clock=clock, owner="web-1")
    worker = Scheduler(database=db, clock=clock, owner="worker-1")
    for scheduler in (web, worker):
        declare(scheduler)
    async with web, worker:
        await clock.advance(timedelta(hours=14))
        assert await web.pause(FEED, "INC-41: the feed's provider rate-limits us", who="alice@ops")
        await clock.advance(timedelta(hours=1))
        assert await web.resume(FEED, "INC-41: limits lifted", who="alice@ops")
        await clock.advance(END - clock.now())
        async with served(web.dashboard(actions=True)) as base, browser_page() as (page, problems):
            # the summary: failing first, counted; both replicas live
            await page.set_viewport_size({"width": 1440, "height": 900})
            await page.goto(base + "/")
            counts = await page.locator("ul.counts li").all_inner_texts()
            assert counts == ["4 jobs", "FAILING 2", "OK 2", "2 live replicas"]
            assert await page.locator(".banner").count() == 0
            ids = await page.locator("table.jobs tbody td.id a").all_inner_texts()
            assert ids == [BILLING, FEED, RARE, STEADY]
            row = page.locator("tr", has=page.get_by_role("link", name=RARE, exact=True))
            assert (
                "cron '17 3 * * *' Europe/Berlin" in await row.locator("td.schedule").inner_text()
            )
            assert "2026-12-02T02:17:00Z" in await row.inner_text()  # next due
            feed_row = page.locator("tr", has=page.get_by_role("link", name=FEED, exact=True))
            assert "resumed by alice@ops" in await feed_row.locator("td.audit").inner_text()
            await shoot(page, tmp_path, "index")

            # the timeline of a job that failed: each slot's fate, coloured, with its reason
            await page.get_by_role("link", name=BILLING, exact=True).click()
            await page.wait_for_url(f"{base}/jobs/{quote(BILLING, safe='')}")
            failed = await titles(page, "failed")
            assert [t.split(" · ")[0] for t in failed] == [
                "2026-12-01T05:00:00Z",
                "2026-12-01T05:30:00Z",
                "2026-12-02T00:30:00Z",
            ]
            assert len(await titles(page, "ran")) == 48 - 3  # the day's half hours, from 00:31
            colour = await page.locator("rect.slot.f-failed").first.evaluate(
                "e => getComputedStyle(e).fill"
            )
            assert colour == "rgb(213, 94, 0)"  # the stylesheet loaded under the CSP
            # readable without hovering: the slots that did not run as due, newest first
            notable = page.locator("table.slots").first
            assert await notable.is_visible()
            fates = [r.split("\t")[1] for r in await notable.locator("tbody tr").all_inner_texts()]
            assert fates == ["failed"] * 3
            # a tap (a click) on a mark opens the table of every slot at the slot's row
            await page.locator("rect.slot.f-failed").first.click()
            await page.wait_for_url("**#slot-20261201T050000Z")
            assert await page.locator("details.slots").get_attribute("open") is not None
            target = page.locator("table.slots tr:target")
            assert await target.is_visible()
            assert (await target.inner_text()).split("\t")[:2] == ["2026-12-01T05:00:00Z", "failed"]

            # a job paused for an hour by someone else (failing since 22:00): its catch-up run
            # at the resume served the first slot late and covered the next one
            await page.goto(f"{base}/jobs/{quote(FEED, safe='')}")
            reason = (
                "paused by alice@ops at 2026-12-01T14:00:00+00:00: "
                "INC-41: the feed's provider rate-limits us"
            )
            [late] = [t for t in await titles(page, "ran") if t.startswith("2026-12-01T14:20")]
            assert "· ran · started 40 min late on " in late, late
            [covered] = await titles(page, "covered")
            assert covered.startswith("2026-12-01T14:40:00Z · covered · covered by the run of ")
            assert covered.endswith(reason), covered
            assert len(await titles(page, "failed")) == 8  # 22:00 to 00:20, every 20 minutes
            audit = await page.locator("table.audit tbody tr").all_inner_texts()
            assert [r.split("\t")[1:] for r in audit] == [
                ["resumed", "alice@ops", "INC-41: limits lifted"],
                ["paused", "alice@ops", "INC-41: the feed's provider rate-limits us"],
            ]
            await shoot(page, tmp_path, "job")

            # a pause with a note; a second tab, still showing Pause, pauses again: no change
            job_url = f"{base}/jobs/{quote(STEADY, safe='')}"
            stale = await page.context.new_page()
            await stale.goto(job_url)
            await page.goto(job_url)
            form = page.locator(".summary form.operate")
            await form.get_by_label("Note for the audit log").fill("INC-42: upstream down")
            await form.get_by_role("button", name="Pause").click()
            await page.wait_for_url("**?done=paused")
            assert await page.get_by_role("status").inner_text() == f"Paused: {STEADY}"
            assert await page.locator(".summary .state").inner_text() == "PAUSED"
            first = await page.locator("table.audit tbody tr").first.inner_text()
            assert first.split("\t")[1:] == [
                "paused",
                "dashboard (127.0.0.1)",
                "INC-42: upstream down",
            ]
            await stale.locator(".summary").get_by_role("button", name="Pause").click()
            await stale.wait_for_url("**?done=already-paused")
            said = await stale.get_by_role("status").inner_text()
            assert said == f"{STEADY} was already paused: nothing changed."
            assert await stale.locator("table.audit td .warn").inner_text() == "no change"

            # an hour later its slots are skipped, and say why, with the note
            await clock.advance(timedelta(hours=1))
            await page.goto(job_url + "?window=6h")
            skipped = await titles(page, "skipped")
            reason = (
                f"paused by dashboard (127.0.0.1) at {(END).isoformat()}: INC-42: upstream down"
            )
            assert [t.split(" · ")[0] for t in skipped] == [
                "2026-12-02T00:45:00Z",
                "2026-12-02T01:00:00Z",
                "2026-12-02T01:15:00Z",
            ]
            assert all(t.endswith(reason) for t in skipped), skipped
            await page.goto(base + "/")
            counts = await page.locator("ul.counts li").all_inner_texts()
            assert "PAUSED 1" in counts
    assert problems == []
    assert [(a.action, a.who, a.note, a.changed) for a in await web.fleet.audit(STEADY)] == [
        ("pause", "dashboard (127.0.0.1)", None, False),  # the second tab's note was empty
        ("pause", "dashboard (127.0.0.1)", "INC-42: upstream down", True),
    ]


async def shoot(page: Page, tmp_path: Path, name: str) -> None:
    """A screenshot of the page's top 1440×900 pixels; copied into docs/ when
    ``TICKLOCK_UPDATE_SCREENSHOT`` is set."""
    shot = tmp_path / f"{name}.png"
    await page.screenshot(path=str(shot), clip={"x": 0, "y": 0, "width": 1440, "height": 900})
    assert shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("TICKLOCK_UPDATE_SCREENSHOT"):  # the docs' pictures, on request only
        shutil.copyfile(shot, SCREENSHOTS[name])
