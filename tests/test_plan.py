"""The planner and retries: every "what next" decision, table-tested without a clock or a loop,
then retries end to end on ManualClock and against a real PostgreSQL."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from helpers import at, run_log
from ticklock import (
    JobContext,
    Outcome,
    RunResult,
    ScheduleError,
    Scheduler,
    cron,
    every,
)
from ticklock._backends.seam import FleetState
from ticklock._runtime.plan import (
    BEHIND_FOR,
    BURST,
    GIVE_UP_FOR,
    KEEP,
    Admission,
    Attempt,
    Busy,
    Delayed,
    GiveUp,
    Idle,
    Look,
    LookAgain,
    OnTime,
    Plan,
    Recheck,
    Replan,
    Run,
    Serve,
    Skip,
    TakeBack,
    admit,
    after_run,
    behind,
    look,
    plan,
    queued,
    standing,
    steer,
)
from ticklock._schedule.job import Job
from ticklock.testing import ManualClock

T0 = at("2030-01-01T00:00:00Z")


async def handler(ctx: JobContext) -> None:
    pass


def job(trigger: Any = None, **options: Any) -> Job:
    return Job.declare(handler, trigger or every(60), id="j", **{"timeout": 5, **options})


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ended(outcome: Outcome, slot: float, end: float) -> RunResult:
    return RunResult("j", outcome, s(slot), s(end - 1), s(end), "me")


def failed(slot: float, end: float, attempts: int, last_slot: float | None = None) -> FleetState:
    return FleetState(
        last_slot=None if last_slot is None else s(last_slot),
        last_end=s(end),
        consecutive_failures=attempts,
        failed_slot=s(slot),
        failed_attempts=attempts,
    )


CASES = [
    # (id, job, state, now, result, plan)
    ("never-ran-every", job(), FleetState(), s(0), None, OnTime(s(0))),
    ("never-ran-cron", job(cron("*/5 * * * *")), FleetState(), s(1), None, OnTime(s(300))),
    (
        "success-fixed-delay",
        job(),
        FleetState(last_slot=s(0), last_end=s(3)),
        s(3),
        ended(Outcome.SUCCESS, 0, 3),
        OnTime(s(63)),
    ),
    (  # timeout 5: the holder's run has ended by 5 + 2 s, or the next attempt ends it
        "locked-looks-again-once-the-holders-run-must-have-ended",
        job(),
        FleetState(),
        s(0),
        ended(Outcome.LOCKED, 0, 0),
        Recheck(7.0),
    ),
    (  # a timeout close to the period: never later than a period
        "locked-looks-again-a-period-later-at-most",
        job(every(10), timeout=9),
        FleetState(),
        s(0),
        ended(Outcome.LOCKED, 0, 0),
        Recheck(10.0),
    ),
    (  # cron: the timeout's bound, not the gap to the next fire (a day)
        "locked-cron-looks-again-once-the-holders-run-must-have-ended",
        job(cron("0 3 * * *"), timeout=60),
        FleetState(),
        s(0),
        ended(Outcome.LOCKED, 0, 0),
        Recheck(62.0),
    ),
    (
        "locked-by-a-batched-run-looks-again-once-its-hold-ends",
        job(),
        FleetState(last_slot=s(0), last_end=s(1), busy_until=s(70)),
        s(63),
        ended(Outcome.LOCKED, 61, 63),
        Recheck(7.25),
    ),
    (
        "skipped-realigns-to-the-fleet",
        job(),
        FleetState(last_slot=s(0), last_end=s(10)),
        s(11),
        ended(Outcome.SKIPPED, 0, 11),
        OnTime(s(70)),
    ),
    (
        "failure-without-retries-waits-for-the-next-slot",
        job(),
        failed(0, 3, 1),
        s(3),
        ended(Outcome.FAILURE, 0, 3),
        OnTime(s(63)),
    ),
    (
        "first-retry-after-the-backoff",
        job(retries=2, retry_backoff=10),
        failed(0, 3, 1),
        s(3),
        ended(Outcome.FAILURE, 0, 3),
        Delayed(s(0), 10.0, 2),
    ),
    (
        "second-retry-doubles",
        job(retries=2, retry_backoff=10),
        failed(0, 14, 2),
        s(14),
        ended(Outcome.TIMEOUT, 0, 14),
        Delayed(s(0), 20.0, 3),
    ),
    (
        "no-retry-left",
        job(retries=2, retry_backoff=10),
        failed(0, 35, 3),
        s(35),
        ended(Outcome.ERROR, 0, 35),
        OnTime(s(95)),
    ),
    (
        "never-past-the-next-slot",
        job(retries=5, retry_backoff=25),
        failed(0, 40, 3),  # the next retry would be at 40 + 100 = 140, after the slot at 100
        s(40),
        ended(Outcome.FAILURE, 0, 40),
        OnTime(s(100)),
    ),
    (
        "a-follower-takes-the-fleets-retry",
        job(retries=1, retry_backoff=10),
        failed(0, 3, 1),
        s(4),
        ended(Outcome.SKIPPED, 0, 4),
        Delayed(s(0), 9.0, 2),
    ),
    (
        "a-retry-that-is-due-runs-at-once",
        job(retries=1, retry_backoff=10),
        failed(0, 3, 1),
        s(30),
        None,
        Delayed(s(0), 0.0, 2),
    ),
    (
        "at-start-the-next-slot-covers-an-old-failure",
        job(retries=3, retry_backoff=10),
        failed(0, 3, 1),
        s(500),
        None,
        OnTime(s(63)),  # catch-up: one run at once covers the window
    ),
    (
        "a-committed-later-slot-ends-the-retries",
        job(retries=3, retry_backoff=10),
        failed(0, 3, 1, last_slot=60),
        s(4),
        None,
        OnTime(s(63)),
    ),
    (  # the wall clock stepped back 60 s during the 00:05 run: it ended at 00:04:02
        "cron-a-run-that-ended-before-its-slot-counts-from-its-slot",
        job(cron("*/5 * * * *")),
        FleetState(last_slot=s(300), last_end=s(242)),
        s(242),
        ended(Outcome.SUCCESS, 300, 242),
        OnTime(s(600)),
    ),
    (
        "cron-at-start-never-owes-a-fire-at-or-before-the-watermark",
        job(cron("*/5 * * * *")),
        FleetState(last_slot=s(300), last_end=s(242)),
        s(250),
        None,
        OnTime(s(600)),
    ),
    (  # every: the slot is the end plus the interval, whatever the wall clock did
        "every-a-run-that-ended-before-its-slot-counts-from-its-end",
        job(),
        FleetState(last_slot=s(300), last_end=s(242)),
        s(242),
        ended(Outcome.SUCCESS, 300, 242),
        OnTime(s(302)),
    ),
]


@pytest.mark.parametrize(
    ("job_", "state", "now", "result", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_plan(
    job_: Job, state: FleetState, now: datetime, result: RunResult | None, expected: Plan
) -> None:
    assert plan(job_, state, now, result) == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"retries": -1},
            r"^job 'j': retries must be a whole number of retries, 0 or more, got -1$",
        ),
        ({"retries": 1.5}, r"^job 'j': retries must be a whole number .* got 1\.5$"),
        ({"retries": True}, r"^job 'j': retries must be a whole number .* got True$"),
        ({"retries": 1, "retry_backoff": 0}, r"^job 'j': retry_backoff must be positive"),
        (
            {"retries": 1, "retry_backoff": 60},
            r"^job 'j': retry_backoff \(60 s\) must be shorter than the period \(60 s\): a retry "
            r"never runs past the next slot, so none would ever run$",
        ),
    ],
)
def test_nonsense_retries_are_refused_at_declaration(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        job(**options)


@pytest.mark.anyio
async def test_a_failed_slot_is_retried_with_backoff_then_the_next_slot_runs() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[tuple[float, str, int]] = []

    @scheduler.job(every(100), id="flaky", timeout=1, retries=2, retry_backoff=10)
    async def flaky(ctx: JobContext) -> None:
        seen.append((clock.monotonic(), ctx.slot.strftime("%M:%S"), ctx.attempt))
        if len(seen) in (1, 2):  # the first two attempts of the first slot fail
            raise RuntimeError("flaky")

    with run_log() as log:
        async with scheduler:
            await clock.advance(150)
    # slot 00:00: attempt 1 at 0, retries after 10 s and 20 s more; the third succeeds.
    # The next slot is 100 s after the last run ended (fixed delay).
    assert seen == [(0, "00:00", 1), (10, "00:00", 2), (30, "00:00", 3), (130, "02:10", 1)]
    assert log.outcomes("flaky") == ["failure", "failure", "success", "success"]
    (health,) = scheduler.health()
    assert health.consecutive_failures == 0


@pytest.mark.anyio
async def test_retries_stop_at_the_limit_and_the_next_slot_covers_the_missed_one() -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock)
    seen: list[tuple[float, int, datetime | None]] = []

    @scheduler.job(every(100), id="down", timeout=1, retries=1, retry_backoff=10)
    async def down(ctx: JobContext) -> None:
        seen.append((clock.monotonic(), ctx.attempt, ctx.previous_success))
        if clock.monotonic() < 100:
            raise RuntimeError("down")

    async with scheduler:
        await clock.advance(125)
    assert seen == [(0, 1, None), (10, 2, None), (110, 1, None)]
    (health,) = scheduler.health()
    assert health.last_success is not None and health.consecutive_failures == 0


@pytest.mark.anyio
@pytest.mark.postgres
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_any_replica_may_take_the_fleets_retry(pg_dsn: str, pg_schema: str) -> None:
    # Replica a's attempt fails and a goes away; b, which knows the failure only from the
    # fleet's state, runs the retry of the same slot as attempt 2.
    clock = ManualClock(datetime.now(T0.tzinfo) - timedelta(seconds=30))
    seen: list[tuple[str, datetime, int]] = []

    async def work(ctx: JobContext) -> None:
        seen.append((ctx.owner, ctx.slot, ctx.attempt))
        if ctx.owner == "a":
            raise RuntimeError("a fails")

    def build(owner: str) -> Scheduler:
        scheduler = Scheduler(pg_dsn, schema=pg_schema, owner=owner, clock=clock)
        scheduler.add(work, every(100), id="work", timeout=1, retries=1, retry_backoff=10)
        return scheduler

    async with build("a"):  # its first run fails, and it goes away (shutdown waits for it)
        for _ in range(500):
            await anyio.sleep(0.01)
            if seen:
                break
    async with build("b"):
        for _ in range(100):  # b plans the retry from the fleet's state, 10 s after a's end
            await clock.advance(1)
            if len(seen) == 2:
                break
            await anyio.sleep(0.01)  # the database answers in real time
    assert [(owner, attempt) for owner, _, attempt in seen] == [("a", 1), ("b", 2)]
    assert seen[0][1] == seen[1][1]  # the same slot


# -- a backup's look, and the admission under the lock: pure, table-tested ------------------

OWNERS = ("o1", "o2")
LOOKS = [
    # (id, state, slot, held, held_for, ahead, observer, second, decision)
    ("committed", FleetState(last_slot=s(60), last_end=s(61)), s(60), False, 0, OWNERS, False,
     False, Replan()),
    ("ran-and-failed", failed(60, 61, 1), s(60), False, 0, OWNERS, False, False, Replan()),
    ("paused", FleetState(paused_at=s(50)), s(60), False, 0, OWNERS, False, False, Replan()),
    ("re-aligning", FleetState(), None, False, 0, OWNERS, False, False, Replan()),
    ("observer", FleetState(), s(60), False, 0, OWNERS, True, False, LookAgain(60)),
    ("held", FleetState(), s(60), True, 0, OWNERS, False, False, LookAgain(1.0)),
    ("held-long", FleetState(), s(60), True, 6.9, OWNERS, False, False, LookAgain(1.0)),
    ("held-past-bound", FleetState(), s(60), True, 7.0, OWNERS, False, False, Attempt()),
    ("open-first-of-two", FleetState(), s(60), False, 0, OWNERS, False, False,
     LookAgain(0.25, second=True, missed=("o1",))),
    ("open-first-backup", FleetState(), s(60), False, 0, ("o1",), False, False,
     Attempt(missed=("o1",))),
    ("open-second-look", FleetState(), s(60), False, 0, OWNERS, False, True,
     Attempt(missed=OWNERS)),
]  # fmt: skip


@pytest.mark.parametrize(
    "state,slot,held,held_for,ahead,observer,second,expected",
    [case[1:] for case in LOOKS],
    ids=[case[0] for case in LOOKS],
)
def test_look(
    state: FleetState,
    slot: datetime | None,
    held: bool,
    held_for: float,
    ahead: tuple[str, ...],
    observer: bool,
    second: bool,
    expected: Look,
) -> None:
    decision = look(
        job(), state, slot, 1, held=held, held_for=held_for, ahead=ahead, observer=observer,
        second=second,
    )  # fmt: skip
    assert decision == expected


BEHIND = [
    # (id, owner_behind, now, decision): a backup's look at the open slot s(60)
    ("owner-behind", True, s(61), LookAgain(1.0)),
    ("owner-behind-too-long", True, s(90), Attempt(missed=("o1",))),
    ("owner-not-behind", False, s(61), Attempt(missed=("o1",))),
]  # fmt: skip


@pytest.mark.parametrize(
    "owner_behind,now,expected", [c[1:] for c in BEHIND], ids=[c[0] for c in BEHIND]
)
def test_a_backup_leaves_an_open_slot_to_an_owner_that_is_behind_for_a_while(
    owner_behind: bool, now: datetime, expected: Look
) -> None:
    decision = look(
        job(), FleetState(), s(60), 1, held=False, held_for=0, ahead=("o1",), observer=False,
        second=False, now=now, owner_behind=owner_behind,
    )  # fmt: skip
    assert decision == expected


def test_behind_are_the_replicas_that_just_committed_a_slot_late() -> None:
    def commits(owner: str, slot: float, end: float, n: int = BURST) -> list[FleetState]:
        return [FleetState(last_slot=s(slot), last_end=s(end), last_owner=owner)] * n

    states = [
        *commits("late", 50, 59.8),  # 9.8 s late
        *commits("late", 45, 59.7, 1),  # an older slot
        *commits("on-time", 59.5, 59.9),  # 0.4 s
        *commits("late-long-ago", 40, 57.9),  # 2.1 s ago
        *commits("slow", 59, 59.8, BURST - 1),  # a few slow runs of one instant: no burst
        FleetState(),
    ]
    # each with the latest slot it committed late: it is behind on that slot's instant, and
    # on earlier ones, not on later slots (an owner that died in a burst has no later ones)
    assert behind(states, s(60)) == {"late": s(50)}


HOLDS = [
    # (id, state, held, held_for, decision): a backup's look at s(62), the slot s(60)
    ("hold-far", FleetState(busy_until=s(80)), False, 0, LookAgain(1.0)),
    ("hold-ending", FleetState(busy_until=s(62.5)), False, 0, LookAgain(0.75)),
    ("hold-ended", FleetState(busy_until=s(61)), False, 0, Attempt(missed=("o1",))),
    ("hold-and-lock", FleetState(busy_until=s(80)), True, 7.0, Attempt()),
]  # fmt: skip


@pytest.mark.parametrize(
    "state,held,held_for,expected", [case[1:] for case in HOLDS], ids=[case[0] for case in HOLDS]
)
def test_look_at_a_batched_run_s_hold(
    state: FleetState, held: bool, held_for: float, expected: Look
) -> None:
    decision = look(
        job(), state, s(60), 1, held=held, held_for=held_for, ahead=("o1",), observer=False,
        second=False, now=s(62),
    )  # fmt: skip
    assert decision == expected


ADMISSIONS = [
    # (id, state, slot, attempt, manual, decision); the tick started at s(70)
    ("on-time", FleetState(last_slot=s(0), last_end=s(1)), s(61), 1, False, Run(s(61))),
    ("committed", FleetState(last_slot=s(61), last_end=s(62)), s(61), 1, False,
     Skip("the fleet has moved past the slot")),
    ("paused", FleetState(paused_at=s(5)), s(61), 1, False, Skip("paused")),
    ("re-align-due", FleetState(last_slot=s(0), last_end=s(1)), None, 1, False, Run(s(61))),
    ("re-align-not-due", FleetState(last_slot=s(20), last_end=s(21)), None, 1, False,
     Skip("no slot is due")),
    ("retry", failed(61, 62, 1, last_slot=0), s(61), 2, False, Run(s(61))),
    ("retry-done-elsewhere", failed(61, 62, 2, last_slot=0), s(61), 2, False,
     Skip("the fleet has moved past the slot")),
    ("run-now", FleetState(last_slot=s(61), last_end=s(62)), None, 1, True, Run(s(70))),
    ("trigger", FleetState(trigger_at=s(65), paused_at=s(5)), s(65), 1, True, Run(s(65))),
    ("trigger-served-elsewhere", FleetState(), s(65), 1, True,
     Skip("another replica served the trigger request")),
    ("trigger-after-a-later-slot", FleetState(trigger_at=s(65), last_slot=s(66)), s(65), 1,
     True, Run(s(70))),
    ("held-between-batches", FleetState(last_slot=s(0), last_end=s(1), busy_until=s(75)),
     s(61), 1, False, Busy(s(75))),
    ("run-now-held-between-batches", FleetState(busy_until=s(75)), None, 1, True, Busy(s(75))),
    ("retry-held-between-batches", replace(failed(61, 62, 1, last_slot=0), busy_until=s(71)),
     s(61), 2, False, Busy(s(71))),
    ("hold-ended", FleetState(last_slot=s(0), last_end=s(1), busy_until=s(69)), s(61), 1, False,
     Run(s(61))),
]  # fmt: skip


@pytest.mark.parametrize(
    "state,slot,attempt,manual,expected",
    [case[1:] for case in ADMISSIONS],
    ids=[case[0] for case in ADMISSIONS],
)
def test_admit(
    state: FleetState, slot: datetime | None, attempt: int, manual: bool, expected: Admission
) -> None:
    assert admit(job(), state, slot, attempt, manual=manual, started=s(70)) == expected


def test_a_cron_slot_at_or_before_the_watermark_is_stale_whatever_the_last_end_says() -> None:
    # committed 00:01, and the wall clock stepped back during that run: it ended at 00:00:02,
    # and the next fire after that end is 00:01 again
    state = FleetState(last_slot=s(60), last_end=s(2))
    minutely = job(cron("* * * * *"))
    assert admit(minutely, state, s(60), 1, manual=False, started=s(60)) == Skip(
        "the fleet has moved past the slot"
    )
    assert admit(minutely, state, s(120), 1, manual=False, started=s(120)) == Run(s(120))


def manual(outcome: Outcome, slot: float, end: float) -> RunResult:
    return RunResult("j", outcome, s(slot), s(end - 1), s(end), "me", manual=True)


AFTER_RUNS = [
    # (id, state, result, plan); now = the result's end
    ("scheduled", FleetState(last_slot=s(0), last_end=s(1)), ended(Outcome.SUCCESS, 0, 1),
     OnTime(s(61))),
    ("asked-meanwhile", FleetState(last_slot=s(0), last_end=s(1), trigger_at=s(0.5)),
     ended(Outcome.SUCCESS, 0, 1), Serve(s(0.5))),
    ("served", FleetState(last_slot=s(5), last_end=s(6)), manual(Outcome.SUCCESS, 5, 6),
     OnTime(s(66))),
    ("served-elsewhere", FleetState(last_slot=s(0), last_end=s(6)),
     manual(Outcome.SKIPPED, 5, 6), OnTime(s(66))),
    ("serving-failed-to-start", FleetState(last_slot=s(0), last_end=s(1), trigger_at=s(5)),
     manual(Outcome.ERROR, 5, 6), OnTime(s(61))),
]  # fmt: skip


@pytest.mark.parametrize(
    "state,result,expected",
    [case[1:] for case in AFTER_RUNS],
    ids=[case[0] for case in AFTER_RUNS],
)
def test_after_run(state: FleetState, result: RunResult, expected: Plan) -> None:
    assert after_run(job(), state, result.finished_at, result) == expected


STEERS = [
    # (id, state, toggled, serving, plan); now = s(70)
    ("asked", FleetState(trigger_at=s(65)), False, False, Serve(s(65))),
    ("asked-already-serving", FleetState(trigger_at=s(65)), False, True, None),
    ("paused", FleetState(paused_at=s(65)), True, False, Idle()),
    ("resumed-catch-up", FleetState(last_slot=s(0), last_end=s(1)), True, False, OnTime(s(61))),
    ("served-elsewhere", FleetState(last_slot=s(0), last_end=s(69)), False, True,
     OnTime(s(129))),
    ("nothing-changed", FleetState(last_slot=s(0), last_end=s(1)), False, False, None),
]  # fmt: skip


@pytest.mark.parametrize(
    "state,toggled,serving,expected",
    [case[1:] for case in STEERS],
    ids=[case[0] for case in STEERS],
)
def test_steer(state: FleetState, toggled: bool, serving: bool, expected: Plan | None) -> None:
    assert steer(job(), state, s(70), toggled=toggled, serving=serving) == expected


# -- standing: give a job up, take it back ------------------------------------------------


@pytest.mark.parametrize(
    ("threshold", "own_failures", "given_up_at", "others", "now", "expected"),
    [
        # failure_threshold failures here in a row while another replica can run it: whether
        # it succeeds elsewhere is not asked (with no retries, nobody else tries the slot)
        (1, 1, None, True, T0, GiveUp()),
        (3, 3, None, True, T0, GiveUp()),
        (3, 2, None, True, T0, KEEP),  # two only
        (1, 0, None, True, T0, KEEP),  # no failure here
        (1, 1, None, False, T0, KEEP),  # nobody else: alone, or the others gave it up too
        # given up: back after a success here, or after GIVE_UP_FOR
        (1, 0, T0, True, T0 + timedelta(seconds=1), TakeBack()),
        (1, 4, T0, True, T0 + timedelta(seconds=GIVE_UP_FOR), KEEP),
        (1, 4, T0, True, T0 + timedelta(seconds=GIVE_UP_FOR + 1), TakeBack()),
    ],
    ids=[
        "one-failure-threshold-1",
        "three-failures-threshold-3",
        "under-the-threshold",
        "no-failure",
        "nobody-else",
        "given-up-succeeded-here",
        "given-up-not-yet-back",
        "given-up-back-after-a-while",
    ],
)
def test_standing(
    threshold: int,
    own_failures: int,
    given_up_at: datetime | None,
    others: bool,
    now: datetime,
    expected: object,
) -> None:
    asked: list[bool] = []

    def others_can_run() -> bool:
        asked.append(True)
        return others

    decision = standing(
        job(failure_threshold=threshold),
        now,
        own_failures=own_failures,
        given_up_at=given_up_at,
        others_can_run=others_can_run,
    )
    assert decision == expected
    assert len(asked) <= 1  # the ranking is asked once at most, and last


def test_a_backup_whose_read_queued_looks_again_until_the_slot_is_long_open() -> None:
    # its read waited behind its own runs: an attempt would wait behind them too, so it looks
    # again a grace later, until BEHIND_FOR after the slot (a full pool never holds it off)
    assert queued(s(60), s(61)) == LookAgain(1.0)
    assert queued(s(60), s(60) + timedelta(seconds=BEHIND_FOR - 0.1)) == LookAgain(1.0)
    assert queued(s(60), s(60) + timedelta(seconds=BEHIND_FOR)) == Attempt()
    assert queued(None, s(61)) == LookAgain(1.0)  # a recheck: no slot to give up on
