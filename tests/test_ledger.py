"""The ledger's rules, one row each: the slots a schedule owed and each slot's fate."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from ticklock import cron, every
from ticklock._operators.fleet import Action, Fate, RunRecord
from ticklock._operators.ledger import AHEAD, STALLED, Incident, Records, Span, account, walking
from ticklock._schedule.spec import Spec, from_json, to_json

T0 = datetime(2026, 12, 1, 3, 0, tzinfo=timezone.utc)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def spec(trigger: object = None, *, catch_up: bool = True, enabled: bool = True) -> Spec:
    return Spec(
        trigger or cron("*/10 * * * *"),  # type: ignore[arg-type]
        timeout=60.0,
        retries=0,
        catch_up=catch_up,
        overdue_grace=60.0,
        failure_threshold=1,
        enabled=enabled,
    )


def run(
    slot: float,
    outcome: str = "success",
    *,
    start: float | None = None,
    took: float = 0.1,
    manual: bool = False,
    owner: str = "a",
) -> RunRecord:
    started = at(slot if start is None else start)
    return RunRecord(
        job_id="j",
        slot=at(slot),
        started_at=started,
        finished_at=started + timedelta(minutes=took),
        outcome=outcome,
        owner=owner,
        report=None,
        error=None if outcome == "success" else f"{outcome}!",
        manual=manual,
    )


LIVE = (Span("a", at(-60), None),)


def fates(ledger: list) -> list[tuple[float, str, str | None]]:  # type: ignore[type-arg]
    return [((s.slot - T0).total_seconds() / 60, s.fate.value, s.reason) for s in ledger]


def test_each_run_gives_its_slot_its_fate() -> None:
    records = Records(
        runs=[run(0), run(10, "failure"), run(20, "timeout"), run(30, "failure"), run(30)],
        presence=LIVE,
        horizon=at(-60),
    )
    ledger = account(spec(), records, at(0), at(30), now=at(45))
    assert [(m, f) for m, f, _ in fates(ledger)] == [
        (0, "ran"),
        (10, "failed"),
        (20, "timed out"),
        (30, "ran"),  # a retry that succeeded
    ]
    assert ledger[1].run is not None and ledger[1].run.error == "failure!"


def test_a_catch_up_run_covers_the_slots_before_it_and_names_itself() -> None:
    down = Span("a", at(5), at(35))  # the database was unreachable
    records = Records(
        runs=[run(0), run(40, start=40.2)], presence=LIVE, outages=(down,), horizon=at(-60)
    )
    ledger = account(spec(), records, at(0), at(40), now=at(45))
    assert fates(ledger)[1:4] == [
        (10, "covered", "the database was unreachable (from a)"),
        (20, "covered", "the database was unreachable (from a)"),
        (30, "covered", "the database was unreachable (from a)"),
    ]
    assert ledger[1].run is not None and ledger[1].run.slot == at(40)


def test_catch_up_false_skips_the_slots_the_next_run_did_not_cover() -> None:
    records = Records(runs=[run(0), run(40)], presence=(Span("a", at(35), None),), horizon=at(-60))
    ledger = account(spec(catch_up=False), records, at(0), at(40), now=at(45))
    assert [f for _, f, _ in fates(ledger)] == ["ran", "skipped", "skipped", "skipped", "ran"]
    reason = ledger[1].reason
    assert reason is not None and reason.startswith("catch_up=False")
    assert "no live replica declared the job" in reason


@pytest.mark.parametrize(
    ("records", "fate", "reason"),
    [
        (Records(runs=[run(0)], horizon=at(-60)), "missed", "no live replica declared the job"),
        (
            Records(
                runs=[run(0)],
                presence=LIVE,
                outages=(Span("a", at(8), at(12)), Span("b", at(8), at(12))),
                horizon=at(-60),
            ),
            "missed",
            "the database was unreachable (from a, b)",
        ),
        (
            Records(
                runs=[run(0)], presence=(Span("a", at(-60), None, enabled=False),), horizon=at(-60)
            ),
            "skipped",
            "disabled: declared with enabled=False by every live replica",
        ),
        (
            Records(
                runs=[run(0)],
                presence=LIVE,
                actions=[Action("j", "pause", "ops@host (cli)", at(5), "INC-42: upstream", True)],
                paused_at=at(5),
                horizon=at(-60),
            ),
            "skipped",
            "paused by ops@host (cli) at 2026-12-01T03:05:00+00:00: INC-42: upstream",
        ),
        (
            Records(runs=[run(0, took=15)], presence=LIVE, horizon=at(-60)),
            "skipped",
            "the run before was still running (the run of 2026-12-01T03:00:00+00:00)",
        ),
        (
            Records(runs=[run(0)], horizon=at(30)),
            "missed",
            "unknown: before the records of live replicas begin (retention)",
        ),
        (
            Records(runs=[run(0)], presence=LIVE, horizon=at(-60)),
            "missed",
            "unknown: replicas a were live and declared the job, and no record explains why it "
            "did not run (a defect: please report it)",
        ),
    ],
    ids=["no-replica", "outage", "disabled", "paused", "overlap", "horizon", "unknown"],
)
def test_a_slot_without_a_run_says_why(records: Records, fate: str, reason: str) -> None:
    ledger = account(spec(), records, at(0), at(10), now=at(30))
    assert fates(ledger)[1] == (10, fate, reason)


def test_a_resume_ends_the_pause() -> None:
    actions = [
        Action("j", "pause", "x", at(5), None, True),
        Action("j", "pause", "y", at(6), "again", False),  # changed nothing: not a new pause
        Action("j", "resume", "x", at(15), None, True),
    ]
    records = Records(runs=[run(0)], presence=LIVE, actions=actions, horizon=at(-60))
    ledger = account(spec(), records, at(0), at(20), now=at(40))
    assert [f for _, f, _ in fates(ledger)] == ["ran", "skipped", "missed"]
    assert ledger[1].reason == "paused by x at 2026-12-01T03:05:00+00:00"


PAUSED = "paused by ops at 2026-12-01T03:05:00+00:00: INC-42"
PAUSE = [
    Action("j", "pause", "ops", at(5), "INC-42", True),
    Action("j", "resume", "ops", at(11 + 26 / 60), None, True),
]
DOWN = (Span("a", at(-60), at(9.5), exact=True), Span("b", at(11.4), None))
"""The whole fleet down across the slot of 03:10: "a" left at 03:09:30, "b" started at 03:11:24."""


@pytest.mark.parametrize(
    ("runs", "presence", "actions", "fate", "lateness", "reason"),
    [
        # the fleet down across the slot: the next replica's catch-up run, 89 s after it
        ([run(10, start=11 + 29 / 60)], DOWN, [], "ran", 89, "no live replica declared the job"),
        # the replicas killed: their last beat before the slot
        (
            [run(10, start=11.5)],
            (Span("a", at(-60), at(9.8)), Span("b", at(11.4), None)),
            [],
            "ran",
            90,
            "the replicas that declared it (a) stopped beating at 2026-12-01T03:09:48+00:00 "
            "(killed, frozen, or cut off from the database)",
        ),
        # a resume after a pause: the slot due while paused runs 86 s after it
        ([run(10, start=11 + 26 / 60)], LIVE, PAUSE, "ran", 86, PAUSED),
        # a failed run that started late says why too
        ([run(10, "failure", start=11.5)], DOWN, [], "failed", 90, "no live replica declared"),
        # within its overdue_grace (60 s): on time
        ([run(10, start=10.9)], DOWN, [], "ran", 54, None),
        # a retry is not lateness: the first attempt started on time
        ([run(10, "failure"), run(10, start=12)], LIVE, [], "ran", 0, None),
    ],
    ids=["fleet-down", "fleet-killed", "resumed", "failed-late", "within-grace", "retried"],
)
def test_a_late_run_says_how_late_and_why(
    runs: list[RunRecord],
    presence: tuple[Span, ...],
    actions: list[Action],
    fate: str,
    lateness: float,
    reason: str | None,
) -> None:
    records = Records(runs=[run(0), *runs], presence=presence, actions=actions, horizon=at(-60))
    ledger = account(spec(), records, at(0), at(10), now=at(30))
    slot = ledger[1]
    assert (slot.fate.value, slot.lateness) == (fate, timedelta(seconds=lateness))
    assert slot.late is (reason is not None)
    assert slot.reason == reason if reason is None else reason in (slot.reason or "")
    assert ledger[0].lateness == timedelta(0) and not ledger[0].late


def test_only_a_slot_with_a_run_has_a_lateness() -> None:
    records = Records(runs=[run(0), run(20, start=20.5)], presence=LIVE, horizon=at(-60))
    ledger = account(spec(), records, at(0), at(30), now=at(32))
    assert [(f, s.lateness) for (_, f, _), s in zip(fates(ledger), ledger, strict=True)] == [
        ("ran", timedelta(0)),
        ("covered", timedelta(minutes=10.5)),  # from the slot to the run that covered it
        ("ran", timedelta(seconds=30)),
        ("pending", None),
    ]


def test_recent_and_future_slots_are_pending() -> None:
    records = Records(runs=[run(0)], presence=LIVE, horizon=at(-60))
    ledger = account(spec(), records, at(0), at(30), now=at(10.5))
    assert [f for _, f, _ in fates(ledger)] == ["ran", "pending", "pending", "pending"]


def test_every_owes_one_slot_an_interval_after_each_end_and_while_none_ran() -> None:
    trigger = every(minutes=10)
    # ran at 0 (ended 0.1), due 10.1, ran then; the fleet down from 20.2 to 55: the restart
    # runs the slot due at 20.2 at 55 (catch-up), which covers those owed before its start
    runs = [run(0), run(10.1), run(20.2, start=55)]
    records = Records(
        runs=runs, presence=(Span("a", at(-60), at(20.3)), Span("a", at(54), None)), horizon=at(-60)
    )
    ledger = account(spec(trigger), records, at(0), at(60), now=at(60))
    rows = [(round(m, 1), f) for m, f, _ in fates(ledger)]
    assert rows == [
        (0, "ran"),
        (10.1, "ran"),
        (20.2, "ran"),
        (30.2, "covered"),
        (40.2, "covered"),
        (50.2, "covered"),
    ]
    assert ledger[3].reason == "no live replica declared the job"
    # after the last run ends (55.1), the next slot is due at 65.1: beyond the window


def test_every_without_a_run_since_owes_its_interval_and_says_why() -> None:
    records = Records(runs=[run(0)], presence=(Span("a", at(-60), at(1)),), horizon=at(-60))
    ledger = account(spec(every(minutes=10)), records, at(0), at(35), now=at(31))
    rows = [(round(m, 1), f) for m, f, _ in fates(ledger)]
    assert rows == [(0, "ran"), (10.1, "missed"), (20.1, "missed"), (30.1, "pending")]


def test_a_manual_run_covers_but_owes_no_slot() -> None:
    records = Records(runs=[run(0), run(12, manual=True)], presence=LIVE, horizon=at(-60))
    ledger = account(spec(catch_up=False), records, at(0), at(20), now=at(40))
    assert [(m, f) for m, f, _ in fates(ledger)] == [(0, "ran"), (10, "covered"), (20, "missed")]
    assert ledger[1].run is not None and ledger[1].run.manual


def test_the_ledger_is_bounded() -> None:
    records = Records(runs=[], presence=LIVE, horizon=at(-60))
    ledger = account(spec(cron("* * * * *")), records, at(0), at(60 * 24 * 30), at(0), limit=50)
    assert len(ledger) == 50
    assert ledger[-1].slot == at(60 * 24 * 30)  # the latest of the window


def test_a_spec_survives_its_json_and_a_foreign_one_reads_as_none() -> None:
    for trigger in (
        every(minutes=5, jitter=3, initial_delay=2),
        cron("17 3 * * *", tz="Europe/Berlin"),
    ):
        s = spec(trigger)
        assert from_json(to_json(s)) == s
    assert from_json({"every": 0, "jitter": 0, "initial_delay": 0}) is None
    assert from_json({"future": "shape"}) is None
    assert from_json(None) is None
    assert Fate("timed out") is Fate.TIMED_OUT


# --- found by review: each of these failed before its fix ---------------------------------


def test_a_short_every_job_over_a_long_window_shows_its_latest_slots() -> None:
    now = at(14 * 24 * 60)
    records = Records(runs=[run(14 * 24 * 60 - 60)], presence=LIVE, horizon=at(-60))
    ledger = account(spec(every(5)), records, T0, now, now)
    assert len(ledger) == 1000 and ledger[-1].slot > now - timedelta(minutes=1)
    assert ledger[-1].fate is Fate.PENDING and ledger[-30].fate is Fate.MISSED


def test_a_pause_after_a_slot_before_its_jittered_fire_skips_it_as_paused() -> None:
    actions = [
        Action("j", "pause", "ops", at(0.2), None, True),
        Action("j", "resume", "ops", at(5), None, True),
    ]
    records = Records(runs=[run(60)], actions=actions, presence=LIVE, horizon=at(-60))
    ledger = account(
        spec(cron("0 * * * *", jitter=600), catch_up=False), records, at(0), at(60), at(65)
    )
    assert ledger[0].reason is not None and "paused by ops" in ledger[0].reason


def test_a_jittered_slot_is_pending_until_its_latest_fire() -> None:
    records = Records(runs=[], presence=LIVE, horizon=at(-60))
    ledger = account(spec(cron("0 * * * *", jitter=900)), records, at(0), at(6), now=at(6))
    assert ledger[0].fate is Fate.PENDING


def test_a_replica_killed_after_its_last_beat_is_named_not_a_defect() -> None:
    dead = (Span("a", at(-60), at(9.9)),)  # its last beat, 6 s before the slot; it never left
    records = Records(runs=[run(0)], presence=dead, horizon=at(-60))
    ledger = account(spec(), records, at(0), at(10), now=at(30))
    assert ledger[1].reason == (
        "the replicas that declared it (a) stopped beating at 2026-12-01T03:09:54+00:00 "
        "(killed, frozen, or cut off from the database)"
    )


def test_an_every_job_run_by_hand_restarts_its_interval_and_owes_no_extra_slot() -> None:
    runs = [run(0), run(5, manual=True), run(15.1)]  # the manual run ended at 5.1
    records = Records(runs=runs, presence=LIVE, horizon=at(-60))
    ledger = account(spec(every(minutes=10)), records, at(0), at(20), now=at(20))
    assert [f for _, f, _ in fates(ledger)] == ["ran", "ran"]


def test_an_every_job_owes_its_first_slot_at_its_declaration_plus_the_initial_delay() -> None:
    records = Records(runs=[run(2)], presence=LIVE, horizon=at(-60), declared_since=at(1.99))
    ledger = account(spec(every(minutes=10, initial_delay=0)), records, at(0), at(5), now=at(5))
    assert [(round(m, 2), f) for m, f, _ in fates(ledger)] == [(2, "ran")]


def test_a_leap_day_cron_has_a_ledger() -> None:
    ledger = account(spec(cron("0 0 29 2 *")), Records(runs=[]), at(-30 * 24 * 60), T0, T0)
    assert ledger == []


def test_a_pause_ends_with_forget_and_one_older_than_the_audit_log_is_said_so() -> None:
    forgotten = [
        Action("j", "pause", "ops", at(-1440), "old", True),
        Action("j", "forget", "ops", at(-1380), None, True),
    ]
    records = Records(runs=[run(0)], actions=forgotten, presence=LIVE, horizon=at(-2880))
    ledger = account(spec(), records, at(0), at(60), at(60))
    assert not any("paused" in (s.reason or "") for s in ledger)
    old = [Action("j", "resume", "ops", at(15), None, True)]  # its pause was pruned
    records = Records(runs=[run(0), run(20)], actions=old, presence=LIVE, horizon=at(-60))
    ledger = account(spec(catch_up=False), records, at(0), at(20), at(30))
    assert ledger[1].reason is not None
    assert ledger[1].reason.endswith("(paused (the pause is older than the audit log))")


def test_an_outage_of_one_replica_is_no_reason_while_another_could_run() -> None:
    both = (Span("a", at(-60), None), Span("b", at(-60), None))
    records = Records(
        runs=[run(0)], presence=both, outages=(Span("a", at(8), at(12)),), horizon=at(-60)
    )
    ledger = account(spec(), records, at(0), at(10), now=at(30))
    assert ledger[1].reason is not None and ledger[1].reason.startswith("unknown: replicas a, b")


def test_the_records_bound_where_the_ledger_begins() -> None:
    # the reader read only the latest runs: no slot before them is called missed
    records = Records(
        runs=[run(30), run(40)], presence=LIVE, horizon=at(-60), complete_since=at(30)
    )
    ledger = account(spec(), records, at(0), at(40), now=at(45))
    assert [m for m, _, _ in fates(ledger)] == [30, 40]
    # runs from before the presence records began (an upgraded schema) still count
    records = Records(
        runs=[run(0), run(10)],
        presence=(Span("a", at(15), None),),
        horizon=at(15),
        declared_since=at(15),
    )
    assert [f for _, f, _ in fates(account(spec(), records, at(0), at(10), at(40)))] == [
        "ran",
        "ran",
    ]


def _paused_for(days: int, trigger: object) -> tuple[list[tuple[timedelta, str, str | None]], int]:
    """The ledger of the day before ``now`` of a job declared ``days`` ago and paused for all
    but its first day, and the schedule steps it took."""
    now = at(60 * 24 * days)
    paused = at(60 * 24)
    records = Records(
        runs=[run(60 * 24 - 1)],
        actions=[Action("j", "pause", "ops", paused, None, True)],
        presence=(Span("a", T0, None),),  # one replica, live all along
        paused_at=paused,
        horizon=T0,
        declared_since=T0,
    )
    with walking() as walk:
        ledger = account(spec(trigger), records, now - timedelta(days=1), now, now)
    return [(s.slot - now, s.fate.value, s.reason) for s in ledger], walk.steps


@pytest.mark.parametrize(
    "trigger", [every(1), every(minutes=1), cron("* * * * *")], ids=["every-1s", "every-1m", "cron"]
)
def test_a_days_ledger_costs_a_day_however_old_the_records(trigger: object) -> None:
    # a replica live for a year, the job paused 364 days ago: the day's ledger walks the
    # day's slots, not every interval since the pause
    year, year_steps = _paused_for(365, trigger)
    days, days_steps = _paused_for(2, trigger)
    assert year == days and len(year) == 1000
    assert year[0][1:] == ("skipped", "paused by ops at 2026-12-02T03:00:00+00:00")
    assert year_steps == days_steps <= 4 * 1440


# --- what a replica recorded of itself: no "unknown" for what it can know --------------------


def _stall(owner: str, since: float, until: float, job: str | None = "blocker") -> Incident:
    return Incident(owner, STALLED, at(since), at(until), job)


@pytest.mark.parametrize(
    ("declared", "outages", "incidents", "reason"),
    [
        (
            ("a",),
            (),
            (_stall("a", 9.95, 10.05),),
            "replica a's event loop was blocked by job 'blocker' for 6.0 s",
        ),
        (
            ("a",),
            (),
            (_stall("a", 9.95, 10.05, None),),
            "replica a's event loop was blocked by code outside its jobs for 6.0 s",
        ),
        (
            ("a",),
            (),
            (Incident("a", AHEAD, at(-1), at(20), "5.012"),),
            "replica a's clock is 5.0 s ahead of the database: its ticks were refused",
        ),
        (  # a backup's look found the database cut off just after the slot: it could not run it
            ("a", "b"),
            (Span("a", at(8), at(12)), Span("b", at(10) + timedelta(seconds=1.5), at(12))),
            (),
            "the database was unreachable (from a, b)",
        ),
        (
            ("a", "b"),
            (Span("a", at(8), at(12)),),
            (_stall("b", 9.9, 10.1),),
            "the database was unreachable (from a); "
            "replica b's event loop was blocked by job 'blocker' for 12.0 s",
        ),
        (  # over before the slot: no reason
            ("a",),
            (),
            (_stall("a", 9.0, 9.9),),
            "unknown: replicas a were live and declared the job, and no record explains why it "
            "did not run (a defect: please report it)",
        ),
        (  # began once the slot's run was no longer due (its timeout and grace: 2 min)
            ("a",),
            (),
            (_stall("a", 12.05, 13),),
            "unknown: replicas a were live and declared the job, and no record explains why it "
            "did not run (a defect: please report it)",
        ),
        (  # another replica's stall explains nothing about this one
            ("a", "b"),
            (),
            (_stall("b", 9.9, 10.1),),
            "unknown: replicas a, b were live and declared the job, and no record explains why "
            "it did not run (a defect: please report it)",
        ),
    ],
    ids=[
        "stall",
        "stall-by-other-code",
        "ahead",
        "outage-seen-by-a-look",
        "mixed",
        "ended",
        "too-late",
        "other",
    ],
)
def test_what_each_replica_recorded_of_itself_says_why_it_did_not_run(
    declared: tuple[str, ...],
    outages: tuple[Span, ...],
    incidents: tuple[Incident, ...],
    reason: str,
) -> None:
    records = Records(
        runs=[run(0)],
        presence=tuple(Span(owner, at(-60), None) for owner in declared),
        outages=outages,
        incidents=incidents,
        horizon=at(-60),
    )
    ledger = account(spec(), records, at(0), at(10), now=at(30))
    assert fates(ledger)[1] == (10, "missed", reason)
