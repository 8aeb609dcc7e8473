"""Prompts to token ids in the HTTP process, in worker threads: neither the event loop (every other client's
requests and streams) nor the engine loop waits while a large prompt is tokenized or a chat template rendered.

The engine gets token ids only. A text prompt far longer than the context is refused before it is tokenized:
no token covers more characters than the vocabulary's longest entry (twice that, for normalizers that fold
characters), so a text of more characters than that many tokens could hold is too long whatever its tokens.
"""
import asyncio
from concurrent.futures import ThreadPoolExecutor

from nanovllm_tp.entrypoints.prompts import check_prompt_length, render_chat

THREADS = 2


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
           tools: list[dict] | None = None) -> str:
    """A request's conversation as prompt text. A `chat_template` among the kwargs is the template (the handlers
    let one through only when the operator trusts them); `tools` go to the template as transformers hands them."""
    kwargs = dict(chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None)
    return render_chat(tokenizer, messages, template, add_generation_prompt, kwargs, tools)


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int, threads: int = THREADS):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._chars_per_token: int | None = None

    async def completions(self, prompts: list, pooling=None) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt (a string or a list of token ids); ValueError for the first
        prompt that cannot fit. `pooling` (PoolingParams): embedding prompts, cut to its truncate_prompt_tokens,
        which may fill max_model_len."""
        return await self.run(self._encode_all, prompts, pooling)

    async def chat(self, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
                   tools: list[dict] | None = None) -> list[int]:
        """The conversation rendered through the model's chat template (render), as token ids. ValueError /
        TypeError for bad input; the template's own errors as they come (jinja raises its own types)."""
        def encode():
            text = render(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs, tools)
            return self._encode(0, text, add_special_tokens=False)    # the template has them
        return await self.run(encode)

    async def run(self, fn, *args):
        """fn(*args) in a tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode_all(self, prompts: list, pooling=None) -> list[tuple[str | None, list[int]]]:
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append((p, self._encode(i, p, pooling=pooling)))
            else:
                out.append((None, self._fit(i, list(p), pooling)))    # the engine checks ids against its vocabulary
        return out

    def _encode(self, i: int, text: str, add_special_tokens: bool = True, pooling=None) -> list[int]:
        if pooling is None or pooling.truncate_prompt_tokens is None:
            check_prompt_length(i, len(text) // (2 * self.chars_per_token()), self.max_model_len, at_least=True,
                                output_room=int(pooling is None))
        return self._fit(i, self.tokenizer.encode(text, add_special_tokens=add_special_tokens), pooling)

    def _fit(self, i: int, ids: list[int], pooling=None) -> list[int]:
        """The prompt's ids as the engine takes them: cut as an embedding's pooling says, checked against the
        context (a generated prompt leaves room for output)."""
        if pooling is not None:
            ids = pooling.truncated(ids, self.max_model_len)
        check_prompt_length(i, len(ids), self.max_model_len, output_room=int(pooling is None))
        return ids

    def chars_per_token(self) -> int:
        """The most characters one vocabulary entry spells (byte-level entries: one character per byte)."""
        if self._chars_per_token is None:
            self._chars_per_token = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        return self._chars_per_token
