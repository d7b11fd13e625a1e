"""The scheduler: the registry of jobs and the lifecycle that runs them in a task group."""

from __future__ import annotations

import contextlib
import os
import random as _random
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._clock import Clock, SystemClock
from ._coordination import FUTURE_LIMIT, Coordinator, FleetState, LocalCoordinator
from ._dispatcher import Dispatcher, Entry
from ._errors import ScheduleError, SchedulerStateError, StartupError
from ._job import Handler, Job, JobHealth, Outcome, RunResult
from ._plan import Plan, overdue_at, plan
from ._runner import Runner
from ._runs import Runs
from ._telemetry import Telemetry, logger
from ._triggers import Trigger
from ._validate import Duration, identifier, name, seconds
from ._validate import dsn as valid_dsn

if TYPE_CHECKING:
    import asyncpg
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider

F = TypeVar("F", bound=Handler)
_State = Literal["idle", "starting", "running", "stopping"]


class Scheduler:
    """Runs periodic jobs inside the current process, coordinated across replicas.

    With neither ``dsn`` nor ``pool`` it runs in local mode (in-process coordination); with
    either, each tick runs in a PostgreSQL transaction that holds the job's advisory lock::

        scheduler = Scheduler()

        @scheduler.job(every(minutes=15, jitter=30), timeout=60)
        async def purge(ctx: JobContext) -> dict[str, int]: ...

        async with scheduler:   # runs every job until the block is left
            ...
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool[Any] | None = None,
        namespace: str = "default",
        schema: str = "ticklock",
        shutdown_grace: Duration = 30.0,
        clock: Clock | None = None,
        random: _random.Random | None = None,
        owner: str | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        retention: Duration = timedelta(days=14),
        require_database: bool = False,
    ) -> None:
        if dsn is not None and pool is not None:
            raise ScheduleError("give either dsn or pool, not both", field="dsn")
        if dsn is not None:
            dsn = valid_dsn(dsn)  # a bad URL or a missing asyncpg fails here, not at start
        self.namespace = name(namespace, "namespace")
        self.schema = identifier(schema, "schema")
        self.shutdown_grace = seconds(shutdown_grace, "shutdown_grace")
        self.retention = seconds(retention, "retention", allow_zero=False)
        self.owner = name(owner if owner is not None else _default_owner(), "owner")
        if not isinstance(require_database, bool):
            raise ScheduleError(
                f"require_database must be True or False, got {require_database!r}",
                field="require_database",
            )
        self._dsn = dsn
        self._pool = pool
        self._require_database = require_database
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._random = random if random is not None else _random.Random()
        self._entries: dict[str, Entry] = {}  # every declared job, by id
        self._status: _State = "idle"
        self._runs: Runs | None = None
        self._outer: TaskGroup | None = None
        self._dispatcher = Dispatcher(self._clock, self._random, self._spawn)
        self._telemetry = Telemetry(self._last_successes, tracer_provider, meter_provider)
        self._coordinator: Coordinator = LocalCoordinator()
        if self.postgres:
            self._add_retention()
        self._runner: Runner | None = None

    def _add_retention(self) -> None:
        from ._postgres.retention import Retention

        if _RETENTION not in self._entries:
            self.add(
                Retention(self.schema, self.namespace, self.retention),
                _retention_trigger(),
                id=_RETENTION,
                timeout=30,
            )

    def use_dsn(self, dsn: str) -> None:
        """Switch a scheduler that is not running to PostgreSQL mode (the CLI's ``--dsn``)."""
        self._check_idle()
        self._dsn, self._pool = valid_dsn(dsn), None
        self._add_retention()

    # -- declaration ---------------------------------------------------------------------

    @property
    def postgres(self) -> bool:
        """Whether this scheduler coordinates through PostgreSQL."""
        return self._dsn is not None or self._pool is not None

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The declared jobs by id (a read-only snapshot)."""
        return MappingProxyType({job_id: entry.job for job_id, entry in self._entries.items()})

    def job(
        self,
        trigger: Trigger,
        *,
        id: str | None = None,
        timeout: Duration | None = None,
        enabled: bool = True,
        catch_up: bool = True,
        overdue_grace: Duration | None = None,
        retries: int = 0,
        retry_backoff: Duration = 10.0,
    ) -> Callable[[F], F]:
        """Declare the decorated ``async def handler(ctx)`` as a job; see :meth:`add`."""

        def decorate(func: F) -> F:
            self.add(
                func,
                trigger,
                id=id,
                timeout=timeout,
                enabled=enabled,
                catch_up=catch_up,
                overdue_grace=overdue_grace,
                retries=retries,
                retry_backoff=retry_backoff,
            )
            return func

        return decorate

    def add(
        self,
        func: Handler,
        trigger: Trigger,
        *,
        id: str | None = None,
        timeout: Duration | None = None,
        enabled: bool = True,
        catch_up: bool = True,
        overdue_grace: Duration | None = None,
        retries: int = 0,
        retry_backoff: Duration = 10.0,
    ) -> Job:
        """Declare ``func`` as a job and return it; while running it is scheduled at once.

        Raises :class:`ScheduleError` for anything that could not run, naming the job and
        the field: a duplicate id, a non-async handler, ``timeout >= interval``, ...
        """
        job = Job.declare(
            func,
            trigger,
            id=id,
            timeout=timeout,
            enabled=enabled,
            catch_up=catch_up,
            overdue_grace=overdue_grace,
            retries=retries,
            retry_backoff=retry_backoff,
        )
        if job.id in self._entries:
            raise ScheduleError(
                "a job with this id is already declared; give one of them another id=",
                job_id=job.id,
                field="id",
            )
        entry = self._entries[job.id] = Entry(job)
        if self._status == "running":
            self._start_job(entry, self._clock.now())
        return job

    def remove(self, id: str) -> Job:
        """Remove the job ``id``; a run in flight finishes, no new one starts."""
        try:
            entry = self._entries.pop(id)
        except KeyError:
            raise KeyError(f"no job with id {id!r}") from None
        entry.removed = True
        self._dispatcher.forget(entry)
        return entry.job

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Scheduler:
        self._check_idle()
        outer = anyio.create_task_group()
        await outer.__aenter__()
        try:
            await outer.start(self.run)
        except BaseException:
            # start() raised the error itself; close the group without re-raising it grouped
            outer.cancel_scope.cancel()
            with contextlib.suppress(BaseException):
                await outer.__aexit__(None, None, None)
            raise
        self._outer = outer
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        outer, self._outer = self._outer, None
        assert outer is not None
        outer.cancel_scope.cancel()
        return await outer.__aexit__(exc_type, exc, tb)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every job until cancelled, then shut down gracefully (the sidecar form).

        Supports ``await task_group.start(scheduler.run)``: it reports started once every
        job is scheduled.
        """
        self._check_idle()
        self._status = "starting"
        try:
            if self.postgres:
                self._coordinator = self._make_postgres()
            self._runner = Runner(
                self._coordinator,
                self._clock,
                self._dispatcher,
                self.namespace,
                self.owner,
                self._telemetry,
            )
            await self._coordinator.open()
            try:
                states = await self._first_load()
                async with anyio.create_task_group() as tg:
                    self._runs = Runs()
                    await tg.start(self._runs.serve)
                    # beside the runs, so that their timeouts fire while they drain
                    self._runs.service(self._dispatcher.run, "ticklock.dispatcher")
                    try:
                        await self._serve(tg, states, task_status)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self._drain()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._coordinator.close()
        except StartupError as exc:
            logger.error("%s", exc)  # one line: the message names the cause and the fix
            raise
        except Exception:
            logger.exception("the scheduler stopped on an error")
            raise
        finally:
            self._status = "idle"
            self._runs = None
            for entry in self._entries.values():
                self._dispatcher.forget(entry)

    def _check_idle(self) -> None:
        if self._status != "idle":
            raise SchedulerStateError(
                "this scheduler is already running; a scheduler runs once at a time "
                "(use one 'async with scheduler' or one 'await scheduler.run()')"
            )

    async def _first_load(self) -> dict[str, FleetState] | None:
        """The fleet's state at start (``None`` while the database does not answer); an error
        that waiting cannot fix (no permission on the tables, say) fails the start."""
        if not self._coordinator.ready:
            return None
        try:
            return await self._load()
        except Exception as exc:
            raise StartupError(self._coordinator.explain(exc)) from exc

    async def _serve(
        self, tg: TaskGroup, states: dict[str, FleetState] | None, task_status: TaskStatus[None]
    ) -> None:
        entries = self._entries.values()
        # Plan from when the fleet's state is known, not from before it was read: a first
        # slot planned before the load would start late by however long the load took.
        now = self._clock.now()
        for entry in entries:
            entry.state = None if states is None else states.get(entry.job.id)
            self._start_job(entry, now)
        if states is None:  # the database did not answer: its ticks end as error meanwhile
            tg.start_soon(self._connect, name="ticklock.connect")
        self._status = "running"
        user = sum(1 for job_id in self._entries if job_id != _RETENTION)
        logger.info(
            "scheduler started (%s mode, %d job%s%s, owner %s)",
            "postgres" if self.postgres else "local",
            user,
            "" if user == 1 else "s",
            f" and the built-in {_RETENTION}" if _RETENTION in self._entries else "",
            self.owner,
        )
        task_status.started()
        await anyio.sleep_forever()

    async def _load(self) -> dict[str, FleetState] | None:
        """The fleet's state of every job (``None`` if the database stopped answering)."""
        jobs = {e.job.id: e.job for e in self._entries.values() if e.job.enabled}
        try:
            return await self._coordinator.load(jobs, self._clock.now())
        except Exception as exc:
            if not self._coordinator.classify(exc):
                raise
            return None  # the coordinator is no longer ready

    async def _connect(self) -> None:
        """Wait for the database, then re-plan every job from the fleet's state."""
        states = None
        while states is None:
            await self._coordinator.connect()
            try:
                states = await self._load()
            except Exception as exc:  # e.g. no permission on the tables: say so, try later
                logger.error("%s", self._coordinator.explain(exc))
                await self._clock.sleep_until(self._clock.monotonic() + _LOAD_RETRY)
        now = self._clock.now()
        for entry in self._entries.values():
            entry.state = states.get(entry.job.id)
            if entry.job.enabled and not entry.running:
                self._dispatcher.schedule(entry, plan(entry.job, entry.state or _NO_STATE, now))

    async def _drain(self) -> None:
        self._status = "stopping"
        for entry in self._entries.values():
            self._dispatcher.forget(entry)
        if self._runs is not None:
            await self._runs.drain(self.shutdown_grace)
        logger.info("scheduler stopped")

    def _make_postgres(self) -> Coordinator:
        from ._postgres.coordinator import PostgresCoordinator

        return PostgresCoordinator(
            dsn=self._dsn,
            pool=self._pool,
            namespace=self.namespace,
            schema=self.schema,
            clock=self._clock,
            random=self._random,
            require_database=self._require_database,
        )

    def _start_job(self, entry: Entry, now: datetime) -> None:
        entry.since = now
        job = entry.job
        if not job.enabled:
            return
        self._dispatcher.schedule(entry, plan(job, entry.state or _NO_STATE, now))

    def _spawn(self, entry: Entry) -> None:
        assert self._runs is not None
        self._runs.start(self._tick, entry, f"ticklock.run {entry.job.id}")

    async def _tick(self, entry: Entry) -> None:
        job = entry.job
        assert self._runner is not None
        try:
            result, state = await self._runner.execute(
                job, entry.slot, entry.fire_at, entry.jitter, attempt=entry.attempt
            )
        except Exception:  # a bug in ticklock itself must not stop the job
            logger.exception("internal error in a tick of %s", job.id)
            if not entry.removed and self._status == "running":
                self._dispatcher.schedule(entry, Plan(None, job.trigger.period))
            return
        finally:
            entry.running = False
        self._after(entry, result, state)

    @staticmethod
    def _observe(entry: Entry, result: RunResult, state: FleetState | None) -> None:
        if state is not None:
            entry.state = state
            entry.held_at = None
        elif result.outcome is Outcome.LOCKED:
            entry.held_at = result.finished_at

    def _after(self, entry: Entry, result: RunResult, state: FleetState | None) -> None:
        self._observe(entry, result, state)
        if entry.removed or self._status != "running":
            return
        now = self._clock.now()
        self._dispatcher.schedule(entry, plan(entry.job, entry.state or _NO_STATE, now, result))

    # -- operations ----------------------------------------------------------------------

    async def run_now(self, id: str) -> RunResult:
        """Run one tick of job ``id`` now (slot = now), under the same lock and recording.

        Returns the run's result; ``outcome`` is ``locked`` if a run of the job is in flight.
        """
        if self._status != "running":
            raise SchedulerStateError(
                "run_now() needs a running scheduler: call it inside 'async with scheduler'"
            )
        try:
            entry = self._entries[id]
        except KeyError:
            raise KeyError(f"no job with id {id!r}") from None
        job = entry.job
        assert self._runner is not None
        result, state = await self._runner.execute(job, None, manual=True)
        self._observe(entry, result, state)
        if state is not None and job.enabled and not entry.running and not entry.removed:
            self._dispatcher.schedule(entry, plan(job, state, self._clock.now()))
        return result

    def health(self, now: datetime | None = None) -> list[JobHealth]:
        """One :class:`JobHealth` per job; ``overdue`` is the absence alarm."""
        clock_now = self._clock.now()
        if now is None:
            now = clock_now
        result = []
        for entry in self._entries.values():
            job = entry.job
            state = entry.state or _NO_STATE
            next_fire = entry.fire_at if self._status == "running" else None
            overdue = False
            base = state.last_success_at or entry.since
            if entry.held_at is not None and base is not None:
                # Another replica was running the job when this one last tried. That run
                # may have succeeded, by the time it was seen plus its timeout, and this
                # replica learns whether at its next attempt (a period later): until then,
                # presume it did, or every follower would report a healthy job overdue.
                base = max(base, entry.held_at + timedelta(seconds=job.timeout))
            # judged whether or not the scheduler still runs: one that stopped while the
            # process lives on runs nothing, and must not keep saying every job is fine
            if job.enabled and base is not None:
                limit = overdue_at(job, base)
                overdue = limit is not None and now > limit
            if job.enabled and _future(state, clock_now):
                # stored by a replica whose clock ran ahead: no replica runs the job until
                # then, so it is overdue now (the database refuses such commits since)
                overdue = True
            result.append(
                JobHealth(
                    job_id=job.id,
                    last_success=state.last_success_at,
                    next_fire=next_fire,
                    consecutive_failures=state.consecutive_failures,
                    overdue=overdue,
                )
            )
        return result

    def _last_successes(self) -> list[tuple[str, datetime]]:
        return [
            (job_id, entry.state.last_success_at)
            for job_id, entry in self._entries.items()
            if entry.state is not None and entry.state.last_success_at is not None
        ]

    # -- integrations --------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """An ASGI lifespan: ``FastAPI(lifespan=scheduler.lifespan)``."""
        async with self:
            yield

    async def aiohttp_ctx(self, app: object) -> AsyncIterator[None]:
        """An aiohttp cleanup context: ``app.cleanup_ctx.append(scheduler.aiohttp_ctx)``."""
        async with self:
            yield


_RETENTION = "ticklock.retention"
_LOAD_RETRY = 30.0  # seconds before reading the fleet's state again after an error
_NO_STATE = FleetState()  # read-only: a job the fleet has no state for


def _future(state: FleetState, now: datetime) -> bool:
    """Whether the fleet's watermark or last end lies ahead of ``now`` by more than the
    skew the database accepts."""
    limit = now + timedelta(seconds=FUTURE_LIMIT)
    return any(t is not None and t > limit for t in (state.last_slot, state.last_end))


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _retention_trigger() -> Trigger:
    from ._triggers import every

    # every minute: an hourly batch of 10,000 kept up with 240,000 runs a day, and a fleet
    # running 250 jobs a second records 21 million (the history grew for ever)
    return every(minutes=1, jitter=10)
