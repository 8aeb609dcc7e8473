"""Prompt-shape rules shared by the Python API (llm.py) and the server (serving/): which inputs are one prompt of
token ids, and how a conversation becomes prompt text. Torch-free: the HTTP process imports it."""


def is_token_ids(p) -> bool:
    """A non-empty list of ints is one prompt of token ids (not a list of prompts)."""
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """A conversation ({"role", "content"} dicts) as prompt text, through the tokenizer's chat template (or
    `chat_template`), with the tools (OpenAI's {"type": "function", "function": {...}} objects) as transformers
    hands them to the template. ValueError when there is no template."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template (give one, or send a plain completion)")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError("chat_template_kwargs must be a dict")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise TypeError("tools must be a list of dicts ({'type': 'function', 'function': {...}})")
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
