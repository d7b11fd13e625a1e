"""The replicas share the jobs: rendezvous hashing (pure), and replicas that attempt only the
slots of the jobs they own, hand them over when they leave, and stand in for a silent owner."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone
from random import Random
from typing import Any

import anyio
import pytest

from helpers import eventually, run_log
from ticklock import JobContext, Scheduler, every
from ticklock._runtime.sharing import Member, Share, weight
from ticklock._schedule.triggers import Trigger
from ticklock.testing import ManualClock, MemoryDatabase

JOBS = [f"job-{i}" for i in range(1000)]
WEB1_PURGE = 0xB1E13F9E4719F652  # blake2b("web-1\\x00purge"), first 8 bytes, big-endian
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def member(jobs: list[str], fp: str = "same", failing: frozenset[str] = frozenset()) -> Member:
    return Member(dict.fromkeys(jobs, fp), failing, T0)


def view(*owners: str, jobs: list[str] = JOBS) -> dict[str, Member]:
    return {owner: member(jobs) for owner in owners}


def owners_of(share: Share) -> dict[str, str]:
    return {job: share.ranking(job)[0] for job in JOBS}


def test_every_replica_ranks_the_same_and_the_jobs_spread_evenly() -> None:
    shares = [Share(me) for me in ("a", "b", "c", "d")]
    for share in shares:
        share.update(view("a", "b", "c", "d"), {})
    assert len({tuple(share.ranking(job) for job in JOBS) for share in shares}) == 1
    counts = Counter(owners_of(shares[0]).values())
    assert set(counts) == {"a", "b", "c", "d"}
    assert all(200 <= n <= 300 for n in counts.values()), counts
    # each replica is ahead of no one for exactly the jobs it owns
    for share in shares:
        mine = [job for job in JOBS if share.role(job).ahead == ()]
        assert len(mine) == counts[share.me]


def test_a_replica_leaving_moves_only_its_own_jobs() -> None:
    share = Share("a")
    share.update(view("a", "b", "c", "d"), {})
    before = owners_of(share)
    assert share.update(view("a", "b", "c"), {})
    after = owners_of(share)
    moved = {job for job in JOBS if before[job] != after[job]}
    assert moved == {job for job in JOBS if before[job] == "d"}
    # and they go to whoever ranked second for them: spread over all the others
    assert {after[job] for job in moved} == {"a", "b", "c"}
    assert not share.update(view("a", "b", "c"), {})  # the same view is no change


def test_only_the_replicas_that_declare_a_job_rank_for_it() -> None:
    share = Share("a")
    share.update({"a": member(JOBS), "old": member(JOBS[:10])}, {})
    assert all(share.ranking(job) == ("a",) for job in JOBS[10:])
    assert all(set(share.ranking(job)) == {"a", "old"} for job in JOBS[:10])


def test_a_replica_outside_the_view_attempts_everything_and_silent_owners_are_passed_over() -> None:
    share = Share("me")
    assert share.role("job-1").ahead == ()  # no view yet: attempt (a transaction, never a run)
    share.update(view("x", "y"), {})
    assert share.role("job-1").ahead == ()  # not in the view (has not beaten yet)
    share.update(view("me", "x", "y"), {})
    job = next(j for j in JOBS if share.ranking(j)[-1] == "me")  # this replica ranks last
    ahead = share.role(job).ahead
    assert ahead == share.ranking(job)[:2]
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    share.update(view("me", "x", "y"), dict.fromkeys(ahead, t))
    share.missed(ahead[:1], t + timedelta(seconds=5))
    assert share.role(job).ahead == ahead[1:]
    share.missed(ahead, t + timedelta(seconds=5))
    assert share.role(job).ahead == ()
    # a heartbeat from before the miss (less a grace) is no news
    assert not share.update(view("me", "x", "y"), {o: t + timedelta(seconds=4) for o in ahead})
    assert share.role(job).ahead == ()
    # one of them beats after it: it was paused, not dead, and is ahead again
    assert share.update(view("me", "x", "y"), {ahead[0]: t + timedelta(seconds=6)})
    assert share.role(job).ahead == ahead[:1]


def test_a_retry_passes_over_the_replica_that_failed_it_and_those_that_gave_up_rank_last() -> None:
    share = Share("me")
    share.update(view("me", "x", "y"), {})
    job = next(j for j in JOBS if share.ranking(j)[1] == "me")  # this replica ranks second
    owner = share.ranking(job)[0]
    assert share.role(job).ahead == (owner,)
    assert share.role(job, owner).ahead == ()  # the owner's attempt failed: this one retries
    assert share.role(job, "me").ahead == share.ranking(job)[::2]  # this one failed: the others
    members = view("me", "x", "y")
    members[owner] = member(JOBS, failing=frozenset({job}))
    share.update(members, {})
    assert share.ranking(job)[-1] == owner  # it gave the job up: it ranks after every other
    assert share.role(job).ahead == ()
    assert share.others_can_run(job)
    members = {o: member(JOBS, failing=frozenset({job})) for o in ("me", "x", "y")}
    members["me"] = member(JOBS)
    share.update(members, {})
    assert not share.others_can_run(job)  # the others gave it up too: nobody to hand it to


def test_the_declaration_most_replicas_share_rules_and_the_others_only_observe() -> None:
    share = Share("me")
    later = T0 + timedelta(minutes=5)
    old, new = member(JOBS[:1], fp="old"), Member({JOBS[0]: "new"}, frozenset(), later)
    share.update({"me": old, "x": old, "n1": new}, {})  # one host declares it otherwise
    assert set(share.ranking(JOBS[0])) == {"me", "x"}
    assert share.disagreement(JOBS[0]) == ("n1",)
    share.update({"me": old, "x": old, "n1": new, "n2": new}, {})  # as many: the one in force
    assert set(share.ranking(JOBS[0])) == {"me", "x"}
    share.update({"me": old, "n1": new, "n2": new}, {})  # most run the new release: it rules
    assert set(share.ranking(JOBS[0])) == {"n1", "n2"}
    assert share.role(JOBS[0]) == (share.ranking(JOBS[0]), True)  # an observer: never attempts
    assert share.disagreement(JOBS[0]) == ("me",)


def test_the_weight_is_stable() -> None:
    # replicas of different releases must agree on who owns what
    assert weight("web-1", "purge") == WEB1_PURGE
    assert weight("web-1", "purge") != weight("web-2", "purge")


def test_the_ranking_is_by_weight_highest_first_given_ups_last() -> None:
    # the ranking hashes inline (for speed): it must order as the stable weight does
    rnd = Random(7)
    started = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for _ in range(200):
        owners = sorted({f"web-{rnd.randrange(10**6)}" for _ in range(rnd.randint(1, 9))})
        job = f"job-{rnd.randrange(10**6)}"
        gave_up = {o for o in owners if rnd.random() < 0.2}
        share = Share(owners[0])
        share.update(
            {
                o: Member({job: "fp"}, frozenset({job} if o in gave_up else ()), started)
                for o in owners
            },
            {},
        )
        expected = sorted(owners, key=lambda o: (o not in gave_up, weight(o, job), o), reverse=True)
        assert share.ranking(job) == tuple(expected)


# -- a backup in local mode: its owner is given, and never runs (deterministic) --------------


def ahead_of(me: str, job_id: str) -> str:
    """A replica name that ranks before ``me`` for ``job_id``."""
    return next(o for o in (f"o{i}" for i in range(100)) if weight(o, job_id) > weight(me, job_id))


class Backup:
    """A scheduler named "backup" on a ManualClock and a MemoryDatabase, with one job "job",
    recording each run's start and slot in seconds from the clock's start; the other replicas
    of the database are silent (frozen or dead before their heartbeat went stale)."""

    def __init__(self, trigger: Trigger, random: Random | None = None, **options: Any) -> None:
        self.clock = ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc))
        self.db = MemoryDatabase()
        self.scheduler = Scheduler(
            database=self.db, clock=self.clock, owner="backup", random=random
        )
        self.starts: list[float] = []
        self.slots: list[float] = []
        self.others: set[str] = set()
        t0 = self.clock.now()

        async def job(ctx: JobContext) -> None:
            self.starts.append((ctx.started_at - t0).total_seconds())
            self.slots.append((ctx.slot - t0).total_seconds())

        self.scheduler.add(job, trigger, id="job", **options)

    def view(self, *others: str, seen: dict[str, datetime] | None = None) -> None:
        """The live replicas are this one and ``others``, which declare the job alike (and
        beat at ``seen``)."""
        for owner in self.others - set(others):
            self.db.leave(owner)
        for owner in others:
            if owner not in self.others:
                self.db.silent_replica(owner, self.scheduler.jobs.values(), self.clock.now())
        self.others = set(others)
        for owner, at in (seen or {}).items():
            self.db.beat(owner, at)


@pytest.mark.anyio
async def test_a_backup_runs_a_slot_its_owner_left_open_a_grace_late_then_stands_in() -> None:
    b = Backup(every(10, initial_delay=5))
    # the job's owner is another replica, which never runs it (killed)
    with run_log() as log:
        async with b.scheduler:
            b.view(ahead_of("backup", "job"))
            await b.clock.advance(5.9)  # the slot at 5 s is the owner's
            assert b.starts == []  # and a backup waits a grace (1 s) after it
            await b.clock.advance(0.6)
            assert b.starts == [6.0]  # the slot is still open: the backup runs it
            # from now on it stands in for the owner: on time, without a look
            await b.clock.advance(10)
            assert b.starts == [6.0, 16.0]
            await b.clock.advance(10)
            assert b.starts == [6.0, 16.0, 26.0]
    assert log.outcomes("job") == ["success"] * 3


@pytest.mark.anyio
async def test_a_backup_does_not_attempt_a_slot_it_finds_committed() -> None:
    b = Backup(every(10, initial_delay=5))
    with run_log() as log:
        async with b.scheduler:
            b.view(ahead_of("backup", "job"))
            await b.clock.advance(5.5)
            # the owner's run, committed where the backup reads the state (here: in-process)
            await b.scheduler.run_now("job")
            await b.clock.advance(3)  # past the slot's grace: the look finds the fleet moved on
            assert b.starts == [5.5]
            await b.clock.advance(7.5)  # and the next slot (15.5) is the owner's again
            assert b.starts == [5.5]
    assert log.outcomes("job") == ["success"]  # no attempt found it locked or done


@pytest.mark.anyio
async def test_a_stand_in_hands_the_job_back_when_the_owner_beats_again() -> None:
    b = Backup(every(10, initial_delay=5))
    owner = ahead_of("backup", "job")
    async with b.scheduler:
        b.view(owner, seen={owner: b.clock.now()})
        await b.clock.advance(6.5)
        assert b.starts == [6.0]  # the owner missed slot 5: stood in
        await b.clock.advance(10)
        assert b.starts == [6.0, 16.0]  # on time, for the owner
        b.view(owner, seen={owner: b.clock.now()})  # the owner beats again (was paused)
        await b.clock.advance(11)
        # a backup again: it looked at slot 26 a grace late (and, nobody running it here,
        # ran it and stood in again)
        assert b.starts == [6.0, 16.0, 27.0]


@pytest.mark.anyio
async def test_a_view_change_keeps_the_slot_waited_for() -> None:
    b = Backup(every(60, jitter=30, initial_delay=60), catch_up=False, timeout=5)
    async with b.scheduler:
        b.view(ahead_of("backup", "job"))
        await b.clock.advance(64)  # slot 60 passed; its owner waits on its jitter
        b.view()  # and leaves before firing
        await b.clock.advance(40)
    assert b.slots[:1] == [60.0]  # the slot moved to this replica; it was not skipped


class NoJitter(Random):
    """Draws no jitter: this replica's own fire is the slot itself."""

    def uniform(self, a: float, b: float) -> float:
        return a


@pytest.mark.anyio
async def test_an_owner_that_becomes_a_backup_waits_for_the_latest_fire_not_its_own() -> None:
    b = Backup(every(60, jitter=30, initial_delay=60), random=NoJitter(), timeout=5)
    async with b.scheduler:
        await b.clock.advance(1)  # no view: it waits for slot 60 as its owner (jitter 0)
        b.view(ahead_of("backup", "job"))  # now the other replica owns it, firing by 90
        await b.clock.advance(89)
        assert b.starts == []  # it did not look before the owner's latest fire and a grace
        await b.clock.advance(2)
        assert b.starts == [91.0]  # open then (nobody runs it here): the backup runs it


@pytest.mark.anyio
async def test_a_slot_whose_two_first_replicas_died_runs_a_grace_and_a_step_late() -> None:
    b = Backup(every(10, initial_delay=3600), timeout=8)
    first, second = sorted((f"o{i}" for i in range(100)), key=lambda o: -weight(o, "job"))[:2]
    assert weight(second, "job") > weight("backup", "job")  # this replica is the 2nd backup
    async with b.scheduler:
        await b.scheduler.run_now("job")  # the last success, at 0: the next slot is 10
        b.view(first, second)
        await b.clock.advance(11)
        # the look at 11 found slot 10 open and its lock free: the owner missed it, and the
        # first backup attempts now; this one looks again a step later
        assert b.starts == [0.0]
        assert [h.overdue for h in b.scheduler.health()] == [False]
        await b.clock.advance(0.25)
        assert b.starts == [0.0, 11.25]  # still open: the first backup missed it too
        await b.clock.advance(10)
        assert b.starts == [0.0, 11.25, 21.25]  # it stands in for both, on time


@pytest.mark.anyio
async def test_a_backup_that_finds_the_lock_held_waits_for_the_run_and_calls_nothing_overdue() -> (
    None
):
    b = Backup(every(10, initial_delay=10), timeout=5, overdue_grace=1)
    owner = ahead_of("backup", "job")
    with run_log() as log:
        async with b.scheduler:
            b.view(owner)
            # the owner's run of slot 10, holding the job's lock (here: in-process)
            held = await b.db.coordinator(owner, b.clock).attempt("job", 5, b.clock.now())
            assert held.acquired
            await b.clock.advance(11)
            assert b.starts == []  # the look at 11 found the lock held: a run is in progress
            await b.clock.advance(6.5)
            assert [h.overdue for h in b.scheduler.health()] == [False]  # presumed to succeed
            assert b.starts == []
            assert log.outcomes("job") == []
            await b.clock.advance(0.5)  # 10 + 1 + 5 + 2: still open and held past any run's bound
            assert b.starts == []
            assert log.outcomes("job") == ["locked"]  # so it attempted (and ends such a holder)
            await held.close()


# -- replicas in one process, on PostgreSQL -------------------------------------------------


def _replica(pg_dsn: str, schema: str, owner: str, jobs: int) -> Scheduler:
    scheduler = Scheduler(pg_dsn, schema=schema, owner=owner, shutdown_grace=1)

    async def run(ctx: JobContext) -> None:
        pass

    for i in range(jobs):
        scheduler.add(run, every(0.5), id=f"job-{i}", timeout=0.4)
    return scheduler


async def _agreed(schedulers: list[Scheduler]) -> None:
    async def agreed() -> bool:
        return all(len(s._crew.share.members) == len(schedulers) for s in schedulers)

    await eventually(agreed, 10, "every replica to see the others")


@pytest.mark.anyio
@pytest.mark.postgres
async def test_each_slot_is_attempted_by_its_owner_alone(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    owners = ["a", "b", "c"]
    schedulers = [_replica(pg_dsn, pg_schema, owner, 24) for owner in owners]
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await _agreed(schedulers)
        # the slots planned before the views agreed, and the owners passed over meanwhile
        await anyio.sleep(3)
        with run_log() as log:
            since = await pg_conn.fetchval("SELECT clock_timestamp()")
            await anyio.sleep(3)
            until = await pg_conn.fetchval("SELECT clock_timestamp()")
        share = schedulers[0]._crew.share  # before they leave
        expected = {(f"job-{i}", share.ranking(f"job-{i}")[0]) for i in range(24)}
    outcomes = Counter(run.outcome for run in log.runs if run.job_id != "ticklock.retention")
    # every replica tried only its own jobs: no transaction found the lock held or the slot done
    assert outcomes["locked"] == outcomes["skipped"] == 0, outcomes
    assert outcomes["success"] >= 24 * 4, outcomes
    rows = await pg_conn.fetch(
        f"SELECT job_id, owner FROM {pg_schema}.runs WHERE started_at BETWEEN $1 AND $2 "
        "AND job_id <> 'ticklock.retention'",
        since,
        until,
    )
    assert {(r["job_id"], r["owner"]) for r in rows} == expected
    assert {r["owner"] for r in rows} == set(owners)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_a_replica_that_leaves_hands_its_jobs_over_at_once(
    pg_dsn: str, pg_schema: str, pg_conn: Any, caplog: pytest.LogCaptureFixture
) -> None:
    leaving, *staying = [_replica(pg_dsn, pg_schema, owner, 24) for owner in ("a", "b", "c")]
    async with AsyncExitStack() as stack:
        for scheduler in staying:
            await stack.enter_async_context(scheduler)
        async with leaving:  # left as a graceful shutdown leaves
            await _agreed([leaving, *staying])
            theirs = [
                f"job-{i}" for i in range(24) if leaving._crew.share.role(f"job-{i}").ahead == ()
            ]
            assert theirs
            await anyio.sleep(1)
        left = await pg_conn.fetchval("SELECT clock_timestamp()")
        with caplog.at_level(logging.INFO, logger="ticklock"):
            await anyio.sleep(3)
    assert "missed it" not in caplog.text  # no look found a slot left open
    rows = await pg_conn.fetch(
        f"SELECT job_id, owner, count(*) FROM {pg_schema}.runs WHERE started_at > $1 "
        "AND outcome = 'success' GROUP BY 1, 2",
        left,
    )
    taken = {r["job_id"]: (r["owner"], r["count"]) for r in rows if r["job_id"] in theirs}
    assert sorted(taken) == sorted(theirs)
    assert all(owner in ("b", "c") and count >= 5 for owner, count in taken.values()), taken


@pytest.mark.anyio
@pytest.mark.postgres
async def test_a_run_longer_than_the_grace_costs_no_backup_attempt(
    pg_dsn: str, pg_schema: str
) -> None:
    def replica(owner: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner, shutdown_grace=1)

        async def slow(ctx: JobContext) -> None:
            await anyio.sleep(2.5)  # the first backup looks 1 s after the slot: still running

        for i in range(4):
            scheduler.add(slow, every(4), id=f"slow-{i}", timeout=3)
        return scheduler

    schedulers = [replica(owner) for owner in ("a", "b", "c", "d")]
    async with AsyncExitStack() as stack:
        for scheduler in schedulers:
            await stack.enter_async_context(scheduler)
        await _agreed(schedulers)
        await anyio.sleep(4)  # the first slots, attempted before the views agreed
        with run_log() as log:
            await anyio.sleep(8)
    outcomes = Counter(run.outcome for run in log.runs if run.job_id != "ticklock.retention")
    assert outcomes["success"] >= 4, outcomes
    # the backups' looks find the lock held and wait for the run's timeout: by then it has
    # committed (with every backup attempting, three attempts a slot)
    assert outcomes["locked"] == 0, outcomes
    assert outcomes["skipped"] <= 4, outcomes


# -- a failing owner: its job's next slots run elsewhere (G2b) -------------------------------


@pytest.mark.anyio
async def test_an_owner_whose_runs_fail_gives_the_job_to_the_others() -> None:
    # A secret missing on the owner's host: its handler always fails, the two others would
    # succeed. With no retries no other replica ever runs a slot the owner failed.
    clock = ManualClock(T0)
    db = MemoryDatabase()
    bad, *good = sorted(("a", "b", "c"), key=lambda o: -weight(o, "job"))  # bad owns "job"
    schedulers = []
    for owner in (bad, *good):
        scheduler = Scheduler(database=db, clock=clock, owner=owner)

        async def job(ctx: JobContext, owner: str = owner) -> None:
            if owner == bad:
                raise RuntimeError("the secret is missing on this host")

        scheduler.add(job, every(10, initial_delay=5), id="job", timeout=5, failure_threshold=2)
        schedulers.append(scheduler)
    async with schedulers[0], schedulers[1], schedulers[2]:
        await clock.advance(100)
        fleet = schedulers[1].fleet
        ledger = await fleet.slots("job", T0, clock.now())
        replicas = {r.owner: r.failing for r in await fleet.replicas()}
        (record,) = [r for r in await fleet.jobs() if r.job_id == "job"]
    fates = [
        (int((s.slot - T0).total_seconds()), str(s.fate), s.run.owner if s.run else None)
        for s in ledger
    ]
    # failure_threshold (2) failures in a row on the owner, then the next slots run on the
    # replica ranked next (after the one that gave it up), on time, every slot
    assert fates == [
        (5, "failed", bad),
        (15, "failed", bad),
        *((slot, "ran", good[0]) for slot in range(25, 96, 10)),
    ]
    assert replicas == {bad: ("job",), good[0]: (), good[1]: ()}  # status: "gave up: job"
    assert record.last_error == "RuntimeError: the secret is missing on this host"
    assert record.consecutive_failures == 0 and record.last_outcome == "success"


# -- a replica that found the lock held looks again within the takeover bound (G2, G5) -------


@pytest.mark.anyio
async def test_a_cold_start_s_frozen_holder_is_taken_over_once_its_run_must_have_ended() -> None:
    # Two replicas start together: the first attempts the first slot alone and holds the
    # lock; the second, the job's owner, attempts half a second later and finds it held
    # (locked). The holder then freezes inside its run (SIGSTOP; here its session ends at
    # once). The owner attempts again once any run must have ended (timeout 12 + 2 s after
    # it found the lock held), not a period (20 s) later, and runs the job.
    clock = ManualClock(T0)
    db = MemoryDatabase()
    follower, holder = sorted(("a", "b"), key=lambda o: weight(o, "job"), reverse=True)
    entered: list[tuple[str, float]] = []
    schedulers = []
    for owner in (holder, follower):
        scheduler = Scheduler(database=db, clock=clock, owner=owner, shutdown_grace=0.1)

        async def job(ctx: JobContext, owner: str = owner) -> None:
            entered.append((owner, (ctx.started_at - T0).total_seconds()))
            if owner == holder:
                await anyio.sleep_forever()  # frozen in here

        scheduler.add(job, every(20), id="job", timeout=12)
        schedulers.append(scheduler)
    with run_log() as log:
        async with schedulers[0]:
            await clock.advance(0.5)
            assert entered == [(holder, 0.0)]
            async with schedulers[1]:
                await clock.advance(0.5)
                assert log.outcomes("job") == ["locked"]
                db.freeze(holder)
                await clock.advance(20)
                db.thaw(holder)
    assert entered[:2] == [(holder, 0.0), (follower, 14.5)]


@pytest.mark.anyio
async def test_a_replica_that_found_the_lock_held_attempts_once_it_is_held_past_any_run() -> None:
    # A holder frozen after it switched off its server-side timeouts keeps the lock; the
    # attempt of a replica that finds it held past any run's bound ends it (on PostgreSQL).
    # A replica that found it held at start looks again 14 s later (timeout 12 + 2 s), as
    # a backup then, and counts the hold from its first sighting: it attempts at its look.
    b = Backup(every(20), timeout=12)
    owner = ahead_of("backup", "job")
    held = await b.db.coordinator(owner, b.clock).attempt("job", 12, b.clock.now())
    assert held.acquired
    with run_log() as log:
        async with b.scheduler:
            await b.clock.advance(0.5)
            assert log.outcomes("job") == ["locked"]  # alone at start: it attempted
            b.view(owner)  # then it sees the holder, which owns the job
            await b.clock.advance(14)
            assert log.outcomes("job") == ["locked"]  # the look at 14 found it held
            await b.clock.advance(1)
            assert log.outcomes("job") == ["locked", "locked"]  # held 15 s: it attempted
            await held.close()  # (in memory no attempt ends a holder: it goes by itself)
            await b.clock.advance(16)
    assert b.starts == [30.0]  # locked at 15: it looked again at 29, and a grace later ran


def test_a_cycle_never_keeps_a_role_taken_in_an_earlier_share() -> None:
    # A cycle keeps its role while its share's version is the one it took it at: a share of a
    # scheduler's later run (a new Share) must never come with a version an earlier one had.
    earlier = Share("A")
    seen = {earlier.version}
    earlier.missed(["B"], datetime(2026, 1, 1, tzinfo=timezone.utc))
    seen.add(earlier.version)
    later = Share("A")
    assert later.version not in seen
