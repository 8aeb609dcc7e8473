"""Scheduling: pure Python + numpy, no torch. Its only output to the workers is a StepPlan; rank 0's engine gets a
ScheduledStep (the plan, the sampling entries, the prompt chunks) and hands the results back to postprocess()."""
from nanovllm_tp.scheduler.block_manager import BlockManager
from nanovllm_tp.scheduler.plan import DECODE, MIXED, PREFILL, StepPlan
from nanovllm_tp.scheduler.scheduled_step import ScheduledStep
from nanovllm_tp.scheduler.scheduler import Scheduler, SchedulerConfig
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["BlockManager", "DECODE", "MIXED", "PREFILL", "ScheduledStep", "Scheduler", "SchedulerConfig", "Sequence",
           "SequenceStatus", "StepPlan"]
