"""The templates' filters: instants, relative times, and text cut to size."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from ..._schedule.caps import cut_text
from ..fleet import json_text


def cut(text: str | None, limit: int) -> str:
    """``text`` in at most ``limit`` characters (``""`` for none), marked where it is cut."""
    return "" if text is None else cut_text(text, len(text), limit)


def json_value(value: Any) -> str:
    """A report as JSON text for a page (autoescaped there like any text); ``""`` for none."""
    return "" if value is None else json_text(value)


def when(when: datetime | None) -> str:
    """An instant as ISO 8601 in UTC, to the second: ``2026-11-29T20:45:07Z``."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if when else ""


def ago(when: datetime | None, now: datetime) -> str:
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
