"""The advisory-lock keys of a job: the legacy key every release takes (stable across versions,
so that mixed releases agree), and the key of one installation (schema) of ticklock."""

from __future__ import annotations

import hashlib


def lock_key(namespace: str, job_id: str, *, schema: str | None = None) -> int:
    """The signed 64-bit PostgreSQL advisory-lock key of ``job_id`` in ``namespace``.

    The first 8 bytes, big-endian, signed, of
    ``blake2b(f"{namespace}\\x00{job_id}".encode(), digest_size=8)``; with ``schema``, of
    ``blake2b(f"{schema}\\x00{namespace}\\x00{job_id}".encode(), digest_size=8)``: the key of
    the job in the installation whose tables are in ``schema``. A tick holds the schema's key
    exclusively and the key without a schema in shared mode (see the PostgreSQL page)::

        >>> lock_key("default", "purge-expired") == lock_key("default", "purge-expired")
        True
        >>> lock_key("default", "a", schema="ticklock") != lock_key("default", "a", schema="b")
        True
    """
    name = f"{namespace}\x00{job_id}" if schema is None else f"{schema}\x00{namespace}\x00{job_id}"
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
