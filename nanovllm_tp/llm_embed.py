"""LLM's embedding side (vLLM's LLM.embed): prompts checked and tokenized, pooling resolved against the model, one
prefill-only request each through the same engine as generation. A part of LLM, kept apart from generation."""
from nanovllm_tp.pooling import EmbeddingRequestOutput, EmbeddingState
from nanovllm_tp.pooling_params import ModelPooling, PoolingParams
from nanovllm_tp.prompts import is_token_ids
from nanovllm_tp.scheduler import Sequence


class EmbeddingRequests:
    """Mixed into LLM: uses its config, engine, request tables, _normalize_prompt and _run."""

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

