"""Helpers shared by the tests."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import pytest

from ticklock import Scheduler
from ticklock.testing import ManualClock

UTC = timezone.utc
TESTS = Path(__file__).parent
PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None
)


@dataclass
class Seen:
    job_id: str
    slot: str
    outcome: str
    error: str | None


class RunLog(logging.Handler):
    """Collects the one log record ticklock writes per tick attempt."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.runs: list[Seen] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "outcome"):
            self.runs.append(
                Seen(
                    record.__dict__["job_id"],
                    record.__dict__["slot"],
                    record.__dict__["outcome"],
                    record.__dict__["error"],
                )
            )

    def outcomes(self, job_id: str) -> list[str]:
        return [r.outcome for r in self.runs if r.job_id == job_id]


@contextmanager
def run_log() -> Iterator[RunLog]:
    logger = logging.getLogger("ticklock")
    handler = RunLog()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await anyio.sleep(0.05)


def add_lock_holder(scheduler: Scheduler, entered: anyio.Event, gate: anyio.Event) -> None:
    """Declare job "shared": its run signals ``entered`` and holds the lock until ``gate``."""
    from ticklock import JobContext, every

    @scheduler.job(every(3600), id="shared")
    async def shared(ctx: JobContext) -> None:
        entered.set()
        await gate.wait()


# --- replica processes -------------------------------------------------------------------------


@dataclass
class Result:
    """What a ``ticklock`` command said."""

    code: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.code}\nstdout:\n{self.out}\nstderr:\n{self.err}"

    def json(self) -> Any:
        return json.loads(self.out)


_PREFIXES = {"ops_app": "OPS", "replica_app": "REPLICA", "contract_app": "CONTRACT"}
"""The prefix of the environment variables each test app reads its settings from."""


class Replicas:
    """Replica processes of a test app (``ticklock run <app>:scheduler``) in one schema, and the
    ``ticklock`` command on that schema.

    ``app`` is ``ops_app`` (configured by ``OPS_*`` variables) or ``replica_app``
    (``REPLICA_*``). Each replica writes its output to ``<tmp>/<owner>.log`` and may touch its
    :meth:`marker` (``replica_app`` does when a handler holds its lock).
    """

    def __init__(self, dsn: str, schema: str, tmp: Path, app: str = "ops_app") -> None:
        self.dsn, self.schema, self.tmp, self.app = dsn, schema, tmp, app
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(
        self, owner: str, scenario: str, dsn: str | None = None, **settings: str
    ) -> dict[str, str]:
        """The environment of replica ``owner``: the app's ``SCENARIO``, ``OWNER``, ``SCHEMA``,
        ``MARKER``, ``DSN`` (if given) and each of ``settings`` (``fail="1"`` is ``OPS_FAIL``)."""
        env = dict(os.environ)
        env.pop("TICKLOCK_DSN", None)
        named = {"scenario": scenario, "owner": owner, "schema": self.schema}
        named["marker"] = str(self.marker(owner))
        if dsn is not None:
            named["dsn"] = dsn
        named.update(settings)
        prefix = _PREFIXES[self.app]
        env.update({f"{prefix}_{name.upper()}": value for name, value in named.items()})
        # the caller's path first: the replicas run the ticklock under test
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
        return env

    def popen(
        self, owner: str, argv: list[str], env: dict[str, str], **options: Any
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` as replica ``owner``, its output appended to its log."""
        with open(self.tmp / f"{owner}.log", "ab") as out:  # the child keeps its own fd
            proc = subprocess.Popen(
                argv, cwd=TESTS, env=env, stdout=out, stderr=subprocess.STDOUT, **options
            )
        self.procs[owner] = proc
        return proc

    def start(
        self,
        owner: str,
        scenario: str,
        *,
        dsn: str | None = None,
        log_level: str = "INFO",
        **settings: str,
    ) -> subprocess.Popen[bytes]:
        """``ticklock run <app>:scheduler`` as replica ``owner``, on ``dsn`` (by default the
        harness's), with :meth:`env`'s variables."""
        argv = [sys.executable, "-m", "ticklock", "run", f"{self.app}:scheduler", "--dsn"]
        argv += [self.tagged(dsn or self.dsn), "--log-level", log_level]
        return self.popen(owner, argv, self.env(owner, scenario, **settings))

    def tagged(self, dsn: str) -> str:
        """``dsn`` with ``application_name`` = the schema: this test's sessions in
        ``pg_stat_activity`` (PgBouncer passes the name on to its server sessions)."""
        parts = urlsplit(dsn)
        query = urlencode([*parse_qsl(parts.query), ("application_name", self.schema)])
        return urlunsplit(parts._replace(query=query))

    def marker(self, owner: str) -> Path:
        return self.tmp / f"{owner}.marker"

    async def wait_marker(self, owner: str, what: str) -> None:
        """Wait until ``owner``'s handler touched its marker (it holds the lock)."""
        marker = self.marker(owner)

        async def touched() -> bool:
            return marker.exists()

        await eventually(touched, 20, what)

    def output(self, owner: str) -> str:
        return (self.tmp / f"{owner}.log").read_text()

    def stop(self, owner: str) -> int:
        """SIGTERM (after a SIGCONT, should the test have stopped it); its exit status."""
        proc = self.procs[owner]
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=20)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    async def cli(
        self, *args: str, dsn: str | None = None, env: dict[str, str] | None = None
    ) -> Result:
        """``python -m ticklock ARGS --schema SCHEMA --dsn DSN`` (no ``--dsn`` if ``env`` has
        ``TICKLOCK_DSN``)."""
        argv = [sys.executable, "-m", "ticklock", *args, "--schema", self.schema]
        environ = dict(os.environ)
        environ.pop("TICKLOCK_DSN", None)
        environ.update(env or {})
        if "TICKLOCK_DSN" not in environ:
            argv += ["--dsn", dsn or self.dsn]
        done = await anyio.run_process(argv, check=False, env=environ)
        result = Result(done.returncode, done.stdout.decode(), done.stderr.decode())
        assert "Traceback" not in result.err, result
        return result


class SteppingClock(ManualClock):
    """A ManualClock whose wall clock can step (NTP, a VM resume): ``offset`` seconds are added
    to ``now()``; ``monotonic()`` and the sleepers do not see it."""

    def __init__(self, start: datetime) -> None:
        super().__init__(start)
        self.offset = 0.0

    def now(self) -> datetime:
        return super().now() + timedelta(seconds=self.offset)


EACH_BACKEND = pytest.mark.parametrize(
    ("anyio_backend", "kind"),
    [
        ("asyncio", "memory"),
        ("trio", "memory"),
        pytest.param("asyncio", "postgres", marks=pytest.mark.postgres),
    ],
    indirect=["anyio_backend"],
)
"""A test on each backend: memory (on asyncio and trio) and PostgreSQL (asyncio); it takes
``kind``."""
