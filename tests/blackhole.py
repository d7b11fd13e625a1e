"""A TCP proxy between replicas and the test server that can drop everything (a network
partition: connections are accepted and nothing is answered, as a firewall that drops packets
does, not refused), and heal: what was sent meanwhile arrives when TCP would send it again
after the heal (its retransmission timeout doubles), or never (``discard``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

RTO = 0.2
"""Seconds before TCP first sends a lost segment again (Linux's least); then twice as long each
time."""


class Blackhole:
    """Forwards ``127.0.0.1:port`` to the server of ``dsn`` until :meth:`drop`; then holds
    every byte, both ways, and every new connection, until :meth:`heal`."""

    def __init__(self, dsn: str, *, discard: bool = False) -> None:
        self._discard = discard
        self._healed = -math.inf
        parts = urlsplit(dsn)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._dsn = parts
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def dsn(self) -> str:
        """The server's DSN through this proxy."""
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._dsn.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{port}"
        return urlunsplit(
            self._dsn._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
        )

    def drop(self) -> None:
        """From now on nothing passes (connections are still accepted)."""
        self._open.clear()

    def heal(self) -> None:
        """Let everything through again, what was held first."""
        self._healed = time.monotonic()
        self._open.set()

    async def _retransmitted(self, sent: float) -> None:
        """Wait until the heal, and then until TCP would send again what was sent at ``sent``
        (its retransmission timeout doubles from :data:`RTO`)."""
        await self._open.wait()
        at = sent + RTO
        while at < self._healed:
            at = sent + (at - sent) * 2 + RTO
        await asyncio.sleep(at - time.monotonic())

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self._open.wait()
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            self._writers.add(up_writer)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                up_writer.transport.abort()
                self._writers.discard(up_writer)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if not self._open.is_set():
                    if self._discard:
                        continue
                    await self._retransmitted(time.monotonic())
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side closed: close the other


@asynccontextmanager
async def blackhole(dsn: str, *, discard: bool = False) -> AsyncIterator[Blackhole]:
    """A :class:`Blackhole` in front of ``dsn``, closed at the end."""
    proxy = Blackhole(dsn, discard=discard)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
