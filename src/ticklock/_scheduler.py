"""The scheduler: the registry of jobs and the lifecycle that runs them in a task group."""

from __future__ import annotations

import contextlib
import os
import random as _random
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus
from typing_extensions import Unpack

from ._backends.memory import MemoryDatabase
from ._backends.seam import Backend, Control, Views
from ._errors import ScheduleError, SchedulerStateError
from ._operators.operations import SchedulerFleet
from ._operators.schedules import Schedules
from ._runtime.catalog import Catalog
from ._runtime.clock import Clock, SystemClock
from ._runtime.crew import Crew, last_successes
from ._runtime.loop import Dispatcher
from ._runtime.roster import Roster
from ._runtime.runner import Runner
from ._runtime.service import Service
from ._runtime.sharing import Share
from ._schedule.job import Handler, Job, JobHealth, JobOptions, RunResult
from ._schedule.stored import ScheduleStore
from ._schedule.triggers import Trigger, every
from ._schedule.validate import Duration, identifier, name, seconds
from ._schedule.validate import dsn as valid_dsn
from ._schedule.validate import name as valid_name
from ._telemetry import Telemetry

if TYPE_CHECKING:
    import asyncpg
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider
    from starlette.applications import Starlette
    from starlette.requests import Request

F = TypeVar("F", bound=Handler)


class Scheduler:
    """Runs periodic jobs inside the current process, coordinated across replicas.

    With neither ``dsn`` nor ``pool`` it runs in local mode (in-process coordination); with
    either, each tick runs in a PostgreSQL transaction that holds the job's advisory lock.
    ``database`` gives it another backend: the in-memory
    :class:`~ticklock.testing.MemoryDatabase` that several schedulers of one test share::

        scheduler = Scheduler()

        @scheduler.job(every(minutes=15, jitter=30), timeout=60)
        async def purge(ctx: JobContext) -> dict[str, int]: ...

        async with scheduler:   # runs every job until the block is left
            ...

    Every duration takes seconds (``float``) or a ``timedelta``. A value that could not work
    (a DSN that does not parse, a schema that is not a plain SQL identifier...) raises
    :class:`~ticklock.ScheduleError` here, naming the parameter.

    :param dsn: A PostgreSQL URL (``postgresql://app:secret@db/app``): PostgreSQL mode, on a
        pool ticklock creates (up to 10 connections, opened on demand) and closes. ``None``
        and no ``pool``: local mode, coordinated in this process only. Nothing connects until
        the scheduler starts.
    :param pool: An asyncpg pool of your own instead of ``dsn``: PostgreSQL mode, and ticklock
        never closes it. Size it for the jobs that run at once, plus one for failure records.
    :param database: Another backend instead of ``dsn`` or ``pool``: a
        :class:`~ticklock.testing.MemoryDatabase` that several schedulers of one test share.
    :param namespace: Separates applications that share a database: replicas of one fleet
        use the same namespace, and jobs of other namespaces are never seen.
    :param schema: The PostgreSQL schema of ticklock's tables, created at start.
    :param shutdown_grace: How long leaving the scheduler waits for runs in flight before it
        cancels them (and rolls them back); real time, also with an injected clock.
    :param clock: Where slots and delays come from: the system clock by default, a
        :class:`~ticklock.testing.ManualClock` in tests.
    :param random: The source of jitter (``random.Random(seed)`` for reproducible tests).
    :param owner: This replica's name in runs, logs and ``ticklock status``: by default
        ``hostname:pid``. Give each replica its own.
    :param tracer_provider: The OpenTelemetry tracer provider for the run spans; by default
        the global one.
    :param meter_provider: The OpenTelemetry meter provider for the metrics; by default the
        global one.
    :param retention: How long run records are kept (PostgreSQL mode): the built-in job
        ``ticklock.retention`` deletes older ones every minute.
    :param require_database: ``True``: starting fails with :class:`~ticklock.StartupError`
        when the database does not answer or refuses the scheduler. ``False``: it starts
        anyway, its runs end as ``error`` and it retries until the database answers.
    """

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool[Any] | None = None,
        database: Backend | None = None,
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
        if database is not None and (dsn is not None or pool is not None):
            message = "give either database or a dsn or pool, not both"
            raise ScheduleError(message, field="database")
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
        self._require_database = require_database
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._random = random if random is not None else _random.Random()
        self._tasks: dict[str, Handler] = {}  # the handlers of stored schedules, by task
        self._busy = False  # run() is in progress (starting, running or stopping)
        self._outer: TaskGroup | None = None
        self._telemetry = Telemetry(
            lambda: [*self._roster.successes(), *last_successes([*self._catalog.cycles.values()])],
            tracer_provider,
            meter_provider,
        )
        self._backend: Backend = database if database is not None else MemoryDatabase()
        self._crew = Crew(
            self._clock,
            self._random,
            Dispatcher(self._clock),
            Share(self.owner),
            self._backend.coordinator(self.owner, self._clock),
        )
        self._roster = Roster(self._crew)  # every job declared in code
        self.postgres = False
        """Whether this scheduler coordinates through PostgreSQL."""
        if dsn is not None or pool is not None:
            self._use_postgres(dsn, pool)
        self._catalog = Catalog(self._crew, self._tasks, self._stored)
        self._fleet = SchedulerFleet(
            self.namespace, self._views, lambda: self._crew.session, self._clock.now
        )
        self._schedules = Schedules(self._stored, self._tasks.keys, self._roster.jobs.keys)

    def _views(self) -> Views:
        """What operators see of the namespace, through this scheduler's coordinator."""
        return self._crew.coordinator.views(lambda: self.jobs, self.health)

    def _stored(self) -> ScheduleStore:
        return self._views().schedules

    def _use_postgres(self, dsn: str | None, pool: asyncpg.Pool[Any] | None) -> None:
        from ._backends.postgres.coordinator import PostgresBackend
        from ._backends.postgres.retention import Retention

        self._backend = PostgresBackend(
            dsn, pool, self.namespace, self.schema, self._random, self._require_database
        )
        self.postgres = True
        self._crew.coordinator = self._backend.coordinator(self.owner, self._clock)
        if _RETENTION not in self._roster.jobs:
            self.add(
                Retention(self.schema, self.namespace, self.retention),
                Retention.trigger(),
                id=_RETENTION,
                timeout=30,
            )

    def use_dsn(self, dsn: str) -> None:
        """Switch a scheduler that is not running to PostgreSQL mode (the CLI's ``--dsn``)."""
        self._check_idle()
        self._use_postgres(valid_dsn(dsn), None)

    # -- declaration ---------------------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The jobs declared in code, by id (a read-only snapshot); stored schedules are
        :attr:`schedules`."""
        return MappingProxyType(dict(self._roster.jobs))

    def job(self, trigger: Trigger, **options: Unpack[JobOptions]) -> Callable[[F], F]:
        """Declare the decorated ``async def handler(ctx)`` as a job::

            @scheduler.job(every(minutes=15), id="purge-expired", timeout=60)
            async def purge(ctx: JobContext) -> dict[str, int]: ...

        The keywords are those of :class:`~ticklock.JobOptions`, each optional; every
        duration takes seconds (``float``) or a ``timedelta``. A declaration that could not
        run raises :class:`~ticklock.ScheduleError` at once, naming the job and the field. The
        handler is returned unchanged; :meth:`add` declares a function without decorating it.

        :param trigger: When the job runs: :func:`~ticklock.every` (fixed delay) or
            :func:`~ticklock.cron`.
        :param id: The job's id, unique in the scheduler, naming its lock, watermark, history
            and metrics. Default: the handler's ``module.qualname``, so renaming or moving the
            function would start a new job: give one.
        :param timeout: Seconds a run may take before it is cancelled and rolled back
            (outcome ``timeout``); shorter than the period. Default: half the job's shortest
            period (the interval; for cron the shortest gap between its fires), at most 300 s.
        :param enabled: ``False`` declares and validates a job that never runs (an on/off
            switch from configuration); ``run_now`` still runs it.
        :param catch_up: ``True``: slots missed while no replica ran are covered by one run at
            start, which sees the window through ``ctx.previous_success``. ``False``: they are
            skipped. A duration (seconds or a ``timedelta``): only the slots missed within it
            before now are covered; older ones are skipped (the ledger says "outside the
            catch-up window").
        :param overdue_grace: Slack after a run was due (the first fire after the last run
            that finished, whatever its outcome) plus the timeout before :meth:`health` and
            ``ticklock status`` call the job overdue: it stopped running. Default: 10 % of the
            period, between 1 s and 5 minutes.
        :param retries: How many times a failed slot (``failure``, ``timeout``, ``error``) runs
            again, never past the next slot.
        :param retry_backoff: Seconds before the first retry, doubling for each one; shorter
            than the period.
        :param max_batches: At most this many batches of
            :meth:`~ticklock.JobContext.batches` per run, after which the run is ``capped``;
            ``None``: no cap.
        :param failure_threshold: How many runs in a row must fail before the job is
            ``failing`` (in ``health()``, ``ticklock status``, the dashboard).
        """

        def decorate(func: F) -> F:
            self.add(func, trigger, **options)
            return func

        return decorate

    def add(self, func: Handler, trigger: Trigger, **options: Unpack[JobOptions]) -> Job:
        """Declare ``func`` as a job and return it; while running it is scheduled at once::

            scheduler.add(purge, every(minutes=15), id="purge-expired", timeout=60)

        The keywords are those of :meth:`job` (:class:`~ticklock.JobOptions`). Raises
        :class:`ScheduleError` for anything that could not run, naming the job and the field:
        a duplicate id, a non-async handler, ``timeout >= interval``, an unknown keyword...

        :param func: The handler, an ``async def handler(ctx: JobContext)`` that returns
            ``None`` or a JSON-serialisable report.
        :param trigger: When the job runs: :func:`~ticklock.every` or :func:`~ticklock.cron`.
        """
        job = Job.declare(func, trigger, **options)
        if job.id in self._roster.jobs:
            raise ScheduleError(
                "a job with this id is already declared; give one of them another id=",
                job_id=job.id,
                field="id",
            )
        self._roster.add(job)
        return job

    def task(self, name: str) -> Callable[[F], F]:
        """Declare the decorated ``async def handler(ctx)`` as the handler of every stored
        schedule whose task is ``name`` (see :attr:`schedules`)::

            @scheduler.task("send-report")
            async def send_report(ctx: JobContext) -> None:
                tenant = ctx.args["tenant"]

        Only replicas with the task run its schedules. Raises :class:`ScheduleError` for a
        name that is not plain text, a task declared twice, or a handler that is not async."""
        task = valid_name(name, "task")

        def decorate(func: F) -> F:
            if task in self._tasks:
                raise ScheduleError(f"task {task!r} is already declared", field="task")
            Job.declare(func, _PROBE, id=task)  # the handler's checks, as for a job
            self._check_idle()
            self._tasks[task] = func
            return func

        return decorate

    @property
    def tasks(self) -> Mapping[str, Handler]:
        """The declared tasks' handlers by name (a read-only snapshot)."""
        return MappingProxyType(dict(self._tasks))

    @property
    def schedules(self) -> Schedules:
        """The namespace's stored schedules: ``put``, ``get``, ``delete``, ``list`` (see
        :class:`~ticklock.Schedules`). In PostgreSQL mode they are the database's, and need
        the scheduler running (its pool); in local mode its database's."""
        return self._schedules

    def remove(self, id: str) -> Job:
        """Remove the job ``id``; a run in flight finishes, no new one starts."""
        try:
            return self._roster.remove(id)
        except KeyError:
            raise KeyError(f"no job with id {id!r}") from None

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
        self._busy = True
        try:
            coordinator = self._crew.coordinator = self._backend.coordinator(
                self.owner, self._clock
            )
            self._catalog = Catalog(self._crew, self._tasks, self._stored)
            service = Service(
                self._crew,
                self._roster,
                self._catalog,
                coordinator,
                Runner(
                    coordinator,
                    self._clock,
                    self._crew.dispatcher,
                    self.namespace,
                    self.owner,
                    self._telemetry,
                ),
                self.owner,
                require_database=self._require_database,
                shutdown_grace=self.shutdown_grace,
                mode="postgres" if self.postgres else "local",
                builtin=_RETENTION,
                tasks=self._tasks,
                fleet=lambda: self._views().fleet,
            )
            await service.run(task_status)
        finally:
            self._busy = False

    def _check_idle(self) -> None:
        if self._busy:
            raise SchedulerStateError(
                "this scheduler is already running; a scheduler runs once at a time "
                "(use one 'async with scheduler' or one 'await scheduler.run()')"
            )

    # -- operations ----------------------------------------------------------------------

    async def run_now(self, id: str) -> RunResult:
        """Run one tick of job ``id`` (declared in code, or a stored schedule of one of this
        scheduler's tasks) now (slot = now), under the same lock and recording.

        Returns the run's result; ``outcome`` is ``locked`` if a run of the job is in flight.
        """
        if not self._crew.running:
            raise SchedulerStateError(
                "run_now() needs a running scheduler: call it inside 'async with scheduler'"
            )
        cycle = self._roster.wake(id) or await self._catalog.hold(id)
        if cycle is None:
            raise KeyError(f"no job with id {id!r}")
        return await cycle.run_now()

    @property
    def fleet(self) -> SchedulerFleet:
        """The jobs of this scheduler's namespace as operators see and steer them: in
        PostgreSQL mode the whole fleet's (through this scheduler's pool, while it runs), in
        local mode this process's, with a shared :class:`~ticklock.testing.MemoryDatabase`
        its schedulers'. The CLI and the dashboard use the same operations."""
        return self._fleet

    async def pause(
        self,
        id: str,
        note: str | None = None,
        *,
        who: str | None = None,
        until: datetime | None = None,
    ) -> bool:
        """Pause job ``id``: no scheduled run of it starts until :meth:`resume` (a run in
        flight finishes), or, with ``until`` (an aware datetime), until that instant, when
        it resumes by itself fleet-wide (audited as resumed by ``ticklock``). Fleet-wide and
        persisted in PostgreSQL mode. Manual runs (:meth:`trigger`, :meth:`run_now`) still
        run. Returns whether it was not paused already. The audit log keeps ``who``
        (default: this process's ``user@host``), when, and ``note``. Raises ``KeyError``
        for an unknown id, ``ValueError`` for a naive ``until``."""
        return await self._fleet.pause(id, note, until, who=who)

    async def resume(self, id: str, note: str | None = None, *, who: str | None = None) -> bool:
        """Undo :meth:`pause` (the next slot follows the job's ``catch_up`` rule); returns
        whether it was paused. Audited as :meth:`pause`."""
        return await self._fleet.resume(id, note, who=who)

    async def trigger(
        self, id: str, note: str | None = None, *, who: str | None = None
    ) -> datetime:
        """Ask the fleet for one run of job ``id`` as soon as possible, and return once the
        request is recorded: some replica that declares the job runs it (slot = the returned
        instant), under the same lock and watermark as any tick, recorded as a manual run.
        A request that no run has served yet is not repeated. Raises ``KeyError`` for a job
        that no live replica runs (unknown, or ``enabled=False``). Audited as :meth:`pause`."""
        return await self._fleet.trigger(id, note, who=who)

    def dashboard(
        self,
        *,
        actions: bool = False,
        allowed_hosts: Iterable[str] | None = None,
        identify: Callable[[Request], str | None] | None = None,
    ) -> Starlette:
        """An ASGI app showing this scheduler's jobs, their slots and history, the operations
        made on them and the live replicas: ``app.mount("/ticklock", scheduler.dashboard())``.
        ``actions=True`` adds pause (with a note), resume and trigger buttons (POST, with a
        CSRF token). ``allowed_hosts`` lists the host names the dashboard answers
        (``"ops.example.com"``, ``"*.example.com"``, ``"*"``); without it pages answer any host
        and actions only ``localhost``. ``identify(request)`` names the caller of an action for
        the audit log; by default the ``display_name`` of the user Starlette's
        ``AuthenticationMiddleware`` authenticated, else ``dashboard (<client address>)``
        (never taken from a request header). Needs ``ticklock[dashboard]``."""
        try:
            from ._operators.dashboard import create_app
        except ImportError as exc:  # the extra, not installed: say which (as the CLI does)
            missing = (exc.name or "?").partition(".")[0]
            if missing.startswith("ticklock"):
                raise
            raise ModuleNotFoundError(
                f"scheduler.dashboard() needs its extra: pip install 'ticklock[dashboard]' "
                f"({missing} is not installed)",
                name=missing,
            ) from None

        return create_app(
            self._fleet,
            actions=actions,
            allowed_hosts=allowed_hosts,
            identify=identify,
            clock=self._clock,
            schedules=lambda: self._fleet.schedules,
        )

    def health(self, now: datetime | None = None) -> list[JobHealth]:
        """One :class:`JobHealth` per job declared in code, and per stored schedule this
        replica holds now (due within a minute, or running here); ``overdue`` is the absence
        alarm (no run finished when one was due), ``failing`` says that its runs fail. For
        every stored schedule, ``fleet.jobs()`` and ``ticklock status`` read the records."""
        clock_now = self._clock.now()
        problem = self._crew.coordinator.problem
        at = now or clock_now
        held = [c.health(at, clock_now, problem=problem) for c in self._catalog.cycles.values()]
        return [*self._roster.health(at, clock_now, problem=problem), *held]

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
_PROBE = every(3600)  # the trigger a task's handler is checked with
_LOAD_RETRY = 30.0  # seconds before reading the fleet's state again after an error
_NO_CONTROL = Control(None, None)


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"
