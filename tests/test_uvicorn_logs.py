"""ticklock's run lines show under a real uvicorn server, configured as the docs say.

uvicorn configures only its own loggers, so without one of these a user sees nothing from
ticklock. Each variant runs a tiny FastAPI app (local mode, an ``every(seconds=1)`` job) in a
uvicorn process on 127.0.0.1 and waits, with a deadline, for the job's run line on stderr.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
APP = """\
import logging

from fastapi import FastAPI

import ticklock
from ticklock import JobContext, Scheduler, every

{setup}

scheduler = Scheduler()


@scheduler.job(every(seconds=1), id="heartbeat")
async def heartbeat(ctx: JobContext) -> dict[str, int]:
    return {{"beats": 1}}


app = FastAPI(lifespan=scheduler.lifespan)
"""


def documented_log_config(page: Path) -> str:
    """The uvicorn ``--log-config`` JSON given on ``page``."""
    found: list[str] = re.findall(r"```json\n(.*?)```", page.read_text(), flags=re.S)
    blocks = [block for block in found if "ticklock" in block]
    assert len(blocks) == 1, f"{page.name}: expected one JSON log config, found {len(blocks)}"
    return blocks[0]


def test_the_readme_and_the_observability_page_give_the_same_log_config() -> None:
    readme = documented_log_config(ROOT / "README.md")
    assert readme == documented_log_config(ROOT / "docs" / "observability.md")
    assert json.loads(readme)["loggers"]["ticklock"]["level"] == "INFO"


def start(tmp: Path, setup: str, *uvicorn_args: str) -> subprocess.Popen[str]:
    tmp.mkdir()
    (tmp / "app.py").write_text(APP.format(setup=setup))
    argv = [sys.executable, "-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port", "0"]
    return subprocess.Popen(
        [*argv, *uvicorn_args],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def lines_of(proc: subprocess.Popen[str]) -> tuple[queue.Queue[str], threading.Thread]:
    """The server's stderr, line by line, read by a thread (so waits can have a deadline)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def wait_for(
    proc: subprocess.Popen[str], lines: queue.Queue[str], needles: list[str], within: float
) -> str:
    """Everything the server wrote until each of ``needles`` has appeared in some line."""
    seen: list[str] = []
    missing = list(needles)
    deadline = time.monotonic() + within
    while missing and (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        missing = [needle for needle in missing if needle not in line]
    if missing:
        raise AssertionError(
            f"no {missing} within {within} s (exit {proc.poll()}):\n{''.join(seen)}"
        )
    return "".join(seen)


def stop(proc: subprocess.Popen[str], reader: threading.Thread | None) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    if reader is not None:
        reader.join(timeout=5)  # EOF once the server has exited
    assert proc.stderr is not None
    proc.stderr.close()


@pytest.mark.timeout(60)
def test_run_lines_show_under_uvicorn_as_documented(tmp_path: Path) -> None:
    config = tmp_path / "logging.json"
    config.write_text(documented_log_config(ROOT / "docs" / "observability.md"))
    # started together, so that the imports of the three servers overlap
    variants = {
        "--log-config": start(tmp_path / "a", "", "--log-config", str(config)),
        "log_to_stderr": start(tmp_path / "b", "ticklock.log_to_stderr()"),
        "basicConfig": start(tmp_path / "c", "logging.basicConfig(level=logging.INFO)"),
    }
    expected = {
        # the documented formats: "%(levelname)s %(name)s: %(message)s", and basicConfig's own
        "--log-config": r" INFO ticklock: run heartbeat slot=\S+ outcome=success ",
        "log_to_stderr": r" INFO ticklock: run heartbeat slot=\S+ outcome=success ",
        "basicConfig": r"^INFO:ticklock:run heartbeat slot=\S+ outcome=success ",
    }
    readers: dict[str, tuple[queue.Queue[str], threading.Thread]] = {}
    try:
        readers.update({name: lines_of(proc) for name, proc in variants.items()})
        for name, proc in variants.items():
            # uvicorn's own lines go on as before, beside ticklock's
            out = wait_for(
                proc, readers[name][0], ["run heartbeat slot=", "Application startup complete"], 30
            )
            run_line = next(line for line in out.splitlines() if "run heartbeat slot=" in line)
            assert re.search(expected[name], run_line), (name, run_line)
            assert 'report={"beats": 1}' in run_line
            assert "ticklock: ticklock" not in run_line and "ticklock:ticklock" not in run_line
    finally:
        for name, proc in variants.items():
            stop(proc, readers[name][1] if name in readers else None)
