"""Which ``Host`` headers the dashboard answers: its defence against DNS rebinding.

A page on another site whose name is made to resolve to the dashboard's address is, to the
browser, of the same origin as the dashboard: its requests carry ``Host`` and ``Origin`` of the
other name, pass a same-origin check, and can read the CSRF token. Only the ``Host`` header
tells such a request apart, so actions are taken only for a host the dashboard knows as its own.

Patterns are those of Starlette's ``TrustedHostMiddleware``: a name (``ops.example.com``), an
address (``127.0.0.1``, ``::1``), ``*.example.com`` for any name under ``example.com``, or
``*`` for any. Ports are not compared: a rebinding page uses the dashboard's own port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from ..._errors import ScheduleError

LOOPBACK = ("localhost", "127.0.0.1", "::1")
"""The hosts that actions are taken from when ``allowed_hosts`` is not given."""
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})
"""Bind addresses that name no host (every interface)."""


def patterns(allowed_hosts: Iterable[str] | None) -> tuple[str, ...] | None:
    """``allowed_hosts`` checked and normalised (lower case, no brackets, no final dot);
    ``None`` stays ``None``. Anything else than host names or patterns is a ``ScheduleError``."""
    if allowed_hosts is None:
        return None
    if isinstance(allowed_hosts, (str, bytes)) or not isinstance(allowed_hosts, Iterable):
        raise ScheduleError(
            f"allowed_hosts must be a list of host names, got {allowed_hosts!r}",
            field="allowed_hosts",
        )
    result = tuple(_pattern(host) for host in allowed_hosts)
    if not result:
        raise ScheduleError(
            "allowed_hosts is empty, which would refuse every request; leave it None for "
            "the default (actions from localhost only)",
            field="allowed_hosts",
        )
    return result


def _pattern(host: object) -> str:
    if not isinstance(host, str) or not host.strip():
        raise ScheduleError(f"allowed_hosts: {host!r} is not a host name", field="allowed_hosts")
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    name = name.rstrip(".") if name != "*" else name
    wildcard = name == "*" or (name.startswith("*.") and "*" not in name[2:] and len(name) > 2)
    if "*" in name and not wildcard:
        raise ScheduleError(
            f"allowed_hosts: {host!r}: a wildcard is '*' or a domain like '*.example.com'",
            field="allowed_hosts",
        )
    if (":" in name and not _is_ipv6(name)) or "/" in name or not name:
        raise ScheduleError(
            f"allowed_hosts: {host!r} is not a host name: give it without scheme, port or "
            "path, e.g. 'ops.example.com'",
            field="allowed_hosts",
        )
    return name


def _is_ipv6(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).version == 6
    except ValueError:
        return False


def for_bind_address(host: str) -> tuple[str, ...] | None:
    """The default hosts of a dashboard that listens on ``host``: that address (and
    ``localhost`` for a loopback one); ``None`` for an address of every interface."""
    name = host.strip().lower().strip("[]")
    if name in WILDCARD_ADDRESSES:
        return None
    try:
        loopback = ipaddress.ip_address(name).is_loopback
    except ValueError:
        loopback = name == "localhost"
    return tuple(dict.fromkeys((name, *(LOOPBACK if loopback else ()))))


def host_name(header: str | None) -> str | None:
    """The host of a ``Host`` header, lower case, without port, brackets or final dot;
    ``None`` for a missing or malformed header."""
    if not header:
        return None
    text = header.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        name, rest = (text[1:end], text[end + 1 :]) if end > 0 else ("", "")
    else:
        name, colon, port = text.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return None
    name = name.rstrip(".")
    return name or None


def allowed(host: str | None, hosts: tuple[str, ...]) -> bool:
    """Whether ``host`` (from :func:`host_name`) matches one of ``hosts``."""
    if host is None:
        return False
    return any(
        pattern == "*"
        or host == pattern
        or (pattern.startswith("*.") and host.endswith(pattern[1:]))
        for pattern in hosts
    )
