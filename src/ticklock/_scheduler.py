"""The scheduler: the registry of jobs and the lifecycle that runs them in a task group."""

from __future__ import annotations

import contextlib
import os
import random as _random
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._clock import Clock, SystemClock
from ._coordination import (
    Control,
    Coordinator,
    Declared,
    FleetState,
    LocalCoordinator,
)
from ._dispatcher import Dispatcher
from ._entry import Entry
from ._errors import ScheduleError, SchedulerStateError, StartupError
from ._fleet import Fleet
from ._health import judge
from ._job import Handler, Job, JobHealth, Outcome, RunResult, declaration
from ._operations import SchedulerFleet
from ._plan import (
    Attempt,
    Delayed,
    LookAgain,
    OnTime,
    Plan,
    Recheck,
    Replan,
    Serve,
    after_run,
    look,
    plan,
    steer,
)
from ._runner import Runner
from ._runs import Runs
from ._sharing import GRACE, Member, Share
from ._telemetry import Telemetry, logger
from ._triggers import Trigger
from ._validate import Duration, identifier, name, seconds
from ._validate import dsn as valid_dsn

if TYPE_CHECKING:
    import asyncpg
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import TracerProvider
    from starlette.applications import Starlette

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
        self._started_at: datetime | None = None
        self._share = Share(self.owner)  # who attempts each job first (PostgreSQL mode)
        self._looks: list[Entry] = []  # backups' looks due, read together
        self._failing: dict[str, datetime] = {}  # the jobs this replica gave up, since
        self._disagree: dict[str, tuple[str, ...]] = {}  # replicas declaring a job otherwise
        self._fleet = SchedulerFleet(
            self.namespace,
            self.owner,
            self._clock,
            lambda: self._coordinator,
            lambda: self.jobs,
            self.health,
            lambda: self._started_at,
        )

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
        self._share = Share(self.owner)  # no view until this run's first heartbeat
        self._failing.clear()
        self._disagree.clear()
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
            self._started_at = None
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
        """The fleet's state at start (``None`` while the database does not answer, or refuses
        the read: logged, and read again later); with ``require_database=True`` a refusal
        fails the start."""
        if not self._coordinator.ready:
            return None
        try:
            return await self._load()
        except Exception as exc:
            if self._require_database:
                raise StartupError(self._coordinator.explain(exc)) from exc
            logger.error("%s", self._coordinator.explain(exc))
            return None

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
        tg.start_soon(
            self._coordinator.watch,
            self.owner,
            self._declared,
            self._apply,
            self._members,
            name="ticklock.watch",
        )
        self._status = "running"
        self._started_at = now
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
                self._schedule(entry, plan(entry.job, entry.state or _NO_STATE, now))

    async def _drain(self) -> None:
        self._status = "stopping"
        for entry in self._entries.values():
            self._dispatcher.forget(entry)
        if self._runs is not None:
            await self._runs.drain(self.shutdown_grace)
        logger.info("scheduler stopped")

    def _make_postgres(self) -> Coordinator:
        from ._postgres.coordinator import PostgresCoordinator
        from ._postgres.database import Database

        return PostgresCoordinator(
            Database(
                dsn=self._dsn,
                pool=self._pool,
                namespace=self.namespace,
                schema=self.schema,
                clock=self._clock,
                random=self._random,
                require_database=self._require_database,
            )
        )

    def _start_job(self, entry: Entry, now: datetime) -> None:
        entry.since = now
        entry.own_failures, entry.failing_since = 0, None
        job = entry.job
        if not job.enabled:
            return
        self._schedule(entry, plan(job, entry.state or _NO_STATE, now))

    def _schedule(self, entry: Entry, plan: Plan) -> None:
        """Wait for ``plan``: as the job's owner (or to serve a trigger), to attempt it; as a
        backup, to look at it a grace after its slot (see :mod:`._sharing`)."""
        entry.stage = 0
        entry.manual = isinstance(plan, Serve)  # a trigger request: this replica serves it
        attempt = plan.attempt if isinstance(plan, Delayed) else 1
        entry.ahead, entry.observer = self._role(entry, attempt)
        slotted = isinstance(plan, (OnTime, Delayed, Serve))
        lag = GRACE if entry.ahead and slotted else 0.0
        self._dispatcher.schedule(entry, plan, lag)

    def _role(self, entry: Entry, attempt: int) -> tuple[tuple[str, ...], bool]:
        """The replicas ahead of this one for the entry's next attempt (none: it attempts),
        and whether it only observes the job. A retry passes over the replica whose attempt
        failed; a trigger request is served by whichever replica hears of it."""
        if entry.manual:
            return (), False
        state = entry.state
        failed_by = state.last_owner if attempt > 1 and state is not None else None
        return self._share.role(entry.job.id, failed_by)

    def _spawn(self, entry: Entry) -> None:
        assert self._runs is not None
        if entry.ahead:  # a backup's look: read with the others due now, in one statement
            self._looks.append(entry)
            if len(self._looks) == 1:
                self._runs.start(self._look, None, "ticklock.look")
            return
        self._runs.start(self._tick, entry, f"ticklock.run {entry.job.id}")

    async def _look(self, _: None) -> None:
        looks, self._looks = self._looks, []
        states: dict[str, FleetState] | None = None
        held: frozenset[str] = frozenset()
        try:
            with anyio.fail_after(_READ_LIMIT):
                states, held = await self._coordinator.read([entry.job.id for entry in looks])
        except Exception as exc:  # the attempts meet the same error, and report it
            logger.debug("reading the state of %d jobs failed: %s", len(looks), exc)
        finally:  # cancelled (shutdown) too: never leave an entry marked as running
            for entry in looks:
                entry.running = False
        for entry in looks:
            if entry.steered:
                entry.steered = False
                self._coordinator.poke()
            if entry.removed or self._status != "running":
                continue
            try:
                if states is None:
                    self._attempt(entry)
                else:
                    state = states.get(entry.job.id) or FleetState()
                    self._looked(entry, state, entry.job.id in held)
            except Exception:  # a bug in ticklock itself must not stop the job
                logger.exception("internal error in a look at %s", entry.job.id)
                self._schedule(entry, Recheck(entry.job.trigger.period))

    def _looked(self, entry: Entry, state: FleetState, held: bool) -> None:
        """A backup read the job's ``state``, and whether its lock is ``held``: plan from it
        if the fleet moved past the slot, else decide whether to attempt the slot now (see
        :mod:`._sharing`)."""
        job = entry.job
        entry.state = state
        self._share.ran(state.last_owner, state.last_end)
        if entry.own_failures:
            self._judge(entry)
        now, now_m = self._clock.now(), self._clock.monotonic()
        if held:
            entry.held_at = entry.held_at or now  # presume the run succeeds (health)
        held_for = 0.0 if entry.held_at is None else (now - entry.held_at).total_seconds()
        decision = look(
            job,
            state,
            entry.slot,
            entry.attempt,
            held=held,
            held_for=held_for,
            ahead=entry.ahead,
            observer=entry.observer,
            second=entry.stage == 1,
        )
        if not held:
            entry.held_at = None
        match decision:
            case Replan():
                entry.held_at = None
                self._plan(entry, None)
            case LookAgain(after, second, missed):
                self._missed(entry, missed, now)
                entry.stage = 1 if second else entry.stage
                self._dispatcher.requeue(entry, now_m - entry.base + after)
            case Attempt(missed):
                self._missed(entry, missed, now)
                self._dispatcher.forget(entry)
                self._attempt(entry)

    def _missed(self, entry: Entry, owners: tuple[str, ...], at: datetime) -> None:
        news = [owner for owner in owners if not self._share.silent(owner)]
        self._share.missed(owners, at)
        if news:
            logger.info(
                "%s: slot %s was still open %.2f s after its latest fire, its lock free: "
                "%s missed it; this replica passes %s over until %s again",
                entry.job.id,
                entry.slot,
                self._clock.monotonic() - entry.base,
                ", ".join(news),
                "it" if len(news) == 1 else "them",
                "it beats" if len(news) == 1 else "they beat",
                extra={"job_id": entry.job.id},
            )

    def _attempt(self, entry: Entry) -> None:
        assert self._runs is not None
        entry.running = True
        self._runs.start(self._tick, entry, f"ticklock.run {entry.job.id}")

    def _members(self, members: Mapping[str, Member], seen: Mapping[str, datetime]) -> None:
        """A new view of the live replicas: wait for the same slots, each as owner or as
        backup as the view now says."""
        if not self._share.update(members, seen) or self._status != "running":
            return
        for entry in self._entries.values():
            if entry.job.enabled:
                self._disagreement(entry)
            if entry.running or entry.removed or entry.manual or not entry.queued:
                continue
            role = self._role(entry, entry.attempt)
            if role == (entry.ahead, entry.observer):
                continue
            if entry.slot is not None and entry.attempt == 1:  # a slot, not a retry's delay
                # the same slot: an owner at it plus its own jitter, a backup a grace after
                # its latest fire (the owner's jitter is not this replica's)
                self._schedule(entry, OnTime(entry.slot))
            else:
                entry.ahead, entry.observer = role
                self._dispatcher.requeue(entry, GRACE if entry.ahead and entry.slot else 0.0)

    def _disagreement(self, entry: Entry) -> None:
        """Log once per change when live replicas declare the job otherwise than the ruling
        declaration (the one most of them share; between as many, the one whose replicas
        started first)."""
        job_id = entry.job.id
        others = self._share.disagreement(job_id)
        if others == self._disagree.get(job_id, ()):
            return
        if others:
            self._disagree[job_id] = others
            logger.warning(
                "%s: the live replicas declare it differently: %s declare it otherwise than "
                "%s, whose declaration rules (most replicas share it): only they run it; this "
                "replica declares %s",
                job_id,
                ", ".join(others),
                ", ".join(sorted(self._share.ranking(job_id))),
                declaration(entry.job),
                extra={"job_id": job_id},
            )
        else:
            del self._disagree[job_id]
            logger.info("%s: the live replicas declare it alike again", job_id)

    async def _tick(self, entry: Entry) -> None:
        job = entry.job
        assert self._runner is not None
        try:
            result, state = await self._runner.execute(
                job,
                entry.slot,
                entry.fire_at,
                entry.jitter,
                attempt=entry.attempt,
                manual=entry.manual,
            )
        except Exception:  # a bug in ticklock itself must not stop the job
            logger.exception("internal error in a tick of %s", job.id)
            if not entry.removed and self._status == "running":
                self._schedule(entry, Recheck(job.trigger.period))
            return
        finally:
            entry.running = False
        self._after(entry, result, state)

    def _observe(self, entry: Entry, result: RunResult, state: FleetState | None) -> None:
        if state is not None:
            entry.state = state
            entry.held_at = None
            self._share.ran(state.last_owner, state.last_end)
        elif result.outcome is Outcome.LOCKED:
            entry.held_at = result.finished_at

    def _after(self, entry: Entry, result: RunResult, state: FleetState | None) -> None:
        self._observe(entry, result, state)
        if not result.manual:
            self._count(entry, result)
        if entry.steered:  # paused, resumed or triggered while it ran
            entry.steered = False
            self._coordinator.poke()
        if entry.removed or self._status != "running":
            return
        state = entry.state or _NO_STATE
        self._schedule(entry, after_run(entry.job, state, self._clock.now(), result))

    def _count(self, entry: Entry, result: RunResult) -> None:
        """Count this replica's failed runs of the job in a row (since when), and judge
        whether to give the job up or take it back (:meth:`_judge`)."""
        if result.outcome is Outcome.SUCCESS:
            entry.own_failures, entry.failing_since = 0, None
        elif result.outcome in (Outcome.FAILURE, Outcome.TIMEOUT):
            if not entry.own_failures:
                entry.failing_since = result.started_at
            entry.own_failures += 1
        self._judge(entry, result.error)

    def _judge(self, entry: Entry, error: str | None = None) -> None:
        """Give the job up after :data:`GIVE_UP_AFTER` failed runs here in a row while it
        succeeds elsewhere (the fleet's last success came after the first of them): rank
        after every other replica for it. Take it back after a success here, or
        :data:`GIVE_UP_FOR` seconds later (the host may have been fixed)."""
        job_id = entry.job.id
        given = self._failing.get(job_id)
        now = self._clock.now()
        if given is not None:
            if entry.own_failures == 0 or (now - given).total_seconds() > GIVE_UP_FOR:
                del self._failing[job_id]
                entry.own_failures, entry.failing_since = 0, None
                logger.info("%s: this replica runs it again", job_id, extra={"job_id": job_id})
                self._coordinator.poke()
            return
        state, since = entry.state, entry.failing_since
        if (
            entry.own_failures >= GIVE_UP_AFTER
            and since is not None
            and state is not None
            and state.last_success_at is not None
            and state.last_success_at > since
            and self._share.others_can_run(job_id)
        ):
            self._failing[job_id] = now
            logger.warning(
                "%s: this replica's last %d runs failed%s, while it succeeds elsewhere: this "
                "replica gives it up, ranking after every other one for it, for %g minutes "
                "or until a run of it here succeeds",
                job_id,
                entry.own_failures,
                f" (last: {error})" if error else "",
                GIVE_UP_FOR / 60,
                extra={"job_id": job_id},
            )
            self._coordinator.poke()

    def _plan(self, entry: Entry, result: RunResult | None) -> None:
        state = entry.state or _NO_STATE
        self._schedule(entry, plan(entry.job, state, self._clock.now(), result))

    def _declared(self) -> Declared:
        jobs = self._entries.values()
        return Declared(
            tuple(e.job.id for e in jobs if e.job.enabled),
            tuple(e.job.id for e in jobs if not e.job.enabled),
            tuple(e.fingerprint for e in jobs if e.job.enabled),
            tuple(sorted(self._failing)),
        )

    def _apply(self, controls: Mapping[str, Control]) -> None:
        """Obey the operators: stop planning paused jobs, plan resumed ones again from the
        fleet's state (their ``catch_up`` rule), and serve trigger requests."""
        if self._status != "running":
            return
        now = self._clock.now()
        for job_id, entry in self._entries.items():
            if not entry.job.enabled:
                continue
            paused_at, trigger_at = controls.get(job_id, _NO_CONTROL)
            if entry.state is None and paused_at is None and trigger_at is None:
                continue
            old = entry.state or _NO_STATE
            was, asked = old.paused_at, old.trigger_at
            state = entry.state = replace(old, paused_at=paused_at, trigger_at=trigger_at)
            if was is not None and paused_at is None:  # resumed: the pause is not overdue
                base, paused = entry.credit
                if base != state.last_success_at:
                    base, paused = state.last_success_at, 0.0
                entry.credit = (base, paused + max(0.0, (now - was).total_seconds()))
            if entry.running:
                # the run's end plans from the state it read under the lock, which may be
                # older than this: it asks the watch to look again then
                entry.steered |= was != paused_at or asked != trigger_at
                continue
            if entry.removed:
                continue
            toggled = (was is None) != (paused_at is None)
            steered = steer(entry.job, state, now, toggled=toggled, serving=entry.manual)
            if steered is not None:
                self._schedule(entry, steered)

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
            self._schedule(entry, plan(job, state, self._clock.now()))
        return result

    @property
    def fleet(self) -> Fleet:
        """The jobs of this scheduler's namespace as operators see and steer them: in
        PostgreSQL mode the whole fleet's (through this scheduler's pool, while it runs), in
        local mode this process's. The CLI and the dashboard use the same operations."""
        return self._fleet

    async def pause(self, id: str) -> None:
        """Pause job ``id``: no scheduled run of it starts until :meth:`resume` (a run in
        flight finishes). Fleet-wide and persisted in PostgreSQL mode. Manual runs
        (:meth:`trigger`, :meth:`run_now`) still run. Raises ``KeyError`` for an unknown id."""
        await self._fleet.pause(id)

    async def resume(self, id: str) -> None:
        """Undo :meth:`pause`; the next slot follows the job's ``catch_up`` rule."""
        await self._fleet.resume(id)

    async def trigger(self, id: str) -> datetime:
        """Ask the fleet for one run of job ``id`` as soon as possible, and return once the
        request is recorded: some replica that declares the job runs it (slot = the returned
        instant), under the same lock and watermark as any tick, recorded as a manual run.
        A request that no run has served yet is not repeated. Raises ``KeyError`` for a job
        that no live replica runs (unknown, or ``enabled=False``)."""
        return await self._fleet.trigger(id)

    def dashboard(
        self, *, actions: bool = False, allowed_hosts: Iterable[str] | None = None
    ) -> Starlette:
        """An ASGI app showing this scheduler's jobs, their history and the live replicas:
        ``app.mount("/ticklock", scheduler.dashboard())``. ``actions=True`` adds pause,
        resume and trigger buttons (POST, with a CSRF token). ``allowed_hosts`` lists the
        host names the dashboard answers (``"ops.example.com"``, ``"*.example.com"``, ``"*"``);
        without it pages answer any host and actions only ``localhost``. Needs
        ``ticklock[dashboard]``."""
        from ._dashboard import create_app

        return create_app(self._fleet, actions=actions, allowed_hosts=allowed_hosts)

    def health(self, now: datetime | None = None) -> list[JobHealth]:
        """One :class:`JobHealth` per job; ``overdue`` is the absence alarm."""
        clock_now = self._clock.now()
        running = self._status == "running"
        return [
            judge(
                entry.job,
                entry.state or _NO_STATE,
                now=now or clock_now,
                clock_now=clock_now,
                since=entry.since,
                held_at=entry.held_at,
                credit=entry.credit,
                next_fire=entry.fire_at if running else None,
                problem=self._coordinator.problem,
                observer=entry.observer,
            )
            for entry in self._entries.values()
        ]

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
_NO_CONTROL = Control(None, None)
GIVE_UP_AFTER = 3
"""A replica gives a job up after this many of its own runs of it failed in a row."""
GIVE_UP_FOR = 900.0
"""Seconds after which a replica takes back a job it gave up."""
_READ_LIMIT = 5.0  # seconds a backups' look may take before they attempt instead


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _retention_trigger() -> Trigger:
    from ._triggers import every

    # every minute: an hourly batch of 10,000 kept up with 240,000 runs a day, and a fleet
    # running 250 jobs a second records 21 million (the history grew for ever)
    return every(minutes=1, jitter=10)
