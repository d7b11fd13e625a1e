"""The documentation's code stays true: its examples run."""

from __future__ import annotations

import re
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


def test_the_getting_started_jobs_module_declares_cleanly() -> None:
    namespace: dict[str, Any] = {"__name__": "docs_index_example"}
    exec(python_blocks("index.md")[0], namespace)
    assert list(namespace["scheduler"].jobs) in (
        ["purge-expired"],
        ["purge-expired", "ticklock.retention"],
    )


def test_the_readme_gives_the_commands_ci_runs_byte_for_byte() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    ci = (DOCS.parent / ".ci" / "run").read_text().strip().splitlines()
    venv = "python3 -m venv .venv && "
    tests = venv + ".venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    demo = venv + ".venv/bin/pip install -e . && .venv/bin/python -m ticklock demo"
    assert ci[-1] == tests  # CI ends with the test command as the README gives it
    commands = re.findall(r"```sh\n(.*?)\n```", readme, flags=re.S)
    assert commands[:2] == [demo, tests]  # the first two commands a reader meets


def test_the_readme_example_is_the_file_mypy_checks() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    example = readme.split("## In 30 seconds\n", 1)[1]
    block = re.findall(r"```python\n(.*?)```", example, flags=re.S)[0]
    checked = Path(__file__).parent / "typing" / "readme_example.py"
    assert block == checked.read_text()  # `mypy --strict tests/typing` checks that file


@pytest.mark.anyio
@pytest.mark.postgres
async def test_the_sqlalchemy_page_app_runs_as_written(
    pg_dsn: str, pg_conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    [block] = [b for b in python_blocks("sqlalchemy.md") if b.startswith("# app.py\n")]
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
