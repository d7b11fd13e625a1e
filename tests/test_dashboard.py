"""The dashboard over an in-memory fleet, served by a real uvicorn server on 127.0.0.1.

These tests check what the dashboard does with the fleet's records: the pages and their
escaping, the fleet summary, the chart and the slot timeline, the JSON, /health, the routing
(also mounted in FastAPI under a prefix), the actions' CSRF and same-origin protection, their
notes and who the audit names, and the answers when the fleet fails. The fleet's own guarantees
are tested against PostgreSQL elsewhere. A few tests run the dashboard of a real local-mode
scheduler on a ManualClock, called in process; one drives the dashboard with a real Chromium
through Playwright.
"""

from __future__ import annotations

import base64
import email.message
import json
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from starlette.middleware import Middleware
from starlette.types import ASGIApp

from ticklock import JobContext, ScheduleError, Scheduler, SchedulerStateError, cron, every
from ticklock._operators.dashboard import create_app
from ticklock._operators.dashboard.chart import duration_chart, seconds_label
from ticklock._operators.dashboard.hosts import for_bind_address, host_name
from ticklock._operators.dashboard.timeline import MAX_SLOTS, slot_timeline
from ticklock._operators.fleet import (
    Action,
    Backfill,
    Fate,
    JobRecord,
    JobState,
    Replica,
    RunRecord,
    SlotRecord,
)
from ticklock._schedule.spec import Spec
from ticklock.testing import ManualClock

UTC = timezone.utc
NOW = datetime.now(UTC).replace(microsecond=0)  # set again before each test (below)
HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


@pytest.fixture(autouse=True)
def _now() -> None:
    """The pages say "N s ago" from the real time: a NOW taken at import, a minute before the
    test ran in a long session, read "1 min ago"."""
    global NOW
    NOW = datetime.now(UTC).replace(microsecond=0)


class MemoryFleet:
    """A :class:`ticklock.Fleet` held in dicts, recording the operations it is asked."""

    def __init__(
        self,
        jobs: list[JobRecord],
        runs: Sequence[RunRecord] = (),
        replicas: Sequence[Replica] = (),
        namespace: str = "default",
        slots: dict[str, list[SlotRecord]] | None = None,
    ) -> None:
        self.namespace = namespace
        self._jobs = {job.job_id: job for job in jobs}
        self._runs = list(runs)
        self._replicas = list(replicas)
        self._slots = slots or {}
        self.calls: list[tuple[str, str]] = []
        self.audited: list[Action] = []
        """Every operation, oldest first, with its note and who (``calls`` has action and id)."""
        self.windows: list[tuple[datetime, datetime, int]] = []
        self.limits: list[int] = []
        self.max_texts: list[int | None] = []
        self.fail: Exception | None = None

    def _known(self, job_id: str) -> JobRecord:
        if self.fail is not None:
            raise self.fail
        return self._jobs[job_id]  # KeyError for an unknown id, as the protocol says

    async def jobs(self) -> list[JobRecord]:
        if self.fail is not None:
            raise self.fail
        return sorted(self._jobs.values(), key=lambda job: job.job_id)

    async def history(
        self, job_id: str, limit: int = 100, *, max_text: int | None = None
    ) -> list[RunRecord]:
        self._known(job_id)
        self.limits.append(limit)
        self.max_texts.append(max_text)
        runs = [run for run in self._runs if run.job_id == job_id]
        return sorted(runs, key=lambda run: run.started_at, reverse=True)[:limit]

    async def replicas(self) -> list[Replica]:
        if self.fail is not None:
            raise self.fail
        return list(self._replicas)

    def _audit(self, job_id: str, action: str, note: str | None, who: str, changed: bool) -> None:
        self.calls.append((action, job_id))
        done = Action(job_id, action, who, datetime.now(UTC), note, changed)
        self.audited.append(done)
        self._jobs[job_id] = replace(self._jobs[job_id], last_action=done)

    async def pause(
        self,
        job_id: str,
        note: str | None = None,
        until: datetime | None = None,
        *,
        who: str,
    ) -> bool:
        job = self._known(job_id)
        changed = job.paused_at is None
        paused_at = job.paused_at or datetime.now(UTC)
        self._jobs[job_id] = replace(job, state=JobState.PAUSED, paused_at=paused_at)
        self._audit(job_id, "pause", note, who, changed)
        return changed

    async def resume(self, job_id: str, note: str | None = None, *, who: str) -> bool:
        job = self._known(job_id)
        changed = job.paused_at is not None
        self._jobs[job_id] = replace(job, state=JobState.OK, paused_at=None)
        self._audit(job_id, "resume", note, who, changed)
        return changed

    async def trigger(self, job_id: str, note: str | None = None, *, who: str) -> datetime:
        job = self._known(job_id)
        if job.state in (JobState.DISABLED, JobState.UNDECLARED):  # as the real fleets refuse
            raise KeyError(f"no live replica runs job {job_id!r}")
        at = datetime.now(UTC)
        self._jobs[job_id] = replace(job, trigger_at=at)
        self._audit(job_id, "trigger", note, who, True)
        return at

    async def forget(self, job_id: str, note: str | None = None, *, who: str) -> None:
        self._known(job_id)
        self.calls.append(("forget", job_id))
        del self._jobs[job_id]

    async def request_backfill(
        self,
        job_id: str,
        slots: Sequence[datetime],
        pace: float | None,
        note: str | None,
        *,
        who: str,
        rerun: bool = False,
    ) -> int:
        raise KeyError(f"no live replica runs job {job_id!r}")  # the dashboard never asks

    async def backfill_state(self, request: int) -> Backfill | None:
        return None

    async def spec(self, job_id: str) -> Spec | None:
        return None

    async def pass_over(
        self, request: int, done: int, count: int, *, committed: bool = False
    ) -> None:
        pass

    async def end_backfill(self, request: int) -> None:
        pass

    async def audit(self, job_id: str | None = None, limit: int = 100) -> list[Action]:
        if self.fail is not None:
            raise self.fail
        done = [a for a in self.audited if job_id is None or a.job_id == job_id]
        return done[::-1][:limit]

    async def slots(
        self, job_id: str, since: datetime, until: datetime, *, limit: int = 1000
    ) -> list[SlotRecord]:
        self._known(job_id)
        self.windows.append((since, until, limit))
        if job_id not in self._slots:  # as the real fleets say of a job without a spec
            raise KeyError(f"job {job_id!r} was never declared here: its schedule is unknown")
        owed = [s for s in self._slots[job_id] if since <= s.slot <= until]
        return owed[-limit:]


def job(job_id: str, state: JobState = JobState.OK, **fields: Any) -> JobRecord:
    values: dict[str, Any] = {
        "last_success": NOW - timedelta(minutes=1),
        "last_outcome": "success",
        "next_due": NOW + timedelta(minutes=14),
        "consecutive_failures": 0,
        "last_error": None,
        "last_owner": "web-1",
        "paused_at": None,
        "trigger_at": None,
        "schedule": "every 15m",
        "timeout": 60.0,
        "retries": 0,
        "owner": "web-1",
    }
    return JobRecord(job_id=job_id, state=state, **{**values, **fields})


def run(
    job_id: str, minutes_ago: float, seconds: float, outcome: str = "success", **fields: Any
) -> RunRecord:
    started = NOW - timedelta(minutes=minutes_ago)
    values: dict[str, Any] = {
        "slot": started,
        "owner": "web-1",
        "report": {"deleted": 3},
        "error": None,
        "manual": False,
    }
    finished = started + timedelta(seconds=seconds)
    return RunRecord(
        job_id, started_at=started, finished_at=finished, outcome=outcome, **{**values, **fields}
    )


def sample_fleet() -> MemoryFleet:
    """A namespace with a job in each state, a little history and two replicas."""
    jobs = [
        job("purge-expired"),
        job(
            "late",
            JobState.OVERDUE,
            consecutive_failures=3,
            last_outcome="failure",
            last_error="RuntimeError: " + "x" * 300,
        ),
        job("held", JobState.PAUSED, paused_at=NOW - timedelta(hours=1)),
        job("gone", JobState.UNDECLARED),
        job("off", JobState.DISABLED),
        job("skewed", JobState.FUTURE),
        job("poked", trigger_at=NOW - timedelta(seconds=5)),
        job("broken", JobState.FAILING, consecutive_failures=1, last_outcome="failure"),
        job("over", JobState.ENDED),
        job("done", JobState.COMPLETED),
    ]
    runs = [
        run("purge-expired", 45, 0.042),
        run("purge-expired", 30, 1.5, "failure", error="RuntimeError: boom", report=None),
        run("purge-expired", 15, 0.2, manual=True),
    ]
    replicas = [
        Replica(
            "web-1", NOW - timedelta(hours=2), NOW - timedelta(seconds=3), ("purge-expired", "late")
        ),
        Replica("web-2", NOW - timedelta(hours=1), NOW - timedelta(seconds=1), ("purge-expired",)),
    ]
    return MemoryFleet(jobs, runs, replicas)


# --- a real server, a plain client ------------------------------------------------------------


@contextmanager
def serve(app: ASGIApp) -> Iterator[str]:
    """``app`` on a uvicorn server in a thread, on a socket bound here (no port race)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", ws="none", log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclass
class Answer:
    status: int
    headers: email.message.Message
    body: str

    def json(self) -> Any:
        assert self.headers["content-type"].startswith("application/json")
        return json.loads(self.body)

    def cookie(self) -> str | None:
        """The CSRF cookie the answer sets, with its attributes."""
        return next(
            (c for c in self.headers.get_all("set-cookie") or [] if c.startswith("ticklock_csrf=")),
            None,
        )


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 303 is an answer to look at, not to follow


_opener = urllib.request.build_opener(_NoRedirects)


def call(url: str, form: dict[str, str] | None = None, /, **headers: str) -> Answer:
    """GET ``url``, or POST ``form`` urlencoded; headers by keyword (``Origin=...``)."""
    data = None if form is None else urllib.parse.urlencode(form).encode()
    request = urllib.request.Request(
        url, data=data, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )
    try:
        with _opener.open(request, timeout=10) as response:
            return Answer(response.status, response.headers, response.read().decode())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers, exc.read().decode())


def token_of(answer: Answer) -> tuple[str, str]:
    """The CSRF token of a page: (the cookie's value, the form field's value)."""
    cookie = answer.cookie()
    assert cookie is not None, answer.headers
    return cookie.split(";")[0].split("=", 1)[1], field_of(answer)


def field_of(answer: Answer) -> str:
    """The CSRF token in a page's forms."""
    field = re.search(r'name="csrf" value="([^"]*)"', answer.body)
    assert field is not None
    return field.group(1)


def svg_of(body: str) -> str:
    found = re.search(r"<svg.*?</svg>", body, flags=re.S)
    assert found is not None, "no chart"
    return found.group(0)


# --- pages -------------------------------------------------------------------------------------


def test_the_index_lists_every_job_with_its_state_and_the_live_replicas() -> None:
    with serve(create_app(sample_fleet())) as base:
        page = call(base + "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    rows = re.findall(
        r'<tr class="row-(\w+)">\s*<td class="id"><a href="[^"]+">([^<]+)</a>', page.body
    )
    assert [(job_id, state) for state, job_id in rows] == [  # what needs a look first
        ("broken", "failing"),
        ("late", "overdue"),
        ("skewed", "future"),
        ("gone", "undeclared"),
        ("held", "paused"),
        ("poked", "ok"),
        ("purge-expired", "ok"),
        ("over", "ended"),
        ("done", "completed"),
        ("off", "disabled"),
    ]
    for state in JobState:  # each state is a distinctly styled, labelled badge
        assert f'<span class="state state-{state.value}">{state.value.upper()}</span>' in page.body
    assert '<a href="/jobs/purge-expired">purge-expired</a>' in page.body
    assert (NOW - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ") in page.body  # ISO, UTC
    assert re.search(r"trigger pending, asked \d+ s ago", page.body)
    shown = re.search(r'<span title="RuntimeError: x{300}">([^<]+)</span>', page.body)
    assert shown is not None and len(shown.group(1)) == 80 and shown.group(1).endswith("x…")
    failures = '<small class="failing" title="Consecutive failures">3 failures in a row</small>'
    assert failures in page.body
    # the replicas, and how many jobs each declares
    assert re.search(
        r'<td class="id">web-1</td>.*?<td class="num" title="purge-expired, late">2</td>',
        page.body,
        re.S,
    )
    assert "web-2" in page.body
    assert "<form" not in page.body and page.cookie() is None  # read-only: no actions, no token
    assert 'href="/style.css"' in page.body and "<script" not in page.body


def test_the_index_names_replicas_that_declare_a_job_otherwise_and_those_that_gave_it_up() -> None:
    fleet = MemoryFleet(
        [job("sync", declared_otherwise=("web-1", HOSTILE), last_owner="web-3")],
        replicas=[Replica("web-3", NOW, NOW, ("sync",), failing=("sync",))],
    )
    with serve(create_app(fleet)) as base:
        page = call(base + "/")
        api = call(base + "/api/jobs")
        live = call(base + "/api/replicas")
    assert f'<span class="warn">declared otherwise by web-1, {ESCAPED}</span>' in page.body
    assert re.search(r'<td class="id">web-3</td>.*?<td class="error">sync</td>', page.body, re.S)
    assert api.json()["jobs"][0]["declared_otherwise"] == ["web-1", HOSTILE]
    assert live.json()["replicas"][0]["failing"] == ["sync"]


def test_every_answer_carries_the_security_headers() -> None:
    with serve(create_app(sample_fleet())) as base:
        answers = [
            call(base + path) for path in ("/", "/jobs/late", "/api/jobs", "/health", "/nowhere")
        ]
        style = call(base + "/style.css")
    for answer in answers:
        csp = answer.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert "form-action 'self'" in csp and "script-src" not in csp  # no script at all
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["referrer-policy"] == "same-origin"
        assert answer.headers["cache-control"] == "no-store"
    assert style.status == 200 and style.headers["content-type"].startswith("text/css")
    assert ".state-overdue" in style.body and "http" not in style.body  # nothing from a CDN


def test_a_job_page_shows_its_record_history_and_a_chart_of_durations() -> None:
    fleet = sample_fleet()
    with serve(create_app(fleet)) as base:
        page = call(base + "/jobs/purge-expired")
        limited = call(base + "/jobs/purge-expired?limit=2")
        huge = call(base + "/jobs/purge-expired?limit=99999")
        bad = call(base + "/jobs/purge-expired?limit=lots")
    assert page.status == 200
    assert '<h1 class="id">purge-expired</h1>' in page.body
    assert page.body.count("<tr>") == 1 + 3  # header + three runs, newest first
    rows = page.body.split("<tbody>")[1]
    assert re.findall(r"outcome o-(\w+)", rows) == ["success", "failure", "success"]
    assert "42 ms" in rows and "1.5 s" in rows and "200 ms" in rows
    assert '<code class="report">{&#34;deleted&#34;: 3}</code>' in rows  # JSON, as text
    assert "RuntimeError: boom" in rows and ">yes<" in rows  # the error; the manual run
    svg = svg_of(page.body)
    marks = re.findall(r'<circle class="run o-(\w+)" cx="([\d.]+)" cy="([\d.]+)"', svg)
    assert [m[0] for m in marks] == ["success", "failure", "success"]  # oldest first
    xs = [float(m[1]) for m in marks]
    assert xs == sorted(xs) and len(set(xs)) == 3
    assert float(marks[1][2]) == min(float(m[2]) for m in marks)  # the longest run is highest
    assert "started (UTC)" in svg and "duration" in svg and "<title>" in svg
    assert 'class="legend o-failure">failure</span>' in page.body
    assert fleet.limits == [100, 2, 1000]  # the default, as asked, bounded
    assert limited.body.count("<circle") == 2
    assert huge.status == 200 and bad.status == 400 and "limit must be a whole number" in bad.body


def test_batched_runs_show_their_batches_and_a_capped_one_says_so() -> None:
    capped = job("sweep", last_batches=100, last_capped=True)
    runs = [
        run("sweep", 30, 12.5, batches=100, capped=True),
        run("sweep", 15, 3.0, batches=7),
    ]
    fleet = MemoryFleet([capped, job("purge-expired")], runs, [])
    with serve(create_app(fleet)) as base:
        index = call(base + "/")
        page = call(base + "/jobs/sweep")
        plain = call(base + "/jobs/purge-expired")
        api = call(base + "/api/jobs/sweep/runs")
    assert index.body.count(">capped</span>") == 1  # only the job whose last run was capped
    rows = page.body.split("<tbody>")[1]
    cells = re.findall(r'<td class="num">(\d+)( <span class="warn">capped</span>)?</td>', rows)
    assert cells == [("7", ""), ("100", ' <span class="warn">capped</span>')]  # newest first
    assert "capped" not in plain.body  # no batched run, no word of it
    assert [(r["batches"], r["capped"]) for r in api.json()["runs"]] == [(7, False), (100, True)]


def test_job_ids_with_slashes_spaces_and_unicode_round_trip_through_links() -> None:
    odd = "reports/daily run é?&#"
    fleet = MemoryFleet([job(odd)], [run(odd, 5, 1.0)])
    with serve(create_app(fleet)) as base:
        index = call(base + "/")
        href = re.search(r'<td class="id"><a href="([^"]+)">', index.body)
        assert href is not None
        assert href.group(1) == "/jobs/" + quote(odd, safe="")
        page = call(base + href.group(1))
        typed = call(base + "/jobs/reports/" + quote("daily run é?&#"))  # as typed, "/" kept
        runs = call(base + "/api/jobs/" + quote(odd, safe="") + "/runs")
    assert page.status == 200 and typed.status == 200
    assert "reports/daily run é?&amp;#" in page.body
    assert runs.json()["job_id"] == odd and len(runs.json()["runs"]) == 1


def test_an_unknown_job_is_a_404_page_and_a_404_json() -> None:
    with serve(create_app(sample_fleet())) as base:
        page = call(base + "/jobs/nope")
        api = call(base + "/api/jobs/nope/runs")
        nowhere = call(base + "/no/such/page")
    assert page.status == 404 and "unknown job: nope" in page.body and "<html" in page.body
    assert api.status == 404 and api.json() == {"ok": False, "error": "unknown job: nope"}
    assert nowhere.status == 404 and "Traceback" not in nowhere.body


def test_what_jobs_report_raise_and_are_called_is_shown_as_text_never_as_markup() -> None:
    evil_id = '<img src=x onerror="alert(2)">'
    evil = run(evil_id, 5, 0.5, "failure", report={"html": HOSTILE}, error=HOSTILE, owner=HOSTILE)
    fleet = MemoryFleet(
        [
            job(
                evil_id,
                last_error=HOSTILE,
                last_owner=HOSTILE,
                last_outcome='"><b>x</b>',
                owner=HOSTILE,
                schedule=HOSTILE,
                last_action=Action(evil_id, "pause", HOSTILE, NOW, HOSTILE, True),
            )
        ],
        [evil, run(evil_id, 4, 0.1, outcome=HOSTILE)],
        [Replica(HOSTILE, NOW, NOW, (HOSTILE,))],
    )
    with serve(create_app(fleet, actions=True)) as base:
        index = call(base + "/")
        page = call(base + "/jobs/" + quote(evil_id, safe=""))
        noted = call(base + "/?done=paused&job=" + quote(HOSTILE))
        forged = call(base + "/?done=" + quote(HOSTILE))
        api = call(base + "/api/jobs/" + quote(evil_id, safe="") + "/runs")
    for body in (index.body, page.body, noted.body):
        assert "<script>" not in body and "<img" not in body and "<b>" not in body
        assert ESCAPED in body
    assert "&lt;img src=x onerror=&#34;alert(2)&#34;&gt;" in page.body
    assert "{&#34;html&#34;: &#34;&lt;script&gt;alert(1)&lt;/script&gt;&#34;}" in page.body
    svg = svg_of(page.body)  # the chart's tooltips and classes are escaped too
    assert ESCAPED in svg and "<script" not in svg and "o-&lt;script&gt;" in svg
    assert f'<p class="note" role="status">Paused: {ESCAPED}</p>' in noted.body
    assert 'class="note"' not in forged.body  # only the known notes are ever shown
    assert api.json()["runs"][1]["report"] == {"html": HOSTILE}  # JSON keeps the data as it is
    assert api.headers["x-content-type-options"] == "nosniff"


# --- the fleet summary, the job's record, the slot timeline --------------------------------------


def counts_of(body: str) -> list[tuple[str, int]]:
    """The summary's counts: (state, how many), in the order shown."""
    found = re.findall(
        r'<span class="state state-(\w+)">\w+</span> <strong class="count">(\d+)<', body
    )
    return [(state, int(n)) for state, n in found]


def test_the_summary_counts_jobs_by_state_failing_first_and_the_live_replicas() -> None:
    with serve(create_app(sample_fleet())) as base:
        page = call(base + "/")
    summary = page.body.split('<section class="fleet"', 1)[1].split("</section>", 1)[0]
    assert counts_of(summary) == [
        ("failing", 1),
        ("overdue", 1),
        ("future", 1),
        ("undeclared", 1),
        ("paused", 1),
        ("ok", 2),
        ("ended", 1),
        ("completed", 1),
        ("disabled", 1),
    ]
    assert "<strong>10</strong> jobs" in summary
    assert "<strong>2</strong> live replicas" in summary
    assert "3 jobs need a look: failing, overdue or ahead" in summary
    assert 'role="alert"' not in page.body  # replicas are live: no banner
    assert page.body.index('<section class="fleet"') < page.body.index('<table class="jobs">')


def test_a_banner_says_when_no_replica_is_live() -> None:
    calm = MemoryFleet([job("a")], replicas=[])
    with serve(create_app(calm)) as base:
        page = call(base + "/")
    banner = re.search(r'<p class="banner" role="alert">(.*?)</p>', page.body)
    assert banner is not None and "No replica is live." in banner.group(1)
    assert "no job runs until one starts" in banner.group(1)
    assert "<strong>0</strong> live replicas" in page.body
    assert counts_of(page.body) == [("ok", 1)] and "No job is failing or overdue." in page.body


def test_each_job_shows_schedule_timeout_retries_owners_next_due_and_last_operation() -> None:
    paused_by = Action(
        "nightly", "pause", "alice@ops-1", NOW - timedelta(minutes=3), "INC-42", True
    )
    again = Action("sync", "pause", "bob", NOW - timedelta(minutes=1), None, False)
    jobs = [
        job(
            "nightly",
            JobState.PAUSED,
            schedule="cron '17 3 * * *' Europe/Berlin",
            timeout=300.0,
            retries=2,
            owner="web-2",
            last_owner="web-1",
            last_success=None,
            last_outcome=None,
            next_due=NOW + timedelta(hours=5, minutes=1),  # before its first run
            paused_at=NOW - timedelta(minutes=3),
            last_action=paused_by,
        ),
        job("sync", retries=1, owner=None, last_action=again),
        job("old", schedule=None, timeout=None, retries=None),
    ]
    with serve(create_app(MemoryFleet(jobs))) as base:
        index = call(base + "/")
        page = call(base + "/jobs/nightly")
        bare = call(base + "/jobs/old")

    def row(job_id: str) -> str:
        found = re.search(
            rf'<tr class="row-\w+">\s*<td class="id"><a href="[^"]+">{job_id}</a>.*?</tr>',
            index.body,
            re.S,
        )
        assert found is not None
        return found.group(0)

    nightly = row("nightly")
    assert '<code class="schedule">cron &#39;17 3 * * *&#39; Europe/Berlin</code>' in nightly
    assert "<small>timeout 5 min · 2 retries</small>" in nightly
    assert '<td class="owner">web-2<small>last ran on web-1</small></td>' in nightly
    assert (NOW + timedelta(hours=5, minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ") in nightly
    assert "in 5 h" in nightly
    assert '<span class="act">paused by alice@ops-1</span>' in nightly
    assert "3 min ago" in nightly and '<q class="said" title="INC-42">INC-42</q>' in nightly
    sync = row("sync")
    assert "timeout 1 min · 1 retry" in sync
    assert '<span class="warn" title="No live replica declares it">none live</span>' in sync
    assert '<span class="act">paused by bob</span> <span class="warn">no change</span>' in sync
    assert 'title="No replica recorded its declaration">unknown</span>' in row("old")
    record = page.body.split('<dl class="record">', 1)[1].split("</dl>", 1)[0]
    for term, shown in (
        ("Schedule", "cron &#39;17 3 * * *&#39; Europe/Berlin"),
        ("Timeout", "5 min"),
        ("Retries", "2"),
        ("Owner", "web-2 <small>runs its next slot</small>"),
        ("Last owner", "web-1"),
        ("Last operation", "paused by alice@ops-1"),
    ):
        assert re.search(rf"<dt>{term}</dt><dd>[^\n]*{re.escape(shown)}", record), term
    assert "in 5 h" in record.split("<dt>Next due</dt>", 1)[1].split("</dd>", 1)[0]
    assert bare.status == 200 and "<dt>Timeout</dt><dd>—</dd>" in bare.body


def test_built_in_jobs_are_labelled_and_offer_no_pause_and_a_pause_of_one_is_refused() -> None:
    retention = job("ticklock.retention", builtin=True)
    held = job("ticklock.held", JobState.PAUSED, builtin=True, paused_at=NOW)
    fleet = MemoryFleet([retention, held, job("mine")])
    with serve(create_app(fleet, actions=True)) as base:
        index = call(base + "/")
        page = call(base + "/jobs/ticklock.retention")
        cookie, token = token_of(page)
        jar = f"ticklock_csrf={cookie}"
        refused = call(
            base + "/jobs/ticklock.retention/pause", {"csrf": token}, Origin=base, Cookie=jar
        )
        resumed = call(
            base + "/jobs/ticklock.held/resume", {"csrf": token}, Origin=base, Cookie=jar
        )
    rows = re.findall(
        r'<tr class="row-\w+">\s*<td class="id"><a href="[^"]+">([^<]+)</a>(.*?)</tr>',
        index.body,
        re.S,
    )
    by_id = dict(rows)
    # by state (paused first), then the operators' jobs before ticklock's own
    assert list(by_id) == ["ticklock.held", "mine", "ticklock.retention"]
    assert (
        '<span class="builtin"' in by_id["ticklock.retention"]
        and "built-in" in by_id["ticklock.retention"]
    )
    assert '<span class="builtin"' not in by_id["mine"]
    assert (
        "btn-pause" not in by_id["ticklock.retention"]
        and "btn-trigger" in by_id["ticklock.retention"]
    )
    assert "btn-resume" in by_id["ticklock.held"]  # a paused one can still be resumed
    assert "btn-pause" in by_id["mine"]
    assert "btn-pause" not in page.body and "<dt>Built-in</dt>" in page.body
    assert "(1 built-in)" not in index.body and "(2 built-in)" in index.body
    assert refused.status == 403 and "one of ticklock&#39;s own jobs" in refused.body
    assert resumed.status == 303
    assert fleet.calls == [("resume", "ticklock.held")]


def slot(
    minutes_ago: float, fate: Fate, reason: str | None = None, ran: RunRecord | None = None
) -> SlotRecord:
    return SlotRecord(NOW - timedelta(minutes=minutes_ago), fate, reason, ran)


def ledger(job_id: str) -> list[SlotRecord]:
    """A slot of each fate, oldest first, every 10 minutes up to 10 minutes ago."""
    late = run(job_id, 60, 0.5)
    late = replace(
        late,
        started_at=late.started_at + timedelta(seconds=4),
        finished_at=late.finished_at + timedelta(seconds=4),
    )
    catch_up = run(job_id, 20, 1.0)
    return [
        slot(60, Fate.RAN, None, late),
        slot(50, Fate.FAILED, None, run(job_id, 50, 0.2, "failure", error="boom")),
        slot(40, Fate.TIMED_OUT, None, run(job_id, 40, 60.0, "timeout")),
        slot(35, Fate.MISSED, f"no live replica declared the job {HOSTILE}"),
        slot(30, Fate.SKIPPED, "paused by alice at 2026-12-01T10:00:00+00:00: INC-42"),
        slot(25, Fate.COVERED, "the database was unreachable (from web-1)", catch_up),
        slot(20, Fate.RAN, None, catch_up),
        slot(10, Fate.PENDING),
    ]


def test_the_job_page_shows_the_slot_timeline_colored_by_fate_with_every_reason_as_text() -> None:
    fleet = MemoryFleet([job("sync")], slots={"sync": ledger("sync")})
    with serve(create_app(fleet)) as base:
        page = call(base + "/jobs/sync")
        six = call(base + "/jobs/sync?window=6h")
        bad = call(base + "/jobs/sync?window=forever")
        api = call(base + "/api/jobs/sync/slots?window=6h")
    assert page.status == 200
    svgs = re.findall(r'<figure class="timeline">\s*(<svg.*?</svg>)', page.body, re.S)
    assert len(svgs) == 1
    marks = re.findall(
        r'<rect class="slot f-([\w-]+)" x="([\d.]+)" y="([\d.]+)" width="[\d.]+" '
        r'height="([\d.]+)"><title>([^<]*)</title>',
        svgs[0],
    )
    assert [m[0] for m in marks] == [
        "ran",
        "failed",
        "timed-out",
        "missed",
        "skipped",
        "covered",
        "ran",
        "pending",
    ]
    xs = [float(m[1]) for m in marks]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # oldest on the left, in time order
    heights = {m[0]: float(m[3]) for m in marks}
    assert heights["missed"] > heights["ran"] > heights["skipped"]  # told apart by shape too
    titles = {m[0]: m[4] for m in marks[::-1]}  # of the first slot of each fate
    assert titles["missed"].endswith(f"missed · no live replica declared the job {ESCAPED}")
    assert "started 4 s late on web-1, took 500 ms" in titles["ran"]
    assert (
        "covered by the run of" in titles["covered"]
        and "database was unreachable" in titles["covered"]
    )
    assert "paused by alice" in titles["skipped"] and "INC-42" in titles["skipped"]
    # a line joins each slot to the run that served it (its own, or the covering one)
    assert svgs[0].count('<line class="served"') == 5
    legend = re.findall(
        r'<span class="legend f-([\w-]+)">([\w ]+) <strong>(\d+)</strong>', page.body
    )
    assert legend == [
        ("missed", "missed", "1"),
        ("failed", "failed", "1"),
        ("timed-out", "timed out", "1"),
        ("skipped", "skipped", "1"),
        ("covered", "covered", "1"),
        ("pending", "pending", "1"),
        ("ran", "ran", "2"),
    ]
    # readable without hovering: the slots that did not run as due, and then every slot
    notable = page.body.split("<h3>Slots that did not run as due (5)</h3>", 1)[1]
    notable = notable.split("</table>", 1)[0]
    fates = re.findall(r'<span class="fate f-[\w-]+">([\w ]+)</span>', notable)
    assert fates == ["covered", "skipped", "missed", "timed out", "failed"]  # newest first
    assert f"no live replica declared the job {ESCAPED}" in notable and "<script>" not in notable
    table = page.body.split("<summary>Every slot, newest first (8)</summary>", 1)[1]
    table = table.split("</table>", 1)[0]
    fates = re.findall(r'<span class="fate f-[\w-]+">([\w ]+)</span>', table)
    assert fates == ["pending", "ran", "covered", "skipped", "missed", "timed out", "failed", "ran"]
    assert '<td class="num">4 s</td>' in table  # late by: actual start against the slot
    # each mark links to its row in the table of every slot (a tap where hover is missing)
    anchors = re.findall(r'<a href="#(slot-\d{8}T\d{6}Z)"><rect class="slot', svgs[0])
    assert len(anchors) == 8 and len(set(anchors)) == 8
    assert re.findall(r'<tr class="f-[\w-]+" id="(slot-[^"]+)">', table) == anchors[::-1]
    assert ' id="slot-' not in notable  # one row per id
    assert "covering run of" in table
    # the window: 24 h by default, as asked, bounded to a few; at most MAX_SLOTS + 1 asked
    (since, until, limit), (six_since, six_until, _), _ = fleet.windows
    assert until - since == timedelta(days=1) and six_until - six_since == timedelta(hours=6)
    assert limit == MAX_SLOTS + 1 and abs(until - datetime.now(UTC)) < timedelta(seconds=10)
    assert six.status == 200 and 'aria-current="page">6h</a>' in six.body
    assert bad.status == 400 and "window must be one of 1h, 6h, 24h, 7d" in bad.body
    body = api.json()
    assert [s["fate"] for s in body["slots"]] == [
        "ran",
        "failed",
        "timed out",
        "missed",
        "skipped",
        "covered",
        "ran",
        "pending",
    ]
    assert body["slots"][3]["reason"] == f"no live replica declared the job {HOSTILE}"
    assert (
        body["slots"][1]["run"]["error"] == "boom" and body["slots"][0]["run"]["job_id"] == "sync"
    )
    since, until = (datetime.fromisoformat(body[key]) for key in ("since", "until"))
    assert until - since == timedelta(hours=6)


def test_the_timeline_is_bounded_and_says_why_a_job_has_none() -> None:
    many = [slot(600 - i, Fate.RAN, None, run("busy", 600 - i, 0.1)) for i in range(MAX_SLOTS + 50)]
    fleet = MemoryFleet(
        [job("busy"), job("unknown"), job("calm")], slots={"busy": many, "calm": []}
    )
    with serve(create_app(fleet)) as base:
        busy = call(base + "/jobs/busy")
        unknown = call(base + "/jobs/unknown")
        calm = call(base + "/jobs/calm")
    assert busy.body.count('<rect class="slot ') == MAX_SLOTS
    assert f"the latest {MAX_SLOTS} slots of the window" in busy.body
    assert "did not run as due" not in busy.body  # every slot ran: no list of the others
    assert busy.body.count('<tr class="f-ran" id="slot-') == MAX_SLOTS
    assert unknown.status == 200
    assert (
        "No timeline: job &#39;unknown&#39; was never declared here: its schedule is unknown."
        in unknown.body
    )
    assert calm.status == 200 and "No slot was owed in the last 24h." in calm.body


def test_the_timeline_places_slots_and_the_runs_that_served_them_on_one_time_axis() -> None:
    slots = ledger("j")
    since, until = NOW - timedelta(minutes=70), NOW
    t = slot_timeline(slots, since, until)
    assert t.cells[0].x == pytest.approx(t.plot_left + (t.plot_right - t.plot_left) / 7, abs=0.1)
    assert t.cells[-1].x < t.plot_right
    covered, own = t.cells[5], t.cells[6]
    assert covered.run_x == own.run_x == own.x  # the catch-up run started at its own slot
    assert t.cells[0].run_x is not None and t.cells[0].run_x > t.cells[0].x  # started 4 s late
    assert t.cells[3].run_x is None and t.cells[7].run_x is None  # missed, pending: no run
    assert [label for _, label in t.x_ticks] == [
        (since + (until - since) * i / 4).strftime("%H:%M") for i in range(5)
    ]
    assert [row.slot.fate for row in t.notable] == [
        Fate.COVERED,
        Fate.SKIPPED,
        Fate.MISSED,
        Fate.TIMED_OUT,
        Fate.FAILED,
    ]
    assert slot_timeline(slots[:1], since, until).notable == ()
    cut = slot_timeline(slots[2:], since, until, cut=True)
    assert cut.since == slots[2].slot and cut.cells[0].x == cut.plot_left


def test_a_slot_whose_run_started_late_is_listed_with_those_that_did_not_run_as_due() -> None:
    due = run("j", 30, 0.5)
    late = replace(due, started_at=due.started_at + timedelta(seconds=89))
    why = "no live replica declared the job"
    slots = [
        SlotRecord(due.started_at, Fate.RAN, why, late, timedelta(seconds=89)),
        slot(20, Fate.RAN, None, run("j", 20, 0.5)),
    ]
    fleet = MemoryFleet([job("j")], slots={"j": slots})
    with serve(create_app(fleet)) as base:
        page = call(base + "/jobs/j")
    t = slot_timeline(slots, NOW - timedelta(hours=1), NOW)
    assert [row.slot for row in t.notable] == [slots[0]] and t.notable[0].late == "1 min 29 s"
    notable = page.body.split("<h3>Slots that did not run as due (1)</h3>", 1)[1]
    notable = notable.split("</table>", 1)[0]
    assert re.findall(r'<span class="fate f-[\w-]+">([\w ]+)</span>', notable) == ["ran"]
    assert why in notable and "1 min 29 s" in notable


def test_a_pause_asks_for_a_note_the_audit_keeps_it_and_a_repeat_says_nothing_changed() -> None:
    fleet = sample_fleet()
    with serve(create_app(fleet, actions=True)) as base:
        index = call(base + "/")
        page = call(base + "/jobs/late")
        cookie, token = token_of(page)
        jar = f"ticklock_csrf={cookie}"

        def act(action: str, note: str | None = None) -> Answer:
            form = {"csrf": token, "back": "job"} | ({} if note is None else {"note": note})
            return call(f"{base}/jobs/late/{action}", form, Origin=base, Cookie=jar)

        paused = act("pause", "  INC-42:\n upstream   down ")
        after = call(base + paused.headers["location"], Cookie=jar)
        again = act("pause", "")
        repeated = call(base + again.headers["location"], Cookie=jar)
        resumed, not_paused = act("resume"), act("resume", "done")
        too_long = act("pause", "x" * 501)
        widest = act("trigger", "🛑" * 500)  # 500 characters of 4 UTF-8 bytes each
    # the index's Pause opens a form with a note field; the job page has one for every button
    row = re.search(r'<a href="/jobs/late">late</a>.*?</tr>', index.body, re.S)
    assert row is not None
    ask = re.search(
        r'<details class="ask">\s*<summary[^>]*>Pause…</summary>(.*?)</details>', row.group(0), re.S
    )
    assert ask is not None and 'action="/jobs/late/pause"' in ask.group(1)
    assert '<input type="text" name="note" maxlength="500"' in ask.group(1)
    operate = re.search(r'<form method="post" class="operate".*?</form>', page.body, re.S)
    assert operate is not None and 'name="note"' in operate.group(0)
    assert 'formaction="/jobs/late/pause"' in operate.group(0)
    assert 'formaction="/jobs/late/trigger"' in operate.group(0)
    # what was done, with the note on one line, under the caller's address (no identify, no auth)
    assert [(a.action, a.note, a.who, a.changed) for a in fleet.audited[:4]] == [
        ("pause", "INC-42: upstream down", "dashboard (127.0.0.1)", True),
        ("pause", None, "dashboard (127.0.0.1)", False),
        ("resume", None, "dashboard (127.0.0.1)", True),
        ("resume", "done", "dashboard (127.0.0.1)", False),
    ]
    assert paused.headers["location"] == "/jobs/late?done=paused"
    assert 'role="status">Paused: late</p>' in after.body
    audit = after.body.split('<table class="audit">', 1)[1].split("</table>", 1)[0]
    assert re.search(
        r"<td>paused</td>\s*<td>dashboard \(127.0.0.1\)</td>\s*"
        r'<td class="said">INC-42: upstream down</td>',
        audit,
    )
    assert again.headers["location"] == "/jobs/late?done=already-paused"
    assert 'role="status">late was already paused: nothing changed.</p>' in repeated.body
    assert '<td>paused <span class="warn">no change</span></td>' in repeated.body
    assert resumed.headers["location"] == "/jobs/late?done=resumed"
    assert not_paused.headers["location"] == "/jobs/late?done=not-paused"
    assert too_long.status == 400 and "the note is longer than 500 characters" in too_long.body
    assert widest.status == 303 and fleet.audited[4].note == "🛑" * 500
    assert len(fleet.audited) == 5  # the long note was refused before the fleet was asked


def test_the_audit_names_the_user_the_app_authenticated_or_whom_identify_names() -> None:
    from starlette.applications import Starlette
    from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
    from starlette.middleware.authentication import AuthenticationMiddleware
    from starlette.requests import HTTPConnection
    from starlette.routing import Mount

    class ByHeader(AuthenticationBackend):
        async def authenticate(
            self, conn: HTTPConnection
        ) -> tuple[AuthCredentials, SimpleUser] | None:
            user = conn.headers.get("x-user")
            return None if user is None else (AuthCredentials(["ops"]), SimpleUser(user))

    fleet = sample_fleet()
    authenticated = Starlette(
        routes=[Mount("/ticklock", create_app(fleet, actions=True))],
        middleware=[Middleware(AuthenticationMiddleware, backend=ByHeader())],
    )
    named = sample_fleet()
    identified = create_app(named, actions=True, identify=lambda r: r.headers.get("x-operator"))
    with serve(authenticated) as base, serve(identified) as other:
        for root, target in ((base + "/ticklock", base), (other, other)):
            cookie, token = token_of(call(root + "/jobs/late"))
            jar = f"ticklock_csrf={cookie}"
            for who in ({"X_User": "alice"}, {"X_Operator": "carol"}, {}):
                answer = call(
                    root + "/jobs/late/trigger", {"csrf": token}, Origin=target, Cookie=jar, **who
                )
                assert answer.status == 303
    assert [a.who for a in fleet.audited] == [
        "alice",
        "dashboard (127.0.0.1)",
        "dashboard (127.0.0.1)",
    ]
    assert [a.who for a in named.audited] == [
        "dashboard (127.0.0.1)",
        "carol",
        "dashboard (127.0.0.1)",
    ]


def test_the_default_who_takes_no_identity_from_a_forwarding_header() -> None:
    # uvicorn (proxy_headers on by default) puts X-Forwarded-For of a connection from
    # 127.0.0.1 in the request's client address: any local process could name anyone
    fleet, trusting = sample_fleet(), sample_fleet()
    default = create_app(fleet, actions=True)
    told = create_app(trusting, actions=True, identify=lambda r: r.headers.get("x-forwarded-for"))
    forged = {"X_Forwarded_For": "alice@corp (sso)"}
    with serve(default) as base, serve(told) as other:
        for root, sent in ((base, forged), (base, {"X_Real_IP": "10.0.0.7"}), (other, forged)):
            cookie, token = token_of(call(root + "/jobs/late"))
            jar = f"ticklock_csrf={cookie}"
            url = root + "/jobs/late/trigger"
            assert call(url, {"csrf": token}, Origin=root, Cookie=jar, **sent).status == 303
        hidden = call(url, {"csrf": token, "note": "ok \u202edone"}, Origin=other, Cookie=jar)
    assert [a.who for a in fleet.audited] == ["dashboard (via a proxy)"] * 2
    assert [a.who for a in trusting.audited] == ["alice@corp (sso)"]  # identify= said so
    assert hidden.status == 400 and "U+202E (RIGHT-TO-LEFT OVERRIDE)" in hidden.body
    assert len(trusting.audited) == 1


async def asgi(
    app: ASGIApp, path: str, form: dict[str, str] | None = None, **headers: str
) -> Answer:
    """GET ``path`` of ``app`` (or POST ``form``) in this event loop, as from 127.0.0.1 to
    ``localhost``: for an app whose fleet lives in this loop (a scheduler on a ManualClock)."""
    data = b"" if form is None else urllib.parse.urlencode(form).encode()
    sent = {"host": "localhost", **{k.replace("_", "-").lower(): v for k, v in headers.items()}}
    if form is not None:
        sent["content-type"] = "application/x-www-form-urlencoded"
    route, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET" if form is None else "POST",
        "scheme": "http",
        "path": urllib.parse.unquote(route),
        "raw_path": route.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in sent.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("localhost", 80),
    }
    messages: list[dict[str, Any]] = []
    asked = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return asked.pop(0) if asked else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)  # type: ignore[arg-type]
    start, *body = messages
    answer_headers = email.message.Message()
    for name, value in start["headers"]:
        answer_headers[name.decode()] = value.decode()
    text = b"".join(m.get("body", b"") for m in body).decode()
    return Answer(start["status"], answer_headers, text)


@pytest.mark.anyio
async def test_a_local_schedulers_dashboard_shows_its_ledger_and_a_pause_with_its_note() -> None:
    start = datetime(2026, 12, 1, tzinfo=UTC)
    clock = ManualClock(start)
    scheduler = Scheduler(clock=clock, owner="web-1")

    @scheduler.job(cron("*/30 * * * *", tz="Europe/Berlin"), id="billing", timeout=60)
    async def billing(ctx: JobContext) -> None:
        if ctx.slot == start + timedelta(hours=1):
            raise RuntimeError("upstream answered 502")

    @scheduler.job(every(minutes=10), id="feed", timeout=30)
    async def feed(ctx: JobContext) -> None:
        return None

    @scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), id="nightly")
    async def nightly(ctx: JobContext) -> None:
        return None

    app = scheduler.dashboard(actions=True)
    async with scheduler:
        await clock.advance(3600)  # 01:00: billing's slot of 01:00 failed
        index = await asgi(app, "/")
        page = await asgi(app, "/jobs/feed")
        cookie, token = token_of(page)
        jar = f"ticklock_csrf={cookie}"
        form = {"csrf": token, "back": "job", "note": "INC-42: upstream down"}
        paused = await asgi(app, "/jobs/feed/pause", form, Origin="http://localhost", Cookie=jar)
        again = await asgi(app, "/jobs/feed/pause", form, Origin="http://localhost", Cookie=jar)
        await clock.advance(1800)  # half an hour passes with feed paused
        feed_page = await asgi(app, "/jobs/feed?window=1h")
        billing_page = await asgi(app, "/jobs/billing?window=1h")
        audit = await scheduler.fleet.audit("feed")
    # the summary and the rows: the failing job first, each with its schedule and owner
    assert counts_of(index.body) == [("failing", 1), ("ok", 2)]
    assert "<strong>1</strong> live replica<" in index.body and 'role="alert"' not in index.body
    rows = re.findall(
        r'<tr class="row-(\w+)">\s*<td class="id"><a href="[^"]+">([^<]+)</a>', index.body
    )
    assert rows == [("failing", "billing"), ("ok", "feed"), ("ok", "nightly")]
    nightly_row = index.body.split(">nightly</a>", 1)[1].split("</tr>", 1)[0]
    assert (
        "cron &#39;17 3 * * *&#39; Europe/Berlin" in nightly_row and "timeout 5 min" in nightly_row
    )
    assert "2026-12-01T02:17:00Z" in nightly_row  # next due, before its first run (03:17 CET)
    assert '<td class="owner">web-1</td>' in nightly_row
    # the pause, its note and who made it, in the audit and in the ledger's reasons
    assert paused.headers["location"] == "/jobs/feed?done=paused"
    assert again.headers["location"] == "/jobs/feed?done=already-paused"
    assert [(a.action, a.who, a.note, a.changed) for a in audit] == [
        ("pause", "dashboard (127.0.0.1)", "INC-42: upstream down", False),
        ("pause", "dashboard (127.0.0.1)", "INC-42: upstream down", True),
    ]
    marks = re.findall(r'<rect class="slot f-([\w-]+)"[^>]*><title>([^<]*)</title>', feed_page.body)
    # 00:30 to 01:00 ran (01:00 before the pause), 01:10 and 01:20 were paused, 01:30 is due
    assert [fate for fate, _ in marks] == ["ran"] * 4 + ["skipped"] * 2 + ["pending"]
    reason = "paused by dashboard (127.0.0.1) at 2026-12-01T01:00:00+00:00: INC-42: upstream down"
    assert [title for _, title in marks[4:6]] == [
        f"2026-12-01T01:10:00Z · skipped · {reason}",
        f"2026-12-01T01:20:00Z · skipped · {reason}",
    ]
    billing_marks = re.findall(
        r'<rect class="slot f-([\w-]+)"[^>]*><title>([^<]*)</title>', billing_page.body
    )
    assert [fate for fate, _ in billing_marks] == ["ran", "failed", "ran"]  # 00:30, 01:00, 01:30
    assert billing_marks[1][1].startswith(
        "2026-12-01T01:00:00Z · failed · started on time on web-1"
    )
    assert "upstream answered 502" in billing_page.body  # the run's error, in its history


# --- JSON and health ---------------------------------------------------------------------------


def test_the_json_api_gives_the_same_data_with_iso_datetimes_and_state_strings() -> None:
    fleet = sample_fleet()
    with serve(create_app(fleet)) as base:
        jobs = call(base + "/api/jobs").json()
        runs = call(base + "/api/jobs/purge-expired/runs?limit=2").json()
        replicas = call(base + "/api/replicas").json()
    assert jobs["namespace"] == "default"
    by_id = {j["job_id"]: j for j in jobs["jobs"]}
    assert by_id["late"]["state"] == "overdue" and by_id["held"]["state"] == "paused"
    assert by_id["late"]["consecutive_failures"] == 3
    assert datetime.fromisoformat(by_id["held"]["paused_at"]) == NOW - timedelta(hours=1)
    assert by_id["purge-expired"]["paused_at"] is None
    assert set(by_id["poked"]) == {
        "job_id",
        "state",
        "last_success",
        "last_outcome",
        "next_due",
        "consecutive_failures",
        "last_error",
        "last_owner",
        "declared_otherwise",
        "paused_at",
        "trigger_at",
        "last_batches",
        "last_capped",
        "schedule",
        "timeout",
        "retries",
        "owner",
        "builtin",
        "last_action",
    }
    assert by_id["poked"]["schedule"] == "every 15m" and by_id["poked"]["owner"] == "web-1"
    assert runs["job_id"] == "purge-expired" and len(runs["runs"]) == 2 and fleet.limits == [2]
    newest = runs["runs"][0]
    assert newest["manual"] is True and newest["duration"] == pytest.approx(0.2)
    assert datetime.fromisoformat(newest["started_at"]) == NOW - timedelta(minutes=15)
    assert newest["started_at"].endswith("+00:00") and newest["report"] == {"deleted": 3}
    assert runs["runs"][1]["error"] == "RuntimeError: boom"
    assert [r["owner"] for r in replicas["replicas"]] == ["web-1", "web-2"]
    assert replicas["replicas"][0]["jobs"] == ["purge-expired", "late"]
    assert datetime.fromisoformat(replicas["replicas"][1]["seen_at"]) == NOW - timedelta(seconds=1)


def test_health_is_503_while_a_job_is_failing_overdue_or_in_the_future_and_200_otherwise() -> None:
    calm = MemoryFleet(
        [
            job("a"),
            job("b", JobState.PAUSED),
            job("c", JobState.UNDECLARED),
            job("d", JobState.DISABLED),
        ]
    )
    late = MemoryFleet(
        [
            job("a"),
            job("late", JobState.OVERDUE),
            job("ahead", JobState.FUTURE),
            job("broken", JobState.FAILING),
        ]
    )
    empty = MemoryFleet([])
    with serve(create_app(calm)) as ok_base, serve(create_app(late)) as late_base:
        ok = call(ok_base + "/health")
        bad = call(late_base + "/health")
    with serve(create_app(empty)) as base:
        nothing = call(base + "/health")
    assert ok.status == 200 and ok.json() == {
        "ok": True,
        "namespace": "default",
        "jobs": 4,
        "overdue": [],
        "future": [],
        "failing": [],
    }
    assert bad.status == 503
    assert bad.json() == {
        "ok": False,
        "namespace": "default",
        "jobs": 4,
        "overdue": ["late"],
        "future": ["ahead"],
        "failing": ["broken"],
    }
    assert nothing.status == 200 and nothing.json()["jobs"] == 0


@pytest.mark.parametrize(
    ("error", "shown", "hidden"),
    [
        (
            SchedulerStateError("the scheduler is not running"),
            "SchedulerStateError: the scheduler is not running",
            None,
        ),
        (OSError("connect to db.internal:5432 as admin failed"), "OSError", "db.internal"),
    ],
    ids=["scheduler-not-running", "database-down"],
)
def test_a_failing_fleet_is_a_503_with_a_short_message_never_a_traceback(
    error: Exception, shown: str, hidden: str | None
) -> None:
    fleet = sample_fleet()
    fleet.fail = error
    with serve(create_app(fleet, actions=True)) as base:
        answers = {
            path: call(base + path)
            for path in (
                "/",
                "/jobs/late",
                "/api/jobs",
                "/api/jobs/late/runs",
                "/api/replicas",
                "/health",
            )
        }
        fleet.fail = None
        page = call(base + "/jobs/late")  # the app keeps serving once the fleet answers again
        cookie, token = token_of(page)
        fleet.fail = error
        action = call(
            base + "/jobs/late/pause",
            {"csrf": token},
            Origin=base,
            Cookie=f"ticklock_csrf={cookie}",
        )
    for path, answer in {**answers, "pause": action}.items():
        assert answer.status == 503, path
        assert shown in answer.body and "Traceback" not in answer.body, path
        assert hidden is None or hidden not in answer.body, path
    assert answers["/health"].json()["ok"] is False
    assert page.status == 200 and fleet.calls == []


def test_a_bug_in_the_dashboard_is_a_plain_500_without_a_traceback() -> None:
    fleet = sample_fleet()
    fleet._jobs["late"] = replace(fleet._jobs["late"], last_success="not a datetime")  # type: ignore[arg-type]
    with serve(create_app(fleet)) as base:
        broken = call(base + "/")
        other = call(base + "/api/replicas")  # the server goes on serving
    assert broken.status == 500 and "internal error in the ticklock dashboard" in broken.body
    assert "Traceback" not in broken.body and "AttributeError" not in broken.body
    assert broken.headers["content-security-policy"].startswith("default-src 'none'")
    assert other.status == 200


# --- actions -----------------------------------------------------------------------------------


def test_read_only_by_default_no_forms_and_posts_are_refused() -> None:
    fleet = sample_fleet()
    with serve(create_app(fleet)) as base:
        index, page = call(base + "/"), call(base + "/jobs/late")
        post = call(base + "/jobs/late/pause", {"csrf": "x"}, Origin=base, Cookie="ticklock_csrf=x")
    assert "<form" not in index.body and "<form" not in page.body and "<button" not in page.body
    assert post.status == 403 and "actions are disabled" in post.body
    assert fleet.calls == []


def test_actions_need_the_csrf_token_and_the_same_origin() -> None:
    fleet = sample_fleet()
    with serve(create_app(fleet, actions=True)) as base:
        page = call(base + "/jobs/late")
        set_cookie = page.cookie()
        cookie, token = token_of(page)
        again = call(base + "/", Cookie=f"ticklock_csrf={cookie}")  # the browser's token is kept
        url = base + "/jobs/late/pause"
        jar = f"ticklock_csrf={cookie}"
        refused = {
            "no token": call(url, {}, Origin=base, Cookie=jar),
            "wrong token": call(url, {"csrf": "A" * 43}, Origin=base, Cookie=jar),
            "cookie only": call(url, {"csrf": ""}, Origin=base, Cookie=jar),
            "no cookie": call(url, {"csrf": token}, Origin=base),
            "cross origin": call(url, {"csrf": token}, Origin="http://evil.example", Cookie=jar),
            "other port": call(
                url, {"csrf": token}, Origin=base.rsplit(":", 1)[0] + ":1", Cookie=jar
            ),
            "origin null": call(url, {"csrf": token}, Origin="null", Cookie=jar),
            "cross referer": call(
                url, {"csrf": token}, Referer="http://evil.example/x", Cookie=jar
            ),
            "no origin nor referer": call(url, {"csrf": token}, Cookie=jar),
        }
        assert fleet.calls == []
        paused = call(url, {"csrf": token, "back": "job"}, Origin=base, Cookie=jar)
        after = call(base + paused.headers["location"])
        by_referer = call(
            base + "/jobs/late/trigger",
            {"csrf": token, "back": "index"},
            Referer=base + "/",
            Cookie=jar,
        )
        resumed = call(base + "/jobs/held/resume", {"csrf": token}, Origin=base, Cookie=jar)
        unknown = call(base + "/jobs/nope/pause", {"csrf": token}, Origin=base, Cookie=jar)
        verb = call(base + "/jobs/late/forget", {"csrf": token}, Origin=base, Cookie=jar)
        disabled = call(base + "/jobs/off/trigger", {"csrf": token}, Origin=base, Cookie=jar)
    assert set_cookie is not None
    attributes = {part.strip().lower() for part in set_cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attributes
    assert again.cookie() is None and field_of(again) == token
    for why, answer in refused.items():
        assert answer.status == 403, why
        assert "refused" in answer.body and "Traceback" not in answer.body, why
    assert paused.status == 303 and paused.headers["location"] == "/jobs/late?done=paused"
    assert 'role="status">Paused: late</p>' in after.body and "PAUSED" in after.body
    assert (
        by_referer.status == 303 and by_referer.headers["location"] == "/?done=triggered&job=late"
    )
    assert resumed.status == 303
    assert unknown.status == 404 and "unknown job: nope" in unknown.body and verb.status == 404
    assert disabled.status == 404 and "no live replica runs job &#39;off&#39;" in disabled.body
    assert fleet.calls == [("pause", "late"), ("trigger", "late"), ("resume", "held")]


def test_a_dns_rebinding_post_naming_another_host_is_refused_by_default() -> None:
    # What a page of evil.example sends once its name resolves to 127.0.0.1: to the browser it
    # is the same origin, so it reads the page (token and cookie) and posts with both headers.
    fleet = sample_fleet()
    with serve(create_app(fleet, actions=True)) as base:
        port = base.rsplit(":", 1)[1]
        evil = f"evil.example:{port}"
        page = call(base + "/jobs/late", Host=evil)
        cookie, token = token_of(page)
        jar = f"ticklock_csrf={cookie}"
        form = {"csrf": token}
        rebound = call(
            base + "/jobs/late/pause", form, Host=evil, Origin=f"http://{evil}", Cookie=jar
        )
        no_host = call(base + "/jobs/late/pause", form, Host="", Origin=base, Cookie=jar)
        accepted = {
            host: call(
                base + "/jobs/late/trigger", form, Host=host, Origin=f"http://{host}", Cookie=jar
            ).status
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}")
        }
    assert page.status == 200  # pages stay readable: the host app decides who reaches them
    assert rebound.status == 403 and no_host.status == 403
    assert "takes actions only for localhost (Host &#39;evil.example&#39;)" in rebound.body
    assert "allowed_hosts=" in rebound.body
    assert accepted == dict.fromkeys(accepted, 303)
    assert fleet.calls == [("trigger", "late")] * 3


def test_with_allowed_hosts_every_answer_for_another_host_is_a_403() -> None:
    fleet = sample_fleet()
    app = create_app(fleet, actions=True, allowed_hosts=["OPS.example.com", "*.internal.example"])
    with serve(app) as base:
        port = base.rsplit(":", 1)[1]

        def get(path: str, host: str) -> Answer:
            return call(base + path, Host=f"{host}:{port}")

        ops = get("/jobs/late", "ops.example.com")
        cookie, token = token_of(ops)
        jar = f"ticklock_csrf={cookie}"
        served = {
            host: get("/", host).status
            for host in ("ops.example.com", "Ops.Example.COM.", "a.b.internal.example")
        }
        refused = {
            (path, host): get(path, host)
            for path in ("/", "/jobs/late", "/api/jobs", "/health", "/style.css")
            for host in ("127.0.0.1", "evil.example", "internal.example", "ops.example.com.evil")
        }
        rebound = call(
            base + "/jobs/late/pause",
            {"csrf": token},
            Host=f"evil.example:{port}",
            Origin=f"http://evil.example:{port}",
            Cookie=jar,
        )
        origin = f"http://ops.example.com:{port}"
        paused = call(
            base + "/jobs/late/pause",
            {"csrf": token},
            Host=f"ops.example.com:{port}",
            Origin=origin,
            Cookie=jar,
        )
    assert served == dict.fromkeys(served, 200)
    for (path, host), answer in refused.items():
        assert answer.status == 403, (path, host)
        assert "not in its allowed hosts" in answer.body, (path, host)
    assert refused["/api/jobs", "evil.example"].json()["ok"] is False
    assert rebound.status == 403 and paused.status == 303
    assert fleet.calls == [("pause", "late")]


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        pytest.param(
            "ops.example.com",
            r"^allowed_hosts must be a list of host names, got 'ops.example.com'$",
            id="a_bare_string",
        ),
        pytest.param(
            [],
            r"^allowed_hosts is empty, which would refuse every request; leave it None for the "
            r"default \(actions from localhost only\)$",
            id="empty",
        ),
        pytest.param(
            ["https://ops.example.com"],
            r"^allowed_hosts: 'https://ops.example.com' is not a host name: give it without "
            r"scheme, port or path, e.g. 'ops.example.com'$",
            id="a_url",
        ),
        pytest.param(
            ["ops.example.com:8080"],
            r"^allowed_hosts: 'ops.example.com:8080' is not a host name: give it without "
            r"scheme, port or path, e.g. 'ops.example.com'$",
            id="a_port",
        ),
        pytest.param(
            ["ops*.example.com"],
            r"^allowed_hosts: 'ops\*.example.com': a wildcard is '\*' or a domain like "
            r"'\*.example.com'$",
            id="a_wildcard_inside",
        ),
        pytest.param([""], r"^allowed_hosts: '' is not a host name$", id="blank"),
        pytest.param([None], r"^allowed_hosts: None is not a host name$", id="not_a_string"),
    ],
)
def test_bad_allowed_hosts_are_a_schedule_error_naming_the_field(hosts: Any, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as caught:
        Scheduler().dashboard(actions=True, allowed_hosts=hosts)
    assert caught.value.field == "allowed_hosts"


def test_ipv6_and_loopback_hosts_are_parsed_and_the_cli_default_is_its_bind_address() -> None:
    assert [host_name(h) for h in ("[::1]:8080", "[::1]", "Example.COM.:80", "a:b", "", None)] == [
        "::1",
        "::1",
        "example.com",
        None,
        None,
        None,
    ]
    assert host_name("[::1]x") is None
    assert for_bind_address("127.0.0.1") == ("127.0.0.1", "localhost", "::1")
    assert for_bind_address("::1") == ("::1", "localhost", "127.0.0.1")
    assert for_bind_address("10.1.2.3") == ("10.1.2.3",)
    assert for_bind_address("0.0.0.0") is None and for_bind_address("::") is None
    assert create_app(sample_fleet(), allowed_hosts=["[::1]"]) is not None


def test_the_forms_show_pause_or_resume_and_trigger_only_for_declared_jobs() -> None:
    with serve(create_app(sample_fleet(), actions=True)) as base:
        index = call(base + "/")

    def buttons(job_id: str) -> list[str]:
        row = re.search(
            rf'<tr class="row-\w+">\s*<td class="id"><a href="[^"]+">{job_id}</a>.*?</tr>',
            index.body,
            re.S,
        )
        assert row is not None
        return re.findall(r'<button type="submit" class="btn btn-(\w+)"', row.group(0))

    assert buttons("purge-expired") == ["pause", "trigger"]
    assert buttons("held") == ["resume", "trigger"]
    assert buttons("gone") == ["pause"] and buttons("off") == ["pause"]
    assert 'action="/jobs/purge-expired/pause"' in index.body
    assert '<input type="hidden" name="back" value="index">' in index.body


# --- mounted in a FastAPI application ----------------------------------------------------------


def test_mounted_under_a_prefix_in_fastapi_every_link_and_action_stays_under_it() -> None:
    fleet = sample_fleet()
    host = FastAPI()

    @host.get("/")
    async def home() -> dict[str, str]:
        return {"app": "host"}

    host.mount("/ticklock", create_app(fleet, actions=True, title="Acme jobs"))
    with serve(host) as base:
        index = call(base + "/ticklock/")
        bare = call(base + "/ticklock")
        hrefs = re.findall(r'(?:href|action)="(?!data:)([^"]+)"', index.body)
        linked = {
            href: call(base + href).status
            for href in hrefs
            if "/pause" not in href and "/trigger" not in href and "/resume" not in href
        }
        cookie, token = token_of(index)
        jar = f"ticklock_csrf={cookie}"
        paused = call(
            base + "/ticklock/jobs/late/pause",
            {"csrf": token, "back": "index"},
            Origin=base,
            Cookie=jar,
        )
        after = call(base + paused.headers["location"], Cookie=jar)
        fleet.fail = SchedulerStateError("the scheduler is not running")
        down = call(base + "/ticklock/")
        home_page = call(base + "/")
    assert index.status == 200 and "<title>Acme jobs</title>" in index.body
    assert bare.status == 307 and bare.headers["location"] == base + "/ticklock/"
    assert hrefs and all(href.startswith("/ticklock/") for href in hrefs), hrefs
    assert "/ticklock/jobs/late" in linked and "/ticklock/style.css" in linked
    assert "/ticklock/api/jobs" in linked and "/ticklock/health" in linked
    assert set(linked.values()) <= {200, 503}  # /health answers 503: jobs are overdue
    assert "path=/ticklock/" in (index.cookie() or "").lower()
    assert paused.status == 303 and paused.headers["location"] == "/ticklock/?done=paused&job=late"
    assert after.status == 200 and "Paused: late" in after.body
    assert fleet.calls == [("pause", "late")]
    assert down.status == 503 and "the scheduler is not running" in down.body
    assert home_page.status == 200 and json.loads(home_page.body) == {"app": "host"}  # unharmed


# --- the chart's numbers -----------------------------------------------------------------------


def test_the_chart_places_runs_oldest_first_inside_the_plot_with_round_axis_labels() -> None:
    runs = [run("j", 10, 3.0), run("j", 20, 1.0, "failure"), run("j", 0, 0.0, "timeout")]
    chart = duration_chart(runs)
    assert chart is not None and duration_chart([]) is None
    assert [m.outcome for m in chart.marks] == ["failure", "success", "timeout"]
    assert [m.x for m in chart.marks] == [
        chart.plot_left,
        (chart.plot_left + chart.plot_right) / 2,
        chart.plot_right,
    ]
    assert chart.marks[2].y == chart.plot_bottom  # 0 s lies on the axis
    assert [t.label for t in chart.y_ticks] == ["0", "1 s", "2 s", "3 s", "4 s"]
    assert chart.marks[1].y == pytest.approx(
        chart.plot_bottom - (chart.plot_bottom - chart.plot_top) * 3 / 4, abs=0.1
    )
    assert chart.outcomes == ("failure", "success", "timeout")
    one = duration_chart([run("j", 1, 0.0045)])
    assert one is not None and one.marks[0].x == (one.plot_left + one.plot_right) / 2
    assert one.y_ticks[-1].label == "5 ms"


@pytest.mark.parametrize(
    ("seconds", "label"),
    [
        (0, "0"),
        (0.0042, "4.2 ms"),
        (0.25, "250 ms"),
        (1.5, "1.5 s"),
        (59, "59 s"),
        (125, "2 min 5 s"),
        (3600, "1 h"),
        (3780, "1 h 3 min"),
    ],
)
def test_durations_read_as_people_say_them(seconds: float, label: str) -> None:
    assert seconds_label(seconds) == label


# --- a real browser ----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.asyncio_only  # Playwright's async API runs on asyncio
async def test_a_real_browser_opens_a_job_pauses_it_and_sees_reports_as_text() -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no `chromium` executable on PATH (Debian: apt-get install chromium)")
    from playwright.async_api import Dialog, async_playwright

    odd = "nightly/report é"
    fleet = MemoryFleet(
        [job("purge-expired"), job(odd, last_error=HOSTILE)],
        [run(odd, 9, 0.3, report={"note": HOSTILE}), run(odd, 3, 0.6, "failure", error=HOSTILE)],
        [Replica("web-1", NOW, NOW, ("purge-expired", odd))],
    )
    dialogs: list[str] = []
    problems: list[str] = []

    async def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.dismiss()

    with serve(create_app(fleet, actions=True)) as base:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=chromium, args=["--no-sandbox"]
            )
            try:
                page = await browser.new_page()
                page.on("dialog", on_dialog)
                page.on("console", lambda message: problems.append(message.text))
                page.on("pageerror", lambda error: problems.append(str(error)))
                await page.goto(base + "/")
                assert await page.locator("tr.row-ok").count() == 2
                assert HOSTILE in await page.locator("td.error").nth(0).inner_text()
                await page.get_by_role("link", name=odd, exact=True).click()
                await page.wait_for_url(base + "/jobs/" + quote(odd, safe=""))
                assert await page.locator("h1").inner_text() == odd
                runs = await page.locator("table.runs").inner_text()
                assert f'{{"note": "{HOSTILE}"}}' in runs and HOSTILE in runs  # text, not markup
                tooltips = await page.locator("svg circle.run title").all_text_contents()
                assert len(tooltips) == 2 and HOSTILE in tooltips[1]
                # the stylesheet loaded under the CSP: the state badge has its colour
                colour = await page.locator(".summary .state").evaluate(
                    "e => getComputedStyle(e).backgroundColor"
                )
                assert colour == "rgb(227, 244, 229)"
                await page.locator(".summary").get_by_role("button", name="Pause").click()
                await page.wait_for_url("**?done=paused")
                assert fleet.calls == [("pause", odd)]
                assert await page.locator(".summary .state").inner_text() == "PAUSED"
                assert await page.get_by_role("status").inner_text() == f"Paused: {odd}"
                assert (
                    await page.locator(".summary").get_by_role("button", name="Resume").count() == 1
                )
            finally:
                await browser.close()
    assert dialogs == [] and problems == []


# --- the documented deployments ----------------------------------------------------------------


def documented_guard() -> str:
    """The ASGI guard example in docs/operations.md."""
    for page in ("operations.md",):
        path = Path(__file__).parent.parent / "docs" / page
        blocks: list[str] = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
        found = [block for block in blocks if "def require_operator" in block]
        if found:
            assert len(found) == 1
            return found[0]
    raise AssertionError("no require_operator example in the docs")


def test_the_documented_guard_protects_every_dashboard_route_that_app_dependencies_miss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TICKLOCK_DASHBOARD_PASSWORD", "s3cret")
    fleet = sample_fleet()
    denied: list[str] = []

    async def deny(request: Request) -> None:
        denied.append(request.url.path)
        raise HTTPException(403)

    class Scheduler:  # what the example calls: scheduler.dashboard(actions=True)
        def dashboard(self, *, actions: bool = False) -> ASGIApp:
            return create_app(fleet, actions=actions)

    # app-wide dependencies run for the app's routes, never for a mounted app: hence the guard
    app = FastAPI(dependencies=[Depends(deny)])
    namespace: dict[str, Any] = {"app": app, "scheduler": Scheduler()}
    exec(documented_guard(), namespace)
    app.mount("/unguarded", create_app(fleet))

    @app.get("/")
    async def home() -> dict[str, str]:
        return {"app": "host"}

    good = "Basic " + base64.b64encode(b"ops:s3cret").decode()
    bad = "Basic " + base64.b64encode(b"ops:guess").decode()
    with serve(app) as base:
        unguarded = call(base + "/unguarded/")
        home_page = call(base + "/")
        refused = [
            call(base + "/ticklock/"),
            call(base + "/ticklock/api/jobs", Authorization=bad),
            call(base + "/ticklock/health"),
            call(base + "/ticklock/jobs/late/pause", {"csrf": "x"}, Origin=base),
        ]
        page = call(base + "/ticklock/jobs/late", Authorization=good)
        cookie, token = token_of(page)
        paused = call(
            base + "/ticklock/jobs/late/pause",
            {"csrf": token},
            Origin=base,
            Cookie=f"ticklock_csrf={cookie}",
            Authorization=good,
        )
    assert unguarded.status == 200 and home_page.status == 403 and denied == ["/"]
    for answer in refused:
        assert (
            answer.status == 401 and answer.headers["www-authenticate"] == 'Basic realm="ticklock"'
        )
    assert page.status == 200 and paused.status == 303
    assert fleet.calls == [("pause", "late")]


def test_behind_a_tls_terminating_proxy_actions_work_and_the_cookie_is_secure() -> None:
    # uvicorn trusts X-Forwarded-Proto from 127.0.0.1 by default; the proxy passes Host on
    fleet = sample_fleet()
    proxy = {"Host": "ops.example.com", "X_Forwarded_Proto": "https"}
    with serve(create_app(fleet, actions=True, allowed_hosts=["ops.example.com"])) as base:
        page = call(base + "/jobs/late", **proxy)
        cookie, token = token_of(page)
        jar = f"ticklock_csrf={cookie}"
        form = {"csrf": token}
        http = call(
            base + "/jobs/late/pause", form, Origin="http://ops.example.com", Cookie=jar, **proxy
        )
        https = call(
            base + "/jobs/late/pause", form, Origin="https://ops.example.com", Cookie=jar, **proxy
        )
        default_port = call(
            base + "/jobs/late/trigger",
            form,
            Origin="https://ops.example.com:443",
            Cookie=jar,
            **proxy,
        )
    assert "secure" in {part.strip().lower() for part in (page.cookie() or "").split(";")}
    assert http.status == 403 and https.status == 303 and default_port.status == 303
    assert fleet.calls == [("pause", "late"), ("trigger", "late")]


def test_the_documented_identify_example_audits_the_proxys_user() -> None:
    path = Path(__file__).parent.parent / "docs" / "operations.md"
    blocks: list[str] = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    [example] = [block for block in blocks if "identify=" in block]
    fleet = sample_fleet()

    class Scheduler:  # what the example calls: scheduler.dashboard(actions=True, ...)
        def dashboard(self, **options: Any) -> ASGIApp:
            return create_app(fleet, **options)

    app = FastAPI()
    exec(example, {"app": app, "scheduler": Scheduler()})
    with serve(app) as base:
        port = base.rsplit(":", 1)[1]
        proxy = {"Host": f"ops.example.com:{port}", "Origin": f"http://ops.example.com:{port}"}
        cookie, token = token_of(call(base + "/ticklock/jobs/late", Host=proxy["Host"]))
        jar = f"ticklock_csrf={cookie}"
        url = base + "/ticklock/jobs/late/pause"
        paused = call(url, {"csrf": token}, Cookie=jar, X_Forwarded_User="alice", **proxy)
    assert paused.status == 303
    assert [(a.action, a.who) for a in fleet.audited] == [("pause", "alice")]
