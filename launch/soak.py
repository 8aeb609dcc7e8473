"""A seeded, randomized soak of the request lifecycle: many requests with random mixes of n, stop strings, stop
ids, min_tokens, penalties, seeds, logprobs and output kinds, arriving at random steps (while others run) and aborted
at random steps, through a KV pool small enough to preempt often. Afterwards:
- every request that finished equals the same request run alone on a reference engine (TP 1, no prefix cache, a
  roomy pool): tokens, text, finish and stop reasons, logprobs;
- an aborted request's tokens are a prefix of its run alone;
- no KV block is left held, and the prefix cache served hits (which the equality above shows exact).

    python -m nanovllm_tp.launch.soak --model DIR [--requests 1000] [--tensor-parallel-size 2] [--kv-blocks 24]

Exits 1 on any mismatch or leak. Run it with `--make-tiny DIR` to build the tiny checkpoint first.
"""
import argparse
import json
import random
import sys
import time
from dataclasses import dataclass

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.sampling_params import RequestOutputKind

KINDS = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)


@dataclass(slots=True)
class SoakRequest:
    prompt: list[int]
    params: SamplingParams
    arrive: int                  # the mixed run's step at which it is added
    abort: int | None            # steps after its arrival at which it is aborted (None: never)


@dataclass(slots=True)
class SoakResult:
    requests: int
    finished: int
    aborted: int
    preemptions: int
    prefix_hit_tokens: int
    steps: int
    mismatches: list[str]
    leaked_blocks: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.leaked_blocks


def make_requests(rng: random.Random, vocab: int, count: int, stop_pool: list[str], max_tokens: int = 24,
                  steps: int | None = None) -> list[SoakRequest]:
    """count requests over a few shared prompt prefixes, with random knobs; arrivals spread over `steps` steps."""
    steps = steps if steps is not None else count // 6
    prefixes = [[rng.randrange(vocab) for _ in range(rng.choice((16, 33, 48)))] for _ in range(4)]
    out = []
    for _ in range(count):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + \
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        kw = {"max_tokens": rng.randint(1, max_tokens), "output_kind": rng.choice(KINDS)}
        if rng.random() < 0.6:
            kw.update(temperature=rng.choice((0.7, 1.0, 1.3)), seed=rng.randrange(1 << 31))
            kw.update(rng.choice(({}, {"top_k": rng.randint(1, 40)}, {"top_p": 0.8}, {"min_p": 0.05})))
        else:
            kw["temperature"] = 0.0
        if rng.random() < 0.25:
            kw["n"] = rng.randint(2, 3)
        if rng.random() < 0.3:
            kw["stop"] = rng.sample(stop_pool, rng.randint(1, 2))
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.2:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.3:
            kw.update(rng.choice(({"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
                                  {"frequency_penalty": 0.4, "presence_penalty": -0.2})))
        if rng.random() < 0.2:
            kw["logprobs"] = rng.randint(0, 3)
        kw["ignore_eos"] = rng.random() < 0.5
        abort = rng.randint(0, 12) if rng.random() < 0.15 else None
        out.append(SoakRequest(prompt, SamplingParams(**kw), rng.randrange(max(steps, 1)), abort))
    return out


def stop_strings_of(tokenizer, vocab: int, rng: random.Random, count: int = 12) -> list[str]:
    """Short strings that random text of this vocabulary holds often: pieces of decoded tokens."""
    pool = set()
    while len(pool) < count:
        text = tokenizer.decode([rng.randrange(vocab)]).strip()
        if text and "\ufffd" not in text:
            pool.add(text[:rng.randint(1, 2)])
    return sorted(pool)


def _merge(acc, out, kind):
    """A request's whole output so far from its stream of RequestOutputs (delta pieces appended)."""
    if acc is None or kind != RequestOutputKind.DELTA:
        return out
    by_index = {c.index: c for c in acc.outputs}
    for c in out.outputs:
        a = by_index.get(c.index)
        if a is None:
            by_index[c.index] = c
            continue
        a.text += c.text
        a.token_ids = list(a.token_ids) + list(c.token_ids)
        if c.logprobs is not None:
            a.logprobs = (a.logprobs or []) + c.logprobs
        a.finish_reason, a.stop_reason, a.cumulative_logprob = c.finish_reason, c.stop_reason, c.cumulative_logprob
    acc.outputs = sorted(by_index.values(), key=lambda c: c.index)
    acc.finished = out.finished
    return acc


def run_mixed(llm: LLM, requests: list[SoakRequest], rng: random.Random) -> dict[int, object]:
    """Requests added at their arrival steps and aborted at theirs; every 7th step's arrivals go through a
    generate() call that runs alongside the step()-driven ones. Returns each request's whole output."""
    by_step: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_step.setdefault(r.arrive, []).append(i)
    rid_of, index_of, abort_at, results = {}, {}, {}, {}
    step = 0
    while step <= max(by_step, default=0) or llm.has_unfinished_requests():
        arrivals = by_step.get(step, [])
        if arrivals and step % 7 == 3:       # a blocking generate() while the others are mid-flight
            for i, out in zip(arrivals, llm.generate([requests[i].prompt for i in arrivals],
                                                     [requests[i].params for i in arrivals], use_tqdm=False)):
                results[i] = out
        else:
            for i in arrivals:
                rid = llm.add_request(requests[i].prompt, requests[i].params)
                rid_of[i], index_of[rid] = rid, i
                if requests[i].abort is not None:
                    abort_at.setdefault(step + requests[i].abort, []).append(rid)
        if abort_at.get(step):
            llm.abort_request(abort_at.pop(step))
        for out in llm.step():
            i = index_of[out.request_id]
            results[i] = _merge(results.get(i), out, requests[i].params.output_kind)
        step += 1
    return results


def _same_logprobs(a, b, tol: float = 1e-3) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    return len(a) == len(b) and all(x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) <= tol
                                                                 for t in x) for x, y in zip(a, b))


def compare(i: int, got, want) -> list[str]:
    """What differs between a request's mixed-run output and its run alone."""
    bad = []
    for g, w in zip(got.outputs, want.outputs):
        where = f"request {i} completion {g.index}"
        if g.finish_reason == "abort":
            if list(g.token_ids) != list(w.token_ids)[:len(g.token_ids)]:
                bad.append(f"{where}: aborted tokens {g.token_ids} are not a prefix of {w.token_ids}")
            continue
        if list(g.token_ids) != list(w.token_ids) or g.text != w.text:
            bad.append(f"{where}: tokens {g.token_ids} ({g.text!r}) != alone {w.token_ids} ({w.text!r})")
        elif (g.finish_reason, g.stop_reason) != (w.finish_reason, w.stop_reason):
            bad.append(f"{where}: finished {g.finish_reason}/{g.stop_reason!r}, alone {w.finish_reason}/"
                       f"{w.stop_reason!r}")
        elif not _same_logprobs(g.logprobs, w.logprobs):
            bad.append(f"{where}: logprobs differ from the run alone")
    if len(got.outputs) != len(want.outputs):
        bad.append(f"request {i}: {len(got.outputs)} completions, alone {len(want.outputs)}")
    return bad


def held_blocks(llm: LLM) -> int:
    bm = llm.engine.scheduler.block_manager
    return (bm.num_blocks - bm.num_free_blocks) + sum(b.ref_count > 0 for b in bm.blocks)


def soak(llm: LLM, reference: LLM, requests: list[SoakRequest], seed: int = 0) -> SoakResult:
    """The mixed run on llm, then each request alone on reference; see the module's docstring."""
    start = time.perf_counter()
    before = llm.stats()
    results = run_mixed(llm, requests, random.Random(seed))
    after = llm.stats()
    mismatches = []
    for i, r in enumerate(requests):
        got = results.get(i)
        if got is None or not got.finished:
            mismatches.append(f"request {i}: no final output")
            continue
        alone = reference.generate([r.prompt], r.params, use_tqdm=False)[0]
        mismatches += compare(i, got, alone)
    aborted = sum(any(c.finish_reason == "abort" for c in out.outputs) for out in results.values())
    return SoakResult(len(requests), len(results) - aborted, aborted,
                      after["num_preemptions"] - before["num_preemptions"],
                      after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                      after["num_steps"] - before["num_steps"], mismatches, held_blocks(llm),
                      time.perf_counter() - start)


def kv_bytes_for(model: str, blocks: int, block_size: int, tp: int) -> int:
    """KV cache bytes per rank that give `blocks` usable blocks of the model (fp32, as on CPU)."""
    import torch
    from transformers import AutoConfig

    from nanovllm_tp.workers.kv_cache import kv_block_bytes
    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_block = kv_block_bytes(c.num_hidden_layers, block_size, max(c.num_key_value_heads // tp, 1), head_dim,
                               torch.float32)
    return per_block * (blocks + 1)          # and the null block


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (the tiny checkpoint with --make-tiny)")
    ap.add_argument("--make-tiny", metavar="DIR", help="build the tiny checkpoint here and soak it")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=17, help="KV blocks of 16 tokens in the soaked engine")
    ap.add_argument("--max-num-batched-tokens", type=int, default=96, help="small: prompts are chunked")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model = args.model
    if args.make_tiny:
        from nanovllm_tp.launch.make_tiny import make_tiny
        model = str(make_tiny(args.make_tiny))
    if not model:
        ap.error("--model or --make-tiny is required")
    rng = random.Random(args.seed)
    reference = LLM(model, kvcache_block_size=16, enable_prefix_caching=False)
    llm = LLM(model, tensor_parallel_size=args.tensor_parallel_size, kvcache_block_size=16,
              kv_cache_memory=kv_bytes_for(model, args.kv_blocks, 16, args.tensor_parallel_size),
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.kv_blocks * 16)
    try:
        vocab = reference.get_tokenizer().vocab_size
        requests = make_requests(rng, vocab, args.requests, stop_strings_of(reference.get_tokenizer(), vocab, rng))
        r = soak(llm, reference, requests, args.seed)
    finally:
        llm.close()
        reference.close()
    for line in r.mismatches[:20]:
        print(line)
    print(json.dumps({k: getattr(r, k) for k in SoakResult.__slots__ if k != "mismatches"}
                     | {"mismatches": len(r.mismatches), "ok": r.ok}))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
