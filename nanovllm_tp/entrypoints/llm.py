"""The client API, with vLLM's names: LLM(model, ...).generate / chat / embed / add_request / step / abort_request.

One object: it checks and tokenizes every input before anything is queued, builds the requests (ids, seeds, one
sequence per completion), runs the engine step by step (outputs detokenized, stop strings matched, grammars
advanced) and answers embeddings through the same engine."""
import itertools
import logging
import sys
import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC

from nanovllm_tp.config.engine_config import EngineConfig
from nanovllm_tp.config.generation_defaults import sampling_defaults
from nanovllm_tp.engine.output_processor import RequestState
from nanovllm_tp.engine.resume import ResumedChoice, check_resume
from nanovllm_tp.entrypoints.prompts import check_prompt_length, is_token_ids, render_chat
from nanovllm_tp.outputs import RequestOutput
from nanovllm_tp.pooling.embeddings import EmbeddingRequestOutput, EmbeddingState
from nanovllm_tp.pooling.params import ModelPooling, PoolingParams
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.scheduler import Sequence
from nanovllm_tp.utils import trace
from nanovllm_tp.utils.checks import integer

_SEED_MIX = 0x9E3779B97F4A7C15
log = logging.getLogger("nanovllm_tp")


class LLM:
    def __init__(self, model, **kwargs):
        """`model`: a Hugging Face directory, a .gguf file, or a hub id (`org/name`, `org/name:Q4_K_M`; resolved
        through huggingface_hub's cache: docs/models.md); `kwargs`: any EngineConfig knob (config.py lists them,
        with vLLM's names where vLLM has one). Unknown names are refused with the closest knob."""
        config = EngineConfig.from_kwargs(model, **kwargs)
        config.validate()
        from nanovllm_tp.distributed.launch import engine_rank, launched_by_torchrun
        if config.world_size > 1 and launched_by_torchrun() and engine_rank() != 0:
            # Under torchrun every rank runs the user's script: ranks > 0 serve rank 0's plans here and
            # leave when it shuts down, so the rest of the script only ever runs on rank 0.
            from nanovllm_tp.workers.worker import run_worker
            sys.exit(run_worker(config))
        from nanovllm_tp.checkpoint.loader import load_tokenizer
        from nanovllm_tp.engine.llm_engine import LLMEngine
        from nanovllm_tp.structured.backend import GrammarBackend
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.sampling_defaults = sampling_defaults(config)      # the generation_config knob's request defaults
        if self.sampling_defaults:
            log.info("request defaults from the model's generation config (--generation-config vllm: none): %s",
                     self.sampling_defaults)
        self.engine = LLMEngine(config)
        from nanovllm_tp.lora.registry import AdapterRegistry
        lora = self.engine.runner.lora
        self.loras = AdapterRegistry(config.enable_lora, config.max_lora_rank, lora.targets() if lora else {})
        self.grammars = GrammarBackend(self.tokenizer, config.model_config.vocab_size,
                                       config.model_config.eos_token_ids, config.grammar_compile_timeout)
        self._request_numbers = itertools.count()
        self._seq_ids = itertools.count()
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._dirty: dict[str, None] = {}       # requests with news that step() has not returned yet
        self._token_text: dict[int, str] = {}
        self._model_pooling: ModelPooling | None = None     # read from the model's files on the first embedding

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams holding the generation_config knob's defaults (the model's generation_config.json
        by default), vLLM's for every other field: what generate and chat use without sampling_params."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 priority: list[int] | None = None, lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order, whole whatever their output_kind.
        Requests queued with add_request keep going alongside, and a later step() reports them. `priority`: one
        per prompt (lower first), with scheduling_policy="priority". `lora_request`: a LoRARequest for every
        prompt, or a list of one per prompt (None entries: the base model), with enable_lora."""
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        return self._generate(items, params, use_tqdm, self._priorities(priority, len(items)),
                              self.loras.check_all(lora_request, len(items)))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        rendered with the tokenizer's chat template (or `chat_template`); `tools` (OpenAI's function tools) are
        handed to the template as transformers does."""
        items = self._chat_prompts(messages, chat_template, add_generation_prompt, chat_template_kwargs, tools)
        params = self._normalize_params(sampling_params, len(items))
        return self._generate(items, params, use_tqdm, loras=self.loras.check_all(lora_request, len(items)))

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, max_tokens_must_fit: bool = False, priority: int = 0,
                    lora_request=None) -> str:
        """Queue one request for step()-driven serving; returns its request id. A request whose prompt and
        max_tokens together exceed max_model_len stops at max_model_len, or, with max_tokens_must_fit (the
        server's rule), is refused with a ValueError. `priority`: lower first, with scheduling_policy="priority".
        `lora_request`: its LoRARequest, with enable_lora."""
        return self.add_requests([prompt], sampling_params, None if request_id is None else [request_id],
                                 max_tokens_must_fit, priority, lora_request)[0]

    def add_requests(self, prompts: list, sampling_params: SamplingParams | PoolingParams | None = None,
                     request_ids: list[str] | None = None, max_tokens_must_fit: bool = False,
                     priority: int = 0, lora_request=None, resume: list | None = None,
                     kv: list | None = None) -> list[str]:
        """Queue one request per prompt, all with the same sampling parameters (priority, LoRARequest), all or
        none: every prompt, id and parameter is checked before the first is queued. Returns their request ids.
        PoolingParams make them embedding requests (step() reports each once, as an EmbeddingRequestOutput).
        `resume`: per prompt, the ResumedChoice list of a request taken over from another engine
        (engine/resume.py), whose outputs are delta outputs that go on where its client stopped. `kv`: with
        resume, per prompt, one entry per resumed completion: None (its tokens are computed again), or its
        CompletionKV (engine/kv_payload.py: the KV of all but its last token, sized for this engine's cache): it
        decodes on at once (it computes again where the pool has no room for it now)."""
        ids = self._new_request_ids(prompts, request_ids)
        if resume is not None and (isinstance(sampling_params, PoolingParams) or not isinstance(resume, list)
                                   or len(resume) != len(prompts)):
            raise ValueError("resume needs one list of resumed completions per prompt, and a generation request")
        if kv is not None and (resume is None or not isinstance(kv, list) or len(kv) != len(resume) or not all(
                isinstance(k, list) and isinstance(r, list) and len(k) == len(r) for k, r in zip(kv, resume))):
            raise ValueError("kv needs resume, and one entry per resumed completion of each prompt")
        if isinstance(sampling_params, PoolingParams):       # embedding requests (vLLM: params of either kind)
            if lora_request is not None:
                raise ValueError("embedding requests run on the base model: lora_request must be None")
            rank, = self._priorities([priority], 1)
            items, pooling = self._embedding_inputs(prompts, [sampling_params])
            return [self._add_embedding(text, token_ids, pooling[0], rid, rank)
                    for (text, token_ids), rid in zip(items, ids)]
        items = [self._normalize_prompt(i, p) for i, p in enumerate(prompts)]
        sp, = self._normalize_params(sampling_params, 1)
        rank, = self._priorities([priority], 1)
        lora = self.loras.check(lora_request)
        if max_tokens_must_fit and sp.max_tokens is not None:
            for _, token_ids in items:
                if len(token_ids) + sp.max_tokens > self.config.max_model_len:
                    raise ValueError(f"This model's maximum context length is {self.config.max_model_len} tokens, "
                                     f"and this request asks for {len(token_ids) + sp.max_tokens}: {len(token_ids)} "
                                     f"in the prompt, {sp.max_tokens} in max_tokens. Lower max_tokens or shorten "
                                     "the prompt.")
        if resume is not None:
            if sp.output_kind != RequestOutputKind.DELTA:
                raise ValueError("a resumed request's outputs are delta outputs: output_kind must be DELTA")
            resume = [check_resume(r, sp.n, len(token_ids), sp.max_tokens, self.config.max_model_len,
                                   self.config.model_config.vocab_size) for (_, token_ids), r in zip(items, resume)]
            if kv is not None:
                from nanovllm_tp.engine.kv_transfer import check_kv
                check_kv(self, [len(token_ids) for _, token_ids in items], resume, kv)
            if sp.structured_outputs is not None:      # every grammar replayed before the first request is queued
                compiled = self.grammars.compile(sp.structured_outputs)
                for (_, token_ids), choices in zip(items, resume):
                    for ch in choices:
                        if error := compiled.new().advance(token_ids + ch.token_ids, len(token_ids)):
                            raise ValueError(f"resumed completion {ch.index}: {error}")
        incremental = sp.output_kind != RequestOutputKind.FINAL_ONLY
        resume = resume or [None] * len(items)
        return [self._add(text, token_ids, sp, rid, incremental, rank, lora, resumed, parts)
                for (text, token_ids), rid, resumed, parts in zip(items, ids, resume, kv or [None] * len(items))]

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter: requests running with it finish with it, its slot goes to the next adapter that needs
        one, and a later LoRARequest with this id reads its directory afresh."""
        self.loras.forget(lora_int_id)
        if self.engine.scheduler.lora_slots is not None:
            self.engine.scheduler.lora_slots.forget(lora_int_id)

    def _generate(self, items, params, use_tqdm: bool, priorities=None, loras=None) -> list[RequestOutput]:
        priorities = priorities or [0] * len(items)
        ids = [self._add(text, token_ids, sp, priority=rank, lora=lora)
               for (text, token_ids), sp, rank, lora in zip(items, params, priorities, loras or [None] * len(items))]
        return self._run(ids, use_tqdm, "Generating")

    def _add(self, text: str | None, token_ids: list[int], sp: SamplingParams, request_id: str | None = None,
             incremental: bool = False, priority: int = 0, lora=None, resumed: list | None = None,
             kv: list | None = None) -> str:
        number = next(self._request_numbers)
        request_id = str(number) if request_id is None else request_id
        base = sp.seed if sp.seed is not None else (self.config.seed * 1_000_003 + number) % (1 << 63)
        compiled = None if sp.structured_outputs is None else self.grammars.compile(sp.structured_outputs)
        choices = resumed or [ResumedChoice(i, []) for i in range(sp.n)]
        seqs = [Sequence(next(self._seq_ids), token_ids, sp, seed=(base + ch.index * _SEED_MIX) % (1 << 63),
                         index=ch.index, priority=priority, grammar=None if compiled is None else compiled.new(),
                         lora=lora, output_ids=ch.token_ids)
                for ch in choices]
        if resumed is None:
            seqs[0].forks = seqs[1:]        # siblings start from the first one's prompt KV
            self.engine.add(seqs[0])
        else:
            self._resume(seqs, kv)
        state = RequestState(request_id, text, token_ids, sp, seqs, self.tokenizer, self._token_texts, incremental,
                             max(sp.stream_interval or 1, self.config.stream_interval), resumed)
        self._requests[request_id] = state
        for seq in seqs:
            self._by_seq[seq.seq_id] = state
        return request_id

    def _resume(self, seqs: list[Sequence], kv: list | None = None) -> None:
        """Resumed completions (engine/resume.py) into the engine, each on its own: their grammars replay the
        tokens so far (add_requests checked that they can), their logprobs and prompt logprobs went out with the
        first engine's outputs. `kv`: per completion, None or its CompletionKV (engine/kv_transfer.py): then it
        runs on without computing its tokens again where the pool has room for it."""
        for seq, entry in zip(seqs, kv or [None] * len(seqs)):
            if seq.grammar is not None:
                seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
            seq.prompt_logprobs = None
            if seq.logprobs is not None:
                seq.logprobs = [None] * seq.num_completion_tokens     # never sent again (delta outputs)
            if entry is not None and entry.has_kv and self.engine.adopt(seq, entry):
                continue
            if kv is not None:
                self.engine.kv_moves.completions_recomputed += 1
            self.engine.add(seq)

    def _detach(self, request_id: str) -> None:
        """The request leaves this engine without a further output (it moved to another: engine/kv_transfer.py):
        its sequences end, their blocks freed."""
        state = self._requests[request_id]
        for c in state.completions:
            self.engine.finish(c.seq, "abort")
        self._dirty.pop(request_id, None)
        self._forget(state)

    def _token_texts(self, ids) -> dict[int, str]:
        """The token id -> text cache of logprobs, holding every id of ids: the missing ones decoded in one batch
        (one decode call per id costs tens of microseconds)."""
        cache = self._token_text
        missing = list({t for t in ids if t not in cache})
        if missing:
            cache.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
        return cache

    def stats(self) -> dict:
        """Facts about the running engine, lifetime counters and its load now: device, dtype,
        tensor_parallel_size, pipeline_parallel_size, pipeline_micro_batches (steps in flight at most: 1 without
        stages), max_steps_in_flight (the most that were at once), attention_backend, kv_block_size, num_kv_blocks
        (under pipeline parallelism the fullest stage's: every stage holds that many blocks), kv_cache_dtype (the KV
        cache's storage: the model dtype's name, or int8 / fp8_e4m3 / fp8_e5m2 with an fp32 scale per token and KV
        head),
        quantization ("none", or the quantized types the weights run in: "Q4_1+Q8_0"), linear (the matmul paths:
        packed_linear.linear_paths), linear_kernels (packed_linear="auto": the kernel per weight shape and
        row-count bucket with the timings that chose it, the extra bytes of second layouts: kernel_choice.report;
        else None), cpu_threads (on CPU, rank 0's: threads, the count now; auto, whether it follows the other
        processes' load, and then ceiling, other_cores (their cores in use over the last second) and changes:
        config/cpu_threads.py; else None), cuda_graph_batch_sizes (None when eager), num_steps, num_preemptions,
        num_draft_tokens / num_accepted_tokens (speculative decoding: proposed, accepted) and
        num_accepted_tokens_per_pos (accepted, by place in the draft), num_computed_tokens (tokens run through the
        model: prompt chunks and decodes), kv_transfer (requests moved out and in with their KV, completions
        imported that computed again, blocks and bytes, seconds: engine/kv_transfer.py), prefix_cache_hit_tokens and
        prefix_cache_query_tokens (tokens found in the prefix cache, of those looked up), num_running and
        num_waiting (sequences), kv_cache_usage (the fraction of KV blocks
        in use), grammar_mask_steps / grammar_masks / grammar_mask_seconds (structured outputs: steps that filled
        grammar masks, masks filled, time spent filling them). RuntimeError once closed."""
        g = self.grammars
        return {**self.engine.stats(), "grammar_mask_steps": g.mask_steps, "grammar_masks": g.masks_filled,
                "grammar_mask_seconds": g.mask_seconds}

    def counters(self) -> dict:
        """The scheduler's figures of stats() alone, under the same keys: num_running, num_waiting,
        kv_cache_usage, num_kv_blocks, num_preemptions, num_draft_tokens, num_accepted_tokens,
        num_accepted_tokens_per_pos, prefix_cache_hit_tokens, prefix_cache_query_tokens, kv_transfer. Cheap enough
        for every step (a server reports them per step); stats() also walks the model's modules (linear,
        linear_kernels), which costs about a millisecond. RuntimeError once closed."""
        return self.engine.counters()

    def close(self) -> None:
        self.grammars.close()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Input checking: every prompt, sampling parameter and priority is checked (and tokenized) before any
    # request reaches the engine; a bad one raises ValueError or TypeError and nothing is queued.

    def _normalize_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or isinstance(prompts, (bytes, bytearray)):
            raise TypeError("prompts must be a string, a list of strings or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        return [self._normalize_prompt(i, p) for i, p in enumerate(prompts)]

    def _normalize_prompt(self, i: int, p, add_special_tokens: bool = True,
                          embedding: PoolingParams | None = None) -> tuple[str | None, list[int]]:
        """One prompt as (text or None, token ids). `embedding`: an embedding request's prompt, cut to its
        truncate_prompt_tokens; it may fill max_model_len (no output follows it)."""
        vocab = self.config.model_config.vocab_size
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"prompt {i} is not valid Unicode text ({exc.reason} at index {exc.start})") from None
            text, ids = p, self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
        elif isinstance(p, (list, tuple)):
            # plain ints: one fast pass (a long prompt's ids are checked in microseconds), then the slow one
            bad = None if all(type(t) is int for t in p) else next(
                (t for t in p if isinstance(t, bool) or not isinstance(t, int)), None)
            if bad is not None:
                raise TypeError(f"prompt {i}: token ids must be ints, got {type(bad).__name__}")
            text, ids = None, list(p)
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                first = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"prompt {i}: token id {first} is outside the vocabulary [0, {vocab})")
        else:
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        limit = self.config.max_model_len
        if embedding is None:
            check_prompt_length(i, len(ids), limit)
            return text, ids
        ids = embedding.truncated(ids, limit)
        check_prompt_length(i, len(ids), limit, output_room=0)
        return text, ids

    def _chat_prompts(self, messages, chat_template, add_generation_prompt, chat_template_kwargs, tools) -> list:
        """One conversation or a list of them, each rendered through the chat template: (text, token ids) each."""
        conversations = [messages] if _is_conversation(messages) else messages
        if not isinstance(conversations, list) or not conversations or \
                not all(_is_conversation(c) for c in conversations):
            raise TypeError("messages must be a list of {'role': str, 'content': str} dicts, or a list of such lists")
        items = []
        for i, conv in enumerate(conversations):
            text = render_chat(self.tokenizer, conv, chat_template, add_generation_prompt, chat_template_kwargs, tools)
            items.append(self._normalize_prompt(i, text, add_special_tokens=False))   # the template has them
        return items

    def _new_request_ids(self, prompts, request_ids) -> list:
        """add_requests' ids, one per prompt: each new (None: one is made when queued)."""
        if not isinstance(prompts, list) or not prompts:
            raise TypeError("prompts must be a non-empty list (one entry per request)")
        ids = [None] * len(prompts) if request_ids is None else request_ids
        if not isinstance(ids, list) or len(ids) != len(prompts):
            raise ValueError(f"request_ids must be a list of {len(prompts)} ids, got {request_ids!r}")
        seen = set()
        for rid in ids:
            if rid is not None and (not isinstance(rid, str) or rid in self._requests or rid in seen):
                raise ValueError(f"request_id must be a new string, got {rid!r}")
            seen.add(rid)
        return ids

    def _normalize_params(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        vocab = self.config.model_config.vocab_size
        for sp in {id(sp): sp for sp in sampling_params}.values():     # one check of a params shared by prompts
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params entries must be SamplingParams, got {type(sp).__name__}")
            sp.validate()
            sp.check_vocab(vocab)
            self._check_logprobs(sp, vocab)
            sp.tokenize_bad_words(self.tokenizer, vocab)
            if sp.structured_outputs is not None:
                self.grammars.compile(sp.structured_outputs)     # compiled (or refused) before the engine
        return list(sampling_params)

    def _check_logprobs(self, sp: SamplingParams, vocab: int) -> None:
        """logprobs and prompt_logprobs within the max_logprobs knob (-1: the vocabulary)."""
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sp, name)
            if asked is not None and asked > limit >= 0:
                raise ValueError(f"{name}={asked} is more than this engine allows: max_logprobs={limit} (the "
                                 "--max-logprobs flag)")
            if asked is not None and asked > vocab:
                raise ValueError(f"{name}={asked} is more than the vocabulary's {vocab} tokens")

    def prepare(self, sampling_params: SamplingParams):
        """Start compiling a request's structured output in the background (the server calls it before
        add_request, so that no step waits for a compile): the compile's `Pending` (`.ready()`), or None when
        there is nothing to compile. Validation errors are raised here."""
        if isinstance(sampling_params, PoolingParams) or sampling_params.structured_outputs is None:
            return None
        sampling_params.validate()
        return self.grammars.submit(sampling_params.structured_outputs)

    def _priorities(self, priority, n: int) -> list[int]:
        """One priority per request: integers, and nonzero only under the priority policy (as vLLM)."""
        if priority is None:
            return [0] * n
        if not isinstance(priority, (list, tuple)) or len(priority) != n:
            raise ValueError(f"priority must be a list of {n} integers (one per prompt), got {priority!r}")
        for p in priority:
            integer("priority", p)
            if p and self.config.scheduling_policy != "priority":
                raise ValueError(f"priority={p} needs scheduling_policy='priority' (the engine's is "
                                 f"'{self.config.scheduling_policy}')")
        return list(priority)

    # The step loop: one engine step at a time, the outputs of the requests that progressed (detokenized,
    # stop strings matched, grammars advanced), aborts, and the loop that runs generate's and embed's
    # requests to the end.

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """End requests now, wherever they are (waiting, running, preempted); their blocks are freed at once and
        the next step() reports them with finish_reason "abort" (under pipeline micro-batches, a request whose step
        is in flight ends when that step's results come back). Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            state = self._requests.get(rid)
            if state is None or state.finished:
                continue
            for c in state.completions:
                self.engine.finish(c.seq, "abort")
            self._dirty[rid] = None

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that progressed (per its output_kind),
        including what happened to step()-driven requests since the last call."""
        if self.engine.has_unfinished():
            with trace.span("step"):
                self._engine_step()
        outputs = []
        for rid in list(self._dirty):
            del self._dirty[rid]
            state = self._requests[rid]
            out = state.output()
            if out is not None:
                outputs.append(out)
            if state.finished:
                self._forget(state)
        return outputs

    def check_ranks(self) -> None:
        """Raise RuntimeError if a rank of this engine died or failed since its last step (the engine is then
        stopped, as after a failed step): what an idle server calls so that a death is seen without a request."""
        try:
            self.engine.check_ranks()
        except BaseException:
            self._forget_all()
            raise

    def _forget_all(self) -> None:
        """The engine failed every request (the error raised says why): none is tracked any more."""
        for state in list(self._requests.values()):
            self._forget(state)
        self._dirty.clear()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished() or bool(self._dirty)

    def _engine_step(self) -> tuple[int, bool]:
        """One engine step: detokenize, match stop strings, mark the requests that progressed."""
        try:
            progressed, num_tokens, is_prefill = self.engine.step()
        except BaseException:
            self._forget_all()
            raise
        with trace.span("detokenize"):
            for seq in progressed:
                state = self._by_seq[seq.seq_id]
                if seq.grammar is not None and (not seq.is_finished or seq.grammar.error is not None):
                    self._advance_grammar(seq)
                hit = state.update(seq)
                if hit is not None:           # a stop string: the sequence ends at the token that completes it
                    self.engine.finish(seq, "stop", *hit)
                    state.update(seq)
                self._dirty[state.request_id] = None
        return num_tokens, is_prefill

    def _advance_grammar(self, seq: Sequence) -> None:
        """The sequence's matcher takes its new tokens; a token outside the language (another knob left the grammar
        nothing to choose: min_tokens against its end, allowed_token_ids, bad_words) ends the request, and so does a
        grammar whose mask failed (a parser limit; the EOS its empty mask left counts as no end): finish_reason
        "abort", the grammar's error in the output."""
        error = seq.grammar.error if seq.is_finished else seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
        if error is not None:
            log.warning("request %s: structured output ended: %s", self._by_seq[seq.seq_id].request_id, error)
            if seq.is_finished:
                self.engine.scheduler.mark_aborted(seq)
            else:
                self.engine.finish(seq, "abort")

    def _run(self, ids: list[str], use_tqdm, desc: str) -> list:
        """Step until the requests `ids` have finished; their whole outputs in that order. use_tqdm: True (a tqdm
        bar), False, or, as vLLM takes it, a callable that makes a tqdm-like bar from total= and desc=; the bar
        shows the prompt and decode rates so far (step_rates.py)."""
        from nanovllm_tp.entrypoints.step_rates import StepRates
        mine = [self._requests[i] for i in ids]
        bar = None
        if callable(use_tqdm):
            bar = use_tqdm(total=len(ids), desc=desc)
        elif use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc=desc, dynamic_ncols=True)
        rates = StepRates()
        done = 0
        try:
            while not all(s.finished for s in mine):
                start = time.perf_counter()
                with trace.span("step"):
                    num_tokens, is_prefill = self._engine_step()
                rates.add(num_tokens, is_prefill, time.perf_counter() - start)
                if bar is not None:
                    now_done = sum(s.finished for s in mine)
                    bar.set_postfix(rates.postfix(), refresh=False)
                    bar.update(now_done - done)
                    done = now_done
        finally:
            if bar is not None:
                bar.close()
        outputs = []
        for state in mine:
            outputs.append(state.output(full=True))
            self._dirty.pop(state.request_id, None)
            self._forget(state)
        return outputs

    def _forget(self, state: RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for c in state.completions:
            self._by_seq.pop(c.seq.seq_id, None)

    # Embeddings (vLLM's LLM.embed): prompts checked and tokenized, pooling resolved against the model, one
    # prefill-only request each through the same engine as generation.

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings, token-id lists or prompt dicts, as generate takes), in input order:
        the model's final hidden states pooled as its sentence-transformers files say (else the last token's,
        normalized). `pooling_params`: one for all prompts or one each; `truncate_prompt_tokens` (vLLM's
        keyword) sets that field of every one of them. Requests queued with add_request keep going alongside."""
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a string, a token-id list, a prompt dict or a non-empty list of them")
        prompts = list(prompts)
        params = pooling_params if isinstance(pooling_params, (list, tuple)) else [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        if truncate_prompt_tokens is not None:
            params = [PoolingParams(**{**(p or PoolingParams()).to_dict(),
                                       "truncate_prompt_tokens": truncate_prompt_tokens}) for p in params]
        items, pooling = self._embedding_inputs(prompts, [p or PoolingParams() for p in params])
        ids = [self._add_embedding(text, token_ids, pool) for (text, token_ids), pool in zip(items, pooling)]
        return self._run(ids, use_tqdm, "Embedding")

    def _embedding_inputs(self, prompts: list, params: list) -> tuple[list, list]:
        """Checked and tokenized prompts, and one resolved pooling per prompt (`params`: one for all, or one each),
        before anything is queued."""
        if self.config.pipeline_parallel_size > 1:      # the hidden states are the last stage's, not rank 0's
            raise ValueError("embeddings are not implemented with pipeline_parallel_size="
                             f"{self.config.pipeline_parallel_size} yet: run pipeline_parallel_size=1")
        if self._model_pooling is None:
            self._model_pooling = ModelPooling.read(self.config.model, self.config.pooler_config)
        params = params * len(prompts) if len(params) == 1 else params
        hidden, limit = self.config.model_config.hidden_size, self.config.max_model_len
        resolved = {}
        for p in params:
            if not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            if id(p) not in resolved:
                if (p.truncate_prompt_tokens or 0) > limit:
                    raise ValueError(f"truncate_prompt_tokens must be <= max_model_len {limit}, "
                                     f"got {p.truncate_prompt_tokens}")
                resolved[id(p)] = self._model_pooling.resolve(p, hidden)
        items = [self._normalize_prompt(i, prompt, embedding=p) for i, (prompt, p) in enumerate(zip(prompts, params))]
        return items, [resolved[id(p)] for p in params]

    def _add_embedding(self, text: str | None, token_ids: list[int], pooling, request_id: str | None = None,
                       priority: int = 0) -> str:
        request_id = str(next(self._request_numbers)) if request_id is None else request_id
        seq = Sequence(next(self._seq_ids), token_ids, priority=priority, pooling=pooling)
        self.engine.add(seq)
        state = EmbeddingState(request_id, text, token_ids, seq)
        self._requests[request_id] = state
        self._by_seq[seq.seq_id] = state
        return request_id


def _is_conversation(x) -> bool:
    """Messages with a role and text content (an assistant's tool calls may stand for its content)."""
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and (
            isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))) for m in x)
