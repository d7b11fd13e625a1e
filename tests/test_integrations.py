"""The integrations and examples, run for real: uvicorn and aiohttp servers on 127.0.0.1, the CLI
in subprocesses with real signals, and the docs/examples against a real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get_json(url: str) -> Any:
    status, body = get(url)
    assert status == 200, body
    return json.loads(body)


def until(check: Callable[[], bool], what: str, within: float = 20) -> None:
    """Poll a real server (in another process: no clock to inject) until ``check()``."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within} s")
        time.sleep(0.05)


def wait_http(url: str, proc: subprocess.Popen[str], within: float = 20) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.communicate()[0]}")
        try:
            get(url)
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{url} did not answer within {within} s")


@contextmanager
def server(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv,
        cwd=EXAMPLES,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out


def test_fastapi_lifespan_on_a_real_uvicorn_server() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--host", "127.0.0.1"]
    with server([*argv, "--port", str(port)], {"TICKLOCK_DSN": ""}) as proc:
        wait_http(base + "/", proc)
        # the app serves requests while its job runs every second
        until(lambda: get_json(base + "/")["processed"] >= 2, "two runs of the job")
        status, body = get(base + "/health")
        health = json.loads(body)
        assert status == 200 and health["tidy"]["last_success"] is not None
        assert health["tidy"]["overdue"] is False
        status, metrics = get(base + "/metrics")
        assert status == 200
        names = {line.split("{")[0] for line in metrics.splitlines() if "ticklock_job_id" in line}
        assert {
            "ticklock_job_last_success_seconds",
            "ticklock_runs_total",
            "ticklock_run_duration_seconds_bucket",
            "ticklock_run_lateness_seconds_bucket",
        } <= names
        gauge = next(m for m in metrics.splitlines() if m.startswith("ticklock_job_last_success"))
        assert 'ticklock_job_id="tidy"' in gauge
        assert abs(float(gauge.split()[-1]) - time.time()) < 10
        started = time.monotonic()
        code, out = stop(proc)
    assert code in (0, -signal.SIGTERM), out  # recent uvicorns re-raise the signal they caught
    assert time.monotonic() - started < 6  # shutdown_grace is 5 s
    assert "Application shutdown complete" in out


def test_fastapi_starts_with_the_database_down_and_says_so_once() -> None:
    # A database that is down must not take the app down with it (every replica would
    # crash-loop behind its load balancer): the app serves, the ticks end as error, and the
    # outage is one WARNING with its cause, not a traceback per tick.
    port = free_port()
    dead = f"postgresql://app:sekret@127.0.0.1:{free_port()}/app"
    argv = [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--host", "127.0.0.1"]
    with server([*argv, "--port", str(port)], {"TICKLOCK_DSN": dead}) as proc:
        wait_http(f"http://127.0.0.1:{port}/", proc)
        time.sleep(2.5)  # a few due ticks of the every(1) job
        code, out = stop(proc, signal.SIGINT)
    assert code == 0, out
    assert out.count("the database is unavailable") == 1, out
    assert "ConnectionRefusedError" in out or "Connect call failed" in out, out
    assert out.count("outcome=error") >= 2, out
    assert "Traceback" not in out and "sekret" not in out, out


@pytest.mark.postgres
def test_fastapi_serves_while_its_database_does_not_exist_yet(pg_dsn: str) -> None:
    # What an operator fixes while the app runs (here: create the database) does not fail
    # its start: the app serves, and one ERROR line names the cause and the fix.
    port = free_port()
    missing = pg_dsn.rsplit("/", 1)[0] + "/no_such_db"
    argv = [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--host", "127.0.0.1"]
    with server([*argv, "--port", str(port)], {"TICKLOCK_DSN": missing}) as proc:
        wait_http(f"http://127.0.0.1:{port}/", proc)
        time.sleep(1.5)  # a due tick of the every(1) job
        code, out = stop(proc, signal.SIGINT)
    assert code == 0, out
    assert (
        'ticklock cannot use the database (InvalidCatalogNameError: database "no_such_db" '
        "does not exist): create the database, or correct its name in the DSN"
    ) in out, out
    assert out.count("cannot use the database") == 1, out
    assert "Traceback" not in out, out


def test_aiohttp_cleanup_ctx_on_a_real_server() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "aiohttp_app.py", "--port", str(port)]
    with server(argv, {"TICKLOCK_DSN": ""}) as proc:
        wait_http(base + "/", proc)
        until(lambda: get_json(base + "/")["processed"] >= 2, "two runs of the job")
        assert get_json(base + "/health")["tidy"]["last_success"] is not None
        code, out = stop(proc, signal.SIGINT)
    assert code == 0, out


def test_sidecar_coroutine_example_runs_and_stops() -> None:
    out = subprocess.run(
        [sys.executable, "sidecar.py"], cwd=EXAMPLES, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr


def cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ticklock", *args],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,
    )


def test_cli_jobs_lists_next_fire_times_in_utc_and_the_job_zone() -> None:
    out = cli("jobs", "sidecar:scheduler", "--count", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refresh-cache: every 5m (jitter 20s), timeout 150s")
    report = lines.index(next(x for x in lines if x.startswith("morning-report")))
    assert "America/New_York" in lines[report + 1] and lines[report + 1].strip()[19:25] == "+00:00"
    # the every job: its first fire, then how the next come; the cron job: its next 3 fires
    assert lines[2] == "    then one interval (5m) after each run ends (+ up to 20s jitter)"
    assert len(lines) == 3 + 1 + 3


def test_cli_help_and_usage_errors() -> None:
    out = cli("--help")
    assert out.returncode == 0
    for command in ("run", "jobs", "status", "migrate", "demo"):
        assert command in out.stdout
    assert "Exit codes" in out.stdout
    assert cli("status").returncode == 2  # --dsn is required
    bad = cli("jobs", "no_such_module:scheduler")
    assert bad.returncode == 2 and "No module named 'no_such_module'" in bad.stderr
    assert cli("jobs", "sidecar").returncode != 0


def signal_after(
    args: list[str], marker: str, count: int, sig: int, cwd: Path | None = None
) -> tuple[int, str]:
    """Run ``python -m ticklock ARGS``; once ``marker`` was printed ``count`` times, send
    ``sig``; return the exit status and the whole output."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ticklock", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the per-test timeout bounds a process that never prints it
        lines.append(line)
        if sum(marker in seen for seen in lines) >= count:
            break
    code, rest = stop(proc, sig)
    return code, "".join(lines) + rest


def test_cli_demo_prints_runs_and_stops_on_sigterm() -> None:
    code, out = signal_after(["demo"], "success", 2, signal.SIGTERM)
    assert code == 0, out
    assert "heartbeat" in out and "success" in out and "stopped cleanly" in out
    # the listing's first fire of an `every` job is its first run (it starts at once), not
    # one interval later
    listed = out.split("heartbeat", 1)[1].split("next: ", 1)[1][:8]
    ran = out.split("heartbeat  slot=", 1)[1][:8]
    seconds = [int(t[:2]) * 3600 + int(t[3:5]) * 60 + int(t[6:8]) for t in (listed, ran)]
    assert (seconds[1] - seconds[0]) % 86400 <= 1, (listed, ran)


def test_cli_run_sidecar_process_exits_zero_on_sigint(tmp_path: Path) -> None:
    app = tmp_path / "myjobs.py"
    app.write_text(
        "from ticklock import Scheduler, every\n"
        "scheduler = Scheduler(shutdown_grace=1)\n"
        "@scheduler.job(every(0.2), id='beat')\n"
        "async def beat(ctx):\n"
        "    print('beat', ctx.slot, flush=True)\n"
    )
    code, out = signal_after(["run", "myjobs:scheduler"], "beat ", 3, signal.SIGINT, tmp_path)
    assert code == 0, out
    assert out.count("beat ") >= 3
    assert "SIGINT received, shutting down" in out


@pytest.mark.postgres
def test_cli_migrate_and_status_exit_codes(pg_dsn: str, pg_schema: str) -> None:
    assert cli("migrate", "--dsn", pg_dsn, "--schema", pg_schema).returncode == 0
    assert cli("migrate", "--dsn", pg_dsn, "--schema", pg_schema).returncode == 0  # idempotent
    empty = cli("status", "--dsn", pg_dsn, "--schema", pg_schema)
    assert empty.returncode == 1 and "no jobs in namespace 'default'" in empty.stderr
    import asyncio

    import asyncpg

    async def seed() -> None:
        conn = await asyncpg.connect(pg_dsn)
        now = datetime.now(timezone.utc)
        await conn.execute(
            f"INSERT INTO {pg_schema}.jobs (namespace, job_id, last_success_at, last_outcome, "
            "overdue_at) VALUES ('default', 'fine', $1, 'success', $2)",
            now,
            now + timedelta(hours=1),
        )
        await conn.close()

    asyncio.run(seed())
    fine = cli("status", "--dsn", pg_dsn, "--schema", pg_schema)
    assert fine.returncode == 0 and "fine" in fine.stdout and "OVERDUE" not in fine.stdout

    async def late() -> None:
        conn = await asyncpg.connect(pg_dsn)
        await conn.execute(
            f"UPDATE {pg_schema}.jobs SET overdue_at = now() - interval '1 minute', "
            "consecutive_failures = 3, last_outcome = 'failure'"
        )
        await conn.close()

    asyncio.run(late())
    overdue = cli("status", "--dsn", pg_dsn, "--schema", pg_schema)
    assert overdue.returncode == 1 and "OVERDUE" in overdue.stdout
    bad = cli("status", "--dsn", f"postgresql://u:sekret@127.0.0.1:{free_port()}/x")
    assert bad.returncode == 2 and "sekret" not in bad.stderr + bad.stdout


@pytest.mark.postgres
def test_watermark_example_counts_each_window_once(pg_dsn: str) -> None:
    import asyncio

    import asyncpg

    database = f"ex_{uuid.uuid4().hex[:10]}"
    dsn = pg_dsn.rsplit("/", 1)[0] + "/" + database

    async def scenario() -> list[Any]:
        admin = await asyncpg.connect(pg_dsn)
        await admin.execute(f"CREATE DATABASE {database}")
        await admin.close()
        conn = await asyncpg.connect(dsn)
        await conn.execute(
            "CREATE TABLE usage (account_id int, amount int, recorded_at timestamptz);"
            "CREATE TABLE usage_totals (account_id int, window_end timestamptz, amount int)"
        )
        past = datetime.now(timezone.utc) - timedelta(hours=1)
        await conn.executemany(
            "INSERT INTO usage VALUES ($1, $2, $3)", [(1, 5, past), (1, 7, past), (2, 1, past)]
        )
        os.environ["TICKLOCK_DSN"] = dsn
        try:
            sys.path.insert(0, str(EXAMPLES))
            import watermark  # type: ignore[import-not-found]

            async def run_now() -> Any:  # the scheduled tick at start may hold the lock
                for _ in range(200):
                    result = await watermark.scheduler.run_now("usage-totals")
                    if result.outcome != "locked":
                        return result
                    await asyncio.sleep(0.05)
                raise AssertionError("the job stayed locked")

            async with watermark.scheduler:
                first = await run_now()
                await conn.execute("INSERT INTO usage VALUES (2, 10, now())")
                second = await run_now()
        finally:
            sys.path.remove(str(EXAMPLES))
            os.environ.pop("TICKLOCK_DSN", None)
        rows = await conn.fetch(
            "SELECT account_id, sum(amount) AS total FROM usage_totals GROUP BY 1 ORDER BY 1"
        )
        await conn.close()
        return [first.report, second.report, [tuple(r) for r in rows]]

    first, second, totals = asyncio.run(scenario())
    assert first["accounts"] in (0, 2) and second == {"accounts": 1}
    assert totals == [(1, 12), (2, 11)]  # every row counted exactly once
