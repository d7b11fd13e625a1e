"""The CLI's usage errors: one line on stderr and exit 2, never a traceback, never a password.

Exit 1 is reserved for ``status`` finding an overdue job. These run ``main()`` in-process (no
database, nothing starts: each mistake is caught before), and one as a real process.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
import unicodedata
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio
import pytest

import ticklock._operators.cli.app
from ticklock._backends.postgres.schema import VERSION
from ticklock._demo import _Printer
from ticklock._operators.cli import main

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
    # refused before connecting (nothing listens on port 1): `status` would print it raw
    pytest.param(
        [
            "pause",
            "nightly",
            "--note",
            "INC-42 \u202efixed",
            "--dsn",
            "postgresql://u:Zq1@127.0.0.1:1/x",
        ],
        r"^ticklock: --note must be one line of plain text, without control, format or "
        r"separator characters: it has U\+202E \(RIGHT-TO-LEFT OVERRIDE\) at character 8$",
        id="note_with_a_bidi_override",
    ),
    pytest.param(
        ["trigger", "nightly", "--note", "a\u2028b", "--dsn", "postgresql://u:Zq1@127.0.0.1:1/x"],
        r"^ticklock: --note must be one line of plain text, without control, format or "
        r"separator characters: it has U\+2028 \(LINE SEPARATOR\) at character 2$",
        id="note_with_a_line_separator",
    ),
    # a byte that is no UTF-8 in argv arrives as a surrogate: refused, not a DataError
    pytest.param(
        ["history", "nope\udcff", "--dsn", "postgresql://u:Zq1@127.0.0.1:1/x"],
        r"^ticklock: JOB must not contain unpaired surrogates \(PostgreSQL text cannot store "
        r"them\), got 'nope\\udcff': U\+DCFF \(an unpaired surrogate\) at character 5$",
        id="job_with_a_surrogate",
    ),
    pytest.param(
        ["status", "--namespace", "\udcffns", "--dsn", "postgresql://u:Zq1@127.0.0.1:1/x"],
        r"^ticklock: --namespace must not contain unpaired surrogates",
        id="namespace_with_a_surrogate",
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
        ["resume", "j", "--note", "zero\u200bwidth", "--dsn", "postgresql://u:Zq1@127.0.0.1:1/x"],
    ],
    ids=["import_error", "bad_log_level", "bad_dsn", "note_with_a_zero_width_space"],
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
def test_run_on_a_database_that_does_not_exist_keeps_running_and_names_the_fix(
    app_dir: Path, pg_dsn: str, tmp_path: Path
) -> None:
    # an operator can create the database while the sidecar runs: it waits for it (G6)
    missing = pg_dsn.rsplit("/", 1)[0] + "/cli_no_such_db"
    err = tmp_path / "stderr"
    with err.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ticklock", "run", "cli_app:scheduler", "--dsn", missing],
            cwd=app_dir,
            stderr=out,
            stdout=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 30
        while 'database "cli_no_such_db" does not exist' not in err.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        assert proc.poll() is None  # still running, retrying
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text()
    assert "Traceback" not in text
    assert "ERROR" in text and "create the database" in text, text


# -- what the commands print ------------------------------------------------------------------

JOBS_MODULE = """
from datetime import timedelta
from ticklock import Scheduler, cron, every

scheduler = Scheduler("postgresql://u@db/x")

@scheduler.job(every(minutes=15, initial_delay=timedelta(seconds=90)), id="purge")
async def purge(ctx): ...

@scheduler.job(cron("17 3 * * *", tz="Europe/Berlin"), id="nightly")
async def nightly(ctx): ...

@scheduler.job(cron("@hourly", jitter=30), id="hourly")
async def hourly(ctx): ...

@scheduler.job(every(60), id="off", enabled=False)
async def off(ctx): ...
"""


def test_jobs_prints_whole_seconds_and_the_first_fires_as_planned(
    app_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (app_dir / "cli_jobs.py").write_text(JOBS_MODULE)
    now = datetime(2026, 3, 28, 12, 0, 7, 123456, tzinfo=timezone.utc)
    monkeypatch.setattr(ticklock._operators.cli.app, "datetime", _Frozen(now))
    assert main(["jobs", "cli_jobs:scheduler", "--count", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        # an every job's next fires follow its runs' ends and jitter: only its first is known
        "ticklock.retention (built-in): every 1m (jitter 10s), timeout 30s",
        "    2026-03-28T12:00:07+00:00  (if started now, + up to 10s jitter)",
        "    then one interval (1m) after each run ends (+ up to 10s jitter)",
        "purge: every 15m, timeout 300s",
        "    2026-03-28T12:01:37+00:00  (if started now)",
        "    then one interval (15m) after each run ends",
        "nightly: cron '17 3 * * *' Europe/Berlin, timeout 300s",
        "    2026-03-29T01:17:00+00:00  (2026-03-29T03:17:00+02:00 Europe/Berlin)",
        "    2026-03-30T01:17:00+00:00  (2026-03-30T03:17:00+02:00 Europe/Berlin)",
        "    2026-03-31T01:17:00+00:00  (2026-03-31T03:17:00+02:00 Europe/Berlin)",
        "hourly: cron '@hourly' UTC (jitter 30s), timeout 300s",
        "    2026-03-28T13:00:00+00:00  (2026-03-28T13:00:00+00:00 UTC, + up to 30s jitter)",
        "    2026-03-28T14:00:00+00:00  (2026-03-28T14:00:00+00:00 UTC, + up to 30s jitter)",
        "    2026-03-28T15:00:00+00:00  (2026-03-28T15:00:00+00:00 UTC, + up to 30s jitter)",
        "off: every 1m, timeout 30s  (disabled: never runs)",
    ]


def test_jobs_refuses_a_count_below_one(app_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["jobs", "cli_app:scheduler", "--count", "0"]) == 2
    assert capsys.readouterr().err == "ticklock: --count must be at least 1, got 0\n"


class _Frozen:
    """Stands in for the ``datetime`` class in the CLI's ``app`` module: ``now()`` is fixed."""

    def __init__(self, now: datetime) -> None:
        self._now = now

    def now(self, tz: Any = None) -> datetime:
        return self._now


def test_the_demo_prints_slots_as_times_and_reports_as_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    printer = _Printer()
    for slot, report, error in (
        ("2026-11-29T02:54:00+00:00", {"jitter_ms": 211, "note": "x"}, None),
        ("2026-11-29T02:54:01.250713+00:00", None, "RuntimeError: simulated failure"),
    ):
        record = logging.LogRecord("ticklock", logging.INFO, __file__, 1, "run", None, None)
        record.__dict__.update(
            job_id="heartbeat",
            slot=slot,
            outcome="success",
            duration=0.0012,
            report=report,
            error=error,
        )
        printer.emit(record)
    assert capsys.readouterr().out.splitlines() == [
        'heartbeat  slot=02:54:00.000 success      1.2 ms report={"jitter_ms": 211, "note": "x"}',
        "heartbeat  slot=02:54:01.250 success      1.2 ms error=RuntimeError: simulated failure",
    ]


def test_the_demo_lists_its_plan_before_the_first_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ticklock", "demo", "--seconds", "2.5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "ticklock demo (local mode). Jobs and their next slots (UTC):"
    # an every job's first slot, then how the next ones come: after each run, with jitter
    assert re.fullmatch(
        r"  heartbeat  every 2s \(jitter 0\.5s\) +next: \d\d:\d\d:\d\d \(\+ up to 0\.5s "
        r"jitter\), then one interval \(2s\) after each run ends \(\+ up to 0\.5s jitter\)",
        lines[1],
    ), lines[1]
    assert re.fullmatch(
        r"  flaky +every 3s +next: \d\d:\d\d:\d\d, then one interval \(3s\) after each run ends",
        lines[2],
    ), lines[2]
    assert re.fullmatch(
        r"  minutely +cron '\* \* \* \* \*' Europe/Berlin +next: (\d\d:\d\d:00, ){2}\d\d:\d\d:00",
        lines[3],
    ), lines[3]
    runs = [line for line in lines if " slot=" in line]
    assert runs, out.stdout
    for line in runs:
        assert re.fullmatch(
            r"(heartbeat|flaky|minutely) +slot=\d\d:\d\d:\d\d\.\d{3} \w+ +[\d.]+ ms "
            r"(report=\{.*\}|error=.*)",
            line,
        ), line
    # the listing's first slot is the first run's (truncated to the second, taken just before
    # the scheduler starts), not one interval later, nor the slot plus its jitter
    listed = lines[1].split("next: ")[1][:8]
    heartbeat = next(line for line in runs if line.startswith("heartbeat"))
    ran = heartbeat.split("slot=")[1][:8]
    listed_s, ran_s = (int(t[:2]) * 3600 + int(t[3:5]) * 60 + int(t[6:8]) for t in (listed, ran))
    assert (ran_s - listed_s) % 86400 in (0, 1), (listed, ran)  # 1: a second began meanwhile
    assert re.search(r'report=\{"jitter_ms": \d+\}$', heartbeat), heartbeat


# -- migrate and status on a real PostgreSQL ---------------------------------------------------


def sql(dsn: str, *statements: str) -> list[Any]:
    """Run ``statements`` on a connection of their own; the rows of the last one."""

    async def go() -> list[Any]:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements[:-1]:
                await conn.execute(statement)
            return list(await conn.fetch(statements[-1]))
        finally:
            await conn.close()

    return anyio.run(go)


@pytest.mark.postgres
def test_migrate_says_whether_it_created_the_tables(
    app_dir: Path, capsys: pytest.CaptureFixture[str], pg_dsn: str, pg_schema: str
) -> None:
    argv = ["migrate", "--dsn", pg_dsn, "--schema", pg_schema]
    assert main(argv) == 0
    assert capsys.readouterr().out == (
        f"ticklock: created ticklock's tables in schema '{pg_schema}' (version {VERSION})\n"
    )
    assert main(argv) == 0
    assert capsys.readouterr().out == (
        f"ticklock: ticklock's tables in schema '{pg_schema}' are already at version {VERSION}; "
        "nothing to do\n"
    )
    sql(pg_dsn, f"UPDATE {pg_schema}.schema_version SET version = {VERSION - 1}", "SELECT 1")
    assert main(argv) == 0  # as if the tables were an older release's
    assert capsys.readouterr().out == (
        f"ticklock: upgraded ticklock's tables in schema '{pg_schema}' to version {VERSION}\n"
    )


@pytest.mark.postgres
@pytest.mark.parametrize("schema_exists", [False, True], ids=["no_schema", "no_tables"])
def test_status_before_migrate_says_to_run_migrate(
    app_dir: Path,
    capsys: pytest.CaptureFixture[str],
    pg_dsn: str,
    pg_schema: str,
    schema_exists: bool,
) -> None:
    if schema_exists:
        sql(pg_dsn, f"CREATE SCHEMA {pg_schema}", "SELECT 1")
    assert main(["status", "--dsn", pg_dsn, "--schema", pg_schema]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"ticklock: no ticklock tables in schema '{pg_schema}' of this database: run 'ticklock "
        "migrate' (a scheduler also creates them when it starts), or give --schema the schema "
        "your schedulers use\n"
    )


@pytest.mark.postgres
def test_status_of_a_namespace_without_jobs_says_so_and_exits_1(
    app_dir: Path, capsys: pytest.CaptureFixture[str], pg_dsn: str, pg_schema: str
) -> None:
    assert main(["migrate", "--dsn", pg_dsn, "--schema", pg_schema]) == 0
    capsys.readouterr()
    assert main(["status", "--dsn", pg_dsn, "--schema", pg_schema]) == 1
    assert capsys.readouterr() == (
        "",
        f"ticklock: no jobs in namespace 'default' (schema '{pg_schema}'): no scheduler of that "
        "namespace has started on this database\n",
    )
    sql(
        pg_dsn,
        f"INSERT INTO {pg_schema}.jobs (namespace, job_id) VALUES ('billing', 'a'), ('app', 'b')",
        "SELECT 1",
    )
    assert main(["status", "--dsn", pg_dsn, "--schema", pg_schema, "--namespace", "ap"]) == 1
    assert capsys.readouterr().err == (
        f"ticklock: no jobs in namespace 'ap' (schema '{pg_schema}'): no scheduler of that "
        "namespace has started on this database; namespaces with jobs: 'app', 'billing'\n"
    )


@pytest.mark.postgres
def test_status_shows_hidden_characters_of_a_recorded_note_as_escapes(
    app_dir: Path, capsys: pytest.CaptureFixture[str], pg_dsn: str, pg_schema: str
) -> None:
    # a note and who recorded before they were refused (or by a writer of its own): the
    # terminal gets escapes, never a bidi override that reorders the line or an escape code
    assert main(["migrate", "--dsn", pg_dsn, "--schema", pg_schema]) == 0
    sql(
        pg_dsn,
        f"INSERT INTO {pg_schema}.jobs (namespace, job_id, paused_at) "
        "VALUES ('default', 'nightly', '2026-12-01T03:05:00Z')",
        f"INSERT INTO {pg_schema}.audit (namespace, job_id, at, action, who, note, changed) "
        "VALUES ('default', 'nightly', '2026-12-01T03:05:00Z', 'pause', "
        "E'ops\\u200b@host', E'INC-42 \\u202egnp.exe\\u2066 \\u001b[2J', true)",
        "SELECT 1",
    )
    capsys.readouterr()
    main(["status", "--dsn", pg_dsn, "--schema", pg_schema])
    out = capsys.readouterr().out
    assert (
        "paused by ops\\u200b@host at 2026-12-01T03:05:00+00:00: "
        "INC-42 \\u202egnp.exe\\u2066 \\x1b[2J"
    ) in out
    assert not any(unicodedata.category(c) in ("Cc", "Cf") for c in out.replace("\n", ""))


@pytest.mark.postgres
def test_status_and_history_show_hidden_characters_of_job_ids_and_owners_as_escapes(
    app_dir: Path, capsys: pytest.CaptureFixture[str], pg_dsn: str, pg_schema: str
) -> None:
    # a job id and an owner are not refused at declaration for hidden characters: whatever
    # the database holds, the terminal gets escapes, never a bidi override or an escape code
    assert main(["migrate", "--dsn", pg_dsn, "--schema", pg_schema]) == 0
    job, owner = "E'nightly\\u202egnp.exe\\u001b[2J'", "E'web-1\\u2066\\u001b[31m'"
    sql(
        pg_dsn,
        f"INSERT INTO {pg_schema}.jobs (namespace, job_id, last_outcome, consecutive_failures, "
        f"last_owner, last_error) VALUES ('default', {job}, 'failure', 1, {owner}, 'boom')",
        f"INSERT INTO {pg_schema}.runs (namespace, job_id, slot, started_at, finished_at, "
        f"outcome, owner, error) VALUES ('default', {job}, '2026-12-01T03:00:00Z', "
        f"'2026-12-01T03:00:00Z', '2026-12-01T03:00:01Z', 'failure', {owner}, 'boom')",
        "SELECT 1",
    )
    capsys.readouterr()
    main(["status", "--dsn", pg_dsn, "--schema", pg_schema])
    out = capsys.readouterr().out
    assert "nightly\\u202egnp.exe\\x1b[2J" in out
    assert "on web-1\\u2066\\x1b[31m: boom" in out
    main(["history", "nightly\u202egnp.exe\x1b[2J", "--dsn", pg_dsn, "--schema", pg_schema])
    shown = capsys.readouterr().out
    assert "web-1\\u2066\\x1b[31m" in shown
    for text in (out, shown):
        assert not any(unicodedata.category(c) in ("Cc", "Cf") for c in text.replace("\n", ""))


@pytest.mark.postgres
def test_status_labels_the_built_in_retention_job(
    app_dir: Path, capsys: pytest.CaptureFixture[str], pg_dsn: str, pg_schema: str
) -> None:
    assert main(["migrate", "--dsn", pg_dsn, "--schema", pg_schema]) == 0
    sql(
        pg_dsn,
        f"INSERT INTO {pg_schema}.jobs (namespace, job_id, last_success_at, last_outcome, "
        "overdue_at) VALUES ('default', 'purge', '2026-11-29T20:45:00.5Z', 'success', "
        "now() + interval '1 hour'), ('default', 'ticklock.retention', NULL, NULL, NULL)",
        "SELECT 1",
    )
    capsys.readouterr()
    assert main(["status", "--dsn", pg_dsn, "--schema", pg_schema]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:5] for line in lines[1:3]] == [
        ["purge", "ok", "2026-11-29T20:45:00+00:00", "success", "0"],
        ["ticklock.retention", "(built-in)", "ok", "-", "-"],
    ]
    assert lines[4] == "live replicas: none reported in the last minute"
