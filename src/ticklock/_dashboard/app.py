"""The dashboard: a small Starlette app over a :class:`~ticklock._fleet.Fleet`.

HTML pages (Jinja2, autoescaped; no JavaScript), the same data as JSON, ``/health`` for probes,
and, only when enabled, POST actions protected by an allowed ``Host`` (:mod:`.hosts`), a
double-submit CSRF token and a same-origin check. Every link is built with ``request.url_for``,
so the app works mounted under a prefix. Every answer is bounded: a run's report and error are
read and shown cut to :data:`MAX_TEXT` characters, a job's last error in a tooltip to
:data:`TOOLTIP`, and a history to :data:`MAX_LIMIT` runs.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from .._caps import cut_text
from .._errors import describe
from .._fleet import Fleet, JobState, job_json, json_text, replica_json, run_json
from . import hosts
from .chart import duration_chart, seconds_label
from .guard import (
    CSRF_COOKIE,
    CSRF_FIELD,
    SECURITY_HEADERS,
    Headers,
    Problem,
    csrf_token,
    foreign,
    read_form,
    same_origin,
)

logger = logging.getLogger("ticklock")

TEMPLATES = Path(__file__).parent / "templates"
ACTIONS = {"pause": "paused", "resume": "resumed", "trigger": "triggered"}  # action: its note
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
MAX_TEXT = 500
"""Characters of a run's report (as JSON) or error that a page or a JSON answer holds; a longer
report comes as the marker object ``{"cut_by_ticklock": true, ...}``."""
TOOLTIP = 500  # characters of a job's last error in the jobs page's tooltip
UNHEALTHY = (JobState.OVERDUE, JobState.FUTURE)
T = TypeVar("T")


def create_app(
    fleet: Fleet,
    *,
    actions: bool = False,
    title: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
) -> Starlette:
    """An ASGI app showing ``fleet``'s jobs, their run history and the live replicas.

    Read-only unless ``actions`` is true, which adds Pause, Resume and Trigger buttons (POST,
    with a CSRF token and a same-origin check). ``allowed_hosts`` (names, ``*.example.com``,
    ``*``) is what the request's ``Host`` must name for any answer; by default pages answer
    any host and actions only ``localhost``, ``127.0.0.1`` and ``::1``. ``title`` defaults to
    ``ticklock · <namespace>``. Mount it in an application, or serve it on its own::

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
    env.filters.update(when=_when, ago=_ago, seconds=seconds_label, json=_json_text, cut=_cut)
    env.globals.update(
        title=title or f"ticklock · {fleet.namespace}", actions=actions, tooltip=TOOLTIP
    )
    stylesheet = (TEMPLATES / "style.css").read_text()

    async def ask(call: Callable[[], Awaitable[T]], job_id: str | None = None) -> T:
        """``call()``; a ``KeyError`` about ``job_id`` is a 404, any other error a 503."""
        try:
            return await call()
        except Exception as exc:
            if isinstance(exc, KeyError) and job_id is not None:
                raise Problem(404, _unknown(exc, job_id)) from None
            logger.warning("dashboard: the fleet did not answer: %s", describe(exc))
            raise Problem(503, _unavailable(exc)) from None

    def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
        token = csrf_token(request) if actions else ""
        html = env.get_template(template).render(
            links=_Links(request), csrf=token, now=datetime.now(timezone.utc), **context
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
        jobs = await ask(fleet.jobs)
        replicas = await ask(fleet.replicas)
        context: dict[str, Any] = {"jobs": jobs, "replicas": replicas, "note": _note(request)}
        return page(request, "index.html", refresh_url=_Links(request).index(), **context)

    async def job(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        limit = _limit(request)
        record = next((j for j in await ask(fleet.jobs) if j.job_id == job_id), None)
        if record is None:
            raise Problem(404, f"unknown job: {job_id}")
        runs = await ask(lambda: fleet.history(job_id, limit, max_text=MAX_TEXT), job_id)
        context: dict[str, Any] = {
            "job": record,
            "runs": runs,
            "chart": duration_chart(runs),
            "limit": limit,
        }
        again = _Links(request).job(job_id, limit=None if limit == DEFAULT_LIMIT else limit)
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
        operation = {"pause": fleet.pause, "resume": fleet.resume, "trigger": fleet.trigger}[action]
        await ask(lambda: operation(job_id), job_id)
        links = _Links(request)
        if form.get("back") == "index":
            target = links.index(done=ACTIONS[action], job=job_id)
        else:
            target = links.job(job_id, done=ACTIONS[action])
        return RedirectResponse(target, status_code=303)

    async def api_jobs(request: Request) -> Response:
        jobs = await ask(fleet.jobs)
        return _json({"namespace": fleet.namespace, "jobs": [job_json(j) for j in jobs]})

    async def api_runs(request: Request) -> Response:
        job_id: str = request.path_params["job_id"]
        limit = _limit(request)
        runs = await ask(lambda: fleet.history(job_id, limit, max_text=MAX_TEXT), job_id)
        return _json(
            {"job_id": job_id, "runs": [{"job_id": r.job_id, **run_json(r)} for r in runs]}
        )

    async def api_replicas(request: Request) -> Response:
        replicas = await ask(fleet.replicas)
        return _json(
            {"namespace": fleet.namespace, "replicas": [replica_json(r) for r in replicas]}
        )

    async def health(request: Request) -> Response:
        jobs = await ask(fleet.jobs)
        body = {
            "ok": not any(j.state in UNHEALTHY for j in jobs),
            "namespace": fleet.namespace,
            "jobs": len(jobs),
            "overdue": [j.job_id for j in jobs if j.state is JobState.OVERDUE],
            "future": [j.job_id for j in jobs if j.state is JobState.FUTURE],
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
        Route("/api/replicas", guarded(api_replicas), name="api_replicas"),
        Route("/jobs/{job_id:path}/{action}", guarded(act), methods=["POST"], name="action"),
        Route("/jobs/{job_id:path}", guarded(job), name="job"),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        Problem: problem,
        HTTPException: problem,
        Exception: problem,
    }
    return Starlette(routes=routes, middleware=[Middleware(Headers)], exception_handlers=handlers)


class _Links:
    """The dashboard's URLs for one request: paths under wherever the app is mounted.

    Job ids are percent-encoded whole (``/`` included), so ids with slashes, spaces or
    non-ASCII characters round-trip through the ``{job_id:path}`` routes.
    """

    def __init__(self, request: Request) -> None:
        self._request = request

    def _path(self, name: str, query: dict[str, Any] | None = None, **params: str) -> str:
        path = self._request.url_for(name, **params).path
        query = {k: v for k, v in (query or {}).items() if v is not None}
        return f"{path}?{urlencode(query)}" if query else path

    def index(self, **query: Any) -> str:
        """The jobs page; ``query`` becomes its query string."""
        return self._path("index", query)

    def job(self, job_id: str, **query: Any) -> str:
        """A job's page."""
        return self._path("job", query, job_id=quote(job_id, safe=""))

    def action(self, job_id: str, action: str) -> str:
        """Where a job's Pause, Resume or Trigger form posts."""
        return self._path("action", job_id=quote(job_id, safe=""), action=action)

    def runs(self, job_id: str, **query: Any) -> str:
        """A job's runs as JSON."""
        return self._path("api_runs", query, job_id=quote(job_id, safe=""))

    def style(self) -> str:
        """The stylesheet."""
        return self._path("style")

    def api_jobs(self) -> str:
        """Every job as JSON."""
        return self._path("api_jobs")

    def api_replicas(self) -> str:
        """The live replicas as JSON."""
        return self._path("api_replicas")

    def health(self) -> str:
        """The health probe."""
        return self._path("health")


def _limit(request: Request) -> int:
    """``?limit=``: how many runs, default 100, at most 1000."""
    raw = request.query_params.get("limit")
    if raw is None:
        return DEFAULT_LIMIT
    try:
        return min(max(int(raw), 1), MAX_LIMIT)
    except ValueError:
        raise Problem(400, "limit must be a whole number") from None


def _note(request: Request) -> str | None:
    """The note after an action (``?done=paused&job=...``): only the known verbs are shown."""
    done = request.query_params.get("done", "")
    if done not in ACTIONS.values():
        return None
    job_id = request.query_params.get("job") or request.path_params.get("job_id")
    return f"{done.capitalize()}: {job_id}" if job_id else f"{done.capitalize()}."


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


def _cut(text: str | None, limit: int) -> str:
    """``text`` in at most ``limit`` characters (``""`` for none), marked where it is cut."""
    return "" if text is None else cut_text(text, len(text), limit)


def _json_text(value: Any) -> str:
    """A report as JSON text for a page (autoescaped there like any text); ``""`` for none."""
    return "" if value is None else json_text(value)


def _when(when: datetime | None) -> str:
    """An instant as ISO 8601 in UTC, to the second: ``2026-11-29T20:45:07Z``."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if when else ""


def _ago(when: datetime | None, now: datetime) -> str:
    """``when`` relative to ``now``, in one rounded unit: ``3 min ago``, ``in 20 s``."""
    if when is None:
        return ""
    seconds = (now - when).total_seconds()
    size = abs(seconds)
    if size < 1:
        return "now"
    unit, per = next(
        (u, p) for u, p in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)) if size >= p
    )
    text = f"{int(size // per)} {unit}"
    return f"{text} ago" if seconds > 0 else f"in {text}"
