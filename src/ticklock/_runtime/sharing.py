"""How the replicas of a fleet share the work: rendezvous hashing over the live replicas.

Every replica ranks the live replicas that declare a job by a hash of (replica, job), highest
first (rendezvous, or highest-random-weight, hashing): the first is the job's owner, which
attempts each slot at its instant, as a lone replica would. The others are its backups. They
do not attempt the slot: :data:`GRACE` after its latest fire each reads the job's state and
whether its lock is held (one statement for every job whose look is due, see ``Dispatcher``).

- The slot was committed, or a run of it ended: nothing to do.
- Its lock is held: a run is in progress; the backups look again once that run must have
  ended (its timeout), and attempt then if the slot is still open and the lock still held
  (the attempt ends a holder past its bound, see ``_postgres``).
- Open, and the lock free: the owner missed it (dead, frozen, or its view differs). Every
  backup notes the owner as *silent*; the first backup attempts at once, and :data:`STEP`
  later every backup still finding it open attempts (those ahead of them missed it too; the
  lock lets one run and the others find it held or done). So a slot whose owners died, however
  many of them, runs about ``GRACE + STEP`` after its latest fire.

A silent replica is passed over in every ranking until it beats again or the fleet's state
shows a run of its (it was paused, or its view differed, not dead), so that the first backup
stands in for it from the next slot on.

Only the replicas whose declaration of the job is the ruling one rank: the declaration most
live replicas share, and between as many the one whose replicas started first (a rolling
deploy's new release rules once most replicas run it), see :meth:`Share.role`. Replicas
that declare it otherwise only observe it. A replica whose own runs of a job kept failing
while others could run it publishes that it gave the job up: it ranks after every other.

Every replica computes the same ranking from the same view. A view that differs (a replica
joined or died, and not every replica has heard yet) costs transactions, never a duplicate: the
lock and the watermark, checked under the lock in the tick's transaction, decide what runs.
When a replica leaves or joins, each job moves only between it and the others (the property
of rendezvous hashing), and an owner's jobs spread over all the others when it dies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from hashlib import blake2b
from typing import NamedTuple

GRACE = 1.0
"""Seconds after a slot's latest fire (slot plus the jitter's maximum) before the backups look."""
STEP = 0.25
"""Seconds after the first look at an open slot before every backup still finding it open
attempts it."""
LIVE = 60.0
"""Seconds after its last heartbeat before a replica leaves the others' view: one that died
or is frozen stays in it (owning its jobs, whose backups stand in a grace after each slot it
misses) until then."""
LOOK_GRID = 0.25
"""Backups' looks are rounded up to this many seconds of the monotonic clock, so that the looks
due close together are read in one statement."""


def _ruling(declarers: list[tuple[datetime, str, str]]) -> str:
    """The ruling fingerprint among (started_at, owner, fingerprint) of a job's declarers: the
    one most of them declare; between as many, the one whose replicas started first."""
    count: dict[str, int] = {}
    first: dict[str, tuple[datetime, str]] = {}
    for started, owner, fp in declarers:
        count[fp] = count.get(fp, 0) + 1
        first[fp] = min(first.get(fp, (started, owner)), (started, owner))
    return min(count, key=lambda fp: (-count[fp], first[fp], fp))


def weight(owner: str, job_id: str) -> int:
    """The rendezvous weight of replica ``owner`` for job ``job_id`` (stable across versions)."""
    digest = blake2b(f"{owner}\x00{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Member(NamedTuple):
    """A live replica as the others see it."""

    jobs: Mapping[str, str]
    """The ids of the enabled jobs it declares, each with the fingerprint of its declaration."""
    failing: frozenset[str]
    """The jobs it gave up: its runs of them kept failing while other replicas could run them."""
    started_at: datetime
    """When it started (between declarations as many replicas share, the one whose replicas
    started first rules)."""
    tasks: frozenset[str] = frozenset()
    """The tasks it has: it may run every stored schedule of them."""


class Role(NamedTuple):
    """This replica's place for one job."""

    ahead: tuple[str, ...]
    """The replicas ranked before it that have not missed a slot since they last beat; empty:
    it attempts each slot itself."""
    observer: bool = False
    """It declares the job otherwise than the ruling declaration: it never attempts a slot."""


_UNRANKED: tuple[tuple[str, ...], frozenset[str]] = ((), frozenset())
"""The ranking of a job no live replica declares (shared: a job costs no entry of its own)."""
_NONE: frozenset[str] = frozenset()
"""No replica declaring a job otherwise (shared)."""
_ALONE = Role(())
"""The role of a replica that attempts each slot itself."""


_VERSIONS = itertools.count(1)
"""Versions of every share in this process: a new share never has an old one's."""


class Share:
    """This replica's view of the live replicas and the jobs each declares, and the role of
    this replica for each job in it."""

    def __init__(self, me: str, task_of: Callable[[str], str | None] = lambda _: None) -> None:
        self.me = me
        self.task_of = task_of
        """The task of a stored schedule (``None``: a job declared in code): the replicas
        that have the task rank for it, in place of those that declare the job."""
        self._members: dict[str, Member] = {}
        self._ranked: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {}  # per view
        self._seen: Mapping[str, datetime] = {}  # each other replica's last heartbeat
        self.silenced: dict[str, datetime] = {}
        """The replicas that missed a slot: a heartbeat after this is news (read-only)."""
        self.version = next(_VERSIONS)
        """Changes whenever a role may have: a new view or heartbeats, a replica found silent
        or back, a job to rank again (a cycle keeps its role until then)."""

    @property
    def members(self) -> Mapping[str, Member]:
        """The live replicas (this one included) and what each declares."""
        return self._members

    def update(self, members: Mapping[str, Member], seen: Mapping[str, datetime]) -> bool:
        """Take a new view, and the replicas' last heartbeats; whether the members or their
        declarations differ from the last view, or a silent replica beat again."""
        self._seen = seen
        self.version = next(_VERSIONS)
        woke = [owner for owner in self.silenced if not self.silent(owner)]
        for owner in woke + [owner for owner in self.silenced if owner not in members]:
            self.silenced.pop(owner, None)  # back, or gone from the view (dead)
        if members == self._members:
            return bool(woke)
        self._members = dict(members)
        self._ranked.clear()
        return True

    def forget(self, job_id: str) -> None:
        """Rank ``job_id`` again when next asked (a stored schedule's task changed)."""
        self._ranked.pop(job_id, None)
        self.version = next(_VERSIONS)

    def missed(self, owners: Iterable[str], at: datetime) -> None:
        """``owners`` left a slot open that this replica found open at ``at``: until one of
        them beats after that (less a grace, for the clocks' skew), it is passed over."""
        since = at - timedelta(seconds=GRACE)
        for owner in owners:
            if owner != self.me:
                self.silenced.setdefault(owner, since)
        self.version = next(_VERSIONS)

    def ran(self, owner: str | None, ended: datetime | None) -> None:
        """``owner`` ran a run that ended at ``ended`` (the fleet's state says so): if that was
        after it was found silent, it is back."""
        if owner is None or ended is None:
            return
        since = self.silenced.get(owner)
        if since is not None and ended > since:
            del self.silenced[owner]
            self.version = next(_VERSIONS)

    def silent(self, owner: str) -> bool:
        """Whether ``owner`` missed a slot and has not beaten since."""
        since = self.silenced.get(owner)
        seen = self._seen.get(owner)
        return since is not None and (seen is None or seen <= since)

    def ranking(self, job_id: str) -> tuple[str, ...]:
        """The live replicas that may run ``job_id``, owner first: those with the ruling
        declaration, the ones that gave it up last."""
        return self._rank(job_id)[0]

    def _rank(self, job_id: str) -> tuple[tuple[str, ...], frozenset[str]]:
        if not self._members:  # no view yet, or alone (local mode): nothing to rank or keep
            return _UNRANKED
        ranked = self._ranked.get(job_id)
        if ranked is None:
            ranked = self._ranked[job_id] = self._order(job_id)
        return ranked

    def _order(self, job_id: str) -> tuple[tuple[str, ...], frozenset[str]]:
        members = self._members
        task = self.task_of(job_id)
        if task is not None:  # a stored schedule: one declaration, the records'
            declared = {o: "" for o, m in members.items() if task in m.tasks}
        else:
            declared = {o: m.jobs[job_id] for o, m in members.items() if job_id in m.jobs}
        if not declared:
            return _UNRANKED
        fingerprints = set(declared.values())
        if len(fingerprints) == 1:  # one declaration: every declarer ranks
            ours, others = list(declared), _NONE
        else:
            ruling = _ruling([(members[o].started_at, o, fp) for o, fp in declared.items()])
            ours = [owner for owner, fp in declared.items() if fp == ruling]
            others = frozenset(owner for owner, fp in declared.items() if fp != ruling)
        suffix = b"\x00" + job_id.encode()
        # (not given up, the weight, the name), highest first; the digest's bytes order as
        # the big-endian weight does
        ours.sort(
            key=lambda o: (
                job_id not in members[o].failing,
                blake2b(o.encode() + suffix, digest_size=8).digest(),
                o,
            ),
            reverse=True,
        )
        return tuple(ours), others

    def role(self, job_id: str, excluding: str | None = None) -> Role:
        """This replica's role for ``job_id``; ``excluding``: a replica passed over (the one
        whose attempt of the slot failed, for its retry), unless it is the only one.

        A replica outside the view (none yet, or it has not published this job) attempts each
        slot itself: attempting costs a transaction, never a run."""
        ranking, others = self._rank(job_id)
        if self.me in others:
            return Role(tuple(ranking), observer=True)
        if self.me not in ranking:
            return _ALONE
        if excluding is not None and excluding in ranking:
            ranking = tuple(o for o in ranking if o != excluding) + (excluding,)
        before = ranking[: ranking.index(self.me)]
        return Role(tuple(o for o in before if not self.silent(o)))

    def others_can_run(self, job_id: str) -> bool:
        """Whether another live replica may run ``job_id`` (with the ruling declaration, and
        not given it up): this replica can give it up."""
        ranking, _ = self._rank(job_id)
        return any(
            owner != self.me and job_id not in self._members[owner].failing for owner in ranking
        )

    def disagreement(self, job_id: str) -> tuple[str, ...]:
        """The live replicas that declare ``job_id`` otherwise than the ruling declaration."""
        return tuple(sorted(self._rank(job_id)[1]))


def owner_of(members: Mapping[str, Member], job_id: str, task: str | None = None) -> str | None:
    """The live replica that runs ``job_id``'s next slot, as the replicas rank it (``None``:
    none declares it; ``task``: a stored schedule's)."""
    share = Share("", lambda _: task)
    share.update(members, {})
    ranking = share.ranking(job_id)
    return ranking[0] if ranking else None
