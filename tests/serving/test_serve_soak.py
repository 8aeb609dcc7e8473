"""The lifecycle soak through the server: the soak's random requests (launch/soak.py) sent at once with the
official `openai` client, streamed or not, some of them dropped by their client mid-way, against a server whose KV
pool preempts often. Every request that ran to its end equals the same request run alone offline (TP 1, no prefix
cache); a dropped one received a prefix of it; afterwards the server has nothing running or waiting, no KV block
held, and its greedy answer is what it was."""
import asyncio
import random
import time

import openai
import pytest

from nanovllm_tp import LLM
from nanovllm_tp.launch.soak import kv_bytes_for, make_requests, stop_strings_of
from tests.serving.test_serve import KEY, metrics, start_server, wait_ready

pytestmark = pytest.mark.spawn
MODEL = 'model_name="tiny"'
_DEFAULTS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "stop": None, "stop_token_ids": None, "min_tokens": 0,
             "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logprobs": None,
             "seed": None}
_OPENAI = ("stop", "presence_penalty", "frequency_penalty", "logprobs", "seed", "top_p")


def request_of(r) -> tuple[dict, dict]:
    """(the openai client's keyword arguments, its extra_body) for a soak request."""
    p = r.params
    kw = {"model": "tiny", "prompt": r.prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "n": p.n}
    extra = {"ignore_eos": p.ignore_eos}
    for name, default in _DEFAULTS.items():
        value = getattr(p, name)
        if value != default:
            (kw if name in _OPENAI else extra)[name] = value
    return kw, extra


async def one(c, r, stream: bool, drop_after: int | None) -> tuple[dict[int, str], dict[int, str], bool]:
    """Send one request: (text per choice, finish reason per choice, whether the client dropped it)."""
    kw, extra = request_of(r)
    texts, reasons = {i: "" for i in range(r.params.n)}, {}
    if not stream:
        if drop_after is not None:
            try:
                await asyncio.wait_for(c.completions.create(**kw, extra_body=extra), timeout=0.05 * drop_after)
            except asyncio.TimeoutError:
                return texts, reasons, True
            return texts, reasons, True         # finished before the drop: only counted, not compared
        out = await c.completions.create(**kw, extra_body=extra)
        return {ch.index: ch.text for ch in out.choices}, {ch.index: ch.finish_reason for ch in out.choices}, False
    chunks = 0
    response = await c.completions.create(**kw, extra_body=extra, stream=True)
    async for chunk in response:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason is not None:
                reasons[ch.index] = ch.finish_reason
        chunks += 1
        if drop_after is not None and chunks >= drop_after:
            await response.close()
            return texts, reasons, True
    return texts, reasons, False


async def send_all(port: int, requests, rng: random.Random):
    plan = [(rng.random() < 0.5, rng.randint(1, 6) if rng.random() < 0.15 else None) for _ in requests]
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0,
                                  timeout=300) as c:
        results = await asyncio.gather(*(one(c, r, s, d) for r, (s, d) in zip(requests, plan)))
    return results


def wait_idle(port: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(port)
        idle = (m[f"num_requests_running{{{MODEL}}}"], m[f"num_requests_waiting{{{MODEL}}}"],
                m[f"kv_cache_usage_perc{{{MODEL}}}"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run_server_soak(tiny_model_dir, count: int, seed: int) -> None:
    rng = random.Random(seed)
    reference = LLM(tiny_model_dir, kvcache_block_size=16, enable_prefix_caching=False, kv_cache_memory=64 << 20)
    try:
        tok = reference.get_tokenizer()
        requests = make_requests(rng, tok.vocab_size, count, stop_strings_of(tok, tok.vocab_size, rng))
        greedy = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
        port, ctx = start_server(tiny_model_dir, "--max-model-len", "256", "--http-priority", "normal",
                                 "--kv-cache-memory", str(kv_bytes_for(tiny_model_dir, 17, 16, 1)), "--api-key", KEY,
                                 "--max-num-batched-tokens", "96")
        with ctx as proc:
            wait_ready(port, proc)
            sync = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
            before = sync.completions.create(**greedy).choices[0].text
            results = asyncio.run(send_all(port, requests, rng))
            m = wait_idle(port)
            assert m[f"num_requests_running{{{MODEL}}}"] == 0 and m[f"num_requests_waiting{{{MODEL}}}"] == 0
            assert m[f"kv_cache_usage_perc{{{MODEL}}}"] == 0
            assert m[f"num_preemptions_total{{{MODEL}}}"] > 0
            assert sync.completions.create(**greedy).choices[0].text == before
        dropped = compared = 0
        for i, (r, (texts, reasons, was_dropped)) in enumerate(zip(requests, results)):
            alone = reference.generate([r.prompt], r.params, use_tqdm=False)[0].outputs
            for c in alone:
                if was_dropped or reasons.get(c.index) is None:
                    assert c.text.startswith(texts[c.index]), (i, c.index, texts[c.index], c.text)
                    continue
                assert (texts[c.index], reasons[c.index]) == (c.text, c.finish_reason), (i, r.params)
                compared += 1
            dropped += was_dropped
        assert dropped > 0 and compared > count // 2
    finally:
        reference.close()


@pytest.mark.slow
def test_quick_server_soak(tiny_model_dir):
    run_server_soak(tiny_model_dir, 120, seed=3)


@pytest.mark.slow
@pytest.mark.long
def test_long_server_soak(tiny_model_dir):
    run_server_soak(tiny_model_dir, 1000, seed=4)
