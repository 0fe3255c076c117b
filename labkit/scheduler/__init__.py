"""Layer 2: who runs each iteration. Continuous batching and the static baseline share one
scheduler and one block manager; they differ only in policy hooks."""

from .records import ScheduledSeq, SchedulerOutput, StepRecord
from .scheduler import Scheduler
from .static import StaticScheduler

__all__ = ["Scheduler", "StaticScheduler", "ScheduledSeq", "SchedulerOutput", "StepRecord"]
