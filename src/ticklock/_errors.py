"""ticklock's exceptions.

Hierarchy::

    ValueError
    └── ScheduleError      a misdeclared job, trigger or scheduler, raised where it is written
    RuntimeError
    └── SchedulerStateError  a scheduler used out of order (entered twice, run_now before start)
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """A declaration that cannot run: raised when it is written, never at the first tick.

    The message names the field, and the job id once there is one::

        >>> every(seconds=0)
        Traceback (most recent call last):
        ScheduleError: every(): interval must be positive, got 0 s
    """

    def __init__(self, message: str, *, job_id: str | None = None, field: str | None = None):
        if job_id is not None:
            message = f"job {job_id!r}: {message}"
        super().__init__(message)
        self.job_id = job_id
        self.field = field


class SchedulerStateError(RuntimeError):
    """The scheduler was used in a state that does not allow it (for example entered twice)."""
