"""What to do about an error a database command met: one hint after its message."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def advice(exc: BaseException, dsn: str | None, schema: str) -> str | None:
    """The fix for ``exc``, met connecting to ``dsn`` (``None``: no database command), or
    ``None``. Never holds the DSN's password."""
    if dsn is None:
        return None
    if type(exc).__module__.startswith("asyncpg"):
        from ..._backends.postgres.database import advice as database_advice

        return database_advice(exc, schema)
    where = _address(dsn)
    if isinstance(exc, socket.gaierror):
        return f"no such host {where}: check the host in the DSN (--dsn or TICKLOCK_DSN)"
    if isinstance(exc, ConnectionRefusedError):
        return (
            f"nothing accepts connections at {where}: check that PostgreSQL runs there, and the "
            "host and port in the DSN (--dsn or TICKLOCK_DSN)"
        )
    if isinstance(exc, TimeoutError):
        return (
            f"{where} did not answer in time: check the host and port in the DSN (--dsn or "
            "TICKLOCK_DSN), and any firewall on the way"
        )
    if isinstance(exc, OSError):
        return (
            f"cannot reach {where}: check the host and port in the DSN (--dsn or TICKLOCK_DSN), "
            "and that PostgreSQL runs there"
        )
    return None


def _address(dsn: str) -> str:
    """The DSN's ``host:port`` as written (never its user or password), for a message."""
    try:
        netloc = urlsplit(dsn).netloc.rpartition("@")[2]
    except ValueError:
        netloc = ""
    return repr(netloc) if netloc else "the host and port the DSN names (or PGHOST and PGPORT)"
