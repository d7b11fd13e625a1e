"""The CLI's usage errors: one line on stderr and exit 2, never a traceback, never a password.

Exit 1 is reserved for ``status`` finding an overdue job. These run ``main()`` in-process (no
database, nothing starts: each mistake is caught before), and one as a real process.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ticklock._cli import main

BAD_PORT = (
    r"bad port: it must be a number from 1 to 65535 \(write '/', '\?' and '#' in the "
    r"password as %2F, %3F and %23\)$"
)
MODULES = {
    "cli_boom": "import ticklock\nraise RuntimeError('boom at import')\n",
    "cli_plain": "answer = 42\n",
    "cli_app": "from ticklock import Scheduler\nscheduler = Scheduler(shutdown_grace=1)\n",
    "cli_needs": "import cli_not_installed_anywhere\n",
    "cli_baddsn": "from ticklock import Scheduler\nscheduler = Scheduler('postgresql://u:Zq1@db:0/x')\n",
}


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of small modules, the current directory (as for ``ticklock run``)."""
    for module, text in MODULES.items():
        (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test
    monkeypatch.delenv("TICKLOCK_DSN", raising=False)
    level = logging.getLogger("ticklock").level
    yield tmp_path
    logging.getLogger("ticklock").setLevel(level)  # main() sets it from --log-level


CASES = [
    pytest.param(
        ["run", "cli_boom:scheduler"],
        r"^ticklock: cannot import cli_boom \(.*cli_boom\.py:2\): RuntimeError: boom at import$",
        id="exception_at_import",
    ),
    pytest.param(
        ["run", "cli_needs:scheduler"],
        r"^ticklock: cannot import cli_needs \(.*cli_needs\.py:1\): ModuleNotFoundError: "
        r"No module named 'cli_not_installed_anywhere'$",
        id="import_inside_the_module_fails",
    ),
    pytest.param(
        ["jobs", "cli_nowhere:scheduler"],
        r"^ticklock: cannot import cli_nowhere: ModuleNotFoundError: "
        r"No module named 'cli_nowhere'$",
        id="module_not_found",
    ),
    pytest.param(
        ["run", "cli_plain:scheduler"],
        r"^ticklock: module cli_plain has no attribute 'scheduler'$",
        id="attribute_missing",
    ),
    pytest.param(
        ["jobs", "cli_plain:answer"],
        r"^ticklock: cli_plain:answer is not a ticklock\.Scheduler: its type is int$",
        id="not_a_scheduler",
    ),
    pytest.param(
        ["run", "cli_plain"],
        r"^ticklock: expected MODULE:ATTR \(e\.g\. myapp\.jobs:scheduler\), got 'cli_plain'$",
        id="no_attribute_given",
    ),
    pytest.param(
        ["run", "cli_baddsn:scheduler"],
        r"^ticklock: cannot import cli_baddsn \(.*cli_baddsn\.py:2\): ScheduleError: dsn has a "
        + BAD_PORT,
        id="bad_dsn_in_the_module",
    ),
    pytest.param(
        ["run", "cli_plain:answer", "--log-level", "loud"],
        r"^ticklock: --log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
        r"got 'loud'$",
        id="bad_log_level",
    ),
    pytest.param(
        ["run", "cli_plain:answer", "--dsn", "postgresql://u:Zq1@db:54x2/x"],
        r"^ticklock: --dsn has a " + BAD_PORT,
        id="run_bad_port",
    ),
    pytest.param(
        ["status", "--dsn", "postgresql://u:Zq1@[db/x"],
        r"^ticklock: --dsn does not parse as a URL \(check the host's \[brackets\]\); "
        r"expected postgresql://user:password@host:port/database$",
        id="status_unclosed_bracket",
    ),
    pytest.param(
        ["migrate", "--dsn", "postgresql+asyncpg://u:Zq1@db/x"],
        r"^ticklock: --dsn has the SQLAlchemy form 'postgresql\+asyncpg://': ticklock uses "
        r"asyncpg directly, so drop '\+asyncpg' and write 'postgresql://'$",
        id="migrate_sqlalchemy_url",
    ),
    pytest.param(
        ["status"],
        r"^ticklock: status needs --dsn or the TICKLOCK_DSN variable$",
        id="status_without_a_dsn",
    ),
]


@pytest.mark.parametrize(("argv", "line"), CASES)
def test_a_mistake_is_one_line_and_exit_2(
    app_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert re.match(line, err.rstrip("\n")), err
    assert "Zq1" not in err


def test_a_bad_dsn_from_the_environment_is_named_as_such(
    app_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TICKLOCK_DSN", "postgresql://u:Zq1@db:99999/x")
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ticklock: TICKLOCK_DSN has a bad port: it must be a number from 1 to")
    assert "Zq1" not in err


def test_a_missing_postgres_extra_is_one_line(
    app_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # as if asyncpg were not installed
    assert main(["migrate", "--dsn", "postgresql://db/x"]) == 2
    assert capsys.readouterr().err == (
        'ticklock: PostgreSQL mode needs asyncpg: pip install "ticklock[postgres]"\n'
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "cli_boom:scheduler"],
        ["run", "cli_plain:answer", "--log-level", "loud"],
        ["status", "--dsn", "postgresql://u:Zq1@db:0/x"],
    ],
    ids=["import_error", "bad_log_level", "bad_dsn"],
)
def test_a_real_process_exits_2_without_a_traceback(app_dir: Path, argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ticklock", *argv],
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("ticklock: ") and out.stderr.count("\n") == 1, out.stderr
    assert "Zq1" not in out.stderr


@pytest.mark.postgres
def test_run_on_a_database_that_does_not_exist_is_one_line_and_exit_2(
    app_dir: Path, pg_dsn: str
) -> None:
    missing = pg_dsn.rsplit("/", 1)[0] + "/cli_no_such_db"
    out = subprocess.run(
        [sys.executable, "-m", "ticklock", "run", "cli_app:scheduler", "--dsn", missing],
        cwd=app_dir,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and 'database "cli_no_such_db" does not exist' in lines[0], lines
