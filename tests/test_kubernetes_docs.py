"""docs/kubernetes.md stays true: its probes run verbatim in a real uvicorn server on
127.0.0.1, added to the quick start's main.py, and its manifests give the scheduler the time
its shutdown needs."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from test_integrations import until
from test_quickstart import SECTION, Replica, blocks, replicas
from test_quickstart import env as process_env

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
    assert "run stuck" in out and "run heartbeat" in out, out


def manifests() -> dict[tuple[str, str], Any]:
    """The page's manifests by kind and name."""
    yaml = pytest.importorskip("yaml")
    loaded = [yaml.safe_load(body) for body in fenced("yaml")]
    found = {(m["kind"], m["metadata"]["name"]): m for m in loaded}
    assert len(found) == len(loaded), "two manifests of one kind and name"
    return found


def test_the_manifests_give_the_shutdown_its_time() -> None:
    found = manifests()
    deployment, cronjob = found["Deployment", "web"], found["CronJob", "ticklock-absence"]
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


def pre_stop(container: dict[str, Any]) -> int:
    """The seconds a container's ``preStop`` hook sleeps (``sleep N`` or the sleep action)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def test_the_pre_stop_hook_is_counted_in_the_grace_period() -> None:
    found = manifests()
    shutdown_grace = 30
    for name in ("web", "web-jobs"):
        pod = found["Deployment", name]["spec"]["template"]["spec"]
        [web] = [c for c in pod["containers"] if c["name"] == "web"]
        drain = int(web["command"][web["command"].index("--timeout-graceful-shutdown") + 1])
        assert pre_stop(web) == 5
        hook = pre_stop(web)
        grace = pod["terminationGracePeriodSeconds"]
        if name == "web":  # the scheduler stops after the hook and the drain
            assert grace > hook + drain + shutdown_grace + 10
        else:  # the sidecar gets SIGTERM with the web container (no hook of its own)
            assert grace > max(hook + drain, shutdown_grace + 10)


def test_the_sidecar_runs_the_jobs_and_the_budget_covers_the_pods() -> None:
    found = manifests()
    pod = found["Deployment", "web-jobs"]["spec"]["template"]
    web, jobs = pod["spec"]["containers"]
    assert (web["name"], jobs["name"]) == ("web", "jobs")
    assert jobs["command"] == ["ticklock", "run", "jobs:scheduler"]
    assert jobs["image"] == web["image"]  # the same code, another process
    assert "env" not in web  # the web container runs no scheduler
    secret = {"secretKeyRef": {"name": "web-db", "key": "dsn"}}
    assert jobs["env"] == [{"name": "TICKLOCK_DSN", "valueFrom": secret}]
    assert "cpu" in jobs["resources"]["requests"] and "cpu" not in jobs["resources"]["limits"]
    for name in ("web", "web-jobs"):
        spec = found["Deployment", name]["spec"]
        assert (
            spec["selector"]["matchLabels"].items()
            <= spec["template"]["metadata"]["labels"].items()
        )
    main = found["Deployment", "web"]["spec"]["template"]["spec"]["containers"][0]
    assert "cpu" not in main["resources"]["limits"]  # the page says: no CPU limit
    budget = found["PodDisruptionBudget", "web"]["spec"]
    deployment = found["Deployment", "web"]["spec"]
    assert budget["selector"] == deployment["selector"]
    assert budget["maxUnavailable"] == 1 < deployment["replicas"]
    assert "minAvailable" not in budget


def test_the_sidecars_command_runs_the_jobs_and_stops_on_sigterm(tmp_path: Path) -> None:
    # the container's command verbatim, in a real process, with the quick start's jobs in
    # jobs.py (local mode: the page's DSN comes from a Secret this test has not)
    found = manifests()
    [jobs] = [
        c
        for c in found["Deployment", "web-jobs"]["spec"]["template"]["spec"]["containers"]
        if c["name"] == "jobs"
    ]
    [main] = blocks(SECTION, "python")
    (tmp_path / "jobs.py").write_text(main)
    command = jobs["command"]
    assert command[0] == "ticklock"
    with subprocess.Popen(
        [sys.executable, "-m", "ticklock", *command[1:]],
        cwd=tmp_path,
        env=process_env(None),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:  # (closes the pipe; kills the process on a failure below)
        try:
            assert proc.stderr is not None
            lines = []
            for line in proc.stderr:  # the first run is logged at start
                lines.append(line)
                if "run heartbeat" in line:
                    break
            proc.send_signal(signal.SIGTERM)  # as the kubelet stops the container
            code = proc.wait(timeout=30)  # well within shutdown_grace + 10 s
            rest = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code == 0, "".join(lines) + rest
    assert "Traceback" not in rest and any("outcome=success" in line for line in lines), lines
