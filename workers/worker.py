"""What every rank runs: join the group, build its shard and KV cache; ranks > 0 then serve plans.

Ranks > 0 never see Sequence objects: only StepPlan bytes from the plan channel. A worker that fails
reports its traceback to rank 0 before exiting; a worker whose rank 0 is gone exits on its own.
"""
import argparse
import json
import logging
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from nanovllm_tp import envs
from nanovllm_tp.config import cpu_threads
from nanovllm_tp.config.engine_config import EngineConfig
from nanovllm_tp.config.platform import resolve_attention_backend, resolve_device_and_dtype
from nanovllm_tp.distributed import shm_allreduce
from nanovllm_tp.distributed import torchrun_replicas, trust
from nanovllm_tp.distributed.launch import (DistInfo, SPAWN_ENV, engine_rank, exit_on_sigterm,
                                            init_process_group, join_spawned, launched_by_torchrun, multi_node,
                                            node_ranks, rank0_host, share_store, torchrun_secret)
from nanovllm_tp.distributed import pipeline
from nanovllm_tp.distributed.parallel_state import current_tp, set_tp, tp_size
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.scheduler.block_manager import check_holds_a_sequence
from nanovllm_tp.scheduler.plan import KV_READ, KV_WRITE, StepPlan
from nanovllm_tp.utils import trace
from nanovllm_tp.utils.proctitle import REPLICA_ENV, rank_title, set_title
from nanovllm_tp.workers.kv_cache import blocks_for_budget
from nanovllm_tp.workers.model_runner import ModelRunner

log = logging.getLogger("nanovllm_tp")
DEFAULT_CPU_KV_BYTES = 1 << 30


def join_group(config: EngineConfig, device: torch.device, spawn=None) -> DistInfo:
    """Process group + shared store (+ the plan channel's secret) for a TP > 1 engine; a no-op DistInfo for
    TP = 1. ``spawn``: rank 0's SpawnRendezvous when it started the workers itself."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    ranks = tp * pp
    if ranks == 1:     # touches no process-wide state: a multi-rank engine may live beside it
        return DistInfo(rank=0, world_size=1, mode="single")
    torchrun = launched_by_torchrun()
    placement = torchrun_replicas.current()      # a data-parallel replica's ranks: a group of their own
    rank = engine_rank()
    world = int(os.environ.get("WORLD_SIZE", ranks)) if (torchrun or SPAWN_ENV in os.environ) else ranks
    if placement is not None:
        world = placement.size
    if world != ranks:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} is {ranks} ranks but "
                         f"WORLD_SIZE={world}: launch one process per rank")
    if torchrun:
        trust.require_secret_for(multi_node())      # refuse before joining anything
    info = DistInfo(rank=rank, world_size=world, mode="torchrun" if torchrun else "spawn",
                    node_rank=int(os.environ.get("GROUP_RANK", 0)), host=rank0_host())
    if spawn is not None:
        info.store, info.secret = spawn.store, spawn.secret
        spawn.wait_for_workers()
    elif info.mode == "spawn":
        join_spawned(info)
    init_process_group(rank, world, device, info.store if info.mode == "spawn" else
                       torchrun_replicas.group_store() if placement is not None else None)
    if pp > 1:      # the stages' TP groups and the TP ranks' pipeline groups (distributed/pipeline.py)
        tp_rank, tp_group, stage = pipeline.build_groups(rank, tp, pp)
        set_tp(tp_rank, tp, tp_group)
        pipeline.set_pp(stage)
    if info.mode == "torchrun":
        share_store(info)
        torchrun_secret(info)
    if info.secret is None and info.rank == 0:
        log.warning("%s=1: the plan channel is NOT authenticated or encrypted", trust.INSECURE_ENV)
    return info


def build_runner(config: EngineConfig, device: torch.device, dtype: torch.dtype, backend,
                 extra_block_bytes: int = 0) -> ModelRunner:
    """This rank's model shard and KV cache; every rank agrees on the smallest block count. extra_block_bytes:
    what else each block costs this rank (rank 0's draft model keeps a block of its own per target block)."""
    torch.manual_seed(config.seed)
    if device.type == "cpu":      # before the weights load: the linear kernels are timed at this count
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        cpu_threads.govern(envs.local_ranks(ranks))
    runner = ModelRunner(config, device, dtype, backend)
    block_bytes = runner.kv_block_bytes() + extra_block_bytes
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            from nanovllm_tp.workers.cuda_graph import profile_kv_budget
            budget = profile_kv_budget(runner, config)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    num_blocks = blocks_for_budget(budget, block_bytes)
    if tp_size() > 1 or pipeline.pp_size() > 1:      # every stage's rank too: one block table serves them all
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        num_blocks = int(agreed[0])
    draft = ", the draft model's included" if extra_block_bytes else ""
    check_holds_a_sequence(num_blocks, config.kvcache_block_size, config.max_model_len,
                           f"the KV cache budget of {budget / 2**20:.1f} MiB per rank ({block_bytes} bytes a "
                           f"block{draft})")
    runner.allocate_kv_cache(num_blocks)
    # a quantized cache reaches the graph-capturing backends through per-step dequantized copies: eager
    if device.type == "cuda" and not config.enforce_eager and backend.supports_graphs and runner.kv_scales is None:
        from nanovllm_tp.workers.cuda_graph import capture_decode_graphs
        runner.graphs = capture_decode_graphs(runner, config.max_num_seqs, config.max_model_len)
    trace.watch_layers(runner.model)    # after capture: no hook runs while graphs are recorded
    return runner


def serve(runner: ModelRunner, reader) -> None:
    """Run every plan rank 0 publishes until it shuts the channel down (or disappears)."""
    from nanovllm_tp.distributed.channel import ChannelClosed
    from nanovllm_tp.workers.kv_blocks import gather_blocks, scatter_blocks
    from nanovllm_tp.workers.plan_check import PlanLimits, check_plan
    limits = PlanLimits.of(runner)
    while True:
        try:
            with trace.span("receive"):
                payload = reader.receive()
        except ChannelClosed:
            return
        with trace.span("decode_plan"):
            plan = StepPlan.decode(payload)
            check_plan(plan, limits)            # before any kernel: PlanError names the step and the field
        if plan.kind in (KV_READ, KV_WRITE):    # a request leaving or entering with its KV: rank 0's collective
            with trace.span("move_kv"):
                blocks = plan.kv_blocks.tolist()
                gather_blocks(runner, blocks) if plan.kind == KV_READ else scatter_blocks(runner, None, [], blocks)
            continue
        with trace.plan_span("execute", plan):
            runner.execute(plan)


def run_worker(config: EngineConfig) -> int:
    """Entry for ranks > 0 (torchrun or spawned). Returns the process exit code."""
    with cpu_kernels.switched(config.cpu_kernels):     # the one engine of this process
        return _run_worker(config)


def _run_worker(config: EngineConfig) -> int:
    from nanovllm_tp.distributed.channel import PlanReader
    exit_on_sigterm()      # SIGTERM (torchrun's agent sends it when another rank fails) runs the cleanup below
    reader = runner = recording = None
    try:
        device, dtype = resolve_device_and_dtype(config)
        info = join_group(config, device)
        recording = trace.start(config, info.rank)
        nodes = node_ranks(info.world_size, info.node_rank)
        reader = PlanReader(info.store, info.rank, local=nodes[info.rank] == nodes[0], secret=info.secret)
        shm_allreduce.setup_stage(info, all(n == nodes[0] for n in nodes), device, config.shm_allreduce,
                                  current_tp(), pipeline.current_pp())
        backend = resolve_attention_backend(config, device, dtype)
        runner = build_runner(config, device, dtype, backend)
        serve(runner, reader)
        return 0
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:      # SIGTERM (exit_on_sigterm): told to stop, not a failure; the caller says so
        if exc.code != 128 + signal.SIGTERM:
            raise
        return exc.code
    except BaseException as exc:
        gone = reader.writer_gone() if reader is not None else None
        if gone is not None:         # rank 0 died: what failed here followed from it, one line says so
            sys.stderr.write(f"[nanovllm_tp worker rank {os.environ.get('RANK')}] rank 0 is gone ({gone}); "
                             f"exiting ({type(exc).__name__}: {exc})\n")
            return 1
        text = traceback.format_exc()
        if reader is not None:
            reader.report_error(text)
        sys.stderr.write(f"[nanovllm_tp worker rank {os.environ.get('RANK')}] {text}")
        return 1
    finally:
        if runner is not None:      # graphs and KV cache go before the process group (see ModelRunner.release)
            try:
                runner.release(hand_back=False)
            except Exception:
                pass
        if reader is not None:
            reader.close()
        trace.finish(recording)             # this rank's part, which rank 0 merges
        shm_allreduce.teardown()        # unlinks the segment too if rank 0 is dead
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="nanovllm_tp worker rank (started by rank 0)")
    parser.add_argument("--config", required=True, help="engine config as JSON")
    args = parser.parse_args(argv)
    config = EngineConfig(**json.loads(args.config))
    config.validate()
    set_title(rank_title(int(os.environ.get("RANK", 0)), os.environ.get(REPLICA_ENV)))
    sys.exit(run_worker(config))


if __name__ == "__main__":
    main()
