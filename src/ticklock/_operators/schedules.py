"""Schedules as data: what an application writes and reads of its stored schedules, through
:attr:`Scheduler.schedules <ticklock.Scheduler.schedules>` (or a fleet's, for the CLI)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from typing_extensions import Unpack

from .._errors import ScheduleError
from .._schedule.job import JobOptions
from .._schedule.stored import Schedule, ScheduleStore, define
from .._schedule.triggers import Trigger
from .fleet import caller, said

MAX_PAGE = 1000
"""The most schedules one :meth:`Schedules.list` returns."""


class Schedules:
    """The namespace's stored schedules::

        s = await scheduler.schedules.put(
            "report:acme", task="send-report", trigger=cron("0 9 * * 1-5", tz="America/New_York"),
            args={"tenant": "acme"}, tenant="acme", timeout=60)
        await scheduler.schedules.get("report:acme")      # the Schedule, or None
        await scheduler.schedules.list(tenant="acme")     # by id, keyset-paged with after=
        await scheduler.schedules.delete("report:acme")   # True when it existed

    Every write is atomic and audited (``who``, default this process's ``user@host``, and
    ``note``); the fleet obeys it within a second (see ``docs/schedules.md``).
    """

    def __init__(
        self,
        store: Callable[[], ScheduleStore],
        tasks: Callable[[], Collection[str]],
        jobs: Callable[[], Collection[str]],
    ) -> None:
        self._store = store
        self._tasks = tasks
        self._jobs = jobs

    async def put(
        self,
        id: str,
        /,
        *,
        task: str,
        trigger: Trigger,
        args: Mapping[str, Any] | None = None,
        tenant: str | None = None,
        who: str | None = None,
        note: str | None = None,
        **options: Unpack[JobOptions],
    ) -> Schedule:
        """Create or replace the schedule ``id`` and return it as stored: ``version`` 1 when
        created, one more per change (a put that changes nothing keeps it).

        :param task: The name of the handler that runs it (``@scheduler.task(name)``): this
            scheduler's or a live replica's.
        :param trigger: :func:`~ticklock.every` or :func:`~ticklock.cron`.
        :param args: A JSON object of at most 64 KiB, given to the handler as ``ctx.args``.
        :param tenant: Whose schedule it is (``list(tenant=...)`` filters by it).

        The other keywords are those of :meth:`Scheduler.job <ticklock.Scheduler.job>` but
        ``id`` (``timeout``, ``retries``, ``catch_up``...). Raises
        :class:`~ticklock.ScheduleError` naming the schedule and the field for anything that
        could not run: an unknown task, a bad trigger, option or args, an id or tenant that
        is empty or over 200 characters, the id of a job declared in code."""
        definition = define(id, task, trigger, args, tenant, options)
        note, who = said(note, who or caller())
        store = self._store()
        return await store.put(
            definition, who=who, note=note, tasks=self._tasks(), jobs=self._jobs()
        )

    async def get(self, id: str, /) -> Schedule | None:
        """The stored schedule ``id``, or ``None``."""
        return await self._store().get(_id(id))

    async def delete(self, id: str, /, *, who: str | None = None, note: str | None = None) -> bool:
        """Delete the schedule ``id``: no slot of it starts once the fleet heard (within a
        second); a run in flight finishes. Its history stays until retention prunes it.
        Returns whether it existed. Audited as :meth:`put`."""
        note, who = said(note, who or caller())
        return await self._store().delete(_id(id), who=who, note=note)

    async def list(
        self,
        *,
        tenant: str | None = None,
        task: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Schedule]:
        """Up to ``limit`` (at most 1,000) schedules ordered by id, of ``tenant`` and of
        ``task`` when given; the next page starts ``after`` the last id of this one."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_PAGE:
            raise ScheduleError(
                f"limit must be a whole number from 1 to {MAX_PAGE}, got {limit!r}", field="limit"
            )
        for field, value in (("tenant", tenant), ("task", task), ("after", after)):
            if value is not None and not isinstance(value, str):
                raise ScheduleError(f"{field} must be a string, got {value!r}", field=field)
        return await self._store().page(tenant, task, after, limit)


def _id(value: object) -> str:
    if not isinstance(value, str):
        raise ScheduleError(f"a schedule's id must be a string, got {value!r}", field="id")
    return value
