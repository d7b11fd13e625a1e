"""Start-up against a real PostgreSQL that is down, or that refuses the scheduler for good (G6)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from helpers import eventually, run_log
from pgserver import TempPostgres
from ticklock import JobContext, Outcome, Scheduler, StartupError, every

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_database_down_at_start_is_waited_for_and_then_used(pg_schema: str) -> None:
    server = TempPostgres()  # initialised, not started: its port refuses connections
    try:
        scheduler = Scheduler(server.dsn, schema=pg_schema, shutdown_grace=1)
        ran = anyio.Event()

        @scheduler.job(every(0.2), id="beat", timeout=0.1)
        async def beat(ctx: JobContext) -> None:
            assert ctx.conn is not None
            await ctx.conn.execute("SELECT 1")
            ran.set()

        records: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        keep = Keep()
        logging.getLogger("ticklock").addHandler(keep)
        try:
            with run_log() as log:
                async with scheduler:  # starts although nothing answers
                    await eventually(
                        lambda: anyio.to_thread.run_sync(lambda: len(log.outcomes("beat")) >= 3),
                        10,
                        "three ticks while the database is down",
                    )
                    assert set(log.outcomes("beat")) == {"error"}
                    await eventually(
                        lambda: anyio.to_thread.run_sync(
                            lambda: scheduler.health()[1].overdue  # [0] is the retention job
                        ),
                        10,
                        "the absence alarm while the database is down",
                    )
                    await anyio.to_thread.run_sync(server.start)
                    with anyio.fail_after(40):  # the backoff's cap is 30 s; the first waits 0.5
                        await ran.wait()
                    await eventually(
                        lambda: anyio.to_thread.run_sync(lambda: not scheduler.health()[1].overdue),
                        5,
                        "the alarm to clear after the first success",
                    )
        finally:
            logging.getLogger("ticklock").removeHandler(keep)
        warnings = [r for r in records if r.levelno == logging.WARNING]
        assert len([r for r in warnings if "database is unavailable" in r.getMessage()]) == 1
        assert len([r for r in records if "answers again" in r.getMessage()]) == 1
        # one line a run, and no traceback for an outage: its cause is in the one WARNING
        errors = [r for r in records if getattr(r, "outcome", None) == "error"]
        assert errors and all(r.exc_info is None for r in errors)
        import asyncpg

        conn = await asyncpg.connect(server.dsn)
        try:  # migrated once the database answered
            assert await conn.fetchval(f"SELECT count(*) FROM {pg_schema}.jobs") >= 1
        finally:
            await conn.close()
    finally:
        await anyio.to_thread.run_sync(server.cleanup)


async def test_require_database_fails_start_up_on_a_database_that_is_down() -> None:
    dsn = f"postgresql://app:sekret@127.0.0.1:{closed_port()}/app"
    scheduler = Scheduler(dsn, require_database=True)
    with pytest.raises(StartupError, match=r"^ticklock could not start: .*require_database=True"):
        async with scheduler:
            pass


def with_user(dsn: str, user: str) -> str:
    return dsn.replace("postgresql://postgres@", f"postgresql://{user}@")


NOT_ACCEPTING = (
    r'^ticklock could not start: ObjectNotInPrerequisiteStateError: database "d_[0-9a-f]+" is '
    r"not currently accepting connections: let the database accept connections \(ALTER "
    r"DATABASE \.\.\. ALLOW_CONNECTIONS true\)$"
)


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        (
            "unknown user",
            r'^ticklock could not start: InvalidAuthorizationSpecificationError: role "nobody_'
            r'[0-9a-f]+" does not exist: create the role \(CREATE ROLE \.\.\. LOGIN\), or '
            r"correct the user in the DSN$",
        ),
        (
            "missing database",
            r'^ticklock could not start: InvalidCatalogNameError: database "no_such_db" does not '
            r"exist: create the database, or correct its name in the DSN$",
        ),
        (
            "no permission to migrate",
            r"^ticklock could not start: InsufficientPrivilegeError: permission denied for "
            r"database postgres: the DSN's user needs CREATE on the database, for ticklock to "
            r"create its tables in schema 't_[0-9a-f]+'; or, once 'ticklock migrate' has "
            r"created them as another user: GRANT USAGE ON SCHEMA t_[0-9a-f]+, GRANT SELECT, "
            r"INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA t_[0-9a-f]+ and GRANT USAGE ON ALL "
            r"SEQUENCES IN SCHEMA t_[0-9a-f]+ to it$",
        ),
        ("not accepting connections", NOT_ACCEPTING),
    ],
)
async def test_require_database_fails_start_up_at_once_on_what_an_operator_must_fix(
    pg_dsn: str, pg_schema: str, pg_conn: Any, problem: str, message: str
) -> None:
    database = f"d_{pg_schema[2:]}"
    if problem == "unknown user":
        dsn = with_user(pg_dsn, f"nobody_{pg_schema[2:]}")
    elif problem == "missing database":
        dsn = pg_dsn.rsplit("/", 1)[0] + "/no_such_db"
    elif problem == "not accepting connections":
        await pg_conn.execute(f"CREATE DATABASE {database} ALLOW_CONNECTIONS false")
        dsn = pg_dsn.rsplit("/", 1)[0] + f"/{database}"
    else:
        role = f"{pg_schema}_limited"
        await pg_conn.execute(f"CREATE ROLE {role} LOGIN")
        dsn = with_user(pg_dsn, role)
    try:
        scheduler = Scheduler(dsn, schema=pg_schema, require_database=True)
        with anyio.fail_after(10), pytest.raises(StartupError, match=message):
            async with scheduler:
                pass
    finally:
        if problem == "no permission to migrate":
            await pg_conn.execute(f"DROP ROLE {pg_schema}_limited")
        if problem == "not accepting connections":
            await pg_conn.execute(f"DROP DATABASE {database}")


async def started_then_fixed(
    dsn: str, schema: str, fix: Callable[[], Awaitable[None]], error: str
) -> None:
    """Start a scheduler on ``dsn``, which refuses it: the app starts, the ERROR names
    ``error``, ``health()`` says so; once ``fix()`` ran, ticks run without a restart."""
    scheduler = Scheduler(dsn, schema=schema, shutdown_grace=1)
    ran = anyio.Event()

    @scheduler.job(every(0.2), id="beat", timeout=0.1)
    async def beat(ctx: JobContext) -> None:
        ran.set()

    def problem() -> str | None:
        return next(h.problem for h in scheduler.health() if h.job_id == "beat")

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(level=logging.ERROR)
    logging.getLogger("ticklock").addHandler(keep)
    try:
        with run_log() as log:
            async with scheduler:  # the host app starts
                await eventually(
                    lambda: anyio.to_thread.run_sync(lambda: len(log.outcomes("beat")) >= 2),
                    10,
                    "ticks while the database refuses the scheduler",
                )
                assert set(log.outcomes("beat")) == {"error"}
                assert not ran.is_set()
                assert error in (problem() or ""), problem()
                errors = [r.getMessage() for r in records if "cannot use the database" in r.msg]
                assert len(errors) == 1 and error in errors[0], errors
                await fix()
                with anyio.fail_after(20):  # the backoff doubles from 0.5 s
                    await ran.wait()
                assert problem() is None
    finally:
        logging.getLogger("ticklock").removeHandler(keep)


async def test_a_database_not_accepting_connections_at_start_is_waited_for(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    database = f"d_{pg_schema[2:]}"
    await pg_conn.execute(f"CREATE DATABASE {database} ALLOW_CONNECTIONS false")

    async def allow() -> None:
        await pg_conn.execute(f"ALTER DATABASE {database} ALLOW_CONNECTIONS true")

    try:
        dsn = pg_dsn.rsplit("/", 1)[0] + f"/{database}"
        await started_then_fixed(dsn, pg_schema, allow, "ALLOW_CONNECTIONS true")
    finally:
        await pg_conn.execute(f"DROP DATABASE {database} WITH (FORCE)")


async def test_a_role_created_after_start_is_used_without_a_restart(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    role = f"{pg_schema}_late"

    async def create() -> None:
        await pg_conn.execute(f"CREATE ROLE {role} LOGIN")
        await pg_conn.execute(f"GRANT CREATE ON DATABASE postgres TO {role}")

    try:
        await started_then_fixed(with_user(pg_dsn, role), pg_schema, create, "CREATE ROLE")
    finally:
        await pg_conn.execute(f"DROP SCHEMA IF EXISTS {pg_schema} CASCADE")
        await pg_conn.execute(f"REVOKE CREATE ON DATABASE postgres FROM {role}")
        await pg_conn.execute(f"DROP ROLE IF EXISTS {role}")


async def test_a_grant_made_after_start_is_used_without_a_restart(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # An administrator ran 'ticklock migrate'; the app's own user may connect, and no more.
    from ticklock._backends.postgres.schema import migrate

    await migrate(pg_conn, pg_schema)
    role = f"{pg_schema}_app"
    await pg_conn.execute(f"CREATE ROLE {role} LOGIN")
    s = pg_schema

    async def grant() -> None:
        await pg_conn.execute(
            f"GRANT USAGE ON SCHEMA {s} TO {role}; "
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {role}; "
            f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {role}"
        )

    try:
        await started_then_fixed(with_user(pg_dsn, role), s, grant, f"GRANT USAGE ON SCHEMA {s}")
    finally:
        await pg_conn.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


async def test_a_partial_grant_is_named_before_any_tick_needs_it(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    from ticklock._backends.postgres.schema import migrate

    await migrate(pg_conn, pg_schema)
    role = f"{pg_schema}_app"
    s = pg_schema
    await pg_conn.execute(
        f"CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA {s} TO {role}; "
        f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA {s} TO {role}"
    )

    async def grant() -> None:
        await pg_conn.execute(
            f"GRANT DELETE ON ALL TABLES IN SCHEMA {s} TO {role}; "
            f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {role}"
        )

    try:
        await started_then_fixed(with_user(pg_dsn, role), s, grant, f"table {s}.jobs (DELETE)")
    finally:
        await pg_conn.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


async def test_a_tick_while_the_database_is_down_is_an_error_not_a_crash() -> None:
    dsn = f"postgresql://app@127.0.0.1:{closed_port()}/app"
    scheduler = Scheduler(dsn, shutdown_grace=1)

    @scheduler.job(every(3600, initial_delay=3000), id="later")
    async def later(ctx: JobContext) -> None:
        pass

    async with scheduler:
        result = await scheduler.run_now("later")
    assert result.outcome is Outcome.ERROR
    assert result.error is not None
    assert result.error.startswith("DatabaseUnavailable: the database is not available")


async def test_a_host_that_accepts_and_never_answers_does_not_hold_up_the_start() -> None:
    # asyncpg waits 60 s for a connection by default: the app would not start for a minute.
    async def silent(stream: Any) -> None:
        async with stream:
            await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, silent)
        scheduler = Scheduler(f"postgresql://app@127.0.0.1:{port}/app", shutdown_grace=1)
        started = anyio.current_time()
        with anyio.fail_after(15):
            async with scheduler:
                pass
        assert anyio.current_time() - started < 10
        tg.cancel_scope.cancel()


async def test_a_dsn_option_asyncpg_refuses_fails_the_start(pg_dsn: str) -> None:
    scheduler = Scheduler(pg_dsn + "?sslmode=bogus")
    with (
        anyio.fail_after(10),
        pytest.raises(StartupError, match=r"^ticklock could not start: ClientConfigurationError"),
    ):
        async with scheduler:
            pass


async def test_a_user_without_rights_on_the_tables_gets_the_grants_to_make(
    pg_dsn: str, pg_schema: str, pg_conn: Any
) -> None:
    # An administrator ran 'ticklock migrate'; the app's own user may connect, and no more.
    from ticklock._backends.postgres.schema import migrate

    await migrate(pg_conn, pg_schema)
    role = f"{pg_schema}_app"
    await pg_conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        scheduler = Scheduler(with_user(pg_dsn, role), schema=pg_schema, require_database=True)
        with anyio.fail_after(10), pytest.raises(StartupError) as raised:
            async with scheduler:
                pass
        assert f"GRANT USAGE ON SCHEMA {pg_schema}" in str(raised.value)
    finally:
        await pg_conn.execute(f"DROP ROLE {role}")


def test_one_outage_is_one_warning_whatever_its_causes_in_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a server being started refuses connections, then says it is starting up: one outage
    import random

    import asyncpg

    from ticklock import SystemClock
    from ticklock._backends.postgres.database import Database

    db = Database(
        dsn="postgresql://127.0.0.1:1/x",
        pool=None,
        namespace="default",
        schema="ticklock",
        clock=SystemClock(),
        random=random.Random(1),
    )
    with caplog.at_level(logging.INFO, logger="ticklock"):
        db.down(ConnectionRefusedError(111, "Connect call failed"))
        db.down(asyncpg.CannotConnectNowError("the database system is starting up"))
    levels = [(r.levelname, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels == [
        ("WARNING", "the database is unavailable"),
        ("INFO", "the database is still unavailable"),
    ]
    assert db.problem is not None and "starting up" in db.problem
