"""Spans, metrics and log lines, read back through the OpenTelemetry SDK's in-memory exporters."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from helpers import add_lock_holder, at, eventually
from ticklock import JobContext, Outcome, Scheduler, cron, every
from ticklock.testing import ManualClock

pytestmark = pytest.mark.anyio
T0 = at("2026-05-01T00:00Z")


@dataclass
class Otel:
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    meter_provider: MeterProvider

    def finished(self, job_id: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == f"ticklock.run {job_id}"]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            if sm.scope.name == "ticklock"
            for metric in sm.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def runs(self, job_id: str, outcome: str) -> int:
        return sum(
            p.value
            for p in self.points("ticklock.runs")
            if p.attributes == {"ticklock.job.id": job_id, "ticklock.run.outcome": outcome}
        )


@pytest.fixture
def otel() -> Iterator[Otel]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Otel(spans, reader, tracer_provider, meter_provider)
    meter_provider.shutdown()
    tracer_provider.shutdown()


async def test_spans_metrics_and_logs_for_success_failure_and_timeout(
    otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(
        clock=clock,
        owner="replica-1",
        tracer_provider=otel.tracer_provider,
        meter_provider=otel.meter_provider,
    )
    inner = otel.tracer_provider.get_tracer("app")

    @scheduler.job(every(60), id="ok")
    async def ok(ctx: JobContext) -> dict[str, int]:
        with inner.start_as_current_span("app.work"):
            await clock.sleep_until(clock.monotonic() + 2)
        return {"n": 3}

    @scheduler.job(every(60), id="bad")
    async def bad(ctx: JobContext) -> None:
        raise ValueError("nope")

    @scheduler.job(every(60), id="slow", timeout=5)
    async def slow(ctx: JobContext) -> None:
        await anyio.sleep_forever()

    caplog.set_level(logging.DEBUG, logger="ticklock")
    async with scheduler:
        await clock.advance(71)  # ok: 0-2, 62-64; bad: 0, 60; slow: 0-5, 65-70

    (first_ok, _) = otel.finished("ok")
    attrs = dict(first_ok.attributes or {})
    assert attrs["ticklock.job.id"] == "ok"
    assert attrs["ticklock.run.outcome"] == "success"
    assert attrs["ticklock.run.slot"] == T0.isoformat()
    assert attrs["ticklock.run.owner"] == "replica-1"
    assert attrs["ticklock.run.jitter"] == 0.0 and attrs["ticklock.run.lateness"] == 0.0
    assert first_ok.status.status_code is StatusCode.UNSET
    (child,) = [s for s in otel.spans.get_finished_spans() if s.name == "app.work"][:1]
    assert child.parent is not None and child.parent.span_id == first_ok.context.span_id

    failed = otel.finished("bad")[0]
    assert failed.attributes["ticklock.run.outcome"] == "failure"  # type: ignore[index]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.status.description == "ValueError: nope"
    assert [e.name for e in failed.events] == ["exception"]

    timed_out = otel.finished("slow")[0]
    assert timed_out.attributes["ticklock.run.outcome"] == "timeout"  # type: ignore[index]
    assert timed_out.status.status_code is StatusCode.ERROR

    assert otel.runs("ok", "success") == 2
    assert otel.runs("bad", "failure") == 2
    assert otel.runs("slow", "timeout") == 2
    durations = {
        p.attributes["ticklock.job.id"]: p
        for p in otel.points("ticklock.run.duration")
        if p.attributes["ticklock.run.outcome"] in ("success", "timeout")
    }
    assert durations["ok"].count == 2 and durations["ok"].sum == pytest.approx(4.0)
    assert durations["slow"].sum == pytest.approx(10.0)
    lateness = {p.attributes["ticklock.job.id"]: p for p in otel.points("ticklock.run.lateness")}
    assert lateness["ok"].count == 2 and lateness["ok"].sum == 0
    gauge = {
        p.attributes["ticklock.job.id"]: p.value for p in otel.points("ticklock.job.last_success")
    }
    # the second success of "ok" started at 62 s (60 s after the first ended) and took 2 s
    assert gauge == {"ok": (T0.timestamp() + 64)}

    lines = [r for r in caplog.records if getattr(r, "job_id", None) == "ok"]
    assert lines[0].levelno == logging.INFO
    # the logger's name already says "ticklock": the message does not repeat it
    assert lines[0].name == "ticklock"
    assert lines[0].getMessage().startswith(f"run ok slot={T0.isoformat()} outcome=success")
    assert lines[0].report == {"n": 3}  # type: ignore[attr-defined]
    bad_lines = [r for r in caplog.records if getattr(r, "job_id", None) == "bad"]
    assert bad_lines[0].levelno == logging.ERROR and bad_lines[0].exc_info is not None


@pytest.mark.postgres
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_locked_and_skipped_attempts_are_spans_and_counts(
    otel: Otel, pg_dsn: str, pg_schema: str
) -> None:
    gate, entered = anyio.Event(), anyio.Event()

    def build(owner: str) -> Scheduler:
        scheduler = Scheduler(
            pg_dsn,
            schema=pg_schema,
            owner=owner,
            tracer_provider=otel.tracer_provider,
            meter_provider=otel.meter_provider,
        )
        add_lock_holder(scheduler, entered, gate)
        return scheduler

    a, b = build("a"), build("b")
    async with a:

        async def holding() -> bool:
            return entered.is_set()

        await eventually(holding, 10, "a run to hold the lock")
        async with b:
            result = await b.run_now("shared")
            assert result.outcome is Outcome.LOCKED
            gate.set()

            async def settled() -> bool:
                return otel.runs("shared", "success") == 1 and (
                    otel.runs("shared", "skipped") + otel.runs("shared", "locked") >= 2
                )

            await eventually(settled, 10, "b's own tick to be locked or skipped")
        gauge = [p.value for p in otel.points("ticklock.job.last_success")]
        assert gauge and all(v > 0 for v in gauge)
    locked = [
        s
        for s in otel.finished("shared")
        if s.attributes["ticklock.run.outcome"] == "locked"  # type: ignore[index]
    ]
    assert locked and locked[0].attributes["ticklock.run.owner"] == "b"  # type: ignore[index]
    assert locked[0].status.status_code is StatusCode.UNSET


async def test_a_timeout_span_records_a_timeout_error_where_the_handler_waited(
    otel: Otel,
) -> None:
    clock = ManualClock(T0)
    scheduler = Scheduler(clock=clock, tracer_provider=otel.tracer_provider)

    async def stuck_on_something() -> None:
        await anyio.sleep_forever()

    @scheduler.job(every(60), id="hangs", timeout=5)
    async def hangs(ctx: JobContext) -> None:
        await stuck_on_something()

    async with scheduler:
        await clock.advance(6)
    (span,) = otel.finished("hangs")
    assert span.status.status_code is StatusCode.ERROR
    (event,) = [e for e in span.events if e.name == "exception"]
    attrs = dict(event.attributes or {})
    assert attrs["exception.type"] == "TimeoutError"
    assert attrs["exception.message"] == "timed out after 5 s"
    assert "stuck_on_something" in str(attrs["exception.stacktrace"])


def _fails_deeper() -> None:
    raise RuntimeError("boom in a helper")


async def test_a_logged_traceback_starts_at_the_handler_and_an_every_slot_at_the_millisecond(
    otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    start = T0 + timedelta(microseconds=123_556)  # an every job's first slot: its start
    clock = ManualClock(start)
    scheduler = Scheduler(clock=clock, tracer_provider=otel.tracer_provider)

    @scheduler.job(every(60), id="bad")
    async def bad(ctx: JobContext) -> None:
        _fails_deeper()

    caplog.set_level(logging.INFO, logger="ticklock")
    async with scheduler:
        await clock.advance(1)
    (line,) = [r for r in caplog.records if getattr(r, "job_id", None) == "bad"]
    # the message rounds the slot to the millisecond; the record's data keeps it whole
    assert line.getMessage().startswith("run bad slot=2026-05-01T00:00:00.124+00:00 ")
    assert line.slot == start.isoformat()  # type: ignore[attr-defined]
    assert line.exc_info is not None
    shown = logging.Formatter().formatException(line.exc_info)
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', shown)
    assert [name for _, name in frames] == ["bad", "_fails_deeper"], shown
    # the exception itself is intact: its traceback, as the span records it, still holds
    # the machinery that called the handler
    exc = line.exc_info[1]
    assert exc is not None and exc.__traceback__ is not None
    assert exc.__traceback__.tb_frame.f_code.co_filename.endswith(
        os.path.join("ticklock", "_runtime", "runner.py")
    )
    (span,) = otel.finished("bad")
    (event,) = span.events
    stack = str((event.attributes or {})["exception.stacktrace"])
    assert "runner.py" in stack and "_fails_deeper" in stack


async def test_the_slot_counters_count_skips_by_reason_replacements_and_backfills(
    otel: Otel,
) -> None:
    clock = ManualClock(T0 + timedelta(seconds=30))
    scheduler = Scheduler(
        clock=clock, tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider
    )

    def minute(ctx: JobContext) -> float:
        return (ctx.slot - T0).total_seconds() / 60

    async def long_first(ctx: JobContext) -> None:  # the run of 00:01 takes 150 s
        if minute(ctx) == 1 and not ctx.backfill:
            await clock.sleep_until(clock.monotonic() + 150)

    scheduler.add(long_first, cron("* * * * *"), id="skip", timeout=600, overlap="skip")
    scheduler.add(long_first, cron("* * * * *"), id="replace", timeout=600, overlap="replace")
    async with scheduler:
        await clock.advance(6 * 60)
        await scheduler.fleet.backfill("skip", T0 - timedelta(minutes=2), T0)

    def total(name: str, **attributes: str) -> int:
        wanted = {"ticklock.job.id": attributes.pop("job")} | {
            f"ticklock.slot.{k}": v for k, v in attributes.items()
        }
        return sum(p.value for p in otel.points(name) if dict(p.attributes) == wanted)

    # skip: 00:02 and 00:03 came while 00:01 ran
    assert (
        total("ticklock.slots.skipped", job="skip", reason="the run before was still running") == 2
    )
    assert total("ticklock.slots.missed", job="skip") == 0
    # replace: 00:01 was replaced at 00:02
    assert total("ticklock.slots.skipped", job="replace", reason="replaced") == 1
    assert total("ticklock.slots.backfilled", job="skip") == 2
