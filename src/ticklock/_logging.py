"""A one-call way to see ticklock's log lines: ticklock logs to the stdlib logger ``ticklock``
and adds no handler of its own, leaving that to the application's logging configuration."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The format of :func:`log_to_stderr`'s lines, the same as ``ticklock run``'s."""


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is when a line is emitted (as ``logging.lastResort``
    does), so that redirecting stderr later, in a test or a daemon, still works."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler's __init__ and setStream assign it
        pass


def log_to_stderr(level: int | str = "INFO") -> logging.Handler:
    """Print the ``ticklock`` logger's lines at ``level`` and above to standard error.

    One line per run (``INFO ticklock: run purge-expired slot=... outcome=success ...``),
    warnings, and errors with their tracebacks. Calling it again changes the level and adds
    no second handler. Returns the handler, e.g. to set a formatter of your own.

    Example::

        import ticklock

        ticklock.log_to_stderr()            # or log_to_stderr("DEBUG")

    Not needed when the application configures logging itself, for example with
    ``logging.basicConfig(level=logging.INFO)``; with both, each line would appear twice.
    """
    logger = logging.getLogger("ticklock")
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    for handler in logger.handlers:
        if isinstance(handler, _StderrHandler):
            return handler
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
    return handler
