"""The dashboard over an in-memory fleet, served by a real uvicorn server on 127.0.0.1.

These tests check what the dashboard does with the fleet's records: the pages and their
escaping, the chart, the JSON, /health, the routing (also mounted in FastAPI under a prefix),
the actions' CSRF and same-origin protection, and the answers when the fleet fails. The
fleet's own guarantees are tested against PostgreSQL elsewhere. The last test drives the
dashboard with a real Chromium through Playwright.
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
from starlette.types import ASGIApp

from ticklock import ScheduleError, Scheduler, SchedulerStateError
from ticklock._dashboard import create_app
from ticklock._dashboard.chart import duration_chart, seconds_label
from ticklock._dashboard.hosts import for_bind_address, host_name
from ticklock._fleet import JobRecord, JobState, Replica, RunRecord

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
    """A :class:`ticklock._fleet.Fleet` held in dicts, recording the operations it is asked."""

    def __init__(
        self,
        jobs: list[JobRecord],
        runs: Sequence[RunRecord] = (),
        replicas: Sequence[Replica] = (),
        namespace: str = "default",
    ) -> None:
        self.namespace = namespace
        self._jobs = {job.job_id: job for job in jobs}
        self._runs = list(runs)
        self._replicas = list(replicas)
        self.calls: list[tuple[str, str]] = []
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

    async def pause(self, job_id: str) -> None:
        job = self._known(job_id)
        self.calls.append(("pause", job_id))
        self._jobs[job_id] = replace(job, state=JobState.PAUSED, paused_at=datetime.now(UTC))

    async def resume(self, job_id: str) -> None:
        job = self._known(job_id)
        self.calls.append(("resume", job_id))
        self._jobs[job_id] = replace(job, state=JobState.OK, paused_at=None)

    async def trigger(self, job_id: str) -> datetime:
        job = self._known(job_id)
        if job.state in (JobState.DISABLED, JobState.UNDECLARED):  # as the real fleets refuse
            raise KeyError(f"no live replica runs job {job_id!r}")
        self.calls.append(("trigger", job_id))
        at = datetime.now(UTC)
        self._jobs[job_id] = replace(job, trigger_at=at)
        return at

    async def forget(self, job_id: str) -> None:
        self._known(job_id)
        self.calls.append(("forget", job_id))
        del self._jobs[job_id]


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
    assert [(job_id, state) for state, job_id in rows] == [
        ("gone", "undeclared"),
        ("held", "paused"),
        ("late", "overdue"),
        ("off", "disabled"),
        ("poked", "ok"),
        ("purge-expired", "ok"),
        ("skewed", "future"),
    ]
    for state in JobState:  # each state is a distinctly styled, labelled badge
        assert f'<span class="state state-{state.value}">{state.value.upper()}</span>' in page.body
    assert '<a href="/jobs/purge-expired">purge-expired</a>' in page.body
    assert (NOW - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ") in page.body  # ISO, UTC
    assert re.search(r"trigger pending, asked \d+ s ago", page.body)
    shown = re.search(r'<span title="RuntimeError: x{300}">([^<]+)</span>', page.body)
    assert shown is not None and len(shown.group(1)) == 80 and shown.group(1).endswith("x…")
    assert re.search(r'<td class="num failing">3</td>', page.body)
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
        [job(evil_id, last_error=HOSTILE, last_owner=HOSTILE, last_outcome='"><b>x</b>')],
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
    }
    assert runs["job_id"] == "purge-expired" and len(runs["runs"]) == 2 and fleet.limits == [2]
    newest = runs["runs"][0]
    assert newest["manual"] is True and newest["duration"] == pytest.approx(0.2)
    assert datetime.fromisoformat(newest["started_at"]) == NOW - timedelta(minutes=15)
    assert newest["started_at"].endswith("+00:00") and newest["report"] == {"deleted": 3}
    assert runs["runs"][1]["error"] == "RuntimeError: boom"
    assert [r["owner"] for r in replicas["replicas"]] == ["web-1", "web-2"]
    assert replicas["replicas"][0]["jobs"] == ["purge-expired", "late"]
    assert datetime.fromisoformat(replicas["replicas"][1]["seen_at"]) == NOW - timedelta(seconds=1)


def test_health_is_503_while_a_job_is_overdue_or_in_the_future_and_200_otherwise() -> None:
    calm = MemoryFleet(
        [
            job("a"),
            job("b", JobState.PAUSED),
            job("c", JobState.UNDECLARED),
            job("d", JobState.DISABLED),
        ]
    )
    late = MemoryFleet([job("a"), job("late", JobState.OVERDUE), job("ahead", JobState.FUTURE)])
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
    }
    assert bad.status == 503
    assert bad.json() == {
        "ok": False,
        "namespace": "default",
        "jobs": 3,
        "overdue": ["late"],
        "future": ["ahead"],
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
