"""How the replicas of a fleet share the work: rendezvous hashing over the live replicas.

Every replica ranks the live replicas that declare a job by a hash of (replica, job), highest
first (rendezvous, or highest-random-weight, hashing): the first is the job's owner, which
attempts each slot at its instant, as a lone replica would. The others are its backups. They
do not attempt the slot: :data:`GRACE` after its latest fire each reads the job's state (one
statement for every job whose look is due, see ``Dispatcher``), and the first backup attempts a
slot that is still open then; the others wait until the runs of those ahead of them must have
ended (see :func:`turn`). A backup that ran a slot stands in for the owners ahead of it from
then on, until one of them beats again (it was paused, not dead) or a run elsewhere shows it is
back.

Every replica computes the same ranking from the same view. A view that differs (a replica
joined or died, and not every replica has heard yet) costs transactions, never a duplicate: the
lock and the watermark, checked under the lock in the tick's transaction, decide what runs.
When a replica leaves or joins, each job moves only between it and the others (the property
of rendezvous hashing), and an owner's jobs spread over all the others when it dies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from hashlib import blake2b

GRACE = 1.0
"""Seconds after a slot's latest fire (slot plus the jitter's maximum) before the first backup
looks; the ``k``-th backup attempts a slot still open ``k`` graces after it."""
LOOK_GRID = 0.5
"""Backups' looks are rounded up to this many seconds of the monotonic clock, so that the looks
due close together are read in one statement."""


def turn(rank: int, timeout: float) -> float:
    """Seconds after a slot's latest fire at which its ``rank``-th backup attempts it if it is
    still open: a grace for the first (the owner missed it, or runs it still: then the attempt
    finds the lock held, one transaction); for the others, a grace per rank after the job's
    timeout, by when any run ahead has ended or been ended by the server."""
    return rank * GRACE if rank <= 1 else timeout + rank * GRACE


def weight(owner: str, job_id: str) -> int:
    """The rendezvous weight of replica ``owner`` for job ``job_id`` (stable across versions)."""
    digest = blake2b(f"{owner}\x00{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Share:
    """This replica's view of the live replicas and the jobs each declares, and the rank of
    this replica for each job in it."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._members: dict[str, frozenset[str]] = {}
        self._ranked: dict[str, tuple[str, ...]] = {}  # per job, cleared when the view changes
        self._seen: Mapping[str, datetime] = {}  # each other replica's last heartbeat
        self._silent: dict[str, datetime] = {}  # missed a slot: a heartbeat after this is news

    @property
    def members(self) -> Mapping[str, frozenset[str]]:
        """The live replicas (this one included) and the ids of the jobs each runs."""
        return self._members

    def update(self, members: Mapping[str, frozenset[str]], seen: Mapping[str, datetime]) -> bool:
        """Take a new view, and the replicas' last heartbeats; whether the members or their
        jobs differ from the last view, or a replica that missed a slot beat again."""
        self._seen = seen
        woke = [owner for owner in self._silent if not self.silent(owner)]
        for owner in woke + [owner for owner in self._silent if owner not in members]:
            self._silent.pop(owner, None)  # back, or gone from the view (dead)
        if members == self._members:
            return bool(woke)
        self._members = dict(members)
        self._ranked.clear()
        return True

    def missed(self, owners: Iterable[str], at: datetime) -> None:
        """``owners`` left a slot open that this replica ran at ``at``: until one of them
        beats after that (less a grace, for the clocks' skew), this replica stands in for it."""
        since = at - timedelta(seconds=GRACE)
        for owner in owners:
            self._silent[owner] = since

    def silent(self, owner: str) -> bool:
        """Whether ``owner`` missed a slot and has not beaten since."""
        since = self._silent.get(owner)
        seen = self._seen.get(owner)
        return since is not None and (seen is None or seen <= since)

    def ranking(self, job_id: str) -> tuple[str, ...]:
        """The live replicas that run ``job_id``, owner first."""
        ranked = self._ranked.get(job_id)
        if ranked is None:
            candidates = [owner for owner, jobs in self._members.items() if job_id in jobs]
            candidates.sort(key=lambda owner: (weight(owner, job_id), owner), reverse=True)
            ranked = self._ranked[job_id] = tuple(candidates)
        return ranked

    def ahead(self, job_id: str, passed: frozenset[str] = frozenset()) -> tuple[str, ...]:
        """The replicas ranked before this one for ``job_id``, but for those in ``passed``
        (which missed a slot that this replica then ran) that have not beaten since. Empty:
        this replica attempts each slot itself, as it does when it is not in the view at all
        (none yet, or it has not beaten since it declared the job): attempting costs a
        transaction, never a run."""
        ranking = self.ranking(job_id)
        if self.me not in ranking:
            return ()
        before = ranking[: ranking.index(self.me)]
        return tuple(o for o in before if o not in passed or not self.silent(o))
