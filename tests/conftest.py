"""Shared fixtures: anyio backends, a real PostgreSQL server, fresh schemas per test."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import PGBOUNCER, Replicas
from pgserver import TempPostgres, pgbouncer


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every async test runs on asyncio and trio, except PostgreSQL tests (asyncpg needs
    asyncio) and tests marked ``asyncio_only``; a test may also choose its own backends."""
    if "anyio_backend" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        if "anyio_backend" in str(mark.args[0]):
            return
    node = metafunc.definition
    only = node.get_closest_marker("postgres") or node.get_closest_marker("asyncio_only")
    backends = ["asyncio"] if only else ["asyncio", "trio"]
    metafunc.parametrize("anyio_backend", backends, indirect=True)


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(
    report: pytest.TestReport,
) -> Generator[None, dict[str, Any], dict[str, Any]]:
    """A report that pytest-xdist sends from a worker as UTF-8: the captured output of a test
    whose handler raises a lone surrogate (``test_session_edges``) keeps it as an escape."""
    escaped: dict[str, Any] = _escaped((yield))
    return escaped


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_escaped(v) for v in value)
    return value


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A trio test that hangs ignores the SIGALRM that pytest-timeout sends by default: time it
    out from a thread instead (which ends the whole run, but does not hang it)."""
    for item in items:
        if "[trio" in item.name and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(method="thread"))


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The backend :func:`pytest_generate_tests` chose for this test."""
    return str(request.param)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[TempPostgres | None]:
    """A throwaway PostgreSQL server for the session, unless TICKLOCK_TEST_DSN names one."""
    if os.environ.get("TICKLOCK_TEST_DSN"):
        yield None
        return
    server = TempPostgres()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: TempPostgres | None) -> str:
    """The DSN of the test server."""
    return os.environ.get("TICKLOCK_TEST_DSN") or (pg_server.dsn if pg_server else "")


@pytest.fixture
def pg_schema() -> str:
    """A schema name of this test's own, so tests never see each other's state."""
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def pg_conn(pg_dsn: str) -> AsyncIterator[object]:
    """A direct connection for assertions (asyncio only: asyncpg needs asyncio)."""
    import asyncpg

    conn = await asyncpg.connect(pg_dsn)
    try:
        yield conn
    finally:
        await conn.close()


@asynccontextmanager
async def _replicas(
    app: str, log_table: str, dsn: str, schema: str, conn: Any, tmp: Path
) -> AsyncIterator[Replicas]:
    """A :class:`helpers.Replicas` of ``app`` in ``schema``, created with the app's ``log``
    table; every replica still running is killed at the end."""
    await conn.execute(f"CREATE SCHEMA {schema}")
    await conn.execute(log_table.format(schema=schema))
    replicas = Replicas(dsn, schema, tmp, app)
    try:
        yield replicas
    finally:
        replicas.kill_all()


@pytest.fixture
async def ops(pg_dsn: str, pg_schema: str, pg_conn: Any, tmp_path: Path) -> AsyncIterator[Replicas]:
    """Replica processes of ``ops_app`` in this test's own schema, with its ``log`` table."""
    from ops_app import LOG_TABLE

    async with _replicas("ops_app", LOG_TABLE, pg_dsn, pg_schema, pg_conn, tmp_path) as replicas:
        yield replicas


@pytest.fixture
async def fleet(
    pg_dsn: str, pg_schema: str, pg_conn: Any, tmp_path: Path
) -> AsyncIterator[Replicas]:
    """Replica processes of ``replica_app`` in this test's own schema, with its ``log`` table."""
    from replica_app import LOG_TABLE

    async with _replicas(
        "replica_app", LOG_TABLE, pg_dsn, pg_schema, pg_conn, tmp_path
    ) as replicas:
        yield replicas


@pytest.fixture
def bouncer(pg_dsn: str, tmp_path: Path) -> Iterator[str]:
    """A real PgBouncer in transaction-pooling mode in front of the test server: its DSN."""
    if PGBOUNCER is None:
        pytest.skip("pgbouncer is not installed")
    with pgbouncer(PGBOUNCER, pg_dsn, tmp_path) as dsn:
        yield dsn


@pytest.fixture
async def table(pg_conn: Any, pg_schema: str) -> str:
    """A table ``<schema>.items (slot, note)`` in this test's own schema, for handlers to write."""
    await pg_conn.execute(f"CREATE SCHEMA {pg_schema}")
    await pg_conn.execute(f"CREATE TABLE {pg_schema}.items (slot timestamptz, note text)")
    return f"{pg_schema}.items"
