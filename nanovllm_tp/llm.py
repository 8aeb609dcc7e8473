"""The client API, with vLLM's names: LLM(model, ...).generate(prompts, sampling_params)."""
import itertools
import os
import sys
import time
from collections.abc import Sequence as SequenceABC

from nanovllm_tp.config import EngineConfig
from nanovllm_tp.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.scheduler import Sequence


class LLM:
    def __init__(self, model, tensor_parallel_size: int = 1, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 kvcache_block_size: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 enable_prefix_caching: bool = True, seed: int = 0):
        config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, device=device,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens, kvcache_block_size=kvcache_block_size,
                              kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
                              enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching, seed=seed)
        config.validate()
        from nanovllm_tp.distributed.launch import launched_by_torchrun
        if tensor_parallel_size > 1 and launched_by_torchrun() and int(os.environ.get("RANK", 0)) != 0:
            # Under torchrun every rank runs the user's script: ranks > 0 serve rank 0's plans here and
            # leave when it shuts down, so the rest of the script only ever runs on rank 0.
            from nanovllm_tp.workers.worker import run_worker
            sys.exit(run_worker(config))
        from nanovllm_tp.engine import LLMEngine
        from nanovllm_tp.loader import load_tokenizer
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.engine = LLMEngine(config)
        self._request_ids = itertools.count()
        self._requests: dict[str, tuple[str | None, Sequence]] = {}     # request id -> (prompt text, sequence)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- input checking: everything is validated before any request reaches the engine ----

    def _normalize_prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, SequenceABC) or isinstance(prompts, (bytes, bytearray)):
            raise TypeError("prompts must be a string, a list of strings or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        vocab = self.config.model_config.vocab_size
        limit = self.config.max_model_len - 1
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if isinstance(p, str):
                text, ids = p, self.tokenizer.encode(p)
            elif isinstance(p, (list, tuple)):
                bad = next((t for t in p if isinstance(t, bool) or not isinstance(t, int)), None)
                if bad is not None:
                    raise TypeError(f"prompt {i}: token ids must be ints, got {type(bad).__name__}")
                text, ids = None, list(p)
                out_of_range = [t for t in ids if not 0 <= t < vocab]
                if out_of_range:
                    raise ValueError(f"prompt {i}: token id {out_of_range[0]} is outside the vocabulary [0, {vocab})")
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) > limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_model_len="
                                 f"{self.config.max_model_len} at most {limit} fit (one slot is for output)")
            out.append((text, ids))
        return out

    @staticmethod
    def _normalize_params(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        for sp in sampling_params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params entries must be SamplingParams, got {type(sp).__name__}")
            sp.validate()
        return list(sampling_params)

    # ---- generation ----

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        ids = [self._add(text, token_ids, sp) for (text, token_ids), sp in zip(items, params)]
        try:
            self._run(len(ids), use_tqdm)
        except BaseException:
            self._drop_aborted()     # the engine failed every unfinished request; the error says why
            raise
        return [self._output(self._requests.pop(i)) for i in ids]

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue one request for step()-driven serving; returns its request id."""
        (text, token_ids), = self._normalize_prompts([prompt])
        sp, = self._normalize_params(sampling_params, 1)
        return self._add(text, token_ids, sp)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        try:
            finished, _, _ = self.engine.step()
        except BaseException:
            self._drop_aborted()
            raise
        return [self._output(self._requests.pop(str(seq.seq_id))) for seq in finished
                if str(seq.seq_id) in self._requests]

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished()

    def _drop_aborted(self) -> None:
        for request_id in [i for i, (_, seq) in self._requests.items() if seq.finish_reason == "abort"]:
            del self._requests[request_id]

    def _add(self, text: str | None, token_ids: list[int], sp: SamplingParams) -> str:
        request_id = next(self._request_ids)
        seed = sp.seed if sp.seed is not None else (self.config.seed * 1_000_003 + request_id) % (1 << 63)
        seq = Sequence(request_id, token_ids, temperature=sp.temperature, max_tokens=sp.max_tokens,
                       ignore_eos=sp.ignore_eos, seed=seed)
        self.engine.add(seq)
        self._requests[str(request_id)] = (text, seq)
        return str(request_id)

    def _output(self, entry) -> RequestOutput:
        text, seq = entry
        completion = seq.completion_token_ids
        return RequestOutput(
            request_id=str(seq.seq_id), prompt=text, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            outputs=[CompletionOutput(0, self.tokenizer.decode(completion, skip_special_tokens=True), completion,
                                      seq.finish_reason)],
            finished=seq.is_finished,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time))

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="Generating", dynamic_ncols=True)
        prefill_tps = decode_tps = 0.0
        try:
            while self.engine.has_unfinished():
                start = time.perf_counter()
                finished, num_tokens, is_prefill = self.engine.step()
                rate = num_tokens / max(time.perf_counter() - start, 1e-9)
                if is_prefill:
                    prefill_tps = rate
                else:
                    decode_tps = rate
                if bar is not None:
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
                    bar.update(len(finished))
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
