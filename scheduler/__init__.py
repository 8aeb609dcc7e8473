"""Scheduling: pure Python + numpy, no torch. Its only output to the workers is a StepPlan."""
from nanovllm_tp.scheduler.block_manager import BlockManager
from nanovllm_tp.scheduler.plan import DECODE, MIXED, PREFILL, StepPlan
from nanovllm_tp.scheduler.scheduler import Scheduler, SchedulerConfig
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "DECODE", "MIXED", "PREFILL", "Scheduler", "SchedulerConfig", "Sequence", "SequenceStatus",
           "StepPlan"]
