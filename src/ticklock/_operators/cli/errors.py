"""The CLI's exit codes and the error for a user's mistake."""

from __future__ import annotations

EXIT_OK, EXIT_NOT_OK, EXIT_ERROR = 0, 1, 2
"""0 ok; 1 a job overdue (``status``), not found, or an operation refused; 2 usage or
connection error."""


class CommandError(Exception):
    """A mistake in the command line or the code it names: one line on stderr, exit 2."""
