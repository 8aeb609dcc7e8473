"""Rank 0's engine: the scheduler, this rank's runner, and the plan channel to the other ranks."""
import atexit
import contextlib
import logging
import time
import weakref


from nanovllm_tp.config import cpu_threads
from nanovllm_tp.config.engine_config import EngineConfig
from nanovllm_tp.config.platform import resolve_attention_backend, resolve_device_and_dtype
from nanovllm_tp.distributed.launch import SpawnRendezvous, exit_on_sigterm, launched_by_torchrun, spawn_workers
from nanovllm_tp.distributed.parallel_state import TPState, current_tp, tp_scope
from nanovllm_tp.distributed.pipeline import PPState, current_pp, pp_scope
from nanovllm_tp.layers import cpu_kernels, kernel_choice
from nanovllm_tp.layers.packed_linear import linear_paths
from nanovllm_tp.scheduler import Scheduler, SchedulerConfig, Sequence
from nanovllm_tp.scheduler.micro_batches import MicroBatchScheduler
from nanovllm_tp.scheduler.plan import KV_READ, KV_WRITE, StepPlan
from nanovllm_tp.utils import trace

log = logging.getLogger("nanovllm_tp")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from nanovllm_tp.workers.draft_runner import DraftProposer
        from nanovllm_tp.workers.worker import build_runner, join_group
        _check_one_multi_rank_engine(config)
        self.config = config
        self.children, self.writer, self.dead, self._rendezvous, self.draft = [], None, None, None, None
        self.rank_killed = False          # the engine stopped because a rank was killed from outside
        self.local_ranks, self.remote_ranks = [], []
        self._closed = False
        self.device, self.dtype = resolve_device_and_dtype(config)
        with cpu_kernels.switched(config.cpu_kernels):
            backend = resolve_attention_backend(config, self.device, self.dtype)
        draft = _draft_config(config)     # refused before any worker starts
        self._trace = trace.start(config, rank=0)
        exit_on_sigterm()      # from here on: a SIGTERM while the workers start still removes what they share
        try:
            if config.world_size > 1 and not launched_by_torchrun():
                self._rendezvous = SpawnRendezvous.create(config.world_size)
                self.children = spawn_workers(config, config.world_size, self._rendezvous)
            self.info = join_group(config, self.device, self._rendezvous)
            self._tp = current_tp() if self.info.world_size > 1 else TPState()
            self._pp = current_pp() if self.info.world_size > 1 else PPState()
            if self.info.world_size > 1:
                self._open_channel()
            with self._scope():
                self.draft = draft and DraftProposer(config, draft, self.device, self.dtype)
                self.runner = build_runner(config, self.device, self.dtype, backend,
                                           self.draft.kv_block_bytes() if self.draft else 0)
                if self.draft:
                    self.draft.allocate(self.runner.num_kv_blocks)
        except BaseException as exc:
            if self.writer is not None and isinstance(exc, Exception):
                self._fail(exc)
            self.close()
            raise
        scheduler_config = SchedulerConfig.of(config, self.runner.num_kv_blocks)
        self.micro_batches = (config.pipeline_micro_batches or config.pipeline_parallel_size
                              if config.pipeline_parallel_size > 1 else 1)
        self.scheduler = (MicroBatchScheduler(scheduler_config, self.micro_batches) if self.micro_batches > 1 else
                          Scheduler(scheduler_config, self.draft))
        if self.runner.kv_pool is not None:      # another engine reading a block checks its version here
            self.scheduler.block_manager.stamps = self.runner.kv_pool.stamps
        from nanovllm_tp.layers.sampler import Sampler
        self.sampler = Sampler(config.model_config.eos_token_ids)
        from nanovllm_tp.engine.kv_transfer import KVMoves
        self.kv_moves = KVMoves()         # what moved in and out with its KV (engine/kv_transfer.py)
        atexit.register(self.close)
        _live_engines.add(self)
        log.info("engine ready: %s%s", self.runner.describe(), f"; {self.draft.describe()}" if self.draft else "")

    @contextlib.contextmanager
    def _scope(self):
        """This engine's process-wide settings (its TP group, its cpu_kernels) while it builds or steps: other
        engines of the process keep theirs."""
        with tp_scope(self._tp), pp_scope(self._pp), cpu_kernels.switched(self.config.cpu_kernels):
            yield

    def _open_channel(self) -> None:
        from nanovllm_tp.distributed import shm_allreduce
        from nanovllm_tp.distributed.channel import PlanWriter
        from nanovllm_tp.distributed.launch import node_ranks
        nodes = node_ranks(self.info.world_size, self.info.node_rank)
        local = [r for r in range(1, len(nodes)) if nodes[r] == nodes[0]]
        remote = [r for r in range(1, len(nodes)) if nodes[r] != nodes[0]]
        self.writer = PlanWriter(self.info.store, local, remote, host=self.info.host, secret=self.info.secret)
        shm_allreduce.setup_stage(self.info, not remote, self.device, self.config.shm_allreduce,  # all local only
                                  self._tp, self._pp)
        self.local_ranks, self.remote_ranks = local, remote    # shared-memory readers, ZMQ readers

    def add(self, seq: Sequence) -> None:
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def adopt(self, seq: Sequence, entry) -> bool:
        """A decoding sequence with the KV of all but its last token from another engine (`entry`: its
        CompletionKV, checked against this engine: engine/kv_transfer.py), as bytes or as blocks in the other
        engine's shared pool: into the pool and running (Scheduler.adopt). False when the pool is short, or the
        other engine's blocks cannot be read after all (its pool is gone, or it took a block for other tokens
        before the copy ended): the caller queues the sequence to compute again."""
        from nanovllm_tp.engine.kv_payload import DRAFT
        from nanovllm_tp.workers.kv_blocks import copy_from_peer
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")

        def write(rows: list[int], block_ids: list[int]) -> bool:
            if entry.kv is not None:
                self._write_kv(entry.kv, rows, block_ids)
                if self.draft is not None:      # its parts were checked against the draft's cache
                    self.draft.write_kv(entry.kv, DRAFT, rows, block_ids)
            elif copy_from_peer(self.runner, entry.pool, entry.blocks, entry.versions, rows, block_ids):
                self.kv_moves.bytes_in += len(block_ids) * self.runner.kv_block_bytes()
            else:
                return False
            self.kv_moves.blocks_in += len(block_ids)
            return True
        return self.scheduler.adopt(seq, write)

    def read_kv(self, block_ids: list[int]) -> dict[str, bytes]:
        """The KV of these blocks, every layer, as bytes (workers/kv_blocks.py): under tensor parallelism every
        rank's part, gathered here; a draft model's parts beside them (adopt writes both)."""
        from nanovllm_tp.engine.kv_payload import DRAFT
        from nanovllm_tp.workers.kv_blocks import gather_blocks, read_blocks
        if self.dead:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        if self._tp.size == 1:
            parts = read_blocks(self.runner, block_ids)
        else:
            parts = self._with_ranks(KV_READ, block_ids, lambda: gather_blocks(self.runner, block_ids))
        if self.draft is not None:
            parts.update(self.draft.read_kv(block_ids, DRAFT))
        return parts

    def _write_kv(self, parts: dict[str, bytes], rows: list[int], block_ids: list[int]) -> None:
        """A payload's KV (checked against this cache), its blocks `rows`, into this pool's `block_ids`: under
        tensor parallelism each rank's part sent to it."""
        from nanovllm_tp.workers.kv_blocks import scatter_blocks, write_blocks
        if self._tp.size == 1:
            write_blocks(self.runner, parts, rows, block_ids)
        elif rows:
            self._with_ranks(KV_WRITE, block_ids, lambda: scatter_blocks(self.runner, parts, rows, block_ids))

    def _with_ranks(self, kind: int, block_ids: list[int], collective):
        """Publish a plan that moves KV (KV_READ, KV_WRITE) and run rank 0's side of its collective. A rank that
        fails in it stops the engine, as a failed step does."""
        try:
            with self._scope():
                self._publish(StepPlan.moving_kv(kind, self.scheduler.step_id, block_ids))
                with trace.span("move_kv"):
                    return collective()
        except BaseException as exc:
            self._step_failed(exc)
            raise

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_completion_tokens: int | None = None) -> None:
        """End a request between steps (abort, stop string); its blocks are free at once (with pipeline
        micro-batches, a request in a step still in flight ends when that step's results are in)."""
        self.scheduler.finish(seq, reason, stop_reason, num_completion_tokens)

    def stats(self) -> dict:
        """What this engine runs on and lifetime counters of what it has done (LLM.stats documents the keys)."""
        counters = self.counters()
        graphs, sched = self.runner.graphs, self.scheduler
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "pipeline_parallel_size": self.config.pipeline_parallel_size,
                "pipeline_micro_batches": self.micro_batches,
                "max_steps_in_flight": getattr(sched, "max_in_flight", int(sched.step_id > 0)),
                "attention_backend": self.runner.backend.name, "kv_block_size": self.config.kvcache_block_size,
                "kv_cache_dtype": self.runner.kv_cache_format(), "quantization": self.runner.quantization,
                "linear": linear_paths(self.runner.model),
                "linear_kernels": kernel_choice.report(self.runner.model),
                "cpu_threads": cpu_threads.report() if self.device.type == "cpu" else None,
                "cuda_graph_batch_sizes": None if graphs is None else sorted(graphs.graphs),
                "num_steps": sched.step_id, "num_computed_tokens": sched.num_computed_tokens, **counters}

    def counters(self) -> dict:
        """The scheduler's figures of stats() alone (LLM.counters documents the keys): cheap enough for every step,
        where stats() also walks the model's modules."""
        if self.runner is None:
            raise RuntimeError("the engine is closed")
        sched, blocks = self.scheduler, self.scheduler.block_manager
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                "kv_cache_usage": blocks.usage(), "num_kv_blocks": self.runner.num_kv_blocks,
                "num_preemptions": sched.num_preemptions, "num_draft_tokens": sched.num_draft_tokens,
                "num_accepted_tokens": sched.num_accepted_tokens,
                "num_accepted_tokens_per_pos": sched.num_accepted_per_position.tolist(),
                "prefix_cache_hit_tokens": blocks.num_prefix_hit_tokens,
                "prefix_cache_query_tokens": blocks.num_prefix_query_tokens, "kv_transfer": self.kv_moves.as_dict()}

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Run one step: (sequences that got a token or an embedding, tokens computed, whether it was a prefill)."""
        from nanovllm_tp.pooling.embeddings import pool_sums
        if self.micro_batches > 1:
            return self._step_micro_batched()
        sched = self.scheduler
        try:
            with trace.span("schedule"):
                step = sched.schedule()          # a draft model proposes in here
        except BaseException as exc:
            self._step_failed(exc)
            raise
        if step is None:
            return [], 0, False
        plan, pooled = step.plan, None
        step.sampling.start_masks()          # structured outputs: grammar masks made while the model runs
        try:
            with self._scope():
                self._publish(plan)
                with trace.plan_span("execute", plan):
                    logits = self.runner.execute(plan)
                if self.draft is not None:
                    self.draft.follow(plan)
                tokens, lp, prompt_lp = self._sample(logits, step)
                if step.pool_chunks:
                    with trace.span("pool"):
                        pooled = pool_sums(self.runner.take_hidden(), step.pool_chunks)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        with trace.span("postprocess"):
            progressed = sched.postprocess(tokens, lp, prompt_lp, pooled)
        return progressed, plan.num_tokens, plan.is_prefill

    def _sample(self, logits, step):
        """The step's tokens and logprobs from its logits (none when every row is an embedding's), and its prompt
        chunks' logprobs."""
        from nanovllm_tp.layers.sampler import prompt_logprobs
        with trace.span("sample"):
            tokens, lp = ([], None) if logits is None else self.sampler(logits, step.sampling)
        prompt_lp = None
        if step.prompt_chunks:
            with trace.span("prompt_logprobs"):
                prompt_lp = prompt_logprobs(logits, step.prompt_chunks)
        return tokens, lp, prompt_lp

    def _publish(self, plan) -> None:
        """The plan to every other rank (none at world size 1)."""
        if self.writer is not None:
            with trace.span("encode_plan"):
                payload = plan.encode()
            with trace.span("publish"):
                self.writer.publish(payload)

    def _step_micro_batched(self) -> tuple[list[Sequence], int, bool]:
        """step() with pipeline micro-batches: start steps (schedule, publish, run stage 0) until as many are in
        flight as there are micro-batches or no part has anything to run, then take the oldest one's logits from
        the last stage, sample and postprocess it. In steady decode each call starts one step and finishes one, so
        while rank 0 runs stage 0 of step k + 1 the later stages run the steps before it."""
        sched = self.scheduler
        try:
            with self._scope():
                while sched.num_in_flight < self.micro_batches:
                    with trace.span("schedule"):
                        started = sched.schedule()
                    if started is None:
                        break
                    started.sampling.start_masks()
                    self._publish(started.plan)
                    with trace.plan_span("execute", started.plan):
                        self.runner.execute(started.plan, collect=False)
                step = sched.oldest()
                if step is None:
                    return [], 0, False
                with trace.span("pp_collect"):
                    logits = self.runner.collect_logits(step.plan)
                tokens, lp, prompt_lp = self._sample(logits, step)
        except BaseException as exc:
            self._step_failed(exc)
            raise
        with trace.span("postprocess"):
            progressed = sched.postprocess(tokens, lp, prompt_lp)
        return progressed, step.plan.num_tokens, step.plan.is_prefill

    def check_ranks(self) -> None:
        """Raise (and stop the engine, as a failed step does) if another rank died or reported an error since the
        last step: an idle engine publishes no plan, so without this a rank's death would go unseen until the next
        request reached it. Cheap (the channel's monitor thread does the watching): call it as often as you like."""
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        if self.writer is None:
            return
        from nanovllm_tp.distributed.channel import PeerError
        try:
            self.writer.check_readers()
        except PeerError as exc:
            self._step_failed(exc)
            raise RuntimeError(self.dead) from exc

    def _step_failed(self, exc: BaseException) -> None:
        """Every request ends (aborted) and the engine stops: no rank is left waiting for a plan."""
        self.scheduler.abort_all()
        if self.writer is not None and isinstance(exc, Exception):
            self._fail(exc)
        else:
            self.close()

    def _fail(self, exc: BaseException) -> None:
        """A step failed with other ranks involved: name the rank at fault if one is, and stop the engine."""
        from nanovllm_tp.distributed.channel import PeerError
        peer = exc if isinstance(exc, PeerError) else None
        deadline = time.monotonic() + 5.0
        while peer is None and time.monotonic() < deadline:
            try:
                self.writer.check_readers()
                time.sleep(0.05)
            except PeerError as found:
                peer = found
        # a rank that reported may have failed because another died (the stage it waited on): name the dead one
        deadline = min(deadline, time.monotonic() + 1.0)
        while peer is not None and time.monotonic() < deadline:
            if (death := self.writer.silent_death()) is not None:
                peer = death if death.rank != peer.rank else peer
                break
            time.sleep(0.05)
        self.dead = str(peer or exc)
        self.rank_killed = peer is not None and self._killed(peer.rank)
        self.close()
        if peer is not None and peer is not exc:
            raise peer from exc

    def _killed(self, rank: int) -> bool:
        """Whether the rank at fault was killed from outside (kill -9, SIGTERM: an operator, the OOM killer) rather
        than failing by itself (an error it reported, a crash): it died without a word, and, where this process
        spawned it, by one of those signals."""
        death = self.writer.silent_death()
        if death is None or death.rank != rank:
            return False
        child = self.children[rank - 1] if 0 < rank <= len(self.children) else None
        if child is None:
            return True                  # a torchrun rank: how it ended is its agent's to know
        try:
            child.wait(timeout=1.0)
        except Exception:
            return False
        from nanovllm_tp.distributed.channel_common import KILLED_BY
        return child.returncode in KILLED_BY

    def close(self) -> None:
        """Stop every rank: shutdown message first (idle workers leave at once), then this rank's graphs and
        KV cache (NCCL cannot destroy a communicator that live graphs captured), then the process group (a
        worker stuck in a collective with us errors out), then wait for spawned workers."""
        if self._closed:
            return
        self._closed = True
        failed = self.dead is not None
        self.dead = self.dead or "the engine was closed"
        atexit.unregister(self.close)
        import torch.distributed as dist
        from nanovllm_tp.distributed import shm_allreduce
        from nanovllm_tp.distributed.launch import stop_children
        from nanovllm_tp.distributed.parallel_state import set_tp
        from nanovllm_tp.distributed.pipeline import set_pp
        if self.writer is not None:
            try:
                self.writer.shutdown("rank 0 closed the engine")
            except Exception:
                pass
        draft, self.draft = self.draft, None
        if draft is not None:
            draft.release()
        runner, self.runner = getattr(self, "runner", None), None
        if runner is not None:      # free the weights, KV cache and graph pools now, not at process exit
            try:
                runner.release(hand_back=not failed)
            except Exception:       # a broken device must not keep the other ranks running
                log.exception("releasing this rank's model and KV cache failed")
        if self.config.world_size > 1:    # the process group is this engine's (one per process)
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
            shm_allreduce.teardown()        # peers stuck in it raise; rank 0 unlinks it
            set_tp(0, 1, None)
            set_pp(PPState())
        stop_children(self.children)
        trace.finish(self._trace, wait_s=0.0 if self.children else 10.0)   # spawned ranks have left by now
        if self._rendezvous is not None:
            self._rendezvous.close()
        if self.writer is not None:
            self.writer.close()
        _live_engines.discard(self)


def _draft_config(config: EngineConfig) -> EngineConfig | None:
    """The draft model's config when speculative_config asks for one (checked against the target)."""
    from nanovllm_tp.scheduler.speculative import SpeculativeConfig
    spec = SpeculativeConfig.from_dict(config.speculative_config, config.tensor_parallel_size)
    if spec is None or spec.method != "draft_model":
        return None
    from nanovllm_tp.workers.draft_runner import draft_config
    return draft_config(config)


_live_engines: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()


def _check_one_multi_rank_engine(config: EngineConfig) -> None:
    """A multi-rank engine owns this process's process group: a second one is refused before anything is
    touched, so the engine already running keeps serving. TP = 1 engines share nothing process-wide (each
    step runs in its own engine's TP scope), so any number of them live beside it."""
    for other in list(_live_engines):
        multi = other.config.world_size
        if not other._closed and multi > 1 and config.world_size > 1:
            raise ValueError(
                f"this process already runs an engine of {multi} ranks, and a process holds "
                "one multi-rank engine at a time (TP = 1 engines can live beside it): close the first "
                "(llm.close()) or start the second in another process")

