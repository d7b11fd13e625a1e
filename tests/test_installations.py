"""Two installations of ticklock in one database (two schemas) never share a lock, and a
rolling deploy from the previous release never runs a slot twice, nor two runs at once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from helpers import TESTS, Replicas, eventually, run_log
from ticklock import JobContext, Scheduler, every, lock_key

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

PREVIOUS = "122434f"
"""The previous release: it takes ``pg_try_advisory_xact_lock(lock_key(namespace, job_id))``."""


def test_the_key_of_a_job_in_a_schema_is_stable_and_is_not_the_legacy_key() -> None:
    key = lock_key("default", "purge-expired", schema="ticklock")
    assert key == -2983258773544367682  # blake2b of "ticklock\0default\0purge-expired"
    assert key != lock_key("default", "purge-expired")
    assert key != lock_key("default", "purge-expired", schema="other")
    assert lock_key("default", "purge-expired") == -5080253436944125446  # as every release


async def test_two_schemas_with_the_same_job_neither_lock_nor_end_each_other(
    pg_dsn: str, pg_conn: Any
) -> None:
    # A's runs hold the job 2.5 s; B's job of the same namespace and id has a 0.2 s timeout,
    # so B would take A's run for a frozen one after 2.2 s if it could see it
    schemas = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    a = Scheduler(pg_dsn, schema=schemas[0], owner="a")
    b = Scheduler(pg_dsn, schema=schemas[1], owner="b")
    long_runs: list[str] = []

    @a.job(every(5), id="j0", timeout=4)
    async def long(ctx: JobContext) -> None:
        await anyio.sleep(2.5)
        long_runs.append(ctx.owner)

    @b.job(every(0.3), id="j0", timeout=0.2)
    async def short(ctx: JobContext) -> None:
        pass

    with run_log() as log:
        async with a, b:

            async def a_succeeded() -> bool:
                return bool(long_runs) and "success" in log.outcomes("j0")

            await eventually(a_succeeded, 15, "the long run to succeed")
            await anyio.sleep(0.5)
    outcomes = log.outcomes("j0")
    assert long_runs == ["a"]
    assert "locked" not in outcomes and "error" not in outcomes, outcomes
    for schema, least in zip(schemas, (1, 5), strict=True):
        rows = await pg_conn.fetch(
            f"SELECT outcome, count(*) AS n FROM {schema}.runs WHERE job_id = 'j0' GROUP BY 1"
        )
        counts = {r["outcome"]: r["n"] for r in rows}
        assert "error" not in counts and counts.get("success", 0) >= least, (schema, counts)
    rows = await pg_conn.fetch(f"SELECT outcome FROM {schemas[0]}.runs WHERE job_id = 'j0'")
    assert [r["outcome"] for r in rows] == ["success"]  # the long run was never ended


def _previous_release(tmp: Path) -> Path:
    """The previous release's source (``src``), from the repository's history."""
    repo = TESTS.parent
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", PREVIOUS, "src"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.skip(
            f"the previous release ({PREVIOUS}) is not in this checkout's git history: "
            + archive.stderr.decode().strip()
        )
    old = tmp / "previous"
    old.mkdir()
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    return old / "src"


async def test_a_rolling_deploy_from_the_previous_release_runs_no_slot_twice_nor_two_at_once(
    fleet: Replicas, pg_conn: Any, tmp_path: Path
) -> None:
    old_src = _previous_release(tmp_path)
    s = fleet.schema
    await pg_conn.execute(
        f"CREATE TABLE {s}.ran (job text, slot timestamptz, owner text, "
        "started timestamptz, finished timestamptz)"
    )
    side = fleet.dsn

    def start_old(owner: str) -> None:
        env = fleet.env(owner, "deploy", side=side)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(old_src)])
        argv = [sys.executable, "-m", "ticklock", "run", "replica_app:scheduler", "--dsn"]
        fleet.popen(owner, [*argv, fleet.tagged(fleet.dsn), "--log-level", "INFO"], env)

    # old, old; then each old replica replaced by a new one, a second apart
    start_old("old1")
    start_old("old2")
    await anyio.sleep(3)
    fleet.start("new1", "deploy", side=side)
    await anyio.sleep(2)
    assert fleet.stop("old1") == 0, fleet.output("old1")
    fleet.start("new2", "deploy", side=side)
    await anyio.sleep(2)
    start_old("old3")  # a pod of the old release that comes back (a rollback, a restart)
    await anyio.sleep(2)
    assert fleet.stop("old2") == 0, fleet.output("old2")
    await anyio.sleep(1.5)
    for owner in ("old3", "new1", "new2"):
        assert fleet.stop(owner) == 0, fleet.output(owner)

    committed = await pg_conn.fetch(f"SELECT job, slot, owner FROM {s}.log ORDER BY job, slot")
    by_slot = [(r["job"], r["slot"]) for r in committed]
    assert len(by_slot) == len(set(by_slot)), "a slot committed twice"
    owners = {r["owner"] for r in committed}
    assert {owner[:3] for owner in owners} == {"old", "new"}, owners  # both releases ran jobs
    ran = await pg_conn.fetch(
        f"SELECT job, owner, started, coalesce(finished, started) AS finished "
        f"FROM {s}.ran ORDER BY job, started"
    )
    assert len(ran) >= 20
    for prev, cur in zip(ran, ran[1:], strict=False):
        if prev["job"] == cur["job"]:
            assert cur["started"] >= prev["finished"], (
                "two runs at once",
                tuple(prev),
                tuple(cur),
            )
