"""The dashboard in a real browser against a real fleet (issue 16).

Replica ``web-1`` is a real uvicorn serving ``ops_app.create_app()``: a FastAPI app whose
lifespan runs the scheduler and that mounts ``scheduler.dashboard(actions=True)`` at
``/ticklock``. Replica ``worker-1`` is a plain ``ticklock run`` process of the same scheduler.
Both share a real PostgreSQL; headless Chromium, driven by Playwright, clicks the buttons.
What the fleet did is read from the database: each handler logs its run there.

``TICKLOCK_UPDATE_SCREENSHOT=1 pytest tests/test_dashboard_e2e.py -k screenshot`` rewrites
``docs/dashboard.png`` from a real job page.
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
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import anyio
import pytest

from helpers import Replicas, eventually
from ops_app import HOSTILE_ERROR, HOSTILE_REPORT
from test_operations import BOUND, MARGIN, db_now, job_row, last_run, wait_live, wait_run
from ticklock._dashboard import create_app

if TYPE_CHECKING:
    from playwright.async_api import Page

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
CHROMIUM = shutil.which("chromium")
SCREENSHOT = Path(__file__).parent.parent / "docs" / "dashboard.png"
"""Written by the screenshot test when ``TICKLOCK_UPDATE_SCREENSHOT`` is set (not on every run:
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
            page = await browser.new_page(viewport={"width": 1200, "height": 800})
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
        if os.environ.get("TICKLOCK_UPDATE_SCREENSHOT"):  # the docs' picture, on request only
            shutil.copyfile(shot, SCREENSHOT)
    assert problems == []


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
