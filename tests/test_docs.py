"""The documentation's code stays true: its examples run."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import pytest

from helpers import eventually

DOCS = Path(__file__).parent.parent / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def test_the_testing_page_example_passes() -> None:
    namespace: dict[str, Any] = {"__name__": "docs_testing_example"}
    exec(python_blocks("testing.md")[0], namespace)
    anyio.run(namespace["test_nightly_runs_at_0317_berlin_time"])


def test_the_testing_page_failover_example_passes() -> None:
    [block] = [b for b in python_blocks("testing.md") if "MemoryDatabase()" in b]
    namespace: dict[str, Any] = {"__name__": "docs_testing_failover"}
    exec(block, namespace)
    anyio.run(namespace["test_the_other_replica_stands_in_for_a_frozen_one"])


def test_the_testing_page_batched_example_passes() -> None:
    [block] = [b for b in python_blocks("testing.md") if "ctx.batches()" in b]
    namespace: dict[str, Any] = {"__name__": "docs_testing_batches"}
    exec(block, namespace)
    anyio.run(namespace["test_the_sweep_is_capped_and_the_next_run_goes_on_from_the_cursor"])


def test_the_lifecycle_page_example_runs_as_written() -> None:
    [block] = python_blocks("lifecycle.md")
    exec(block, {"__name__": "docs_lifecycle"})  # it runs itself (anyio.run) and asserts


def test_the_readme_gives_the_commands_ci_runs_byte_for_byte() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    ci = (DOCS.parent / ".ci" / "run").read_text().strip().splitlines()
    venv = "python3 -m venv .venv && "
    tests = venv + ".venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -n 2"
    demo = venv + ".venv/bin/pip install -e . && .venv/bin/python -m ticklock demo"
    assert ci[-1] == tests  # CI ends with the test command as the README gives it
    commands = re.findall(r"```sh\n(.*?)\n```", readme, flags=re.S)
    assert commands[:2] == [demo, tests]  # the first two commands a reader meets


def test_the_readme_example_is_the_file_mypy_checks() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    example = readme.split("## Quick start\n", 1)[1]
    block = re.findall(r"```python\n(.*?)```", example, flags=re.S)[0]
    checked = Path(__file__).parent / "typing" / "readme_example.py"
    assert block == checked.read_text()  # `mypy --strict tests/typing` checks that file


@pytest.mark.postgres
def test_the_testing_page_run_job_example_passes_under_pytest(tmp_path: Path, pg_dsn: str) -> None:
    # Run as a user would: the page's myapp/jobs.py and tests/test_jobs.py, collected by
    # pytest (annotations such as asyncpg.Connection[Any] are evaluated there), with a
    # `conn` fixture of one's own and the `keys` table the job purges.
    [jobs, test] = [b for b in python_blocks("testing.md") if "purge" in b]
    assert jobs.startswith("# myapp/jobs.py\n") and test.startswith("# tests/test_jobs.py\n")
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(jobs)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_jobs.py").write_text(test)
    (tmp_path / "tests" / "conftest.py").write_text(
        "import asyncpg\nimport pytest\n\n\n"
        "@pytest.fixture\n"
        "async def conn():\n"
        f"    conn = await asyncpg.connect({pg_dsn!r})\n"
        "    await conn.execute('CREATE TEMP TABLE keys (expires_at timestamptz NOT NULL)')\n"
        "    yield conn\n"
        "    await conn.close()\n"
    )
    src = str(DOCS.parent / "src")
    env = {k: v for k, v in os.environ.items() if k != "TICKLOCK_DSN"}
    env["PYTHONPATH"] = os.pathsep.join([src, str(tmp_path)])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_jobs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout


def test_the_reference_shows_the_defaults_job_declare_uses() -> None:
    # The API page lists job()'s keywords with defaults that the TypedDict cannot carry: the
    # extension's table of them must be what a declaration without the keyword gets.
    import ast
    import importlib.util

    from ticklock import JobOptions, every
    from ticklock._schedule.job import Job

    path = DOCS / "reference" / "rst_docstrings.py"
    spec = importlib.util.spec_from_file_location("rst_docstrings", path)
    assert spec is not None and spec.loader is not None
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    defaults = {k: ast.literal_eval(v) for k, v in extension.JOB_OPTION_DEFAULTS.items()}
    assert list(defaults) == list(JobOptions.__annotations__)

    async def handler(ctx: Any) -> None: ...

    plain = Job.declare(handler, every(3600))
    spelled = Job.declare(handler, every(3600), **defaults)
    fields = list(defaults)  # Job's fields carry the keywords' names
    assert [getattr(spelled, f) for f in fields] == [getattr(plain, f) for f in fields]


def test_the_logging_snippets_run_as_written() -> None:
    # each snippet on its own, in a fresh namespace: no name it uses is left unimported
    import logging

    root, ours = logging.getLogger(), logging.getLogger("ticklock")
    saved = (list(root.handlers), root.level, list(ours.handlers), ours.level)
    pages = [DOCS.parent / "README.md", DOCS / "observability.md"]
    snippets = [
        block
        for page in pages
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        if ("basicConfig" in block or "log_to_stderr" in block) and "FastAPI" not in block
    ]
    assert len(snippets) == 4, snippets
    try:
        for snippet in snippets:
            exec(snippet, {"__name__": "docs_logging_snippet"})
    finally:
        root.handlers[:], ours.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        ours.setLevel(saved[3])


@pytest.mark.anyio
@pytest.mark.postgres
async def test_the_sqlalchemy_page_app_runs_as_written(
    pg_dsn: str, pg_conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    [block] = [b for b in python_blocks("sqlalchemy.md") if b.startswith("# app.py\n")]
    ours = logging.getLogger("ticklock")  # the page's log_to_stderr() is this test's alone
    monkeypatch.setattr(ours, "handlers", list(ours.handlers))
    monkeypatch.setattr(ours, "level", ours.level)
    database = f"docs_{uuid.uuid4().hex[:12]}"
    await pg_conn.execute(f"CREATE DATABASE {database}")
    monkeypatch.setenv("DATABASE_URL", urlunsplit(urlsplit(pg_dsn)._replace(path=database)))
    namespace: dict[str, Any] = {"__name__": "docs_sqlalchemy_app"}
    try:  # compiled as its own file (app.py): without this module's __future__ import
        exec(compile(block, "app.py", "exec", dont_inherit=True), namespace)
        scheduler = namespace["scheduler"]
        async with namespace["lifespan"](namespace["app"]):

            async def first_digest() -> bool:  # the first slot runs at start
                return bool(await namespace["digests"]())

            await eventually(first_digest, 20, "the first digest")
            assert [d["signups"] for d in await namespace["digests"]()] == [0]
            await namespace["signup"]("a@example.com")
            await namespace["signup"]("b@example.com")
            result = await scheduler.run_now("signup-digest")
            assert result.outcome.value == "success", result.error
            assert result.report == {"signups": 2}
            assert [d["signups"] for d in await namespace["digests"]()] == [0, 2]
    finally:
        await pg_conn.execute(f"DROP DATABASE {database} WITH (FORCE)")


@pytest.mark.anyio
@pytest.mark.asyncio_only
async def test_the_schedules_page_app_runs_as_written_under_uvicorn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json
    import socket
    import urllib.request

    import uvicorn

    [block] = [b for b in python_blocks("schedules.md") if b.startswith("# app.py\n")]
    monkeypatch.delenv("DATABASE_URL", raising=False)  # local mode, as the page says
    namespace: dict[str, Any] = {"__name__": "docs_schedules_app"}
    exec(compile(block, "app.py", "exec", dont_inherit=True), namespace)
    scheduler, sent = namespace["scheduler"], namespace["sent"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(namespace["app"], host="127.0.0.1", port=port, log_level="warning")
    )

    def call(method: str, path: str) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)

        async def serving() -> bool:
            return bool(server.started)

        await eventually(serving, 20, "uvicorn serving the app")
        path = "/tenants/acme/report?hour=8&tz=America/New_York"
        first = await anyio.to_thread.run_sync(call, "PUT", path)
        assert first == {
            "id": "report:acme",
            "version": 1,
            "schedule": "cron '0 8 * * 1-5' America/New_York",
        }
        assert (await anyio.to_thread.run_sync(call, "PUT", path))["version"] == 1  # unchanged
        later = await anyio.to_thread.run_sync(call, "PUT", "/tenants/acme/report?hour=9")
        assert later["version"] == 2
        stored = await scheduler.schedules.get("report:acme")
        assert (stored.tenant, dict(stored.args)) == ("acme", {"tenant": "acme"})
        result = await scheduler.run_now("report:acme")  # the task runs with the args
        assert result.report == {"sent_to": "acme"} and sent[-1]["tenant"] == "acme"
        gone = await anyio.to_thread.run_sync(call, "DELETE", "/tenants/acme/report")
        assert gone == {"deleted": True}
        assert await scheduler.schedules.list(tenant="acme") == []
        server.should_exit = True
