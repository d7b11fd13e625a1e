"""The replica process of the contract suite on PostgreSQL: ``python -m ticklock run
contract_app:scheduler --dsn ...``, declaring the jobs of ``CONTRACT_SCENARIO`` (see
``contract_jobs.py``) as ``CONTRACT_OWNER`` in ``CONTRACT_SCHEMA``.

Every tick attempt's log record (one per attempt: ``skipped`` and ``locked`` too, at DEBUG) is
appended as a JSON line to ``CONTRACT_ATTEMPTS``, so that the test sees the attempts of a
process as it sees those of a replica in its own process.
"""

from __future__ import annotations

import json
import logging
import os

from contract_jobs import declare
from ticklock import Scheduler

OWNER = os.environ.get("CONTRACT_OWNER", "replica")
ATTEMPTS = os.environ.get("CONTRACT_ATTEMPTS", os.devnull)


class Attempts(logging.Handler):
    """Appends each run record of the ``ticklock`` logger to :data:`ATTEMPTS`."""

    def emit(self, record: logging.LogRecord) -> None:
        fields = record.__dict__
        if "outcome" not in fields:
            return
        line = {name: fields[name] for name in ("job_id", "slot", "outcome", "owner")}
        with open(ATTEMPTS, "a") as out:
            out.write(json.dumps(line) + "\n")


logging.getLogger("ticklock").addHandler(Attempts(level=logging.DEBUG))
scheduler = Scheduler(
    schema=os.environ.get("CONTRACT_SCHEMA", "ticklock"), owner=OWNER, shutdown_grace=1
)
declare(scheduler, os.environ.get("CONTRACT_SCENARIO", "tick"))
