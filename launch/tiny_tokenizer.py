"""The tiny checkpoints' tokenizer: a byte-level BPE of BPE_VOCAB_SIZE entries trained on the bundled corpus
(deterministic, once per process), plus 3 special tokens, with a Qwen-style chat template; and the JSON files
a Hugging Face directory holds for it."""
from __future__ import annotations

import functools
import importlib.resources
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BPE_VOCAB_SIZE = 2000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # appended after BPE: ids 2000..2002
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = importlib.resources.files("nanovllm_tp") / "data" / "corpus.txt"


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """Train the BPE once per process; training is deterministic, so the JSON is too."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with importlib.resources.as_file(CORPUS) as corpus_path:
        tokenizer.train([str(corpus_path)], trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer.to_str()


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tokenizer_files(out_dir: pathlib.Path, model_max_length: int) -> int:
    """The trained BPE, its special tokens, chat template and generation config; returns the EOS id."""
    tokenizer_json = trained_tokenizer_json()
    eos = SPECIAL_TOKENS[0]
    eos_id = Tokenizer.from_str(tokenizer_json).token_to_id(eos)
    write_json(out_dir / "generation_config.json", {"bos_token_id": eos_id, "eos_token_id": eos_id,
                                                      "do_sample": False})
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    special_tokens = {"eos_token": eos, "pad_token": eos, "additional_special_tokens": SPECIAL_TOKENS[1:]}
    write_json(out_dir / "special_tokens_map.json", special_tokens)
    write_json(out_dir / "tokenizer_config.json", {
        **special_tokens, "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length})
    return eos_id
