"""The responses /v1/responses keeps (store=true, OpenAI's default) in the HTTP process's memory, so that a
follow-up names one with previous_response_id instead of sending the conversation again, and GET
/v1/responses/{id} returns it.

Bounded, least recently used first out: at most MAX_RESPONSES responses and MAX_CHARS characters of JSON, each
response counted with its whole conversation (a long conversation's turns share their messages in memory, so the
count is an upper bound). The server keeps the conversations of every client in one store: a response id is 128
random bits, so only who got one can continue or read it. Nothing survives a restart, as in vLLM's in-memory
store."""
from collections import OrderedDict
from dataclasses import dataclass

from nanovllm_tp.serving.responses import json_text

MAX_RESPONSES = 4096
MAX_CHARS = 64 << 20


@dataclass(slots=True)
class StoredResponse:
    body: dict             # the response object, as the client got it last
    messages: list[dict]   # the conversation it ends, as chat messages (without instructions: they are per request)
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, messages: list[dict]) -> bool:
        """Keeps a response (the oldest ones go to make room); False when it alone is larger than the store."""
        chars = len(json_text(body)) + len(json_text(messages))
        if chars > self.max_chars:
            return False
        self.delete(response_id)
        self._entries[response_id] = StoredResponse(body, messages, chars)
        self.chars += chars
        while len(self._entries) > self.max_responses or self.chars > self.max_chars:
            _, gone = self._entries.popitem(last=False)
            self.chars -= gone.chars
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.chars -= entry.chars
        return entry is not None
