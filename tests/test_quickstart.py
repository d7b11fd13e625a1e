"""The quick start, as README.md and docs/index.md give it, run verbatim: the same text in both,
its `main.py` under real uvicorn servers in local mode and as two replicas on PostgreSQL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from test_integrations import free_port

ROOT = Path(__file__).parent.parent
SRC = ROOT / "src"
# a run line of the quick start's job, as the page shows it and as uvicorn's stderr has it
RUN = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ticklock: run heartbeat slot=(\S+) "
    r'outcome=success duration=\S+s report=\{"owner": "([^"]+)"\}$',
    flags=re.M,
)


def quick_start(path: Path) -> str:
    """The page's `## Quick start` section, up to the next heading of its level."""
    text = path.read_text()
    section = text.split("\n## Quick start\n", 1)[1]
    return "## Quick start\n" + section.split("\n## ", 1)[0]


def blocks(section: str, language: str) -> list[str]:
    """The section's fenced blocks in ``language`` (``""``: the unlabelled ones)."""
    fenced = re.findall(r"^```(\w*)\n(.*?)^```$", section, flags=re.M | re.S)
    return [body for lang, body in fenced if lang == language]


SECTION = quick_start(ROOT / "README.md")


def test_the_readme_and_the_getting_started_page_give_the_same_quick_start() -> None:
    assert quick_start(ROOT / "docs" / "index.md") == SECTION


def test_the_expected_output_is_a_line_the_job_logs() -> None:
    [expected] = [b for b in blocks(SECTION, "") if "ticklock: run" in b]
    assert RUN.fullmatch(expected.strip()), expected


def app_dir(tmp_path: Path) -> Path:
    [main] = blocks(SECTION, "python")
    (tmp_path / "main.py").write_text(main)
    return tmp_path


def env(dsn: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TICKLOCK_DSN"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    if dsn is not None:
        env["TICKLOCK_DSN"] = dsn
    return env


def replica_ports() -> list[str]:
    """The ports of the page's `uvicorn main:app --port N` commands (the test runs each on a
    free port instead: the page's may be taken on this machine)."""
    [commands] = [b for b in blocks(SECTION, "sh") if "uvicorn" in b]
    lines = commands.strip().splitlines()
    ports = [re.fullmatch(r"uvicorn main:app --port (\d+)", line) for line in lines]
    assert all(ports), lines
    return [m.group(1) for m in ports if m]


class Replica:
    """`uvicorn main:app` in a process of its own, its stderr (where the runs are logged)
    collected by a thread."""

    def __init__(self, cwd: Path, dsn: str | None) -> None:
        argv = [sys.executable, "-m", "uvicorn", "main:app", "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*argv, "--port", str(free_port())],
            cwd=cwd,
            env=env(dsn),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.append(line)

    def read(self) -> str:
        return "".join(list(self._lines))

    def runs(self) -> list[tuple[str, str]]:
        return RUN.findall(self.read())

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C
            self.proc.wait(timeout=20)
        self._reader.join(timeout=5)
        return self.read()


@contextmanager
def replicas(cwd: Path, dsn: str | None, n: int) -> Iterator[list[Replica]]:
    started = [Replica(cwd, dsn) for _ in range(n)]
    try:
        yield started
    finally:
        for replica in started:
            if replica.proc.poll() is None:
                replica.proc.kill()
            replica.proc.wait()
            replica._reader.join(timeout=5)
            assert replica.proc.stderr is not None
            replica.proc.stderr.close()


def until(check: Any, what: str, within: float, fleet: list[Replica]) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            logs = "\n---\n".join(r.read() for r in fleet)
            raise AssertionError(f"{what} did not happen within {within} s:\n{logs}")
        time.sleep(0.1)


def test_the_quick_start_runs_in_local_mode_and_lists_its_jobs_without_a_database(
    tmp_path: Path,
) -> None:
    cwd = app_dir(tmp_path)
    listing = subprocess.run(
        [sys.executable, "-m", "ticklock", "jobs", "main:scheduler"],
        cwd=cwd,
        env=env(None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listing.returncode == 0, listing.stderr
    assert "heartbeat" in listing.stdout, listing.stdout
    with replicas(cwd, None, 1) as [replica]:
        until(lambda: replica.runs(), "a run in local mode", 30, [replica])
        out = replica.stop()
    assert "Traceback" not in out, out


@pytest.mark.postgres
def test_the_quick_start_runs_once_per_slot_on_two_replicas_and_fails_over(
    tmp_path: Path, pg_dsn: str
) -> None:
    assert len(replica_ports()) == 2
    database = f"qs_{uuid.uuid4().hex[:10]}"
    dsn = pg_dsn.rsplit("/", 1)[0] + "/" + database
    [create_table] = blocks(SECTION, "sql")

    async def setup() -> None:
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'CREATE DATABASE "{database}"')
        finally:
            await admin.close()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(create_table)
        finally:
            await conn.close()

    async def rows() -> list[tuple[str, str]]:
        conn = await asyncpg.connect(dsn)
        try:
            found = await conn.fetch("SELECT slot, owner FROM heartbeats ORDER BY slot")
        finally:
            await conn.close()
        return [(r["slot"].isoformat(), r["owner"]) for r in found]

    async def drop() -> None:
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            await admin.close()

    anyio.run(setup)
    try:
        check_two_replicas(tmp_path, dsn, rows)
    finally:
        anyio.run(drop)


def check_two_replicas(tmp_path: Path, dsn: str, rows: Any) -> None:
    cwd = app_dir(tmp_path)
    with replicas(cwd, dsn, 2) as fleet:

        def runs() -> list[tuple[str, str]]:
            return [run for replica in fleet for run in replica.runs()]

        until(lambda: len(runs()) >= 3, "three runs", 40, fleet)
        # the owner: the replica that logged the latest run
        latest = max(runs())
        [owner] = [r for r in fleet if latest in r.runs()]
        [other] = [r for r in fleet if r is not owner]
        before = len(other.runs())
        owner.stop()
        until(lambda: len(other.runs()) > before, "a run on the other replica", 20, fleet)
        other.stop()
        logged = runs()
    slots = [slot for slot, _ in logged]
    assert len(slots) == len(set(slots)), logged  # each slot ran once, on one replica
    stored = anyio.run(rows)
    # one row per run logged, written by the replica that logged it
    assert sorted(o for _, o in stored) == sorted(o for _, o in logged), (stored, logged)
    assert len({o for _, o in stored}) == 2  # the other replica took over
