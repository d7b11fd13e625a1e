"""The advisory-lock key of a job: stable across versions so mixed releases agree."""

from __future__ import annotations

import hashlib


def lock_key(namespace: str, job_id: str) -> int:
    """The signed 64-bit PostgreSQL advisory-lock key of ``job_id`` in ``namespace``.

    The first 8 bytes, big-endian, signed, of
    ``blake2b(f"{namespace}\\x00{job_id}".encode(), digest_size=8)``::

        >>> lock_key("default", "purge-expired") == lock_key("default", "purge-expired")
        True
    """
    digest = hashlib.blake2b(f"{namespace}\x00{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
