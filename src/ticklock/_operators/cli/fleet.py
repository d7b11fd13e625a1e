"""The commands on a fleet's database: ``status``, ``history``, ``pause``, ``resume``,
``trigger``, ``forget``, ``migrate`` and ``dashboard``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime

from ..._backends.postgres.fleet import PostgresFleet, from_connection
from ..._schedule.validate import visible
from ..fleet import (
    JobDeclared,
    JobRecord,
    JobState,
    caller,
    checked,
    done,
    iso,
    jobs_json,
    json_text,
    pause_end,
    runs_json,
)
from .app import label
from .errors import EXIT_NOT_OK, EXIT_OK, CommandError

# the states each ``status --fail-on`` name makes exit 1
_ALARMS = {"overdue": (JobState.OVERDUE, JobState.FUTURE), "failing": (JobState.FAILING,)}


def alarms(fail_on: str) -> set[JobState]:
    """The states that make ``status`` exit 1, from ``--fail-on``."""
    names = {name.strip() for name in fail_on.split(",") if name.strip()}
    unknown = names - _ALARMS.keys()
    if unknown or not names:
        raise CommandError(
            f"--fail-on takes {', '.join(_ALARMS)} (comma-separated), got {fail_on!r}"
        )
    return {state for name in names for state in _ALARMS[name]}


@asynccontextmanager
async def open_fleet(args: argparse.Namespace) -> AsyncIterator[PostgresFleet]:
    """The fleet of ``--namespace`` over one connection to ``--dsn``."""
    import asyncpg

    from ..._backends.postgres.connection import connect

    conn, _ = await connect(args.dsn)
    try:
        yield PostgresFleet(from_connection(conn), schema=args.schema, namespace=args.namespace)
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
        raise CommandError(
            f"no ticklock tables in schema {args.schema!r} of this database: run 'ticklock "
            "migrate' (a scheduler also creates them when it starts), or give --schema the "
            "schema your schedulers use"
        ) from None
    finally:
        await conn.close()


def when(at: datetime | None) -> str:
    return at.isoformat(timespec="seconds") if at is not None else "-"


def one_line(text: str | None, width: int = 60) -> str:
    if not text:
        return "-"
    line = visible(" ".join(text.split()))  # no bidi override or escape reaches the terminal
    return line if len(line) <= width else line[: width - 1] + "…"


async def status(args: argparse.Namespace) -> int:
    """Every job of the namespace and the live replicas; exit 1 if a job is overdue or
    failing."""
    states = alarms(args.fail_on)
    async with open_fleet(args) as fleet:
        jobs = await fleet.jobs()
        replicas = await fleet.replicas()
        others = [] if jobs else await fleet.namespaces()
    if not jobs:
        found = ", ".join(repr(namespace) for namespace in others)
        print(
            f"ticklock: no jobs in namespace {args.namespace!r} (schema {args.schema!r}): "
            "no scheduler of that namespace has started on this database"
            + (f"; namespaces with jobs: {found}" if found else ""),
            file=sys.stderr,
        )
        return EXIT_NOT_OK
    alarm = any(job.state in states for job in jobs)
    if args.json:
        print(json_text(jobs_json(args.namespace, jobs, replicas), indent=2))
        return EXIT_NOT_OK if alarm else EXIT_OK
    width = max(24, *(len(label(job.job_id)) for job in jobs))
    print(
        f"{'job':<{width}}  {'status':<10}  {'last success':<25}  {'last outcome':<12}  "
        f"{'fails':>5}  {'next due':<25}  {'owner':<20}  last error"
    )
    for job in jobs:
        state = job.state.value.upper() if job.state is not JobState.OK else "ok"
        if job.trigger_at is not None:
            state += "+TRIGGER"
        print(
            f"{label(job.job_id):<{width}}  {state:<10}  {when(job.last_success):<25}  "
            f"{job.last_outcome or '-':<12}  {job.consecutive_failures:>5}  "
            f"{when(job.next_due):<25}  {visible(job.owner or '-'):<20}  "
            f"{_failed(job) if job.consecutive_failures else '-'}"
        )
        if job.declared_otherwise:
            shown = visible(", ".join(job.declared_otherwise))
            print(f"{'':<{width}}  declared otherwise by {shown} (the majority's rules)")
        if job.last_action is not None and job.state is JobState.PAUSED:
            print(f"{'':<{width}}  {one_line(done(job.last_action), 120)}")
        if job.last_capped:
            print(
                f"{'':<{width}}  last run CAPPED after {job.last_batches} batches "
                "(max_batches): a backlog is left for the next run"
            )
    print()
    if replicas:
        print(f"live replicas ({len(replicas)}):")
        for replica in replicas:
            print(
                f"  {visible(replica.owner)}  up since {when(replica.started_at)}, last seen "
                f"{when(replica.seen_at)}, {len(replica.jobs)} jobs"
                + (f"; gave up: {visible(', '.join(replica.failing))}" if replica.failing else "")
            )
    else:
        print("live replicas: none reported in the last minute")
    return EXIT_NOT_OK if alarm else EXIT_OK


def _failed(job: JobRecord) -> str:
    """The last error, and the replica whose run it was."""
    where = f"on {visible(job.last_owner)}: " if job.last_owner else ""
    return where + one_line(job.last_error)


async def history(args: argparse.Namespace) -> int:
    """The job's last runs, newest first."""
    if args.limit < 1:
        raise CommandError(f"--limit must be at least 1, got {args.limit}")
    async with open_fleet(args) as fleet:
        try:
            # the table prints 60 characters of each: read no more than a little over that
            cut = None if args.json else 200
            runs = await fleet.history(args.job, args.limit, max_text=cut)
        except KeyError as exc:
            return refused(exc)
    if args.json:
        print(json_text(runs_json(args.job, runs), indent=2))
        return EXIT_OK
    print(f"{'finished':<25}  {'slot':<25}  {'outcome':<9}  {'seconds':>8}  {'owner':<20}  note")
    for run in runs:
        note = "manual " if run.manual else ""
        if run.batches or run.capped:
            note += f"{run.batches} batches{' CAPPED' if run.capped else ''} "
        if run.error:
            note += one_line(run.error)
        elif run.report is not None:
            note += one_line(json_text(run.report))
        print(
            f"{when(run.finished_at):<25}  {when(run.slot):<25}  {run.outcome:<9}  "
            f"{run.duration:>8.3f}  {visible(run.owner):<20}  {note or '-'}"
        )
    if not runs:
        print(f"(no runs of {args.job!r} recorded)")
    return EXIT_OK


async def pause(args: argparse.Namespace) -> int:
    """Pause a job fleet-wide (until ``--until``, if given)."""
    note = note_of(args)
    until = _until(args)
    async with open_fleet(args) as fleet:
        try:
            changed = await fleet.pause(args.job, note, until, who=who())
        except KeyError as exc:
            return refused(exc)
    then = "" if until is None else f" until {iso(until)}, when it resumes by itself"
    if not changed:
        print(
            f"ticklock: {args.job!r} was paused already: nothing changed but its end"
            f"{then or ' (none now)'} (the note is logged)"
        )
        return EXIT_OK
    print(f"ticklock: paused {args.job!r}: no replica starts a scheduled run of it{then}")
    return EXIT_OK


def _until(args: argparse.Namespace) -> datetime | None:
    """``--until``, parsed and checked before anything is asked of the database."""
    if args.until is None:
        return None
    try:
        return pause_end(datetime.fromisoformat(args.until))
    except ValueError as exc:
        raise CommandError(f"--until: {exc}") from None


async def resume(args: argparse.Namespace) -> int:
    """Resume a paused job fleet-wide."""
    note = note_of(args)
    async with open_fleet(args) as fleet:
        try:
            changed = await fleet.resume(args.job, note, who=who())
        except KeyError as exc:
            return refused(exc)
    if not changed:
        print(f"ticklock: {args.job!r} was not paused: nothing changed (the note is logged)")
        return EXIT_OK
    print(f"ticklock: resumed {args.job!r}")
    return EXIT_OK


async def trigger(args: argparse.Namespace) -> int:
    """Ask the fleet for one run of a job now."""
    note = note_of(args)
    async with open_fleet(args) as fleet:
        try:
            at = await fleet.trigger(args.job, note, who=who())
        except KeyError as exc:
            return refused(exc)
    print(
        f"ticklock: asked the fleet to run {args.job!r} (slot {when(at)}); "
        f"'ticklock history {args.job}' shows the run"
    )
    return EXIT_OK


async def forget(args: argparse.Namespace) -> int:
    """Delete the state and history of a job no live replica declares."""
    note = note_of(args)
    async with open_fleet(args) as fleet:
        try:
            await fleet.forget(args.job, note, who=who())
        except (KeyError, JobDeclared) as exc:
            return refused(exc)
    print(f"ticklock: forgot {args.job!r}: its state and history are deleted")
    return EXIT_OK


def note_of(args: argparse.Namespace) -> str | None:
    """``--note``, checked before anything is asked of the database."""
    try:
        return checked(args.note, "--note")
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def who() -> str:
    """Who the CLI acts for in the audit log: its user and host."""
    return f"{caller()} (cli)"


def refused(exc: BaseException) -> int:
    message = exc.args[0] if exc.args else str(exc)
    print(f"ticklock: {message}", file=sys.stderr)
    return EXIT_NOT_OK


async def migrate(args: argparse.Namespace) -> int:
    """Create or upgrade ticklock's tables."""
    from ..._backends.postgres.connection import connect
    from ..._backends.postgres.schema import VERSION
    from ..._backends.postgres.schema import migrate as run_migration
    from ..._errors import SchemaBusy

    def waiting() -> None:
        print(
            "ticklock: waiting for a run in flight to end before upgrading the schema (its "
            "transaction holds ticklock's tables; the running replicas are not held up) ...",
            file=sys.stderr,
            flush=True,
        )

    conn, _ = await connect(args.dsn)
    try:
        done = await run_migration(conn, args.schema, wait=args.wait, waiting=waiting)
    except SchemaBusy as exc:
        raise CommandError(f"{exc}: run 'ticklock migrate' again, or give --wait longer") from None
    finally:
        await conn.close()
    where = f"ticklock's tables in schema {args.schema!r}"
    if done == "created":
        print(f"ticklock: created {where} (version {VERSION})")
    elif done == "upgraded":
        print(f"ticklock: upgraded {where} to version {VERSION}")
    else:
        print(f"ticklock: {where} are already at version {VERSION}; nothing to do")
    return EXIT_OK


async def dashboard(args: argparse.Namespace) -> int:
    """Serve the dashboard of the namespace until SIGTERM or SIGINT."""
    try:
        import uvicorn

        from ..dashboard import create_app
        from ..dashboard.hosts import for_bind_address, patterns
    except ImportError as exc:
        raise CommandError(
            f"the dashboard needs its extra: pip install 'ticklock[dashboard]' ({exc})"
        ) from None
    from ..._backends.postgres.connection import Pooler, create_pool
    from ..._backends.postgres.fleet import from_pool

    # By default only the address it listens on: a page of another name that resolves to it
    # (DNS rebinding) is refused. An address of every interface names no host: then pages
    # answer any host and actions localhost only, as a mounted dashboard's.
    allowed = patterns(args.allowed_hosts) or for_bind_address(args.host)  # before connecting
    pool = await create_pool(args.dsn, Pooler())
    try:
        fleet = PostgresFleet(from_pool(pool), schema=args.schema, namespace=args.namespace)
        app = create_app(
            fleet,
            actions=args.actions,
            allowed_hosts=allowed,
            schedules=lambda: fleet.schedules,
        )
        config = uvicorn.Config(
            app, host=args.host, port=args.port, root_path=args.root_path, log_level="warning"
        )
        answers = "any host, actions for localhost only" if allowed is None else ", ".join(allowed)
        print(
            f"ticklock: dashboard of namespace {args.namespace!r} on "
            f"http://{args.host}:{args.port}/ ({'with' if args.actions else 'no'} actions; "
            f"answers Host: {answers})",
            flush=True,
        )
        await uvicorn.Server(config).serve()
    finally:
        await pool.close()
    return EXIT_OK
