"""`POST /v1/embeddings`: OpenAI's body (input, model, encoding_format, dimensions, user) with vLLM's extra fields
(truncate_prompt_tokens, normalize, priority), strict as the other bodies, and its response: one embedding per
input, as floats or as base64 of little-endian float32, with the prompt tokens counted in usage."""
import base64
from typing import Literal

from nanovllm_tp.entrypoints.prompts import prompt_list
from nanovllm_tp.pooling.params import PoolingParams
from nanovllm_tp.serving.body import Int, Prompt, TextBody
from nanovllm_tp.serving.wire import float32_bytes


class EmbeddingRequest(TextBody):
    input: Prompt
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None                   # accepted, without effect (OpenAI's bookkeeping)
    # vLLM's extra fields
    truncate_prompt_tokens: Int | None = None
    normalize: bool | None = None
    priority: Int = 0

    def prompts(self) -> list:
        """One entry per input: a string or a list of token ids."""
        return prompt_list(self.input, "input")

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


def _encoded(embedding: list[float], encoding_format: str):
    return embedding if encoding_format == "float" else base64.b64encode(float32_bytes(embedding)).decode("ascii")


def embedding_response(outputs: list, model: str, encoding_format: str) -> dict:
    """The response body of the finished EmbeddingRequestOutputs, in input order."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(o.outputs.embedding, encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
