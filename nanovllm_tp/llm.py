"""The client API, with vLLM's names: LLM(model, ...).generate / chat / add_request / step / abort_request.

LLM is made of parts, one file each: input checking (llm_inputs.py), the step loop and aborts (llm_steps.py),
embeddings (llm_embed.py); this file builds requests (ids, seeds, sequences) and holds the engine."""
import itertools
import os
import sys

from nanovllm_tp.config import EngineConfig
from nanovllm_tp.llm_embed import EmbeddingRequests
from nanovllm_tp.llm_inputs import RequestInputs
from nanovllm_tp.llm_steps import StepLoop
from nanovllm_tp.output_processor import RequestState
from nanovllm_tp.outputs import RequestOutput
from nanovllm_tp.pooling_params import ModelPooling, PoolingParams
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.scheduler import Sequence

_SEED_MIX = 0x9E3779B97F4A7C15


class LLM(RequestInputs, StepLoop, EmbeddingRequests):
    def __init__(self, model, **kwargs):
        """`model`: a Hugging Face directory or .gguf file; `kwargs`: any EngineConfig knob (config.py lists them,
        with vLLM's names where vLLM has one). Unknown names are refused with the closest knob."""
        config = EngineConfig.from_kwargs(model, **kwargs)
        config.validate()
        from nanovllm_tp.distributed.launch import launched_by_torchrun
        if config.tensor_parallel_size > 1 and launched_by_torchrun() and int(os.environ.get("RANK", 0)) != 0:
            # Under torchrun every rank runs the user's script: ranks > 0 serve rank 0's plans here and
            # leave when it shuts down, so the rest of the script only ever runs on rank 0.
            from nanovllm_tp.workers.worker import run_worker
            sys.exit(run_worker(config))
        from nanovllm_tp.engine import LLMEngine
        from nanovllm_tp.loader import load_tokenizer
        from nanovllm_tp.structured.backend import GrammarBackend
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
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
                     priority: int = 0, lora_request=None) -> list[str]:
        """Queue one request per prompt, all with the same sampling parameters (priority, LoRARequest), all or
        none: every prompt, id and parameter is checked before the first is queued. Returns their request ids.
        PoolingParams make them embedding requests (step() reports each once, as an EmbeddingRequestOutput)."""
        ids = self._new_request_ids(prompts, request_ids)
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
        incremental = sp.output_kind != RequestOutputKind.FINAL_ONLY
        return [self._add(text, token_ids, sp, rid, incremental, rank, lora)
                for (text, token_ids), rid in zip(items, ids)]

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
             incremental: bool = False, priority: int = 0, lora=None) -> str:
        number = next(self._request_numbers)
        request_id = str(number) if request_id is None else request_id
        base = sp.seed if sp.seed is not None else (self.config.seed * 1_000_003 + number) % (1 << 63)
        compiled = None if sp.structured_outputs is None else self.grammars.compile(sp.structured_outputs)
        seqs = [Sequence(next(self._seq_ids), token_ids, sp, seed=(base + i * _SEED_MIX) % (1 << 63), index=i,
                         priority=priority, grammar=None if compiled is None else compiled.new(), lora=lora)
                for i in range(sp.n)]
        seqs[0].forks = seqs[1:]        # siblings start from the first one's prompt KV
        self.engine.add(seqs[0])
        state = RequestState(request_id, text, token_ids, sp, seqs, self.tokenizer, self._token_texts, incremental,
                             max(sp.stream_interval or 1, self.config.stream_interval))
        self._requests[request_id] = state
        for seq in seqs:
            self._by_seq[seq.seq_id] = state
        return request_id

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
        tensor_parallel_size, attention_backend, kv_block_size, num_kv_blocks, kv_cache_dtype (the KV cache's
        storage: the model dtype's name, or int8 / fp8_e4m3 / fp8_e5m2 with an fp32 scale per token and KV head),
        quantization ("none", or the quantized types the weights run in: "Q4_1+Q8_0"), linear (the matmul paths:
        packed_linear.linear_paths), linear_kernels (packed_linear="auto": the kernel per weight shape and
        row-count bucket with the timings that chose it, the extra bytes of second layouts: kernel_choice.report;
        else None), cuda_graph_batch_sizes (None when eager), num_steps, num_preemptions,
        num_draft_tokens / num_accepted_tokens (speculative decoding: proposed, accepted) and
        num_accepted_tokens_per_pos (accepted, by place in the draft), prefix_cache_hit_tokens, num_running and
        num_waiting (sequences), kv_cache_usage (the fraction of KV blocks
        in use), grammar_mask_steps / grammar_masks / grammar_mask_seconds (structured outputs: steps that filled
        grammar masks, masks filled, time spent filling them). RuntimeError once closed."""
        g = self.grammars
        return {**self.engine.stats(), "grammar_mask_steps": g.mask_steps, "grammar_masks": g.masks_filled,
                "grammar_mask_seconds": g.mask_seconds}

    def close(self) -> None:
        self.grammars.close()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
