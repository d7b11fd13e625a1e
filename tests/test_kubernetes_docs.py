"""docs/kubernetes.md stays true: its probes run verbatim in a real uvicorn server on
127.0.0.1, added to the quick start's main.py, and its manifests give the scheduler the time
its shutdown needs."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from test_integrations import until
from test_quickstart import SECTION, Replica, blocks, replicas

PAGE = (Path(__file__).parent.parent / "docs" / "kubernetes.md").read_text()


def fenced(language: str) -> list[str]:
    fences = re.findall(r"^```(\w*)\n(.*?)^```$", PAGE, flags=re.M | re.S)
    return [body for lang, body in fences if lang == language]


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# declared by the test after the page's code: a job that fails at every run, which never turns
# /jobz red (it is failing, not absent), and one whose run is deaf to its timeout for a while,
# so that no run of it finishes: that absence turns /jobz red, while /livez stays green
BROKEN = """

import anyio


@scheduler.job(every(seconds=1), timeout=0.5, id="broken")
async def broken(ctx: JobContext) -> None:
    raise RuntimeError("broken on purpose")


@scheduler.job(every(seconds=1), timeout=0.5, id="stuck")
async def stuck(ctx: JobContext) -> None:
    with anyio.CancelScope(shield=True):
        await anyio.sleep(6)
"""


def port_of(replica: Replica) -> int:
    args = replica.proc.args
    assert isinstance(args, list)
    return int(args[args.index("--port") + 1])


def test_the_probes_answer_as_the_page_says_under_uvicorn(tmp_path: Path) -> None:
    [probes] = fenced("python")
    assert probes.startswith("# main.py, after the quick start's code\n")
    [main] = blocks(SECTION, "python")
    (tmp_path / "main.py").write_text(main + "\n\n" + probes + BROKEN)
    with replicas(tmp_path, None, 1) as [replica]:
        base = f"http://127.0.0.1:{port_of(replica)}"

        def serving() -> bool:
            try:
                return get(base + "/livez")[0] == 200
            except OSError:
                return False

        until(serving, "uvicorn serving /livez", within=30)
        assert get(base + "/jobz") == (200, {"overdue": []})
        # stuck: every(1), timeout 0.5 s, grace 1 s, its first run still going: overdue 2.5 s
        # after start; broken, whose runs fail every second meanwhile, is not
        red = (503, {"overdue": ["stuck"]})
        until(lambda: get(base + "/jobz") == red, "/jobz turning 503", within=15)
        assert get(base + "/livez") == (200, {"ok": True})  # liveness ignores the jobs
        out = replica.stop()
    assert "outcome=failure" in out and "run heartbeat" in out, out


def test_the_manifests_give_the_shutdown_its_time() -> None:
    yaml = pytest.importorskip("yaml")
    deployment, cronjob = (yaml.safe_load(b) for b in fenced("yaml"))
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    command = container["command"]
    drain = int(command[command.index("--timeout-graceful-shutdown") + 1])
    shutdown_grace = 30  # Scheduler's default, as the page says
    assert pod["terminationGracePeriodSeconds"] > drain + shutdown_grace + 10
    paths = re.findall(r'@app\.get\("([^"]+)"\)', fenced("python")[0])
    assert container["livenessProbe"]["httpGet"]["path"] in paths
    assert container["readinessProbe"]["httpGet"]["path"] in paths
    [status] = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert status["command"] == ["ticklock", "status", "--fail-on", "overdue"]
    secret = {"secretKeyRef": {"name": "web-db", "key": "dsn"}}
    for env in (container["env"], status["env"]):
        assert env == [{"name": "TICKLOCK_DSN", "valueFrom": secret}]
