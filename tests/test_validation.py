"""Every misdeclaration is refused when it is written, naming the field and the job."""

from __future__ import annotations

import re
import sys
from datetime import timedelta

import pytest

from ticklock import JobContext, ScheduleError, Scheduler, cron, every
from ticklock._operators.fleet import checked


async def handler(ctx: JobContext) -> None:
    pass


def sync_handler(ctx: JobContext) -> None:
    pass


@pytest.mark.parametrize(
    ("make", "message", "field"),
    [
        pytest.param(
            lambda: every(0),
            r"^every\(\): interval must be positive and finite, got 0 s$",
            "interval",
            id="zero_interval",
        ),
        pytest.param(
            lambda: every(-5),
            r"^every\(\): interval must be positive",
            "interval",
            id="negative_interval",
        ),
        pytest.param(
            lambda: every(), r"^every\(\): interval must be positive", "interval", id="no_interval"
        ),
        pytest.param(
            lambda: every(float("nan")),
            r"^every\(\): interval must be positive",
            "interval",
            id="nan_interval",
        ),
        pytest.param(
            lambda: every(seconds=float("nan")),
            r"^every\(\): interval must be positive and finite, got seconds=nan$",
            "interval",
            id="nan_seconds",
        ),
        pytest.param(
            lambda: every(minutes=float("-inf")),
            r"^every\(\): interval must be positive and finite, got minutes=-inf$",
            "interval",
            id="infinite_minutes",
        ),
        pytest.param(
            lambda: every("5"),  # type: ignore[arg-type]
            r"^every\(\): interval must be seconds \(a number\) or a "
            r"timedelta, got '5'$",
            "interval",
            id="string_interval",
        ),
        pytest.param(
            lambda: every(10, seconds=5),
            r"^every\(\): give the interval either",
            "interval",
            id="both_forms",
        ),
        pytest.param(
            lambda: every(10, jitter=10),
            r"^every\(\): jitter \(10 s\) must be smaller "
            r"than the interval \(10 s\)$",
            "jitter",
            id="jitter_not_smaller",
        ),
        pytest.param(
            lambda: every(10, jitter=-1),
            r"^every\(\): jitter must be non-negative",
            "jitter",
            id="negative_jitter",
        ),
        pytest.param(
            lambda: every(10, initial_delay=-1),
            r"^every\(\): initial_delay must be non-negative",
            "initial_delay",
            id="negative_initial_delay",
        ),
        pytest.param(
            lambda: cron("* * * * *", jitter=timedelta(minutes=2)),
            r"^cron\(\): jitter \(120 s\) must be smaller than the shortest gap",
            "jitter",
            id="cron_jitter",
        ),
        pytest.param(
            lambda: cron("* * * * *", tz=""),
            r"^cron\(\): tz must be an IANA zone name",
            "tz",
            id="empty_zone",
        ),
        pytest.param(
            lambda: every(days=10**9),
            r"^every\(\): interval must be at most 100 years",
            "interval",
            id="interval_beyond_timedelta",
        ),
        pytest.param(
            lambda: every(1e12),
            r"^every\(\): interval must be at most 100 years, got 1e\+12 s$",
            "interval",
            id="interval_beyond_the_calendar",
        ),
        pytest.param(
            lambda: every(days="1"),  # type: ignore[arg-type]
            r"^every\(\): interval must be seconds \(a number\) or a timedelta",
            "interval",
            id="string_days",
        ),
        pytest.param(
            lambda: every(10, initial_delay=timedelta(days=10**6)),
            r"^every\(\): initial_delay must be at most 100 years",
            "initial_delay",
            id="initial_delay_beyond_the_calendar",
        ),
    ],
)
def test_trigger_errors(make: object, message: str, field: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        make()  # type: ignore[operator]
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_durations_accept_timedelta() -> None:
    assert every(timedelta(minutes=15)).interval == 900
    assert every(hours=1, minutes=30).interval == 5400
    assert every(10, jitter=timedelta(seconds=2)).jitter == 2


JOB_CASES = [
    pytest.param(
        {"timeout": 10},
        every(10),
        r"^job 'x': timeout \(10 s\) must be shorter than the interval \(10 s\)$",
        "timeout",
        id="timeout_not_shorter",
    ),
    pytest.param(
        {"timeout": 60},
        cron("*/1 * * * *"),
        r"^job 'x': timeout \(60 s\) must be shorter than the shortest gap between "
        r"fires \(60 s\); declare overlap= to allow up to 24 hours$",
        "timeout",
        id="cron_timeout",
    ),
    pytest.param(
        {"timeout": 7200},
        cron("0 0,23 */7 * 4,5"),  # 23 h apart, but 1 h from a Thursday 29 February to 1 March
        r"^job 'x': timeout \(7200 s\) must be shorter than the shortest gap between "
        r"fires \(3600 s\); declare overlap= to allow up to 24 hours$",
        "timeout",
        id="cron_timeout_rare_gap",
    ),
    pytest.param(
        {"overlap": "queue"},
        cron("* * * * *"),
        r"^job 'x': overlap must be one of 'skip', 'buffer_one', 'replace' or None, "
        r"got 'queue'$",
        "overlap",
        id="unknown_overlap",
    ),
    pytest.param(
        {"overlap": "replace"},
        every(10),
        r"^job 'x': overlap='replace' needs a cron trigger: an every job never overlaps "
        r"itself",
        "overlap",
        id="overlap_on_every",
    ),
    pytest.param(
        {"overlap": "buffer_one", "timeout": 86401},
        cron("* * * * *"),
        r"^job 'x': timeout must be at most 86400 s \(24 hours\) with "
        r"overlap='buffer_one', got 86401 s$",
        "timeout",
        id="overlap_timeout_over_a_day",
    ),
    pytest.param(
        {"timeout": 0},
        every(10),
        r"^job 'x': timeout must be positive and finite",
        "timeout",
        id="zero_timeout",
    ),
    pytest.param(
        {"timeout": timedelta(days=25)},
        every(days=365),
        r"^job 'x': timeout must be at most 2147482\.647 s \(about 24\.8 days: PostgreSQL "
        r"holds statement and transaction timeouts up to 2147483647 ms, and ticklock adds "
        r"1 s\), got 2\.16e\+06 s$",
        "timeout",
        id="timeout_beyond_the_server",
    ),
    pytest.param(
        {"overdue_grace": -1},
        every(10),
        r"^job 'x': overdue_grace must be non-negative",
        "overdue_grace",
        id="negative_grace",
    ),
    pytest.param(
        {"enabled": "yes"},
        every(10),
        r"^job 'x': enabled must be True or False",
        "enabled",
        id="enabled_not_bool",
    ),
]


@pytest.mark.parametrize(("kwargs", "trigger", "message", "field"), JOB_CASES)
def test_job_errors_name_the_job_and_the_field(
    kwargs: dict[str, object], trigger: object, message: str, field: str
) -> None:
    scheduler = Scheduler()
    with pytest.raises(ScheduleError, match=message) as info:
        scheduler.add(handler, trigger, id="x", **kwargs)  # type: ignore[arg-type]
    assert info.value.job_id == "x" and info.value.field == field
    assert "x" not in scheduler.jobs  # nothing half-declared


def test_sync_handler_is_refused_with_the_thread_recipe() -> None:
    scheduler = Scheduler()
    with pytest.raises(ScheduleError) as info:
        scheduler.add(sync_handler, every(10), id="sync")  # type: ignore[arg-type]
    text = str(info.value)
    assert text.startswith("job 'sync': handler sync_handler is not an async function")
    assert "anyio.to_thread.run_sync" in text
    assert info.value.field == "func"


def test_async_callable_objects_are_accepted() -> None:
    class Handler:
        async def __call__(self, ctx: JobContext) -> None:
            pass

    assert Scheduler().add(Handler(), every(10), id="obj").id == "obj"


def test_duplicate_id() -> None:
    scheduler = Scheduler()
    scheduler.add(handler, every(10), id="dup")
    with pytest.raises(ScheduleError, match=r"^job 'dup': a job with this id is already declared"):
        scheduler.add(handler, every(20), id="dup")
    assert scheduler.jobs["dup"].trigger == every(10)  # the first declaration is untouched


def test_default_id_is_module_and_qualname() -> None:
    scheduler = Scheduler()

    @scheduler.job(every(10))
    async def tidy(ctx: JobContext) -> None:
        pass

    (job_id,) = scheduler.jobs
    assert job_id == f"{__name__}.test_default_id_is_module_and_qualname.<locals>.tidy"


@pytest.mark.parametrize("bad", ["", "x" * 201, 5])
def test_ids_and_namespaces_must_be_short_strings(bad: object) -> None:
    with pytest.raises(ScheduleError, match=r"^job .*id must be a non-empty string|^id must"):
        Scheduler().add(handler, every(10), id=bad)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match=r"^namespace must be a non-empty string of at most"):
        Scheduler(namespace=bad)  # type: ignore[arg-type]


def test_names_with_a_nul_character_are_refused() -> None:
    # PostgreSQL text cannot hold NUL: such a job would fail at every tick, not at declaration
    with pytest.raises(ScheduleError, match=r"^id must not contain NUL") as info:
        Scheduler().add(handler, every(10), id="a\x00b")
    assert info.value.field == "id"
    with pytest.raises(ScheduleError, match=r"^namespace must not contain NUL"):
        Scheduler(namespace="a\x00")
    with pytest.raises(ScheduleError, match=r"^owner must not contain NUL"):
        Scheduler(owner="host\x00")


def test_names_with_an_unpaired_surrogate_are_refused() -> None:
    # PostgreSQL text cannot hold one (UTF-8 has no encoding of it): such a job's runs would
    # all be errors and the replica's every heartbeat would fail, so it never appeared live
    with pytest.raises(
        ScheduleError,
        match=r"^id must not contain unpaired surrogates \(PostgreSQL text cannot store them\), "
        r"got 'job\\ud800': U\+D800 \(an unpaired surrogate\) at character 4$",
    ) as info:
        Scheduler().add(handler, every(10), id="job\ud800")
    assert info.value.field == "id"
    with pytest.raises(
        ScheduleError,
        match=r"^namespace must not contain unpaired surrogates \(PostgreSQL text cannot store "
        r"them\), got 'ns\\udcff': U\+DCFF \(an unpaired surrogate\) at character 3$",
    ) as info:
        Scheduler(namespace="ns\udcff")  # a byte that is no UTF-8, decoded as surrogateescape
    assert info.value.field == "namespace"
    with pytest.raises(ScheduleError, match=r"^owner must not contain unpaired surrogates"):
        Scheduler(owner="\udfffhost")
    scheduler = Scheduler()
    with pytest.raises(ScheduleError, match=r"^id must not contain unpaired surrogates"):

        @scheduler.job(every(10), id="ü\ud83d")  # half of an emoji's pair
        async def tidy(ctx: JobContext) -> None:
            pass

    assert scheduler.jobs == {}
    # a pair encoded as one code point is text: an emoji, accents and other scripts pass
    assert Scheduler().add(handler, every(10), id="nightly 🛑 ü שלום").id == "nightly 🛑 ü שלום"


HIDDEN = [
    pytest.param("\u202e", "U+202E (RIGHT-TO-LEFT OVERRIDE)", id="bidi_override"),
    pytest.param("\u202a", "U+202A (LEFT-TO-RIGHT EMBEDDING)", id="bidi_embedding"),
    pytest.param("\u2066", "U+2066 (LEFT-TO-RIGHT ISOLATE)", id="bidi_isolate"),
    pytest.param("\u2069", "U+2069 (POP DIRECTIONAL ISOLATE)", id="bidi_pop_isolate"),
    pytest.param("\u200b", "U+200B (ZERO WIDTH SPACE)", id="zero_width_space"),
    pytest.param("\u200d", "U+200D (ZERO WIDTH JOINER)", id="zero_width_joiner"),
    pytest.param("\ufeff", "U+FEFF (ZERO WIDTH NO-BREAK SPACE)", id="byte_order_mark"),
    pytest.param("\u2028", "U+2028 (LINE SEPARATOR)", id="line_separator"),
    pytest.param("\u2029", "U+2029 (PARAGRAPH SEPARATOR)", id="paragraph_separator"),
    pytest.param("\x1b", "U+001B (a control character)", id="control_escape"),
    pytest.param("\x85", "U+0085 (a control character)", id="control_next_line"),
    pytest.param("\ud800", "U+D800 (an unpaired surrogate)", id="unpaired_surrogate"),
]


@pytest.mark.parametrize(("char", "named"), HIDDEN)
@pytest.mark.parametrize("field", ["note", "who"])
def test_a_note_or_who_with_a_hidden_character_is_refused_naming_it(
    field: str, char: str, named: str
) -> None:
    # each would be stored and then printed raw by `ticklock status` and the dashboard: a bidi
    # override reorders the line, a zero-width character hides in it, a separator breaks it
    with pytest.raises(
        ValueError,
        match=rf"^{field} must be one line of plain text, without control, format or separator "
        rf"characters: it has {re.escape(named)} at character 7$",
    ):
        checked(f"INC-42{char}: fixed", field)


@pytest.mark.parametrize(("char", "named"), [p for p in HIDDEN if p.id != "unpaired_surrogate"])
def test_an_id_namespace_or_owner_with_a_hidden_character_is_refused_naming_it(
    char: str, named: str
) -> None:
    # a job id is printed by `status`, logged on every run and shown on the dashboard: an
    # escape would forge a log line or colour the terminal, a bidi override reorder the row
    name = f"nightly{char}x"
    message = (
        rf"^{{0}} must be plain text, without control, format or separator characters, got "
        rf"{re.escape(repr(name))}: {re.escape(named)} at character 8$"
    )
    scheduler = Scheduler()
    with pytest.raises(ScheduleError, match=message.format("id")) as info:
        scheduler.add(handler, every(10), id=name)
    assert info.value.field == "id" and scheduler.jobs == {}
    with pytest.raises(ScheduleError, match=message.format("namespace")) as info:
        Scheduler(namespace=name)
    assert info.value.field == "namespace"
    with pytest.raises(ScheduleError, match=message.format("owner")):
        Scheduler(owner=name)


def test_a_note_in_any_script_passes() -> None:
    for text in ("שלום עולם", "مرحبا", "🛑 stopped", "non\u00a0breaking", "ü" * 500):
        assert checked(text, "note") == text


@pytest.mark.anyio
async def test_an_operation_with_a_hidden_character_changes_nothing() -> None:
    scheduler = Scheduler()
    scheduler.add(handler, every(60), id="j")
    async with scheduler:
        with pytest.raises(ValueError, match=r"^note must be one line of plain text"):
            await scheduler.pause("j", "fixed \u202egnp.exe")
        with pytest.raises(ValueError, match=r"^who must be one line of plain text"):
            await scheduler.fleet.trigger("j", who="alice\u200b")
        assert await scheduler.fleet.audit("j") == []


def test_job_durations_beyond_the_calendar_are_refused() -> None:
    with pytest.raises(ScheduleError, match=r"^job 'x': overdue_grace must be at most 100 years"):
        Scheduler().add(handler, every(10), id="x", overdue_grace=timedelta(days=10**6))


@pytest.mark.parametrize("schema", ["", "drop table x;", "a-b", '"x"', "1abc", "a" * 64, "ä"])
def test_schema_must_be_a_plain_identifier(schema: str) -> None:
    with pytest.raises(ScheduleError, match=r"^schema must be a plain SQL identifier"):
        Scheduler(schema=schema)


def test_default_timeout_is_half_the_period_capped_at_five_minutes() -> None:
    scheduler = Scheduler()
    assert scheduler.add(handler, every(60), id="a").timeout == 30
    assert scheduler.add(handler, every(hours=1), id="b").timeout == 300
    assert scheduler.add(handler, cron("*/10 * * * *"), id="c").timeout == 300
    assert scheduler.add(handler, cron("0,1 * * * *"), id="d").timeout == 30


def test_the_default_timeout_counts_the_shortest_gap_however_rare() -> None:
    # 00:00, 00:55, 23:00, 23:55: 55 min apart at least, but 5 min from 23:55 on a Thursday
    # 29 February (2024) to 00:00 on Friday 1 March
    job = Scheduler().add(handler, cron("0,55 0,23 */7 * 4,5"), id="rare")
    assert job.timeout == 150


def test_dsn_and_pool_are_exclusive() -> None:
    with pytest.raises(ScheduleError, match="^give either dsn or pool, not both$"):
        Scheduler("postgresql://x", pool=object())  # type: ignore[arg-type]


def test_the_longest_timeout_fits_the_servers_millisecond_settings() -> None:
    # a tick sets statement/transaction_timeout to the timeout + 1 s, in int milliseconds
    job = Scheduler().add(handler, every(days=365), id="x", timeout=2_147_482.647)
    assert int((job.timeout + 1) * 1000) == 2_147_483_647


BAD_PORT = (
    r"^dsn has a bad port: it must be a number from 1 to 65535 \(write '/', '\?' and '#' "
    r"in the password as %2F, %3F and %23\)$"
)
BAD_DSNS = [
    pytest.param(
        "postgresql://app:Zq1Zq2@[db/app",
        r"^dsn does not parse as a URL \(check the host's \[brackets\]\); expected "
        r"postgresql://user:password@host:port/database$",
        id="unclosed_bracket",
    ),
    pytest.param(
        "postgresql://app:Zq1Zq2@db:54x2/app",
        BAD_PORT,
        id="port_not_a_number",
    ),
    pytest.param("postgresql://app:Zq1Zq2@db:65536/app", BAD_PORT, id="port_high"),
    pytest.param("postgresql://app:Zq1Zq2@db:0/app", BAD_PORT, id="port_zero"),
    pytest.param(  # fullwidth digits, which int() would read
        "postgresql://app:Zq1Zq2@db:\uff15\uff14\uff13\uff12/app", BAD_PORT, id="port_fullwidth"
    ),
    pytest.param("postgresql://app:Zq1Zq2@h1:5432,h2:99999/app", BAD_PORT, id="multi_host"),
    pytest.param("postgresql://app:Zq1/Zq2@db/app", BAD_PORT, id="slash_in_pw"),
    pytest.param("postgresql://db/app?port=5x", BAD_PORT, id="query_port"),
    pytest.param(
        "postgresql://app:Zq1@Zq2@db/app",
        r"^dsn has more than one '@' before the host: write '@' in the password as %40$",
        id="at_in_password",
    ),
    pytest.param(
        "postgresql://h1,,h2/app?password=Zq1Zq2",
        r"^dsn has an empty host in its host list; expected "
        r"postgresql://user:password@host:port/database$",
        id="empty_host",
    ),
    pytest.param(
        "postgresql://db/app?password=Zq1Zq2&sslmode",
        r"^dsn has a malformed query: write each option as name=value, joined by '&'$",
        id="bad_query",
    ),
    pytest.param(
        "postgresql+asyncpg://app:Zq1Zq2@db/app",
        r"^dsn has the SQLAlchemy form 'postgresql\+asyncpg://': ticklock uses asyncpg "
        r"directly, so drop '\+asyncpg' and write 'postgresql://'$",
        id="sqlalchemy_url",
    ),
    pytest.param(
        "host=db dbname=app password=Zq1Zq2",
        r"^dsn must be a URL, not key=value settings; expected "
        r"postgresql://user:password@host:port/database$",
        id="keyword_value",
    ),
    pytest.param(
        "mysql://app:Zq1Zq2@db/app",
        r"^dsn must start with postgresql:// or postgres://, not 'mysql:'$",
        id="other_scheme",
    ),
    pytest.param(
        "db:5432/app",
        r"^dsn must start with postgresql:// or postgres://, not 'db:'$",
        id="no_scheme",
    ),
    pytest.param("   ", r"^dsn must be a non-empty connection string$", id="blank"),
    pytest.param("", r"^dsn must be a non-empty connection string$", id="empty"),
]


@pytest.mark.parametrize(("dsn", "message"), BAD_DSNS)
def test_malformed_dsns_are_refused_at_construction_without_the_password(
    dsn: str, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        Scheduler(dsn)
    assert info.value.field == "dsn"
    assert "Zq1Zq2" not in str(info.value) and "ret" not in str(info.value).split("%")[0]
    scheduler = Scheduler()
    with pytest.raises(ScheduleError, match=message):
        scheduler.use_dsn(dsn)
    assert not scheduler.postgres


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:sekret@db:5432/app",
        "postgres://db/app",
        "POSTGRESQL://db/app",
        "postgresql:///app?host=/var/run/postgresql&port=5433",
        "postgresql://app@h1:5432,h2:5433,[::1]:5434/app",
        "postgresql://app:p%40ss%2Fword@[2001:db8::1]/app?sslmode=require",
        "postgresql://",
    ],
)
def test_dsns_asyncpg_accepts_are_accepted(dsn: str) -> None:
    assert Scheduler(dsn).postgres


def test_a_missing_postgres_extra_is_named_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # as if asyncpg were not installed
    message = r'^PostgreSQL mode needs asyncpg: pip install "ticklock\[postgres\]"$'
    with pytest.raises(ScheduleError, match=message) as info:
        Scheduler("postgresql://db/app")
    assert info.value.field == "dsn"
    with pytest.raises(ScheduleError, match=message):
        Scheduler().use_dsn("postgresql://db/app")
    assert not Scheduler().postgres  # local mode needs no extra


def test_an_unknown_job_keyword_is_named_with_the_closest_known_one() -> None:
    scheduler = Scheduler()

    async def purge(ctx: JobContext) -> None:
        pass

    with pytest.raises(ScheduleError) as raised:
        scheduler.add(purge, every(60), id="purge", timout=5)  # type: ignore[call-arg]
    assert raised.value.field == "timout"
    assert raised.value.job_id == "purge"
    assert str(raised.value).startswith(
        "job 'purge': unknown keyword timout=; did you mean timeout=? (a job takes id, timeout,"
    )
    with pytest.raises(ScheduleError, match="unknown keyword nonsense=[ ]"):
        scheduler.job(every(60), nonsense=1)(purge)  # type: ignore[call-arg]
    assert scheduler.jobs == {}  # nothing half-declared
