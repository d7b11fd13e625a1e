"""ticklock: periodic jobs inside the process you already run, safe across replicas."""

from ._errors import ScheduleError as ScheduleError
from ._errors import SchedulerStateError as SchedulerStateError
from ._errors import StartupError as StartupError
from ._logging import log_to_stderr as log_to_stderr
from ._operators.schedules import Schedules as Schedules
from ._runtime.batch import Batch as Batch
from ._runtime.clock import Clock as Clock
from ._runtime.clock import SystemClock as SystemClock
from ._schedule.job import Job as Job
from ._schedule.job import JobContext as JobContext
from ._schedule.job import JobHealth as JobHealth
from ._schedule.job import JobOptions as JobOptions
from ._schedule.job import Outcome as Outcome
from ._schedule.job import RunResult as RunResult
from ._schedule.lock_key import lock_key as lock_key
from ._schedule.stored import Schedule as Schedule
from ._schedule.triggers import Cron as Cron
from ._schedule.triggers import Every as Every
from ._schedule.triggers import cron as cron
from ._schedule.triggers import every as every
from ._scheduler import Scheduler as Scheduler
from ._version import __version__ as __version__

__all__ = (
    "Batch",
    "Clock",
    "Cron",
    "Every",
    "Job",
    "JobContext",
    "JobOptions",
    "JobHealth",
    "Outcome",
    "RunResult",
    "Schedule",
    "ScheduleError",
    "Scheduler",
    "SchedulerStateError",
    "Schedules",
    "StartupError",
    "SystemClock",
    "__version__",
    "cron",
    "every",
    "lock_key",
    "log_to_stderr",
)
