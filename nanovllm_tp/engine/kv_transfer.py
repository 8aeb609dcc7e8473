"""A running request moved between two engines with its KV: `export_request` takes it out of one (its state and
the KV of its blocks as bytes: engine/kv_payload.py; the request leaves that engine, its blocks freed),
`import_request` puts it into another, which goes on decoding it without computing its prompt again.

The import is the resume path of engine/resume.py (`LLM.add_requests(resume=...)`) with one more way in: a
completion that brings its KV takes blocks in the new engine's pool (the leading full ones from its prefix cache
where it holds them), the KV is written into them, they enter the prefix cache as if computed there, and the
completion is running at once, its next token decoded in the next step. A completion without KV (it was waiting,
preempted or part-way through its prompt, or its sliding window had released blocks), or one the new pool has no
room for now, is queued to compute its tokens again, as a resumed one is. Either way its outputs are delta outputs
that start where the first engine's caller stopped, and its tokens count as its output (max_tokens, penalties, the
sampler's noise counter). The request's seed travels (the one the first engine drew, where the caller set none),
so a sampled completion goes on with the draws it would have made: the noise is a function of the seed and the
token index (layers/sampling_noise.py). A grammar replays the tokens so far; penalties recount them.

On one host the KV need not travel at all: an engine whose pool is shared (workers/kv_pool.py) exports by
reference, the payload naming the request's blocks and their versions, and the importer copies them from pool to
pool; a block taken for other tokens before the copy ends is noticed by its version, and that completion computes
again.

A LoRA request moves with its adapter named in the payload: the importing engine must run that adapter (it loads
it into a slot as it adopts the KV), and a KV computed with one adapter never goes on under another.

Under tensor parallelism rank 0 gathers every rank's KV heads for the payload and sends each rank its own on import
(workers/kv_blocks.py): TP rank i's part goes to TP rank i, so both engines must have the same TP size (a payload of
another is refused by the name of its layout field, tp_size). By reference needs a shared pool, which an engine of
one rank has: a TP engine's KV travels as bytes.

An engine that speculates with a draft model (speculative_config draft_model) keeps a second cache, indexed by the
same blocks: its KV travels beside the target's (parts "draft_k", "draft_v", ...), and both engines must run the same
draft (the payload's draft_layout). The draft's cache is not in the shared pool: such an engine's KV travels as
bytes.

Not yet: pipeline_parallel_size > 1 (each stage holds the KV of its own layers), cumulative logprobs (logprobs go on
from the move, as for a resumed request). These are refused by name.
"""
import time
from dataclasses import dataclass

from nanovllm_tp.engine.kv_payload import DRAFT, CacheSpec, CompletionKV, KVLayout, KVPayload
from nanovllm_tp.engine.resume import ResumedChoice
from nanovllm_tp.sampling_params import RequestOutputKind
from nanovllm_tp.scheduler.sequence import SequenceStatus

_SEED_MIX = 0x9E3779B97F4A7C15       # as entrypoints/llm.py mixes a completion's index into the request's seed


@dataclass(slots=True)
class KVMoves:
    """An engine's lifetime counts of what moved (LLM.stats()["kv_transfer"])."""
    requests_out: int = 0
    requests_in: int = 0
    completions_recomputed: int = 0   # imported completions queued to compute again (no KV, or no room)
    blocks_out: int = 0
    blocks_in: int = 0                # blocks written (those the prefix cache held are not)
    bytes_out: int = 0
    bytes_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


def _layout(runner, config) -> KVLayout:
    """The layout of a runner's KV blocks (each TP rank's the same shape as rank 0's)."""
    mc, layer = config.model_config, runner.attention_layers[0]
    return KVLayout(mc.architecture, mc.vocab_size, len(runner.attention_layers), config.tensor_parallel_size,
                    layer.num_kv_heads, layer.head_dim, config.kvcache_block_size, runner.kv_cache_format())


def engine_layout(llm) -> KVLayout:
    """The layout of `llm`'s KV blocks."""
    return _layout(llm.engine.runner, llm.config)


def _caches_of(llm) -> list[CacheSpec]:
    """The caches whose KV moves: the model's, then its draft model's where it has one."""
    out = []
    for prefix, owner in (("", llm.engine), (DRAFT, llm.engine.draft)):
        if owner is not None:
            runner = owner.runner
            out.append(CacheSpec(_layout(runner, owner.config), runner.k_cache.element_size(),
                                 runner.kv_scales is not None, prefix))
    return out


def check_kv(llm, prompt_lens: list[int], resume: list, kv: list) -> None:
    """`LLM.add_requests`' check of its `kv` argument, before anything is queued: per prompt, per resumed
    completion, None or that completion's CompletionKV (its index and tokens), sized for this engine's cache."""
    _check_engine(llm, "moving a request's KV")
    caches = _caches_of(llm)
    for prompt_len, choices, entries in zip(prompt_lens, resume, kv):
        for choice, entry in zip(choices, entries):
            if entry is None:
                continue
            if not isinstance(entry, CompletionKV) or (entry.index, entry.token_ids) != (choice.index,
                                                                                        choice.token_ids):
                raise ValueError(f"kv of completion {choice.index} must be None or its CompletionKV "
                                 "(engine/kv_payload.py), with its index and tokens")
            entry.check(caches, prompt_len, f"completion {choice.index}")


def shares_pool(llm) -> bool:
    """Whether `llm` can export by reference: its whole KV is in a shared pool (the kv_shared_pool knob, one rank;
    a draft model's cache is not in it)."""
    return llm.engine.runner.kv_pool is not None and llm.engine.draft is None


def _check_engine(llm, what: str) -> None:
    """The engines a request moves between, for now: one pipeline stage."""
    cfg = llm.config
    if cfg.pipeline_parallel_size > 1:
        raise ValueError(f"{what} is not implemented with pipeline_parallel_size={cfg.pipeline_parallel_size} yet: "
                         "each stage holds the KV of its own layers")
    if llm.engine.scheduler.scheduled:
        raise RuntimeError(f"{what} between a step's schedule and its results")


def export_request(llm, request_id: str, by_reference: bool = False) -> memoryview:
    """Take request `request_id` out of `llm` (it leaves without a further output, its blocks freed): its state and
    the KV of its running completions, as the bytes `import_request` reads (a read-only memoryview: write it to a
    file or socket as it is, `bytes()` it for a copy). `by_reference`, where `llm`'s pool is
    shared (the kv_shared_pool knob): the KV stays in the pool and the payload names its blocks, which an engine
    on this host copies from pool to pool while this one lives and has not taken them for other tokens (freed
    blocks are taken again least recently freed first); elsewhere the KV travels as bytes."""
    return take_request(llm, request_id, by_reference).encode()


def take_request(llm, request_id: str, by_reference: bool = False) -> KVPayload:
    """export_request's payload, before encoding."""
    from nanovllm_tp.serving.wire import params_to_wire
    start = time.perf_counter()
    _check_engine(llm, "moving a request's KV")
    state = llm._requests.get(request_id)
    if state is None or not hasattr(state, "completions"):
        raise ValueError(f"request_id {request_id!r} is not a generation request of this engine")
    if state.finished:
        raise ValueError(f"request {request_id!r} has finished: nothing is left to move")
    completions = [c for c in state.completions if not c.seq.is_finished]
    first = completions[0].seq
    engine, bs = llm.engine, llm.config.kvcache_block_size
    pool = engine.runner.kv_pool if by_reference and shares_pool(llm) else None
    pending = {dst: src for src, dst in engine.scheduler._copies}   # n > 1: a sibling's block copy not yet run
    moves, out, referenced = engine.kv_moves, [], 0
    for c in completions:
        seq = c.seq
        row = CompletionKV(seq.index, seq.completion_token_ids, c.sent_chars)
        if seq.status == SequenceStatus.RUNNING and seq.num_cached_tokens == seq.num_tokens - 1 \
                and not seq.num_window_freed:
            row.num_cached_tokens = seq.num_cached_tokens
            blocks = [pending.get(b, b) for b in seq.block_table[:row.num_blocks(bs)]]
            if pool is not None:
                row.blocks, row.versions = blocks, [engine.scheduler.block_manager.blocks[b].version for b in blocks]
                referenced += len(blocks)
            else:
                row.kv = engine.read_kv(blocks)
            moves.blocks_out += len(blocks)
        out.append(row)
    params = params_to_wire(state.params)
    params["seed"] = (first.seed - first.index * _SEED_MIX) % (1 << 63)     # the request's, as the first engine drew it
    lora = None if first.lora is None else first.lora.to_wire()
    draft = engine.draft and _layout(engine.draft.runner, engine.draft.config)
    payload = KVPayload(engine_layout(llm), request_id, list(state.prompt_ids), params, first.priority, out,
                        pool.ref() if referenced else None, lora, draft)
    llm._detach(request_id)
    moves.requests_out += 1
    moves.bytes_out += payload.num_bytes + referenced * engine.runner.kv_block_bytes()
    moves.seconds_out += time.perf_counter() - start
    return payload


def import_request(llm, payload, request_id: str | None = None) -> str:
    """Queue in `llm` the request an `export_request` took out of another engine (`request_id`: its id here, by
    default the one it had there). Every field is checked against this engine before anything is queued (ValueError
    naming the field; the engine untouched). Returns its request id; step() goes on with it."""
    from nanovllm_tp.serving.wire import params_from_wire
    start = time.perf_counter()
    p, _ = _payload_for(llm, payload)
    try:
        params = params_from_wire(dict(p.params))
    except TypeError as exc:
        raise ValueError(f"KV payload field params: {exc}") from None
    if "pooling" in p.params:
        raise ValueError("KV payload field params: an embedding request does not move")
    params.output_kind = RequestOutputKind.DELTA     # it goes on where its caller stopped, as a resumed request
    lora = None
    if p.lora is not None:      # the adapter its KV was computed with, which this engine must run (ValueError)
        from nanovllm_tp.lora import LoRARequest
        lora = llm.loras.check(LoRARequest(*p.lora))
    rid, = llm.add_requests([p.prompt_token_ids], params, [p.request_id if request_id is None else request_id],
                            priority=p.priority, lora_request=lora,
                            resume=[[ResumedChoice(c.index, c.token_ids, c.sent_chars) for c in p.completions]],
                            kv=[p.completions])
    note_import(llm, p.completions, time.perf_counter() - start)
    return rid


def _payload_for(llm, raw) -> tuple[KVPayload, list[CacheSpec]]:
    """The payload `raw` decoded and checked against `llm`'s caches (ValueError naming the field), and those."""
    _check_engine(llm, "moving a request's KV")
    p = KVPayload.decode(raw)
    caches = _caches_of(llm)
    p.check_against(caches)
    return p, caches


def kv_for_resume(llm, raw, prompt_token_ids: list[int], choices: list[ResumedChoice], lora_id: int = 0) -> list:
    """What a request resumed from its caller's view (`choices`: each completion's tokens the caller has; `lora_id`:
    its adapter's id, 0 for none) takes of the payload an export of it made (`raw`): per choice, its completion's
    KV cut to the caller's tokens (the export may be ahead of what the caller read), or None (that completion
    computes again). A payload that does not fit this engine, or that is of another request or adapter, is refused
    whole: ValueError naming the field."""
    p, caches = _payload_for(llm, raw)
    if p.prompt_token_ids != list(prompt_token_ids):
        raise ValueError("KV payload field prompt_token_ids: not the prompt of the request it came with")
    if (p.lora[1] if p.lora else 0) != lora_id:
        raise ValueError(f"KV payload field lora: its KV was computed with adapter {p.lora and p.lora[1]}, the "
                         f"request runs {lora_id or None}")
    exported = {c.index: c for c in p.completions}
    out = []
    for choice in choices:
        c = exported.get(choice.index)
        if c is None or not c.has_kv or c.token_ids[:len(choice.token_ids)] != list(choice.token_ids):
            out.append(None)
            continue
        out.append(c.cut(choice.token_ids, choice.sent_chars, len(prompt_token_ids), caches))
    return out


def export_all(llm, by_reference: bool = False) -> dict[str, memoryview]:
    """Every open generation request of `llm` that can move, exported (export_request; `by_reference` as there):
    {request id: payload}. The others (an embedding, an engine that cannot move KV) stay where they are."""
    out = {}
    for request_id in list(llm._requests):
        try:
            out[request_id] = export_request(llm, request_id, by_reference)
        except ValueError:
            continue
    return out


def note_import(llm, entries: list, seconds: float) -> None:
    """Count a request imported with these completions' KV (CompletionKV entries, None for one without): the KV
    bytes that came with it (the blocks its adoption wrote are counted there)."""
    moves = llm.engine.kv_moves
    moves.requests_in += 1      # (the bytes of blocks copied from a shared pool are counted as they are copied)
    moves.bytes_in += sum(len(b) for e in entries if e is not None and e.kv for b in e.kv.values())
    moves.seconds_in += seconds


def has_first_tokens(llm, request_id: str) -> bool:
    """Whether every completion of the open request `request_id` has generated a token (a prefill replica hands it
    over from then on: serving/replica_roles.py)."""
    state = llm._requests.get(request_id)
    return state is not None and hasattr(state, "completions") and all(
        c.seq.num_completion_tokens > 0 for c in state.completions)
