"""The CLI's log lines: every logger's warnings, and the ``ticklock`` logger's lines at
``--log-level``, each line once however the code it runs configures logging."""

from __future__ import annotations

import logging

from ..._logging import FORMAT, _StderrHandler


class _Once(logging.Filter):
    """On the handler the CLI gives the root logger: lets ``ticklock``'s lines through only
    while the ``ticklock`` logger has no handler of :func:`ticklock.log_to_stderr` (a module
    that calls it, at import or later, would print each of them a second time)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "ticklock" and not record.name.startswith("ticklock."):
            return True
        own = logging.getLogger("ticklock").handlers
        return not any(isinstance(handler, _StderrHandler) for handler in own)


def configure() -> None:
    """Print WARNING and above of every logger to stderr in :data:`FORMAT` (the ``ticklock``
    logger's lines at its own level), unless the root logger has handlers already: the code
    ``ticklock run`` imported configured logging itself, and its handlers print them."""
    root = logging.getLogger()
    if root.handlers:
        return
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    for handler in root.handlers:
        handler.addFilter(_Once())
