"""vLLM's /tokenize and /detokenize bodies: a text prompt, or a chat rendered through the model's template, to
token ids (with their count, the context length and, if asked, each token's text); token ids back to text. The
work runs in the HTTP process's tokenizer threads (serving/inputs.py), as prompts do."""
from typing import Annotated

from pydantic import Discriminator, Field, Tag

from nanovllm_tp.serving.body import Body, Int
from nanovllm_tp.serving.chat_request import ChatMessage
from nanovllm_tp.serving.inputs import render


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def token_ids(self, tokenizer) -> list[int]:
        return tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens)


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False          # the template writes them
    chat_template_kwargs: dict[str, object] | None = None
    return_token_strs: bool = False

    def token_ids(self, tokenizer) -> list[int]:
        text = render(tokenizer, [m.as_template_message() for m in self.messages], self.add_generation_prompt,
                      self.chat_template_kwargs)
        return tokenizer.encode(text, add_special_tokens=self.add_special_tokens)


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat")] | Annotated[TokenizeCompletionRequest, Tag("prompt")],
    Discriminator(lambda d: "chat" if isinstance(d, dict) and "messages" in d else "prompt")]


def tokenize_response(ids: list[int], tokenizer, max_model_len: int, with_strs: bool) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if with_strs else None}


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Int]

    def text(self, tokenizer) -> str:
        vocab = len(tokenizer)
        bad = next((t for t in self.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return tokenizer.decode(self.tokens)
