"""A schedule stored as data: its record, its validation when it is written, the JSON the
records keep of it, and the job a replica with its task builds from it.

A stored schedule is a job whose declaration lives in the database instead of in code (see
``docs/schedules.md``): its ``task`` names the handler (``@scheduler.task(name)``), its
``args`` reach the handler as ``ctx.args``. Its declaration is kept in the job's record (the
spec of :mod:`.spec`, with the keys of :func:`to_json`), beside the job's state, and its
``version`` grows by one with each change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol

from .._errors import ScheduleError
from . import spec as _spec
from .job import Handler, Job, JobOptions
from .triggers import Cron, Every, Trigger
from .validate import name

MAX_ARGS = 64 * 1024
"""The most bytes a schedule's ``args`` may take as JSON."""
OPTIONS = tuple(key for key in JobOptions.__annotations__ if key != "id")
"""The keywords of ``schedules.put()`` that shape the job (those of ``job()`` but ``id``)."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """A stored schedule, as ``scheduler.schedules.get()`` and ``put()`` return it."""

    id: str
    """Its id, in the namespace's job ids (its lock, watermark, history and metrics)."""
    task: str
    """The name of the handler that runs it (``@scheduler.task(name)``)."""
    trigger: Trigger
    args: Mapping[str, Any]
    """A JSON object, given to the handler as ``ctx.args``."""
    tenant: str | None
    """Whose it is: ``schedules.list(tenant=...)`` and the dashboard filter by it."""
    options: Mapping[str, Any]
    """The job options it was put with (``timeout``, ``retries``...), durations in seconds."""
    version: int
    """1 when created, one more with each change."""
    created_at: datetime
    updated_at: datetime

    @property
    def schedule(self) -> str:
        """The trigger as operators read it (``every 15m``, ``cron '0 9 * * 1-5' UTC``)."""
        return self.trigger.describe()


@dataclass(frozen=True, slots=True)
class Definition:
    """A validated ``put``: what the records keep, and the job it makes."""

    id: str
    task: str
    trigger: Trigger
    args: Mapping[str, Any]
    tenant: str | None
    options: Mapping[str, Any]
    job: Job
    """The job built with a placeholder handler: its spec and first slot are the records'."""

    def same(self, other: Schedule) -> bool:
        """Whether ``other`` already is this definition (a put that changes nothing)."""
        return (
            other.task == self.task
            and other.trigger == self.trigger
            and dict(other.args) == dict(self.args)
            and other.tenant == self.tenant
            and dict(other.options) == dict(self.options)
        )


async def _placeholder(ctx: object) -> None:
    """The handler a definition is validated with (a replica runs the task's own)."""


def define(
    schedule_id: object,
    task: object,
    trigger: object,
    args: object,
    tenant: object,
    options: Mapping[str, object],
) -> Definition:
    """Validate a ``put`` and return its definition; raises :class:`ScheduleError` naming
    the schedule and the field."""
    sid = name(schedule_id, "id")

    def error(field: str, message: str) -> ScheduleError:
        return ScheduleError(message, job_id=sid, field=field, what="schedule")

    try:
        task_name = name(task, "task")
        tenant_name = None if tenant is None else name(tenant, "tenant")
    except ScheduleError as exc:
        raise error(exc.field or "task", str(exc)) from None
    if not isinstance(trigger, (Every, Cron)):
        raise error("trigger", f"trigger must be every(...) or cron(...), got {trigger!r}")
    arguments = _args(args, error)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        known = ", ".join(OPTIONS)
        raise error(unknown[0], f"unknown keyword {unknown[0]}= (a schedule takes {known})")
    try:
        keywords: Any = options  # checked by declare(), which names what it refuses
        job = Job.declare(_placeholder, trigger, id=sid, **keywords)
    except ScheduleError as exc:
        message = str(exc).removeprefix(f"job {sid!r}: ")
        raise error(exc.field or "trigger", message) from None
    given = {key: getattr(job, key) for key in OPTIONS if key in options}
    job = replace(job, task=task_name, args=arguments, tenant=tenant_name)
    return Definition(sid, task_name, trigger, arguments, tenant_name, given, job)


def _args(args: object, error: Any) -> Mapping[str, Any]:
    """``args`` as the JSON object the records keep (a copy the caller cannot change)."""
    if args is None:
        return MappingProxyType({})
    if not isinstance(args, Mapping):
        raise error("args", f"args must be a JSON object (a dict), got {type(args).__name__}")
    try:
        text = json.dumps(args, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise error("args", f"args must be a JSON object: {exc}") from None
    size = len(text.encode())
    if size > MAX_ARGS:
        raise error("args", f"args must take at most {MAX_ARGS} bytes as JSON, got {size}")
    if "\\u0000" in text:
        raise error("args", "args must not contain NUL characters (jsonb cannot store them)")
    value = json.loads(text)  # its keys as JSON has them (str), a copy of its values
    return MappingProxyType(value)


def trigger_from_json(value: Mapping[str, Any]) -> Trigger:
    """The trigger a spec keeps (raises ``KeyError``, ``ValueError``...)."""
    if "every" in value:
        return Every(float(value["every"]), float(value["jitter"]), float(value["initial_delay"]))
    return Cron(str(value["cron"]), str(value["tz"]), float(value["jitter"]))


def to_json(
    definition: Definition, version: int, created_at: datetime, updated_at: datetime
) -> dict[str, Any]:
    """The record's spec for ``definition``: the job's spec (what operators and the ledger
    read of any job) and the schedule's own keys."""
    return {
        **_spec.to_json(_spec.of(definition.job)),
        "task": definition.task,
        "args": dict(definition.args),
        "tenant": definition.tenant,
        "options": {k: _plain(v) for k, v in definition.options.items()},
        "version": version,
        "created_at": created_at.isoformat(),
        "updated_at": updated_at.isoformat(),
    }


def _plain(value: Any) -> Any:
    """An option's value as JSON keeps it: an instant as ISO 8601 (an infinite duration
    cannot be an option)."""
    if isinstance(value, datetime):
        return value.isoformat()
    return value if not isinstance(value, float) or math.isfinite(value) else None


INSTANTS = ("start", "end")
"""The options that are instants (kept as ISO 8601 text)."""


def _options(value: Mapping[str, Any]) -> dict[str, Any]:
    """The options a record keeps, as ``put`` took them (instants as datetimes)."""
    return {
        k: datetime.fromisoformat(v) if k in INSTANTS and isinstance(v, str) else v
        for k, v in value.items()
    }


def from_json(schedule_id: str, value: Any) -> Schedule | None:
    """The schedule a record's spec holds; ``None`` for a code job's spec, a deleted
    schedule's, or one this release cannot read."""
    if not isinstance(value, Mapping) or "task" not in value or value.get("deleted_at"):
        return None
    try:
        return Schedule(
            id=schedule_id,
            task=str(value["task"]),
            trigger=trigger_from_json(value),
            args=MappingProxyType(dict(value["args"])),
            tenant=None if value["tenant"] is None else str(value["tenant"]),
            options=MappingProxyType(_options(value["options"])),
            version=int(value["version"]),
            created_at=datetime.fromisoformat(value["created_at"]),
            updated_at=datetime.fromisoformat(value["updated_at"]),
        )
    except (KeyError, TypeError, ValueError, ScheduleError):
        return None


def job_of(schedule: Schedule, handler: Handler) -> Job:
    """The job a replica runs for ``schedule`` with its task's ``handler`` (validated when
    the schedule was written: a schedule written by another release that this one refuses
    raises :class:`ScheduleError`)."""
    keywords: Any = schedule.options
    job = Job.declare(handler, schedule.trigger, id=schedule.id, **keywords)
    return replace(
        job,
        task=schedule.task,
        args=schedule.args,
        tenant=schedule.tenant,
        version=schedule.version,
        defined_at=schedule.updated_at,
    )


def unknown_task(schedule_id: str, task: str) -> ScheduleError:
    """The error of a put whose task neither the writer nor a live replica has."""
    return ScheduleError(
        f"task {task!r} is not declared by this scheduler nor by any live replica: declare it "
        f"with @scheduler.task({task!r}) in the replicas that should run it (a process that "
        "only writes schedules declares the tasks it writes, or writes while a replica runs)",
        job_id=schedule_id,
        field="task",
        what="schedule",
    )


def declared_in_code(schedule_id: str) -> ScheduleError:
    """The error of a put whose id is a job declared in code."""
    return ScheduleError(
        "a job declared in code has this id: a schedule's id must differ from every job's",
        job_id=schedule_id,
        field="id",
        what="schedule",
    )


class ScheduleStore(Protocol):
    """Where stored schedules live: written by the application, read by the replicas that
    have their tasks. Each write is audited and numbered: :meth:`changes` gives what changed
    since a number, in the order the writes committed."""

    async def put(
        self,
        definition: Definition,
        *,
        who: str,
        note: str | None,
        tasks: Collection[str],
        jobs: Collection[str],
    ) -> Schedule:
        """Create or replace the schedule atomically (a put that changes nothing keeps its
        version); ``tasks`` and ``jobs``: those the writing scheduler declares itself, besides
        the live replicas'. Raises :class:`~ticklock.ScheduleError` for a task no one has, or
        the id of a job declared in code."""
        ...

    async def get(self, schedule_id: str) -> Schedule | None:
        """The stored schedule, or ``None``."""
        ...

    async def delete(self, schedule_id: str, *, who: str, note: str | None) -> bool:
        """Delete the schedule (its history stays); whether it existed."""
        ...

    async def page(
        self, tenant: str | None, task: str | None, after: str | None, limit: int
    ) -> list[Schedule]:
        """Up to ``limit`` schedules by id, after ``after``, of ``tenant`` and ``task``."""
        ...

    async def changes(self, since: int) -> tuple[int, list[str]]:
        """The number of the last write, and the ids written after write ``since``."""
        ...

    async def read(self, tasks: Collection[str], ids: Collection[str]) -> list[Schedule]:
        """The schedules of ``tasks`` among ``ids``."""
        ...

    async def due(
        self,
        tasks: Collection[str],
        now: datetime,
        until: datetime,
        limit: int,
        after: str | None = None,
    ) -> tuple[list[Schedule], str | None]:
        """Of the schedules of ``tasks`` due by ``until`` (their next slot, as the records say
        at ``now``, or a trigger request), not paused, by id, those after the id ``after``
        when given: a page of up to ``limit`` records (those this release can read), and the
        ``after`` of the next page (``None``: this was the last)."""
        ...
