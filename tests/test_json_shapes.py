"""One JSON shape: ``ticklock status --json``, ``history --json`` and ``slots --json`` print what
the dashboard's ``/api/jobs``, ``/api/jobs/{id}/runs`` and ``/api/jobs/{id}/slots`` answer,
over the same fleet, with ``job_id`` in every record of a job."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

import ticklock._operators.cli.fleet
import ticklock._operators.cli.ledger
from test_dashboard import MemoryFleet, call, ledger, sample_fleet, serve
from ticklock._operators.cli import main
from ticklock._operators.dashboard import create_app


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> MemoryFleet:
    """The dashboard tests' sample fleet with a ledger, as the CLI's fleet too."""
    fleet = sample_fleet()
    fleet._slots["purge-expired"] = ledger("purge-expired")

    @asynccontextmanager
    async def open_fleet(args: argparse.Namespace) -> AsyncIterator[MemoryFleet]:
        yield fleet

    monkeypatch.setattr(ticklock._operators.cli.fleet, "open_fleet", open_fleet)
    monkeypatch.setattr(ticklock._operators.cli.ledger, "open_fleet", open_fleet)
    return fleet


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    """What ``ticklock *argv --json`` prints, as JSON."""
    assert main([*argv, "--json", "--dsn", "postgresql://db/x"]) in (0, 1)  # 1: an alarm
    return json.loads(capsys.readouterr().out)


def keys(value: Any) -> Any:
    """The shape of a JSON value: every object's keys, recursively; lists by their first."""
    if isinstance(value, dict):
        return {key: keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return None


def test_the_cli_prints_what_the_dashboard_answers(
    fleet: MemoryFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    status = printed(capsys, "status")
    history = printed(capsys, "history", "purge-expired", "--limit", "100")
    slots = printed(capsys, "slots", "purge-expired", "--since", "24h")
    with serve(create_app(fleet)) as base:
        jobs = call(base + "/api/jobs").json()
        runs = call(base + "/api/jobs/purge-expired/runs").json()
        owed = call(base + "/api/jobs/purge-expired/slots?window=24h").json()
        replicas = call(base + "/api/replicas").json()

    # status: /api/jobs, and the replicas as /api/replicas gives them
    assert status == {**jobs, "replicas": replicas["replicas"]}
    assert history == runs  # the reports and errors here are short: nothing cut
    assert keys(slots) == keys(owed) and slots["slots"] == owed["slots"]
    assert set(slots) == {"job_id", "since", "until", "slots"}

    # job_id in every record of a job, the same name everywhere
    assert all(job["job_id"] for job in status["jobs"])
    assert {run["job_id"] for run in history["runs"]} == {"purge-expired"}
    assert {slot["job_id"] for slot in slots["slots"]} == {"purge-expired"}
    ran = [slot["run"] for slot in slots["slots"] if slot["run"] is not None]
    assert ran and all(set(run) == set(history["runs"][0]) for run in ran)
