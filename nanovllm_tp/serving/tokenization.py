"""vLLM's /tokenize and /detokenize bodies: a text prompt, or a chat rendered through the model's template, to
token ids (with their count, the context length and, if asked, each token's text); token ids back to text. The
work runs in the HTTP process's tokenizer threads under the prompts' limits (serving/inputs.py): a prompt longer
than the context, or more token ids than it holds, is refused."""
from typing import Annotated

from pydantic import Discriminator, Field, Tag

from nanovllm_tp.serving.body import Body, Int
from nanovllm_tp.serving.chat_request import ChatMessage


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False          # the template writes them
    chat_template_kwargs: dict[str, object] | None = None
    return_token_strs: bool = False


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("a chat")] | Annotated[TokenizeCompletionRequest, Tag("a prompt")],
    Discriminator(lambda d: "a chat" if isinstance(d, dict) and "messages" in d else "a prompt")]


def tokenize_response(ids: list[int], tokenizer, max_model_len: int, with_strs: bool) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if with_strs else None}


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Int]
