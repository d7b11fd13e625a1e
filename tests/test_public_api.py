"""The public names: __all__ matches what the package exports, and the contract's names exist."""

from __future__ import annotations

import subprocess
import sys

import ticklock
import ticklock.testing


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in dir(ticklock) if not name.startswith("_")}
    modules = {"sqlalchemy", "testing"}  # submodules become attributes once imported
    assert set(ticklock.__all__) - {"__version__"} == public - modules
    for name in set(ticklock.__all__) - {"__version__", "Clock"}:
        assert getattr(ticklock, name).__module__.startswith("ticklock._")


def test_contract_names() -> None:
    for name in ("Scheduler", "JobContext", "every", "cron", "ScheduleError", "lock_key"):
        assert name in ticklock.__all__
    assert ticklock.testing.__all__ == ("ManualClock", "MemoryDatabase", "ReplicaLost", "run_job")
    assert issubclass(ticklock.ScheduleError, ValueError)


def test_import_does_not_load_optional_weight() -> None:
    code = (
        "import sys, ticklock; "
        "print(sorted(m for m in ('asyncpg', 'fastapi', 'starlette', 'aiohttp', 'trio') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
