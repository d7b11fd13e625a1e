"""How large a run's report and error may be where they are recorded, and how a larger one is cut.

A run's result is cut once, when the runner builds it, so that local mode and PostgreSQL mode
store, log and return the same bounded values. Readers (the dashboard, the CLI) cut further
with :func:`cut_text` and :func:`report_marker` for what they show.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from typing import Any

logger = logging.getLogger("ticklock")

REPORT_LIMIT = 65_536
"""Characters of JSON text a recorded report may have; a larger report is recorded as the
marker of :func:`report_marker` instead."""
ERROR_LIMIT = 4_096
"""Characters a recorded error text may have, its marker included; a longer one keeps its start."""
HEAD = 200
"""Characters of a cut report's JSON text that its marker keeps."""
_MARKER = re.compile(r" … \[cut by ticklock: (\d+) characters in all\]\Z")
MARKER_KEY = "cut_by_ticklock"
"""The key that marks a report replaced by :func:`report_marker`."""
MARKER_MAX = 2_000
"""Characters of JSON text a marker has at most (its head may be escaped)."""


def cut_text(head: str, total: int, limit: int) -> str:
    """A text of ``total`` characters, of which ``head`` is the start, in at most ``limit``
    characters: as it is when it fits, else its start and a marker saying how long it was.

    >>> cut_text("x" * 100, 100, 60)
    'xxxxxxxxxxxxxxxxx … [cut by ticklock: 100 characters in all]'
    """
    if total <= limit and len(head) == total:
        return head
    if len(head) == total and (found := _MARKER.search(head)):  # cut before: keep its count
        head, total = head[: found.start()], int(found.group(1))
    marker = f" … [cut by ticklock: {total} characters in all]"
    return head[: max(limit - len(marker), 0)] + marker


def report_marker(head: str, total: int) -> dict[str, Any]:
    """What stands for a report whose JSON text (starting with ``head``) has ``total``
    characters: a small JSON object that says so."""
    return {MARKER_KEY: True, "characters": total, "head": head[:HEAD]}


def bound_report(report: Any, text: str, job_id: str, slot: datetime | None) -> Any:
    """``report`` (whose JSON text is ``text``), or its marker, with a WARNING, when the text
    is longer than :data:`REPORT_LIMIT`."""
    if len(text) <= REPORT_LIMIT:
        return report
    logger.warning(
        "the report of %s (slot %s) has %d characters of JSON, over the %d ticklock records: "
        "it is recorded as {%r: true, ...}; return a smaller report (keep large results in "
        "a table of your own)",
        job_id,
        slot.isoformat() if slot is not None else "-",
        len(text),
        REPORT_LIMIT,
        MARKER_KEY,
    )
    return report_marker(text, len(text))


def bound_error(error: str | None, job_id: str, slot: datetime | None) -> str | None:
    """``error``, cut to :data:`ERROR_LIMIT` characters with a WARNING when it is longer."""
    if error is None or len(error) <= ERROR_LIMIT:
        return error
    logger.warning(
        "the error of %s (slot %s) has %d characters, over the %d ticklock records: it is "
        "recorded cut",
        job_id,
        slot.isoformat() if slot is not None else "-",
        len(error),
        ERROR_LIMIT,
    )
    return cut_text(error, len(error), ERROR_LIMIT)


def shorten_report(report: Any, limit: int) -> Any:
    """``report``, or its marker when its JSON text is longer than ``limit`` characters (for
    a reader that shows less than what is recorded)."""
    if report is None:
        return None
    text = json.dumps(report, ensure_ascii=False, default=str)
    if len(text) <= limit or is_marker(report, text):
        return report
    return report_marker(text, len(text))


def is_marker(report: Any, text: str) -> bool:
    """Whether ``report`` (JSON text ``text``) is a marker, which readers show as it is."""
    return isinstance(report, dict) and report.get(MARKER_KEY) is True and len(text) <= MARKER_MAX


def report_text(report: Any) -> str:
    """``report`` as the JSON text whose length :data:`REPORT_LIMIT` bounds."""
    return json.dumps(report, allow_nan=False, ensure_ascii=False)


_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")  # an escaped NUL, not an escaped backslash


def jsonb_text(value: Any) -> str:
    """``value``'s JSON text; ``TypeError`` or ``ValueError`` unless PostgreSQL's ``jsonb`` can
    store it (in local mode too, so that a job behaves the same in both): a run's report, a
    batch's cursor."""
    text = report_text(value)
    if _NUL.search(text):
        raise ValueError("a string holds a NUL character, which jsonb cannot store")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("a string holds an unpaired surrogate, which jsonb cannot store") from None
    return text
