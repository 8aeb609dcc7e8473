"""The references of quantized engines: transformers with every linear layer's input rounded as
csrc/linear_q.c rounds it (and, for int8, its weights quantized as the engine quantizes them), and the comparison
of the engine's greedy tokens and logprobs with such a reference.

Why a near tie ends the token comparison: rounding is a step function, so two sums of the same numbers in another
order (a kernel's, a TP split's), a few fp32 ulps apart, may round one activation to neighbouring steps; that moves
the next layers' inputs by up to a step, they round differently in turn, and the logits of the two computations
then differ by the order of the rounding's own error (about 0.1 on the tiny random models), not by fp32 noise. So
tokens are compared up to the reference's first step whose two best logits are closer than GAP, and the engine's
logprobs of the reference's tokens (teacher-forced) everywhere. Only a computation in transformers' own order (the
torch reference at TP 1) equals it token for token throughout."""
import functools

import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers.quant import INT8_BLOCK, int8_blocks, round_activations
from tests.helpers import hf_greedy, mixed_prompts

TOKENS = 8
GAP = 0.25
# Where a tiny random model's near ties fall depends on the CPU's rounding (on one Intel Xeon with AMX three
# prompts left fewer than TOKENS decisive steps): eight prompts leave 24-59 of their 64 steps decisive on the
# int8 references (TP 1 and 2, seeds 0-11), so the floor of MIN_COMPARED holds on any CPU and still fails an
# engine that parts from the reference early.
PROMPT_LENGTHS = (1, 20, 70, 5, 33, 12, 48, 2)
MIN_COMPARED = 2 * TOKENS
LOGPROB_TOL = 0.3
ROW_PARALLEL = ("o_proj", "down_proj")      # layers whose inputs the engine splits across ranks


def rounded_reference(ref):
    """ref (a transformers model of dequantized GGUF weights) with every linear input rounded per block of 32."""
    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda module, args: (round_activations(args[0]),))
    return ref


def int8_reference(ref, tp: int):
    """ref with every linear layer's weight quantized to int8 per output channel and its input rounded per block
    of INT8_BLOCK, as each of tp ranks does: a row-parallel layer's rank quantizes its slice of inputs (weights and
    activations; a slice's last block is what is left of it)."""
    def round_slices(module, args, parts: int):
        return (torch.cat([round_activations(c, INT8_BLOCK) for c in args[0].chunk(parts, dim=-1)], dim=-1),)

    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear):
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            w = torch.cat([int8_blocks(c).dequantize() for c in m.weight.data.chunk(parts, dim=1)], dim=1)
            m.weight = torch.nn.Parameter(w, requires_grad=False)      # its own: a tied embedding stays dense
            m.register_forward_pre_hook(functools.partial(round_slices, parts=parts))
    return ref


def reference_run(ref, prompt: list[int]) -> tuple[list[int], list[float], torch.Tensor]:
    """The reference's greedy tokens, the gap between its two best logits at each step, and its logprobs of those
    tokens (teacher-forced)."""
    tokens = hf_greedy(ref, prompt, TOKENS)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    top = logits.topk(2, -1).values
    logprobs = torch.log_softmax(logits, -1)[torch.arange(TOKENS), torch.tensor(tokens)]
    return tokens, (top[:, 0] - top[:, 1]).tolist(), logprobs


def assert_follows_reference(model: str, ref, exact: bool = False, **knobs) -> dict:
    """The engine's greedy tokens on fixed prompts are the reference's up to its first near tie (exact: all of
    them), its logprobs of the reference's tokens within LOGPROB_TOL; returns the engine's stats()."""
    prompts = mixed_prompts(ref.config.vocab_size, lengths=PROMPT_LENGTHS, seed=9)
    runs = [reference_run(ref, p) for p in prompts]
    llm = LLM(model, max_num_batched_tokens=32, kvcache_block_size=16, kv_cache_memory=32 << 20, **knobs)
    try:
        stats = llm.stats()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                            use_tqdm=False)
        forced = llm.generate([p + tokens for p, (tokens, *_) in zip(prompts, runs)],
                              SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.close()
    compared = 0
    for prompt, out, done, (tokens, gaps, logprobs) in zip(prompts, outs, forced, runs):
        decisive = TOKENS if exact else next((i for i, gap in enumerate(gaps) if gap < GAP), TOKENS)
        assert out.outputs[0].token_ids[:decisive] == tokens[:decisive]
        compared += decisive
        ours = torch.tensor([done.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(tokens)])
        assert (ours.double() - logprobs).abs().max() < LOGPROB_TOL
    assert compared >= MIN_COMPARED, compared      # the data leave enough decisive steps to compare
    return stats
