"""ticklock: periodic jobs inside the process you already run, safe across replicas."""

from ._batch import Batch as Batch
from ._clock import Clock as Clock
from ._clock import SystemClock as SystemClock
from ._errors import ScheduleError as ScheduleError
from ._errors import SchedulerStateError as SchedulerStateError
from ._errors import StartupError as StartupError
from ._job import Job as Job
from ._job import JobContext as JobContext
from ._job import JobHealth as JobHealth
from ._job import JobOptions as JobOptions
from ._job import Outcome as Outcome
from ._job import RunResult as RunResult
from ._lock_key import lock_key as lock_key
from ._logging import log_to_stderr as log_to_stderr
from ._scheduler import Scheduler as Scheduler
from ._triggers import Cron as Cron
from ._triggers import Every as Every
from ._triggers import cron as cron
from ._triggers import every as every
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
    "ScheduleError",
    "Scheduler",
    "SchedulerStateError",
    "StartupError",
    "SystemClock",
    "__version__",
    "cron",
    "every",
    "lock_key",
    "log_to_stderr",
)
