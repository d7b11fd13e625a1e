"""Conversion and validation of the durations, names and connection strings a user declares."""

from __future__ import annotations

import importlib.util
import math
import re
from datetime import timedelta
from functools import partial
from urllib.parse import parse_qs, urlsplit, urlunsplit

from ._errors import ScheduleError

Duration = float | int | timedelta
"""A duration: seconds as a number, or a :class:`datetime.timedelta`."""

MAX_NAME = 200
MAX_SECONDS = 100 * 365.25 * 86400
"""The longest duration accepted: 100 years (a slot must stay a date the calendar has)."""
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


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


def name(value: object, field: str, *, job_id: str | None = None) -> str:
    """Return ``value`` if it is a non-empty string of at most 200 characters."""
    if type(value) is str and 0 < len(value) <= MAX_NAME and "\x00" not in value:
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
