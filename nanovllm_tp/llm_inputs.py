"""LLM's input checking: every prompt, sampling parameter and priority is checked (and tokenized) before any
request reaches the engine; a bad one raises ValueError or TypeError and nothing is queued. A part of LLM."""
from collections.abc import Sequence as SequenceABC

from nanovllm_tp.checks import integer
from nanovllm_tp.pooling_params import PoolingParams
from nanovllm_tp.prompts import check_prompt_length, is_token_ids, render_chat
from nanovllm_tp.sampling_params import SamplingParams


class RequestInputs:
    """Mixed into LLM: uses its config, tokenizer, grammars and request table."""

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
            sampling_params = SamplingParams()
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
            sp.tokenize_bad_words(self.tokenizer, vocab)
            if sp.structured_outputs is not None:
                self.grammars.compile(sp.structured_outputs)     # compiled (or refused) before the engine
        return list(sampling_params)

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


def _is_conversation(x) -> bool:
    """Messages with a role and text content (an assistant's tool calls may stand for its content)."""
    return isinstance(x, list) and bool(x) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and (
            isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls"))) for m in x)
