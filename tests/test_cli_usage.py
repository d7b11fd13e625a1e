"""The CLI's surface: ``--version``, the options before the command, every ``--help``, the
hint after a connection error, and ``ticklock run``'s log lines printed once."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import ticklock
import ticklock._operators.cli.fleet
from ticklock._operators.cli import main
from ticklock._operators.cli.errors import CommandError
from ticklock._operators.cli.main import _COMMANDS, _parser


@pytest.fixture
def quiet_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("TICKLOCK_DSN", raising=False)
    level = logging.getLogger("ticklock").level
    yield
    logging.getLogger("ticklock").setLevel(level)  # main() sets it from --log-level


def ticklock_cli(*argv: str, cwd: Path | None = None, timeout: float = 30) -> Any:
    """``python -m ticklock *argv`` as a real process (this worktree's ``src`` through the
    inherited ``PYTHONPATH``)."""
    return subprocess.run(
        [sys.executable, "-m", "ticklock", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version_prints_the_package_version() -> None:
    out = ticklock_cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"ticklock {ticklock.__version__}\n", "")


# -- --dsn, --schema and --namespace before the command ----------------------------------------

D1, D2 = "postgresql://u:Zq1@db1/x", "postgresql://u:Zq1@db2/x"


@pytest.mark.parametrize(
    ("argv", "seen"),
    [
        (["--dsn", D1, "status"], (D1, "ticklock", "default")),
        (["status", "--dsn", D1], (D1, "ticklock", "default")),
        (
            ["--dsn", D1, "--schema", "s1", "--namespace", "n1", "status"],
            (D1, "s1", "n1"),
        ),
        (["--dsn", D1, "--schema", "s1", "status", "--schema", "s2"], (D1, "s2", "default")),
        (["--dsn", D1, "--namespace", "n1", "history", "x", "--dsn", D2], (D2, "ticklock", "n1")),
    ],
    ids=["before", "after", "all_before", "after_wins_schema", "after_wins_dsn"],
)
def test_options_before_the_command_apply_and_the_ones_after_it_win(
    quiet_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    seen: tuple[str, str, str],
) -> None:
    got: list[tuple[str, str, str]] = []

    @asynccontextmanager
    async def fake_fleet(args: argparse.Namespace) -> AsyncIterator[Any]:
        got.append((args.dsn, args.schema, args.namespace))
        raise CommandError("stopped here")
        yield  # pragma: no cover

    monkeypatch.setattr(ticklock._operators.cli.fleet, "open_fleet", fake_fleet)
    assert main(argv) == 2
    assert capsys.readouterr().err == "ticklock: stopped here\n"
    assert got == [seen]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--namespace", "n", "migrate", "--dsn", D1], "ticklock: migrate takes no --namespace\n"),
        (["--dsn", D1, "jobs", "app:scheduler"], "ticklock: jobs takes no --dsn\n"),
        (["--schema", "s", "run", "app:scheduler"], "ticklock: run takes no --schema\n"),
        (
            ["--dsn", "postgresql://u:Zq1@db:99999/x", "status"],
            "ticklock: --dsn has a bad port: it must be a number from 1 to 65535 (write '/', "
            "'?' and '#' in the password as %2F, %3F and %23)\n",
        ),
    ],
    ids=["migrate_namespace", "jobs_dsn", "run_schema", "checked_as_after"],
)
def test_an_option_before_a_command_that_does_not_take_it_is_refused(
    quiet_env: None, capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr() == ("", line)


@pytest.mark.postgres
def test_a_real_process_takes_the_dsn_before_the_command(pg_dsn: str, pg_schema: str) -> None:
    out = ticklock_cli("--dsn", pg_dsn, "--schema", pg_schema, "migrate")
    assert out.returncode == 0, out.stderr
    shown = ticklock_cli("--dsn", pg_dsn, "--schema", pg_schema, "--namespace", "ns1", "status")
    assert shown.returncode == 1, shown.stderr  # the tables are there, no job in ns1
    assert shown.stderr.startswith(f"ticklock: no jobs in namespace 'ns1' (schema '{pg_schema}')")


# -- --help ------------------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


@pytest.mark.parametrize("command", [name for name, _, _ in _COMMANDS])
def test_every_help_has_a_description_and_each_option_its_default(
    quiet_env: None, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    description = next(text for name, text, _ in _COMMANDS if name == command)
    assert description in shown
    parser = _subcommands()[command]
    options = [a for a in parser._actions if a.option_strings and a.nargs != 0]
    assert options
    for action in options:
        assert action.help is not None and "default" in action.help, action.option_strings
        assert " ".join(action.help.split()) in shown, action.help


def test_the_top_help_shows_the_options_before_the_command_and_which_wins(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--version" in shown and "--dsn DSN" in shown and "--namespace NAMESPACE" in shown
    assert "given in both places, the one after the command wins" in shown


# -- connection errors -------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_connection_is_one_line_with_a_hint_and_exit_2() -> None:
    port = _closed_port()
    out = ticklock_cli("--dsn", f"postgresql://u:Zq1@127.0.0.1:{port}/x", "status")
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(
        r"ticklock: ConnectionRefusedError: .*: nothing accepts connections at "
        rf"'127\.0\.0\.1:{port}': check that PostgreSQL runs there, and the host and port in "
        r"the DSN \(--dsn or TICKLOCK_DSN\)\n",
        out.stderr,
    ), out.stderr
    assert "Zq1" not in out.stderr


def test_an_unknown_host_is_one_line_with_a_hint_and_exit_2(quiet_env: None) -> None:
    out = ticklock_cli("history", "x", "--dsn", "postgresql://u:Zq1@no-such-host.invalid/x")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Zq1" not in out.stderr
    if out.stderr.startswith("ticklock: TimeoutError: "):  # a resolver that did not answer
        assert out.stderr.endswith(
            ": 'no-such-host.invalid' did not answer in time: check the host and port in the "
            "DSN (--dsn or TICKLOCK_DSN), and any firewall on the way\n"
        ), out.stderr
        return
    assert out.stderr.startswith("ticklock: gaierror: "), out.stderr
    assert out.stderr.endswith(
        ": no such host 'no-such-host.invalid': check the host in the DSN (--dsn or TICKLOCK_DSN)\n"
    )


@pytest.mark.postgres
def test_a_missing_database_is_one_line_with_the_fix(pg_dsn: str) -> None:
    base, _, _ = pg_dsn.rpartition("/")
    out = ticklock_cli("--dsn", f"{base}/cli_no_such_db", "status")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("ticklock: database error: InvalidCatalogNameError: ")
    assert out.stderr.endswith(": create the database, or correct its name in the DSN\n")
    assert out.stderr.count("\n") == 1


# -- ticklock run: each log line once ------------------------------------------------------------

LOGGING_MODULE = """
import logging
import os
import ticklock
from ticklock import Scheduler, every

{setup}
scheduler = Scheduler(shutdown_grace=1)

@scheduler.job(every(0.2), id="tick")
async def tick(ctx):
    return {{"n": 1}}
"""


@pytest.mark.parametrize(
    ("setup", "extra", "shown"),
    [
        ("", [], "INFO"),
        ("ticklock.log_to_stderr()", [], "INFO"),
        ("ticklock.log_to_stderr('DEBUG')", [], "INFO"),  # a module's level, below the default
        ("logging.basicConfig(level=logging.INFO, format='app %(message)s')", [], "app"),
        ("ticklock.log_to_stderr()", ["--log-level", "WARNING"], None),  # the option wins
    ],
    ids=["cli_only", "log_to_stderr", "log_to_stderr_debug", "basic_config", "option_wins"],
)
def test_run_prints_each_log_line_once(
    tmp_path: Path, setup: str, extra: list[str], shown: str | None
) -> None:
    (tmp_path / "cli_logs.py").write_text(LOGGING_MODULE.format(setup=setup))
    err = tmp_path / "stderr"
    with err.open("w") as stream:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ticklock", "run", "cli_logs:scheduler", *extra],
            cwd=tmp_path,
            stderr=stream,
            stdout=subprocess.DEVNULL,
        )
    try:
        time.sleep(1.5)  # some runs, every 0.2 s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.read_text().splitlines()
    runs = [line for line in lines if "run tick slot=" in line]
    if shown is None:
        assert runs == [], lines
        return
    assert len(runs) >= 3, lines
    assert len(set(runs)) == len(runs), lines  # each slot's line once
    assert all(shown in line for line in runs), runs
    assert sum("scheduler stopped" in line for line in lines) == 1, lines


@pytest.mark.parametrize(
    ("exc", "dsn", "hint"),
    [
        (
            TimeoutError(),
            "postgresql://u:Zq1@db.internal:6432/x",
            "'db.internal:6432' did not answer in time: check the host and port in the DSN "
            "(--dsn or TICKLOCK_DSN), and any firewall on the way",
        ),
        (
            FileNotFoundError(2, "No such file or directory"),
            "postgresql:///x?host=/nowhere",
            "cannot reach the host and port the DSN names (or PGHOST and PGPORT): check the host "
            "and port in the DSN (--dsn or TICKLOCK_DSN), and that PostgreSQL runs there",
        ),
        (
            ConnectionRefusedError(111, "Connect call failed"),
            "postgresql://u:Zq1@[::1]:1/x",
            "nothing accepts connections at '[::1]:1': check that PostgreSQL runs there, and the "
            "host and port in the DSN (--dsn or TICKLOCK_DSN)",
        ),
        (ValueError("not a connection error"), "postgresql://db/x", None),
        (ConnectionRefusedError(111, "refused"), None, None),  # no database command
    ],
    ids=["timeout", "no_socket", "refused_ipv6", "other", "no_dsn"],
)
def test_the_hint_names_what_to_check_and_never_the_password(
    exc: BaseException, dsn: str | None, hint: str | None
) -> None:
    from ticklock._operators.cli.hints import advice

    assert advice(exc, dsn, "ticklock") == hint


def test_a_reader_that_closes_the_pipe_is_no_database_error(tmp_path: Path) -> None:
    # `ticklock jobs app:scheduler | head -1`: the reader goes away after one line
    (tmp_path / "many.py").write_text(
        "from ticklock import Scheduler, every\n"
        "scheduler = Scheduler()\n"
        "async def noop(ctx): ...\n"
        "for i in range(3000):\n"
        "    scheduler.add(noop, every(60), id=f'job-{i}')\n"
    )
    src = str(Path(ticklock.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(tmp_path)])}
    reader = subprocess.Popen(
        f"'{sys.executable}' -m ticklock jobs many:scheduler | head -1",
        shell=True,
        executable="/bin/bash",
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = reader.communicate(timeout=60)
    assert out.startswith("job-0"), out
    assert "BrokenPipe" not in err and "cannot reach" not in err, err
