"""ticklock.log_to_stderr(): one handler however often it is called, on the current stderr."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import ticklock


@pytest.fixture
def ticklock_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("ticklock")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_log_to_stderr_adds_one_handler_and_sets_the_level(
    ticklock_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(ticklock_logger.handlers)
    handler = ticklock.log_to_stderr()
    assert ticklock.log_to_stderr("debug") is handler  # idempotent; the level changes
    assert len(ticklock_logger.handlers) == before + 1
    assert ticklock_logger.level == logging.DEBUG
    ticklock.log_to_stderr(logging.WARNING)
    assert ticklock_logger.level == logging.WARNING

    ticklock.log_to_stderr()
    ticklock_logger.info("run %s slot=%s", "purge", "-")
    ticklock_logger.debug("not shown at INFO")
    err = capsys.readouterr().err  # the stderr of the moment, not the one at the first call
    assert err.endswith(" INFO ticklock: run purge slot=-\n")
    assert "not shown" not in err


def test_log_to_stderr_refuses_an_unknown_level(ticklock_logger: logging.Logger) -> None:
    with pytest.raises(ValueError, match="^Unknown level: 'LOUD'$"):
        ticklock.log_to_stderr("loud")
