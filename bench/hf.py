"""transformers as the engine's reference and peer: `hf_greedy`, the greedy tokens the tests and the GPU check
hold the engine to, and `HFRunner` for `bench --compare hf` (and the GPU check): the engine's checkpoint, dtype and
device, timed on the same workload two ways:

  generate: model.generate on static batches: requests sorted by requested output length (then prompt length),
      left-padded with an attention mask, min_new_tokens = max_new_tokens = the batch's largest requested output;
      only requested tokens are counted.
  continuous batching: transformers' continuous batching manager (the engine behind generate_batch), one
      add_request per request with its own max_new_tokens and EOS disabled.
"""
from __future__ import annotations

import math
import time

from nanovllm_tp.bench import common as bc


class HFRunner:
    """transformers on the engine's checkpoint, dtype and device."""

    def __init__(self, model_dir: str, dtype, device, temperature: float, seed: int, cb_max_batch_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM
        bc.quiet_transformers()
        self.torch, self.temperature, self.seed = torch, temperature, seed
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        self.pad_id = gc.pad_token_id if gc.pad_token_id is not None else (eos if eos is not None else 0)
        self.cb_max_batch_tokens = cb_max_batch_tokens
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", None)

    def _sampling(self) -> dict:
        if self.temperature > 0:      # plain temperature sampling, like the engine: no top-k / top-p
            return dict(do_sample=True, temperature=self.temperature, top_k=None, top_p=None)
        return dict(do_sample=False, temperature=None, top_k=None, top_p=None)

    # ---- static batches with model.generate ----

    @staticmethod
    def batches(workload: bc.Workload, batch_size: int) -> list[list[int]]:
        order = sorted(range(workload.num_requests),
                       key=lambda i: (workload.output_lens[i], workload.prompt_lens[i]))
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def generate_static(self, workload: bc.Workload, prompts, batch_size: int) -> dict:
        torch = self.torch
        torch.manual_seed(self.seed)
        produced_ok, steps, t0 = True, 0, time.perf_counter()
        with torch.inference_mode():
            for idx in self.batches(workload, batch_size):
                width = max(len(prompts[i]) for i in idx)
                new = max(workload.output_lens[i] for i in idx)
                ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):       # left padding
                    ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                    mask[row, width - len(prompts[i]):] = 1
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          max_new_tokens=new, min_new_tokens=new, pad_token_id=self.pad_id,
                                          **self._sampling())
                produced_ok &= out.shape[1] - width == new
                steps += new
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds, "lengths_ok": produced_ok,
                "decode_steps": steps}

    # ---- continuous batching ----

    def cb_config(self, workload: bc.Workload) -> dict:
        page = 256
        blocks = sum(math.ceil((p + o) / page) + 1 for p, o in zip(workload.prompt_lens, workload.output_lens))
        return {"page_size": page, "num_blocks": blocks + 8, "max_batch_tokens": self.cb_max_batch_tokens,
                "allow_block_sharing": False}

    def generate_cb(self, workload: bc.Workload, prompts) -> dict:
        torch = self.torch
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
        torch.manual_seed(self.seed)
        sampling = {k: v for k, v in self._sampling().items() if v is not None}
        gen = GenerationConfig(max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=self.pad_id,
                               **sampling)
        cfg = self.cb_config(workload)
        cb_config = ContinuousBatchingConfig(**cfg, seed=self.seed)
        hints = WorkloadHints(max_prompt_length=max(workload.prompt_lens),
                              max_generated_length=max(workload.output_lens), num_requests=workload.num_requests)
        manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config,
                                                      workload_hints=hints)
        manager.warmup()            # builds the paged cache (no-op warm-up on CPU): set-up, not timed
        manager.start()
        results = {}
        try:
            t0 = time.perf_counter()
            for i, (p, m) in enumerate(zip(prompts, workload.output_lens)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
            while len(results) < workload.num_requests:
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    results[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching thread stopped with "
                                       f"{len(results)}/{workload.num_requests} results")
            seconds = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()
        errors = [r.error for r in results.values() if r.error]
        if errors:
            raise RuntimeError(f"transformers' continuous batching failed {len(errors)} requests: {errors[0]}")
        produced = [len(results[f"r{i}"].generated_tokens) for i in range(workload.num_requests)]
        return {"seconds": seconds, "tok_s": workload.requested_output_tokens / seconds,
                "lengths_ok": produced == workload.output_lens}

    def warm_up(self, vocab_size: int, modes) -> float:
        prompts, outs = bc.warmup_prompts(vocab_size, self.seed)
        w = bc.Workload([len(p) for p in prompts], outs, self.seed, vocab_size)
        t0 = time.perf_counter()
        if "generate" in modes:
            self.generate_static(w, prompts, len(prompts))
        if "cb" in modes:
            self.generate_cb(w, prompts)
        return time.perf_counter() - t0


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens with its KV cache, never stopping at EOS: the reference the engine's
    greedy output is compared with (the engine runs with ignore_eos). The cache is `cache` from transformers 5
    on (`past_key_values` before, and deprecated since)."""
    import inspect

    import torch
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        tokens = []
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), use_cache=True, **{name: getattr(out, name)})
    return tokens
