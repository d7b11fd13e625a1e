"""Conversion and validation of the durations and names a user declares."""

from __future__ import annotations

import math
import re
from datetime import timedelta

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
        raise ScheduleError(
            f"{field} must be seconds (a number) or a timedelta, got {value!r}",
            job_id=job_id,
            field=field,
        )
    if not math.isfinite(result) or result < 0 or (result == 0 and not allow_zero):
        need = "non-negative" if allow_zero else "positive"
        raise ScheduleError(
            f"{field} must be {need} and finite, got {result:g} s", job_id=job_id, field=field
        )
    if result > MAX_SECONDS:
        raise ScheduleError(
            f"{field} must be at most 100 years, got {result:g} s", job_id=job_id, field=field
        )
    return result


def name(value: object, field: str, *, job_id: str | None = None) -> str:
    """Return ``value`` if it is a non-empty string of at most 200 characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise ScheduleError(
            f"{field} must be a non-empty string of at most {MAX_NAME} characters, got {shown!r}",
            job_id=job_id,
            field=field,
        )
    if "\x00" in value:
        raise ScheduleError(
            f"{field} must not contain NUL characters (PostgreSQL text cannot store them), "
            f"got {value!r}",
            job_id=job_id,
            field=field,
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
