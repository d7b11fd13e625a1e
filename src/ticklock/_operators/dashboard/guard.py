"""What a request must be for the dashboard to answer it: the security headers on every
response, the allowed ``Host`` (:mod:`.hosts` says which), the double-submit CSRF token and
the same-origin check of an action, a bounded form, and who the caller is for the audit."""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..._schedule.caps import cut_text
from ..fleet import NOTE_LIMIT, checked

CSRF_COOKIE = "ticklock_csrf"
CSRF_FIELD = "csrf"
NOTE_FIELD = "note"
MAX_NOTE = NOTE_LIMIT
"""Characters of an operator's note the audit keeps."""
MAX_WHO = 200
"""Characters of a caller's name the dashboard gives the audit (it cuts a longer one)."""
MAX_FORM_BYTES = 8192  # a note of MAX_NOTE characters, each percent-encoded UTF-8, fits
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",  # pages carry a CSRF token and live state
}
_TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")  # what secrets.token_urlsafe(32) returns
_SPACE = re.compile(r"\s+")

Identify = Callable[[Request], str | None]
"""Who made a request, for the audit log: a name, or ``None`` for the default (:func:`caller`)."""


class Problem(Exception):
    """An answer other than 200: rendered as a short HTML page, or as JSON under ``/api``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Headers:
    """ASGI middleware: the security headers on every response (unless it set its own)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def foreign(host: str | None, what: str, default: bool) -> str:
    """Why a request for a ``Host`` the dashboard does not know as its own is refused."""
    named = "no valid Host header" if host is None else f"Host {cut_text(host, len(host), 100)!r}"
    if default:
        return (
            f"refused: this dashboard takes actions only for localhost ({named}); if that is "
            "its real name, name it in allowed_hosts= (ticklock dashboard: --allowed-host)"
        )
    return (
        f"refused: this dashboard does not {what} for {named}, which is not in its allowed "
        "hosts (allowed_hosts=, or ticklock dashboard --allowed-host)"
    )


def csrf_token(request: Request) -> str:
    """The browser's token if it holds a well-formed one, else a new random one."""
    token = request.cookies.get(CSRF_COOKIE, "")
    return token if _TOKEN.fullmatch(token) else secrets.token_urlsafe(32)


def same_origin(request: Request) -> bool:
    """Whether ``Origin`` (or ``Referer`` when there is no ``Origin``) is this request's origin,
    its scheme and ``Host``; a request with neither is refused."""
    source = request.headers.get("origin") or request.headers.get("referer")
    host = request.headers.get("host")
    if not source or not host:
        return False
    theirs = _origin(source)
    return theirs is not None and theirs == _origin(f"{request.url.scheme}://{host}")


def _origin(url: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of ``url``, the default port filled in; ``None`` if it has none
    (``Origin: null``, a malformed URL)."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.scheme.lower(), parts.hostname.lower(), port


async def read_form(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST, the first value of each field (no multipart needed)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        return {}
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise Problem(413, "form too large")
    fields = parse_qs(body.decode("ascii", "replace"), max_num_fields=20)
    return {name: values[0] for name, values in fields.items()}


def read_note(form: dict[str, str]) -> str | None:
    """The operator's note of an action: one line, trimmed; ``None`` for none; a 400 for one
    the audit log refuses (:func:`~ticklock._operators.fleet.checked`)."""
    note = _SPACE.sub(" ", form.get(NOTE_FIELD, "")).strip()
    if len(note) > MAX_NOTE:
        raise Problem(400, f"the note is longer than {MAX_NOTE} characters: shorten it")
    try:
        return checked(note, "the note")
    except ValueError as exc:
        raise Problem(400, str(exc)) from None


def caller(request: Request, identify: Identify | None) -> str:
    """Who the audit log names for ``request``: what ``identify`` says; by default (or when it
    says ``None``) the ``display_name`` of the user an ``AuthenticationMiddleware`` of the
    mounting app authenticated, else ``dashboard (<client address>)`` (:func:`peer`)."""
    who = identify(request) if identify is not None else None
    if not who or not who.strip():
        user = request.scope.get("user")  # set only by Starlette's AuthenticationMiddleware
        if user is not None and getattr(user, "is_authenticated", False):
            who = str(getattr(user, "display_name", "") or "")
    if not who or not who.strip():
        who = f"dashboard ({peer(request)})"
    who = _SPACE.sub(" ", who).strip()
    return cut_text(who, len(who), MAX_WHO)


_FORWARDING = ("x-forwarded-for", "forwarded", "x-real-ip")
"""Headers from which a server may rewrite a request's client address (uvicorn does from
``X-Forwarded-For`` for a connection from 127.0.0.1, by default)."""


def peer(request: Request) -> str:
    """The client address of ``request`` as the default ``who`` names it, never taken from a
    header: a request that carries a forwarding header (whose value a server may have put in
    the client address) is ``via a proxy``, an address that is no IP address ``unknown
    address``."""
    if any(name in request.headers for name in _FORWARDING):
        return "via a proxy"
    host = request.client.host if request.client is not None else ""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return "unknown address"
