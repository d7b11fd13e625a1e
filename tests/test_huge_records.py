"""Huge reports and errors: cut where they are recorded, and every page and answer bounded.

Jobs return 1 MB reports and raise 2 MB errors on a real PostgreSQL; rows as an older release
recorded them (uncut) are added by hand. A real ``ticklock dashboard`` process serves the
pages; the CLI runs as real processes. The same dashboard process refuses a DNS-rebinding page.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from ticklock import JobContext, Outcome, Scheduler, every
from ticklock._operators.dashboard.app import MAX_TEXT
from ticklock._schedule.caps import ERROR_LIMIT, MARKER_KEY, MARKER_MAX, REPORT_LIMIT

pytestmark = [pytest.mark.anyio]
REPORT = 1_000_000  # characters of each huge report's string
ERROR = 2_000_000  # characters of each huge error's message
BOUND = 1_000_000  # bytes a page or an answer must stay below
RARE = every(3600, initial_delay=3000)  # runs only when asked


@dataclass
class Answer:
    status: int
    body: bytes


def fetch(url: str, data: bytes | None = None, **headers: str) -> Answer:
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def dashboard_process(dsn: str, schema: str, *args: str) -> Iterator[tuple[str, int]]:
    """A real ``ticklock dashboard`` on 127.0.0.1: its base URL and its pid."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ticklock", "dashboard", "--dsn", dsn, "--schema", schema]
        + ["--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the dashboard did not start"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def cli(dsn: str, schema: str, *argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "ticklock", *argv, "--dsn", dsn, "--schema", schema],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode in (0, 1), out.stderr
    return out.stdout


@pytest.mark.postgres
async def test_huge_reports_and_errors_are_cut_where_recorded_and_every_answer_stays_small(
    pg_dsn: str, pg_schema: str, pg_conn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(RARE, id="big-report")
    async def big_report(ctx: JobContext) -> dict[str, str]:
        return {"rows": "r" * REPORT}

    async def big_error(ctx: JobContext) -> None:
        raise RuntimeError("e" * ERROR)

    for n in range(20):
        scheduler.add(big_error, RARE, id=f"big-error-{n}")
    caplog.set_level(logging.WARNING, logger="ticklock")
    async with scheduler:
        reports = [await scheduler.run_now("big-report") for _ in range(120)]
        errors = [await scheduler.run_now(f"big-error-{n}") for n in range(20)]
        history = await scheduler.fleet.history("big-report", 1)
    # the store: every run recorded, none over its cap
    runs, longest_report, longest_error = await pg_conn.fetchrow(
        f"SELECT count(*), max(length(report::text)), max(length(error)) FROM {pg_schema}.runs "
        "WHERE job_id LIKE 'big-%'"
    )
    longest_last_error = await pg_conn.fetchval(
        f"SELECT max(length(last_error)) FROM {pg_schema}.jobs"
    )
    assert runs == 140
    assert longest_report <= REPORT_LIMIT and longest_error <= ERROR_LIMIT
    assert longest_last_error <= ERROR_LIMIT
    assert all(r.outcome is Outcome.SUCCESS for r in reports)
    marker = reports[0].report
    assert set(marker) == {MARKER_KEY, "characters", "head"} and marker[MARKER_KEY] is True
    assert marker["characters"] == REPORT + len('{"rows": ""}')
    assert marker["head"].startswith('{"rows": "rrr') and history[0].report == marker
    error = errors[0].error
    assert errors[0].outcome is Outcome.FAILURE and error is not None
    assert len(error) == ERROR_LIMIT and error.startswith("RuntimeError: eee")
    assert error.endswith(
        f" … [cut by ticklock: {ERROR + len('RuntimeError: ')} characters in all]"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum(m.startswith("the report of big-report (slot ") for m in warnings) == 120
    assert sum(m.startswith("the error of big-error-") for m in warnings) == 20
    assert f"has {REPORT + 12} characters of JSON, over the {REPORT_LIMIT}" in warnings[0]

    # rows as an older release recorded them, uncut: read bounded all the same
    await pg_conn.execute(
        f"INSERT INTO {pg_schema}.runs (namespace, job_id, slot, started_at, finished_at, "
        "outcome, owner, report, error) SELECT 'default', 'big-report', now(), now(), now(), "
        "'failure', 'old-1', jsonb_build_object('rows', repeat('o', $1)), repeat('o', $2) "
        "FROM generate_series(1, 20)",
        REPORT,
        ERROR,
    )
    await pg_conn.execute(
        f"UPDATE {pg_schema}.jobs SET last_error = repeat('x', $1) WHERE job_id LIKE 'big-%'",
        ERROR,
    )
    with dashboard_process(pg_dsn, pg_schema) as (base, pid):
        index = await anyio.to_thread.run_sync(fetch, base + "/")
        page = await anyio.to_thread.run_sync(fetch, base + "/jobs/big-report?limit=1000")
        api = await anyio.to_thread.run_sync(fetch, base + "/api/jobs/big-report/runs?limit=1000")
        jobs = await anyio.to_thread.run_sync(fetch, base + "/api/jobs")
        peak = peak_rss_mb(pid)
    sizes = {name: len(a.body) for name, a in [("index", index), ("page", page), ("api", api)]}
    sizes["jobs"] = len(jobs.body)
    print(f"bytes: {sizes}; dashboard peak RSS {peak:.0f} MB")  # noqa: T201
    assert {a.status for a in (index, page, api, jobs)} == {200}
    assert max(sizes.values()) < BOUND, sizes
    titles = re.findall(rb'<span title="([^"]*)"', index.body)
    assert len(titles) == 21 and max(len(t.decode()) for t in titles) <= 500
    assert b"cut by ticklock: 2000000 characters in all" in index.body
    assert b"cut_by_ticklock" in page.body and b"cut by ticklock" in page.body
    rows = json.loads(api.body)["runs"]
    assert len(rows) == 140
    assert all(len(r["error"] or "") <= MAX_TEXT for r in rows)
    assert {r["report"]["characters"] for r in rows} == {REPORT + 12}  # all over MAX_TEXT

    # the CLI: history and status print bounded lines
    table = await anyio.to_thread.run_sync(
        lambda: cli(pg_dsn, pg_schema, "history", "big-report", "--limit", "140")
    )
    as_json = await anyio.to_thread.run_sync(
        lambda: cli(pg_dsn, pg_schema, "history", "big-report", "--limit", "140", "--json")
    )
    status = await anyio.to_thread.run_sync(lambda: cli(pg_dsn, pg_schema, "status"))
    status_json = await anyio.to_thread.run_sync(lambda: cli(pg_dsn, pg_schema, "status", "--json"))
    print(f"cli: history {len(table)}, --json {len(as_json)}, status {len(status)}")  # noqa: T201
    assert table.count("\n") == 141 and max(len(line) for line in table.splitlines()) < 300
    assert len(as_json) < 140 * (REPORT_LIMIT + ERROR_LIMIT + 1000)
    assert len(status) < 20_000 and len(status_json) < 21 * (ERROR_LIMIT + 1000)


@pytest.mark.postgres
async def test_the_cli_dashboard_answers_only_the_address_it_binds(
    pg_dsn: str, pg_schema: str
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema)

    @scheduler.job(RARE, id="j")
    async def j(ctx: JobContext) -> None: ...

    async with scheduler:  # creates the tables and the job's row
        pass
    with dashboard_process(pg_dsn, pg_schema, "--actions") as (base, _):
        port = base.rsplit(":", 1)[1]
        evil = f"evil.example:{port}"
        own = await anyio.to_thread.run_sync(fetch, base + "/jobs/j")
        rebound_read = await anyio.to_thread.run_sync(lambda: fetch(base + "/jobs/j", Host=evil))
        token = re.search(rb'name="csrf" value="([^"]*)"', own.body)
        assert token is not None
        form = b"csrf=" + token.group(1)
        jar = "ticklock_csrf=" + token.group(1).decode()
        rebound_post = await anyio.to_thread.run_sync(
            lambda: fetch(
                base + "/jobs/j/pause",
                form,
                Host=evil,
                Origin=f"http://{evil}",
                Cookie=jar,
                **{"Content-Type": "application/x-www-form-urlencoded"},
            )
        )
        jobs = await anyio.to_thread.run_sync(fetch, base + "/api/jobs")
    assert own.status == 200
    assert rebound_read.status == 403 and rebound_post.status == 403
    assert b"not in its allowed hosts" in rebound_post.body
    assert b'"paused_at":null' in jobs.body.replace(b" ", b"")  # nothing happened


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_in_local_mode_the_same_caps_apply(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = Scheduler()

    @scheduler.job(RARE, id="big")
    async def big(ctx: JobContext) -> list[str]:
        return ["é" * REPORT_LIMIT]

    @scheduler.job(RARE, id="small")
    async def small(ctx: JobContext) -> dict[str, str]:
        return {"fits": "x" * (REPORT_LIMIT - 20)}

    @scheduler.job(RARE, id="fails")
    async def fails(ctx: JobContext) -> None:
        raise ValueError("e" * ERROR)

    caplog.set_level(logging.WARNING, logger="ticklock")
    async with scheduler:
        cut, kept, failed = [await scheduler.run_now(i) for i in ("big", "small", "fails")]
        shown = await scheduler.fleet.history("big", max_text=100)
        last = {j.job_id: j for j in await scheduler.fleet.jobs()}["fails"].last_error
    # sizes first, without introspection: pytest's diff of 64 KiB values takes minutes
    sizes = len(json.dumps(cut.report)), len(failed.error or "")
    assert sizes[0] <= MARKER_MAX and sizes[1] <= ERROR_LIMIT, sizes
    assert cut.report == {
        MARKER_KEY: True,
        "characters": REPORT_LIMIT + 4,
        "head": '["' + "é" * 198,
    }
    assert kept.report == {"fits": "x" * (REPORT_LIMIT - 20)}
    assert failed.error is not None and len(failed.error) == ERROR_LIMIT == len(last or "")
    assert shown[0].report == cut.report  # a marker is shown as it is
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
