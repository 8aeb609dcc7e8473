"""Prompts to token ids in the HTTP process, in worker threads: neither the event loop (every other client's
requests and streams) nor the engine loop waits while a large prompt is tokenized or a chat template rendered.

The engine gets token ids only. Every route that reads a prompt (completions, chat, embeddings, /tokenize) holds
it to the context before tokenizing: no token covers more characters than the vocabulary's longest entry (twice
that, for normalizers that fold characters), so a text of more characters than `max_model_len` such tokens could
hold is too long whatever its tokens, and is refused without touching the tokenizer. An embedding cut to its last
k tokens (truncate_prompt_tokens) reads only the end of its text that could hold them (twice that, so the cut is
far from the tokens kept). So one job (one prompt, one chat, one /detokenize) is bounded by the context.

The threads take jobs round robin, over clients (their address) and then over each client's requests, one job at a
time (`FairPool`): a request waits behind at most one job per thread of anyone else's, however much others sent.
After a large job, and after a large request body (limits.BodyLimit), the freed heap goes back to the system
(`release_heap`), so a burst of large inputs does not leave the process at its peak size.
"""
import asyncio
import ctypes
import ctypes.util
import itertools
import threading
from collections import OrderedDict, deque

from nanovllm_tp.entrypoints.prompts import check_prompt_length, render_chat

THREADS = 2
LARGE_INPUT = 256 << 10        # characters from which a job, or bytes from which a request body, is large


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
           tools: list[dict] | None = None, default_template: str | None = None) -> str:
    """A request's conversation as prompt text. A `chat_template` among the kwargs is the template (the handlers
    let one through only when the operator trusts them), else `default_template` (--chat-template), else the
    tokenizer's; `tools` go to the template as transformers hands them."""
    kwargs = dict(chat_template_kwargs or {})
    template = kwargs.pop("chat_template", None) or default_template
    return render_chat(tokenizer, messages, template, add_generation_prompt, kwargs, tools)


_libc = None


def release_heap() -> None:
    """Hand the heap's free memory back to the system (glibc's malloc_trim; nothing elsewhere). Python frees a
    large input's objects, but glibc keeps the pages for reuse: without this the process stays at its peak."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


def _settle(fut: asyncio.Future, result, exc) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


class FairPool:
    """Worker threads over queues of jobs: clients round robin, then that client's requests round robin, one job
    each turn. `submit` returns an asyncio future; a job whose future was cancelled before it started is
    skipped."""

    def __init__(self, threads: int = THREADS):
        self._cond = threading.Condition()
        self._queues: OrderedDict = OrderedDict()      # client -> OrderedDict(request -> deque of jobs)
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"tokenize-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, client, request, fn, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the tokenizer pool is closed")
            self._queues.setdefault(client, OrderedDict()).setdefault(request, deque()).append((loop, fut, fn, args))
            self._cond.notify()
        return fut

    def pending(self) -> int:
        with self._cond:
            return sum(len(jobs) for requests in self._queues.values() for jobs in requests.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._cond.notify_all()

    def _take(self):
        client, requests = next(iter(self._queues.items()))
        self._queues.move_to_end(client)
        request, jobs = next(iter(requests.items()))
        requests.move_to_end(request)
        job = jobs.popleft()
        if not jobs:
            del requests[request]
            if not requests:
                del self._queues[client]
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queues and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                loop, fut, fn, args = self._take()
            if fut.cancelled():
                continue
            result = exc = None
            try:
                result = fn(*args)
            except Exception as e:            # handed to the request (jinja raises its own types)
                exc = e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, exc)
            except RuntimeError:              # the loop closed meanwhile (shutdown)
                return
            del result, exc


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int, threads: int = THREADS, chat_template: str | None = None):
        self.tokenizer, self.max_model_len, self.chat_template = tokenizer, max_model_len, chat_template
        self._pool = FairPool(threads)
        self._requests = itertools.count()
        self._chars_per_token: int | None = None
        self.chars_per_token()                # read once, before any request

    async def completions(self, prompts: list, pooling=None, client=None, add_special_tokens: bool = True,
                          output_room: int | None = None) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt (a string or a list of token ids); ValueError for the first
        prompt that cannot fit (lowest index), and the prompts not yet tokenized are dropped. `pooling`
        (PoolingParams): embedding prompts, cut to its truncate_prompt_tokens, which may fill max_model_len.
        `output_room`: context slots a prompt must leave (default: 1 to generate, 0 for an embedding)."""
        room = int(pooling is None) if output_room is None else output_room
        for i, p in enumerate(prompts):       # refused at once, before any job is queued
            if isinstance(p, str):
                self._check_chars(i, p, pooling, room)
        request = next(self._requests)
        futures = [self._pool.submit(client, request, self._encode_one, i, p, pooling, add_special_tokens, room)
                   for i, p in enumerate(prompts)]
        return await self._gather(futures)

    async def chat(self, messages: list[dict], add_generation_prompt: bool, chat_template_kwargs: dict | None,
                   tools: list[dict] | None = None, client=None, output_room: int = 1,
                   add_special_tokens: bool = False) -> list[int]:
        """The conversation rendered through the chat template (render: --chat-template's, else the model's), as
        token ids. ValueError / TypeError for bad input; the template's own errors as they come (jinja raises its
        own types)."""
        def encode():
            text = render(self.tokenizer, messages, add_generation_prompt, chat_template_kwargs, tools,
                          self.chat_template)
            return self._encode(0, text, add_special_tokens, None, output_room)    # the template has them
        return await self.run(encode, client=client)

    async def detokenize(self, ids: list[int], client=None) -> str:
        """Token ids as text: no more than the context holds (ValueError), each in the vocabulary."""
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens; with max_model_len={self.max_model_len} no prompt or output is "
                             "longer")
        vocab = len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return await self.run(self.tokenizer.decode, ids, client=client)

    async def run(self, fn, *args, client=None):
        """fn(*args) as one job of a request of its own."""
        return await self._pool.submit(client, next(self._requests), fn, *args)

    def close(self) -> None:
        self._pool.close()

    @staticmethod
    async def _gather(futures: list[asyncio.Future]) -> list:
        try:
            done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for f in futures:
                f.cancel()
            raise
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for f in pending:
                f.cancel()
            raise failed[0].exception()
        return [f.result() for f in futures]

    def _bound(self) -> int:
        """The most characters max_model_len tokens can spell."""
        return 2 * self.chars_per_token() * self.max_model_len

    def _check_chars(self, i: int, text: str, pooling, output_room: int) -> None:
        if pooling is None or pooling.truncate_prompt_tokens is None:
            check_prompt_length(i, len(text) // (2 * self.chars_per_token()), self.max_model_len, at_least=True,
                                output_room=output_room)

    def _encode_one(self, i: int, prompt, pooling, add_special_tokens: bool, output_room: int):
        if isinstance(prompt, str):
            return prompt, self._encode(i, prompt, add_special_tokens, pooling, output_room)
        return None, self._fit(i, list(prompt), pooling, output_room)    # the engine checks ids against its vocabulary

    def _encode(self, i: int, text: str, add_special_tokens: bool = True, pooling=None, output_room: int = 1) \
            -> list[int]:
        self._check_chars(i, text, pooling, output_room)
        if pooling is not None and pooling.truncate_prompt_tokens is not None:
            keep = pooling.truncate_prompt_tokens
            keep = self.max_model_len if keep == -1 else keep
            span = 4 * self.chars_per_token() * keep        # twice what the kept tokens can spell
            if len(text) > span:
                text = text[-span:]
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if len(text) >= LARGE_INPUT:
            release_heap()
        return self._fit(i, ids, pooling, output_room)

    def _fit(self, i: int, ids: list[int], pooling=None, output_room: int = 1) -> list[int]:
        """The prompt's ids as the engine takes them: cut as an embedding's pooling says, checked against the
        context (a generated prompt leaves room for output)."""
        if pooling is not None:
            ids = pooling.truncated(ids, self.max_model_len)
        check_prompt_length(i, len(ids), self.max_model_len, output_room=output_room)
        return ids

    def chars_per_token(self) -> int:
        """The most characters one vocabulary entry spells (byte-level entries: one character per byte)."""
        if self._chars_per_token is None:
            self._chars_per_token = max(1, max(map(len, self.tokenizer.get_vocab()), default=1))
        return self._chars_per_token
