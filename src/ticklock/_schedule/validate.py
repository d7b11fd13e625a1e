"""Conversion and validation of the durations, names and connection strings a user declares."""

from __future__ import annotations

import importlib.util
import math
import re
import unicodedata
from datetime import datetime, timedelta, timezone
from functools import partial
from urllib.parse import parse_qs, urlsplit, urlunsplit

from .._errors import ScheduleError

Duration = float | int | timedelta
"""A duration: seconds as a number, or a :class:`datetime.timedelta`."""

LAST_YEAR = 9000
"""The last year a ``start`` or ``end`` may fall in: the slots around it stay dates the
calendar has."""
MAX_NAME = 200
MAX_SECONDS = 100 * 365.25 * 86400
"""The longest duration accepted: 100 years (a slot must stay a date the calendar has)."""
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_SURROGATE = re.compile("[\ud800-\udfff]")
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""The Unicode categories a line of text to show must not hold: control characters (a
terminal escape, a NUL), format characters (bidi overrides and isolates, zero-width
characters), unpaired surrogates and the line and paragraph separators."""
_KIND = {"Cc": "a control character", "Cs": "an unpaired surrogate"}


def seconds(
    value: Duration, field: str, *, job_id: str | None = None, allow_zero: bool = True
) -> float:
    """Return ``value`` in seconds, refusing non-finite, negative (or zero) values."""
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    else:
        message = f"{field} must be seconds (a number) or a timedelta, got {value!r}"
        raise ScheduleError(message, job_id=job_id, field=field)
    if 0 < result <= MAX_SECONDS:
        return result  # (the error below is built only when there is one)
    if allow_zero and result == 0:
        return 0.0  # the shared constant: a job without jitter keeps no float of its own
    if not math.isfinite(result) or result < 0 or (result == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        message = f"{field} must be {need} and finite, got {result:g} s"
    else:
        message = f"{field} must be at most 100 years, got {result:g} s"
    raise ScheduleError(message, job_id=job_id, field=field)


def instant(value: object, field: str, *, job_id: str | None = None) -> datetime | None:
    """``value``, an aware datetime (or ``None``), in UTC; a naive one is refused, since the
    zone it meant cannot be known."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        message = f"{field} must be a datetime with a time zone, got {value!r}"
        raise ScheduleError(message, job_id=job_id, field=field)
    if value.tzinfo is None or value.utcoffset() is None:
        message = (
            f"{field} must be an aware datetime, got the naive {value.isoformat()}: give its "
            "zone, e.g. datetime(..., tzinfo=ZoneInfo('Europe/Paris')) or timezone.utc"
        )
        raise ScheduleError(message, job_id=job_id, field=field)
    try:
        at = value.astimezone(timezone.utc)
    except OverflowError:
        at = None
    if at is None or at.year > LAST_YEAR:  # slots after it would overflow the calendar
        message = f"{field} must be before the year {LAST_YEAR + 1}, got {value.isoformat()}"
        raise ScheduleError(message, job_id=job_id, field=field)
    return at


def described(char: str, at: int) -> str:
    """``char``, found at index ``at`` of a text, as a message names it: ``U+202E
    (RIGHT-TO-LEFT OVERRIDE) at character 4``."""
    kind = unicodedata.name(char, "") or _KIND.get(unicodedata.category(char), "unnamed")
    return f"U+{ord(char):04X} ({kind}) at character {at + 1}"


def hidden(text: str) -> str | None:
    """The first character of ``text`` that a line shown to an operator must not hold (see
    ``_HIDDEN``), :func:`described`; ``None`` when there is none."""
    if text.isascii() and text.isprintable():
        return None  # the common case, checked at once
    for at, char in enumerate(text):
        if unicodedata.category(char) in _HIDDEN:
            return described(char, at)
    return None


def visible(text: str) -> str:
    """``text`` with each character :func:`hidden` refuses written as its escape (``\\u202e``),
    for a terminal: a text recorded before such characters were refused, or an error's."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(
        char.encode("unicode_escape", "backslashreplace").decode("ascii")
        if unicodedata.category(char) in _HIDDEN
        else char
        for char in text
    )


def surrogate(text: str) -> str | None:
    """The first unpaired surrogate of ``text`` (PostgreSQL cannot store one: UTF-8 has no
    encoding of it), :func:`described`; ``None`` when there is none."""
    found = _SURROGATE.search(text)
    return None if found is None else described(found.group(), found.start())


def name(value: object, field: str, *, job_id: str | None = None) -> str:
    """Return ``value`` if it is a non-empty string of at most 200 characters that
    PostgreSQL text can store (no NUL, no unpaired surrogate) and a terminal, a log line or a
    page shows as it is (no control, format or separator character: see ``_HIDDEN``)."""
    if (
        type(value) is str
        and 0 < len(value) <= MAX_NAME
        and value.isprintable()
        and (value.isascii() or hidden(value) is None)
    ):
        return value  # the common case, checked at once
    error = partial(ScheduleError, job_id=job_id, field=field)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise error(
            f"{field} must be a non-empty string of at most {MAX_NAME} characters, got {shown!r}"
        )
    if "\x00" in value:
        raise error(
            f"{field} must not contain NUL characters (PostgreSQL text cannot store them), "
            f"got {value!r}"
        )
    if (found := surrogate(value)) is not None:
        raise error(
            f"{field} must not contain unpaired surrogates (PostgreSQL text cannot store them), "
            f"got {value!r}: {found}"
        )
    if (found := hidden(value)) is not None:
        raise error(
            f"{field} must be plain text, without control, format or separator characters, "
            f"got {value!r}: {found}"
        )
    return value


def identifier(value: object, field: str) -> str:
    """Return ``value`` if it is a plain SQL identifier (letters, digits, underscore)."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ScheduleError(
            f"{field} must be a plain SQL identifier (a letter or _, then letters, digits or _, "
            f"at most 63 characters), got {value!r}",
            field=field,
        )
    return value


def dsn(value: object, field: str = "dsn") -> str:
    """Return ``value`` if it is a PostgreSQL URL asyncpg can use, and asyncpg is installed.

    The message never contains the DSN, so no password reaches a log.
    """
    if not isinstance(value, str) or not value.strip():
        raise ScheduleError(f"{field} must be a non-empty connection string", field=field)
    problem = _dsn_problem(value)
    if problem is not None:
        raise ScheduleError(f"{field} {problem}", field=field)
    if importlib.util.find_spec("asyncpg") is None:
        raise ScheduleError(
            'PostgreSQL mode needs asyncpg: pip install "ticklock[postgres]"', field=field
        )
    return value


_EXPECTED = "expected postgresql://user:password@host:port/database"


def _dsn_problem(text: str) -> str | None:
    """What asyncpg would refuse in the URL ``text``, or None; never quotes the text."""
    try:
        parts = urlsplit(text)
    except ValueError:  # an unclosed '[' or a bracketed host that is no IP address
        return f"does not parse as a URL (check the host's [brackets]); {_EXPECTED}"
    scheme = parts.scheme
    if scheme.startswith(("postgresql+", "postgres+")):
        base, _, driver = scheme.partition("+")
        return (
            f"has the SQLAlchemy form '{scheme}://': ticklock uses asyncpg directly, "
            f"so drop '+{driver}' and write '{base}://'"
        )
    if scheme not in ("postgresql", "postgres"):
        if not scheme and "=" in text:
            return f"must be a URL, not key=value settings; {_EXPECTED}"
        if scheme:
            return f"must start with postgresql:// or postgres://, not '{scheme}:'"
        return f"must start with postgresql:// or postgres://; {_EXPECTED}"
    hosts = parts.netloc.split("@", 1)[-1]  # asyncpg: after the first '@'
    if "@" in hosts:
        return "has more than one '@' before the host: write '@' in the password as %40"
    ports = []
    for spec in hosts.split(",") if hosts else ():  # host[:port],host[:port]...
        if not spec:
            return f"has an empty host in its host list; {_EXPECTED}"
        if spec.startswith("["):  # [IPv6]:port
            ports.append(spec.partition("]")[2].removeprefix(":"))
        else:
            ports.append(spec.partition(":")[2])
    try:
        query = parse_qs(parts.query, strict_parsing=True)
    except ValueError:
        return "has a malformed query: write each option as name=value, joined by '&'"
    for value in query.get("port", [])[-1:]:  # asyncpg takes the last one
        ports += value.split(",")
    for port in ports:
        if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            # not quoted: a password holding '/' ends the host part early, inside the password
            return (
                "has a bad port: it must be a number from 1 to 65535 (write '/', '?' and '#' "
                "in the password as %2F, %3F and %23)"
            )
    return None


def redact(dsn: str) -> str:
    """``dsn`` without its password, fit for logs and messages."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<dsn>"
    if parts.password is None:
        return dsn
    netloc = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
