"""The dashboard: a small Starlette app over a :class:`~ticklock._operators.fleet.Fleet`.

HTML pages (Jinja2, autoescaped; no JavaScript), the same data as JSON, ``/health`` for probes,
and, only when enabled, POST actions protected by an allowed ``Host`` (:mod:`.hosts`), a
double-submit CSRF token and a same-origin check, audited under the caller's name as the
mounting app identifies it. Every link is built with ``request.url_for``, so the app works
mounted under a prefix. Every answer is bounded: a run's report and error are read and shown
cut to :data:`MAX_TEXT` characters, a job's last error in a tooltip to :data:`TOOLTIP`, a
history to :data:`MAX_LIMIT` runs, a slot timeline to :data:`~.timeline.MAX_SLOTS` slots and
the audit to :data:`AUDIT` operations.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ..._errors import describe
from ..._runtime.clock import Clock, SystemClock
from ..._schedule.caps import cut_text, shorten_report
from ..._schedule.stored import Schedule, ScheduleStore
from ..fleet import (
    Fleet,
    JobState,
    RunRecord,
    SlotRecord,
    jobs_json,
    json_text,
    replicas_json,
    runs_json,
    schedule_json,
    slots_json,
)
from . import hosts
from .chart import duration_chart, seconds_label
from .filters import ago, cut, json_value, when
from .guard import (
    CSRF_COOKIE,
    CSRF_FIELD,
    SECURITY_HEADERS,
    Headers,
    Identify,
    Problem,
    caller,
    csrf_token,
    foreign,
    read_form,
    read_note,
    same_origin,
)
from .links import Links
from .summary import ALARMS, by_urgency, fleet_summary
from .timeline import DEFAULT_WINDOW, MAX_SLOTS, WINDOWS, Timeline, slot_timeline

logger = logging.getLogger("ticklock")

TEMPLATES = Path(__file__).parent / "templates"
PAGE = 100
"""How many stored schedules a page lists."""
ACTIONS = {"pause": "paused", "resume": "resumed", "trigger": "triggered"}  # action: its note
UNCHANGED = {"pause": "already-paused", "resume": "not-paused"}  # a repeat that changed nothing
NOTES = {
    "paused": "Paused: {job}",
    "resumed": "Resumed: {job}",
    "triggered": "Triggered: {job}",
    "already-paused": "{job} was already paused: nothing changed.",
    "not-paused": "{job} was not paused: nothing changed.",
}
"""What the page says after an action (``?done=...&job=...``): only these are ever shown."""
AUDIT = 20  # operations a job page lists
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
MAX_TEXT = 500
"""Characters of a run's report (as JSON) or error that a page or a JSON answer holds; a longer
report comes as the marker object ``{"cut_by_ticklock": true, ...}``."""
TOOLTIP = 500  # characters of a job's last error in the jobs page's tooltip
T = TypeVar("T")


def create_app(
    fleet: Fleet,
    *,
    actions: bool = False,
    title: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
    identify: Identify | None = None,
    clock: Clock | None = None,
    schedules: Callable[[], ScheduleStore] | None = None,
) -> Starlette:
    """An ASGI app showing ``fleet``'s jobs, their slots and run history, the operations made
    on them and the live replicas.

    Read-only unless ``actions`` is true, which adds Pause (with a note), Resume and Trigger
    buttons (POST, with a CSRF token and a same-origin check). Each operation is audited under
    ``identify(request)``: by default the user an ``AuthenticationMiddleware`` of the mounting
    app authenticated, else ``dashboard (<client address>)``, never from a request header
    (see :func:`.guard.caller`).
    ``allowed_hosts`` (names, ``*.example.com``, ``*``) is what the request's ``Host`` must name
    for any answer; by default pages answer any host and actions only ``localhost``,
    ``127.0.0.1`` and ``::1``. ``title`` defaults to ``ticklock · <namespace>``. ``clock`` (the
    scheduler's) says what "now" is for the timeline and the "3 min ago" labels.
    ``schedules`` gives the namespace's stored schedules: a page lists them, paged and
    filtered by tenant and task, and the jobs page lists only those that need a look. Mount it
    in an application, or serve it on its own::

        app.mount("/ticklock", create_app(fleet, allowed_hosts=["ops.example.com"]))
    """
    trusted = hosts.patterns(allowed_hosts)
    acting = trusted if trusted is not None else hosts.LOOPBACK
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, ago=ago, seconds=seconds_label, json=json_value, cut=cut)
    env.globals.update(
        title=title or f"ticklock · {fleet.namespace}",
        actions=actions,
        stored=schedules is not None,
        tooltip=TOOLTIP,
        past={**ACTIONS, "forget": "forgotten"},
    )
    stylesheet = (TEMPLATES / "style.css").read_text()
    wall = clock or SystemClock()  # what "now" is: the scheduler's clock (a ManualClock in tests)

    async def ask(call: Callable[[], Awaitable[T]], job_id: str | None = None) -> T:
        """``call()``; a ``KeyError`` about ``job_id`` is a 404, any other error a 503."""
        try:
            return await call()
        except Exception as exc:
            if isinstance(exc, KeyError) and job_id is not None:
                raise Problem(404, _unknown(exc, job_id)) from None
            if isinstance(exc, ValueError):  # a note or a caller the audit log refuses
                raise Problem(400, str(exc)) from None
            logger.warning("dashboard: the fleet did not answer: %s", describe(exc))
            raise Problem(503, _unavailable(exc)) from None

    def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
        token = csrf_token(request) if actions else ""
        html = env.get_template(template).render(
            links=Links(request), csrf=token, now=wall.now(), **context
        )
        response = HTMLResponse(html, status_code=status)
        if actions and request.cookies.get(CSRF_COOKIE) != token:
            response.set_cookie(
                CSRF_COOKIE,
                token,
                path=request.url_for("index").path,
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return response

    async def index(request: Request) -> Response:
        jobs = by_urgency(await ask(fleet.jobs))
        replicas = await ask(fleet.replicas)
        # stored schedules are the schedules page's, but those that need a look
        shown = [j for j in jobs if j.task is None or j.state in ALARMS]
        context: dict[str, Any] = {
            "jobs": shown,
            "stored_count": sum(1 for j in jobs if j.task is not None) if schedules else 0,
            "replicas": replicas,
            "summary": fleet_summary(jobs, replicas),
            "note": _note(request),
        }
        return page(request, "index.html", refresh_url=Links(request).index(), **context)

    async def ledger(job_id: str, window: str) -> tuple[Timeline | None, str | None]:
        """The job's slot timeline over ``window``, or why there is none (its schedule is
        not in the records)."""
        until = wall.now()
        since = until - WINDOWS[window]
        try:  # one slot more than shown: whether the window held more
            slots = await ask(
                lambda: fleet.slots(job_id, since, until, limit=MAX_SLOTS + 1), job_id
            )
        except Problem as problem:
            if problem.status != 404:
                raise
            return None, problem.message
        return slot_timeline(slots[-MAX_SLOTS:], since, until, len(slots) > MAX_SLOTS), None

    async def job(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        limit = _limit(request)
        record = next((j for j in await ask(fleet.jobs) if j.job_id == job_id), None)
        if record is None:
            raise Problem(404, f"unknown job: {job_id}")
        window = _window(request)
        runs = await ask(lambda: fleet.history(job_id, limit, max_text=MAX_TEXT), job_id)
        timeline, gap = await ledger(job_id, window)
        audit = await ask(lambda: fleet.audit(job_id, AUDIT), job_id)
        context: dict[str, Any] = {
            "job": record,
            "runs": runs,
            "chart": duration_chart(runs),
            "limit": limit,
            "window": window,
            "windows": WINDOWS,
            "timeline": timeline,
            "gap": gap,
            "audit": audit,
        }
        again = Links(request).job(
            job_id,
            limit=None if limit == DEFAULT_LIMIT else limit,
            window=None if window == DEFAULT_WINDOW else window,
        )
        return page(request, "job.html", refresh_url=again, note=_note(request), **context)

    async def act(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        action: str = request.path_params["action"]
        if action not in ACTIONS:
            raise Problem(404, f"no such action: {action}")
        if not actions:
            raise Problem(403, "actions are disabled on this dashboard")
        host = hosts.host_name(request.headers.get("host"))
        if not hosts.allowed(host, acting):
            raise Problem(403, foreign(host, "take actions", trusted is None))
        if not same_origin(request):
            raise Problem(403, "refused: the request does not come from this dashboard's origin")
        form = await read_form(request)
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = form.get(CSRF_FIELD, "")
        if not cookie or not hmac.compare_digest(cookie.encode(), sent.encode()):
            raise Problem(403, "refused: missing or invalid CSRF token; reload the page")
        note = read_note(form)
        who = caller(request, identify)
        if action == "pause":
            jobs = await ask(fleet.jobs)
            if any(j.job_id == job_id and j.builtin for j in jobs):
                raise Problem(403, f"refused: {job_id} is one of ticklock's own jobs")
        operation = {"pause": fleet.pause, "resume": fleet.resume, "trigger": fleet.trigger}[action]
        changed = await ask(lambda: operation(job_id, note, who=who), job_id)
        done = ACTIONS[action] if changed is not False else UNCHANGED[action]
        links = Links(request)
        if form.get("back") == "index":
            target = links.index(done=done, job=job_id)
        else:
            target = links.job(job_id, done=done)
        return RedirectResponse(target, status_code=303)

    async def listed(request: Request) -> tuple[list[Schedule], dict[str, str | None]]:
        """A page of stored schedules, by ``?tenant=``, ``?task=`` and ``?after=``."""
        if schedules is None:
            raise Problem(404, "this dashboard was given no stored schedules")
        query = {k: request.query_params.get(k) or None for k in ("tenant", "task", "after")}
        store = schedules()
        found = await ask(lambda: store.page(query["tenant"], query["task"], query["after"], PAGE))
        return found, query

    async def schedule_list(request: Request) -> Response:
        found, query = await listed(request)
        after = found[-1].id if len(found) == PAGE else None
        return page(request, "schedules.html", schedules=found, query=query, after=after)

    async def api_schedules(request: Request) -> Response:
        found, query = await listed(request)
        after = found[-1].id if len(found) == PAGE else None
        body = {"namespace": fleet.namespace, "schedules": [schedule_json(s) for s in found]}
        return _json({**body, "after": after})

    async def api_jobs(request: Request) -> Response:
        jobs = await ask(fleet.jobs)
        return _json(jobs_json(fleet.namespace, jobs))

    async def api_runs(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        limit = _limit(request)
        runs = await ask(lambda: fleet.history(job_id, limit, max_text=MAX_TEXT), job_id)
        return _json(runs_json(job_id, runs))

    async def api_slots(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        until = wall.now()
        since = until - WINDOWS[_window(request)]
        slots = await ask(lambda: fleet.slots(job_id, since, until, limit=MAX_SLOTS), job_id)
        return _json(slots_json(job_id, since, until, [_short(slot) for slot in slots]))

    async def api_replicas(request: Request) -> Response:
        replicas = await ask(fleet.replicas)
        return _json(replicas_json(fleet.namespace, replicas))

    async def health(request: Request) -> Response:
        jobs = await ask(fleet.jobs)
        body = {
            "ok": not any(j.state in ALARMS for j in jobs),
            "namespace": fleet.namespace,
            "jobs": len(jobs),
            "overdue": [j.job_id for j in jobs if j.state is JobState.OVERDUE],
            "future": [j.job_id for j in jobs if j.state is JobState.FUTURE],
            "failing": [j.job_id for j in jobs if j.state is JobState.FAILING],
        }
        return _json(body, status=200 if body["ok"] else 503)

    async def style(request: Request) -> Response:
        headers = {"Cache-Control": "max-age=300"}
        return Response(stylesheet, media_type="text/css", headers=headers)

    async def problem(request: Request, exc: Exception) -> Response:
        """The one renderer of errors: JSON for the API and /health, a short page otherwise."""
        headers: dict[str, str] = {}
        if isinstance(exc, Problem):
            status, message = exc.status, exc.message
        elif isinstance(exc, HTTPException):  # no such route (404), a wrong method (405)
            status, message, headers = exc.status_code, str(exc.detail), dict(exc.headers or {})
        else:  # a bug in the dashboard itself: a plain 500, the traceback goes to the log
            status, message = 500, "internal error in the ticklock dashboard"
        route = request.scope.get("route")
        response: Response
        if route is not None and (route.path.startswith("/api/") or route.path == "/health"):
            response = _json({"ok": False, "error": message}, status=status)
        else:
            try:
                response = page(
                    request, "error.html", status=status, status_code=status, message=message
                )
            except Exception:  # the page itself failed: say it in plain text
                response = PlainTextResponse(message, status_code=status)
        response.headers.update(headers)
        for name, value in SECURITY_HEADERS.items():  # a 500 is sent outside the middleware
            response.headers.setdefault(name, value)
        return response

    def guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Any:
        """``endpoint``, answering 403 to a ``Host`` outside ``allowed_hosts`` (when given)."""

        async def checked(request: Request) -> Response:
            host = hosts.host_name(request.headers.get("host"))
            if trusted is not None and not hosts.allowed(host, trusted):
                raise Problem(403, foreign(host, "answer", False))
            return await endpoint(request)

        return checked

    routes = [
        Route("/", guarded(index), name="index"),
        Route("/style.css", guarded(style), name="style"),
        Route("/health", guarded(health), name="health"),
        Route("/api/jobs", guarded(api_jobs), name="api_jobs"),
        Route("/api/jobs/{job_id:path}/runs", guarded(api_runs), name="api_runs"),
        Route("/api/jobs/{job_id:path}/slots", guarded(api_slots), name="api_slots"),
        Route("/api/replicas", guarded(api_replicas), name="api_replicas"),
        Route("/schedules", guarded(schedule_list), name="schedules"),
        Route("/api/schedules", guarded(api_schedules), name="api_schedules"),
        Route("/jobs/{job_id:path}/{action}", guarded(act), methods=["POST"], name="action"),
        Route("/jobs/{job_id:path}", guarded(job), name="job"),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        Problem: problem,
        HTTPException: problem,
        Exception: problem,
    }
    return Starlette(routes=routes, middleware=[Middleware(Headers)], exception_handlers=handlers)


def _limit(request: Request) -> int:
    """``?limit=``: how many runs, default 100, at most 1000."""
    raw = request.query_params.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        return min(max(int(raw), 1), MAX_LIMIT)
    except ValueError:
        raise Problem(400, "limit must be a whole number") from None


def _window(request: Request) -> str:
    """``?window=``: how far back the slot timeline reaches, one of :data:`WINDOWS`."""
    window = request.query_params.get("window", DEFAULT_WINDOW)
    if window not in WINDOWS:
        raise Problem(400, f"window must be one of {', '.join(WINDOWS)}")
    return window


def _note(request: Request) -> str | None:
    """The note after an action (``?done=paused&job=...``): only the known ones are shown."""
    text = NOTES.get(request.query_params.get("done", ""))
    if text is None:
        return None
    job_id = request.query_params.get("job") or request.path_params.get("job_id")
    return text.format(job=job_id) if job_id else text.format(job="the job")


def _short(slot: SlotRecord) -> SlotRecord:
    """``slot`` with its run's report and error cut as a page shows them."""
    run = slot.run
    if run is None:
        return slot
    return replace(slot, run=_cut_run(run))


def _cut_run(run: RunRecord) -> RunRecord:
    error = None if run.error is None else cut_text(run.error, len(run.error), MAX_TEXT)
    return replace(run, report=shorten_report(run.report, MAX_TEXT), error=error)


def _unknown(exc: KeyError, job_id: str) -> str:
    """What a 404 says: the fleet's own message (``trigger`` explains why it refuses), or
    ``unknown job: <id>`` for a bare ``KeyError(job_id)``."""
    said = exc.args[0] if len(exc.args) == 1 else None
    return said if isinstance(said, str) and said and said != job_id else f"unknown job: {job_id}"


def _unavailable(exc: Exception) -> str:
    """What a 503 says: ticklock's own errors with their message (written for operators),
    others by type only (a driver's message may name hosts and users)."""
    text = describe(exc) if type(exc).__module__.startswith("ticklock.") else type(exc).__name__
    return f"the fleet is unavailable ({text}); see the application's log"


def _json(body: Any, status: int = 200) -> Response:
    """JSON, with anything JSON cannot hold (a report of an in-process fleet) as its ``str``."""
    return Response(json_text(body), status_code=status, media_type="application/json")
