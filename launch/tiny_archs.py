"""make_tiny's other architectures (--arch): small random checkpoints initialised through transformers, with the
tiny tokenizer; the transformers model comes back as the tests' reference."""
from __future__ import annotations

import pathlib

import torch
from tokenizers import Tokenizer

from nanovllm_tp.launch.tiny_qwen3 import EMBED_STD, NORM_NOISE_STD
from nanovllm_tp.launch.tiny_tokenizer import trained_tokenizer_json, write_tokenizer_files

# Other architectures: small random checkpoints initialised through transformers (model_type -> config beyond
# ARCH_SHAPE). Projections get std 1.5 / sqrt(fan_in) and embeddings 0.7, so greedy steps are decided by clear
# margins; the MoE router favours experts 0-1 and neglects 6-7, so expert loads are uneven.
ARCH_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
ARCHS = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": None},
         "qwen3_moe": dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                           mlp_only_layers=[1], norm_topk_prob=True),
         # a window of 24 on layers 0 and 2, a scale of 24 ** -0.5 rather than head_dim's, an attention cap low
         # enough to change the tokens (Gemma 2 ships 50 for scores of another size); untied, as tied embeddings
         # scaled by sqrt(hidden) make greedy decoding repeat the prompt's last token
         "gemma2": dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                        final_logit_softcapping=30.0),
         # layers 0, 1 windowed (24 tokens, RoPE base 100), layer 2 global (base 1e6, linear scaling)
         "gemma3_text": dict(sliding_window=24, query_pre_attn_scalar=24, sliding_window_pattern=3,
                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e6}}),
         # Phi-4-mini's shape of attention: 3/4 of each head rotates; a window of 40 on every layer
         "phi3": dict(partial_rotary_factor=0.75, sliding_window=40, original_max_position_embeddings=1024,
                      pad_token_id=None)}
NOISY_NORMS = {"gemma2", "gemma3_text", "phi3"}     # norm weights get noise here (the others keep transformers' init)


def make_tiny_arch(out_dir, model_type: str, *, seed: int = 0, **config_overrides):
    """Write a random checkpoint of `model_type` (a key of ARCHS) with the tiny tokenizer; returns the
    transformers model (fp32), the reference for tests."""
    from transformers import AutoConfig, AutoModelForCausalLM
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_id = write_tokenizer_files(out_dir, ARCH_SHAPE["max_position_embeddings"])
    vocab = Tokenizer.from_str(trained_tokenizer_json()).get_vocab_size(with_added_tokens=True)
    config = AutoConfig.for_model(model_type, vocab_size=vocab, eos_token_id=eos_id, bos_token_id=eos_id,
                                  **{**ARCH_SHAPE, **ARCHS[model_type], **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if model_type in NOISY_NORMS:     # a swapped, dropped or un-offset norm changes the tokens
                    p.add_(NORM_NOISE_STD * torch.randn_like(p))
                continue
            if "embed" in name or "lm_head" in name:
                p.normal_(0, EMBED_STD)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1)
            if name.endswith("mlp.gate.weight"):     # wide router rows win top-k often, near-zero ones rarely
                p[:2] *= 4.0
                p[6:] *= 0.05
    model.save_pretrained(out_dir)
    return model
