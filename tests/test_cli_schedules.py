"""``ticklock schedules``: the stored schedules listed, paged and filtered, and deleted, on a
real PostgreSQL."""

from __future__ import annotations

import json

import anyio.to_thread
import pytest

from ticklock import JobContext, Scheduler, cron
from ticklock._operators.cli import main

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


async def test_schedules_are_listed_paged_filtered_and_deleted_from_the_cli(
    pg_dsn: str, pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    scheduler = Scheduler(pg_dsn, schema=pg_schema, owner="app")

    @scheduler.task("report")
    async def report(ctx: JobContext) -> None: ...

    async with scheduler:
        for i in range(5):
            await scheduler.schedules.put(
                f"report:t{i}", task="report", trigger=cron("0 9 * * *"), tenant=f"t{i % 2}"
            )
    base = ["--dsn", pg_dsn, "--schema", pg_schema]

    async def cli(*argv: str) -> tuple[int, str, str]:
        """main() runs its own event loop: in a worker thread, beside this test's."""
        code = await anyio.to_thread.run_sync(main, [*argv, *base])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await cli("schedules", "--tenant", "t0")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["schedule", "task", "tenant", "version"]
    assert [line.split()[0] for line in lines[1:]] == ["report:t0", "report:t2", "report:t4"]
    assert "cron '0 9 * * *' UTC" in lines[1]
    code, out, _ = await cli("schedules", "--limit", "2", "--json")
    page = json.loads(out)
    assert [s["id"] for s in page["schedules"]] == ["report:t0", "report:t1"]
    assert page["after"] == "report:t1" and page["schedules"][0]["version"] == 1
    code, out, _ = await cli("schedules", "--after", "report:t3", "--json")
    assert [s["id"] for s in json.loads(out)["schedules"]] == ["report:t4"]
    code, out, _ = await cli("schedules", "delete", "report:t1", "--note", "churned")
    assert code == 0 and "deleted report:t1" in out
    code, out, err = await cli("schedules", "delete", "report:t1")
    assert code == 1 and "no stored schedule report:t1" in out + err
    code, out, _ = await cli("schedules", "--json")
    assert [s["id"] for s in json.loads(out)["schedules"]] == [
        "report:t0",
        "report:t2",
        "report:t3",
        "report:t4",
    ]
    code, out, _ = await cli("history", "report:t1")  # the history stays
    assert code == 0
    code, _, err = await cli("schedules", "--limit", "0")
    assert code == 2 and "--limit must be from 1 to 1000" in err
