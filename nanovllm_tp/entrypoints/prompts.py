"""Prompt-shape rules shared by the Python API (llm.py) and the server (serving/): which inputs are one prompt of
token ids, and how a conversation becomes prompt text. Torch-free: the HTTP process imports it."""
import inspect


def is_token_ids(p) -> bool:
    """A non-empty list of ints is one prompt of token ids (not a list of prompts)."""
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) for t in p)


def prompt_list(value, name: str) -> list:
    """A body's prompt field (a string, token ids, or a list of either) as one entry per prompt; ValueError naming
    the field when it is empty."""
    if isinstance(value, str) or is_token_ids(value):
        return [value]
    if not value:
        raise ValueError(f"{name} is empty")
    return list(value)


def check_prompt_length(i: int, num_tokens: int, max_model_len: int, at_least: bool = False,
                        output_room: int = 1) -> None:
    """ValueError when prompt i (`num_tokens` long, or at least that long) leaves no room for output (an embedding's
    prompt, output_room=0, may fill max_model_len)."""
    limit = max_model_len - output_room
    if num_tokens > limit:
        raise ValueError(f"prompt {i} has {'at least ' if at_least else ''}{num_tokens} tokens; with max_model_len="
                         f"{max_model_len} at most {limit} fit" + (" (one slot is for output)" if output_room else ""))


def render_chat(tokenizer, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
    """A conversation ({"role", "content"} dicts) as prompt text, through the tokenizer's chat template (or
    `chat_template`), with the tools (OpenAI's {"type": "function", "function": {...}} objects) as transformers
    hands them to the template. ValueError when there is no template."""
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template (give one, or send a plain completion)")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError("chat_template_kwargs must be a dict")
    taken = sorted(set(chat_template_kwargs or ()) & template_arguments(tokenizer))
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(map(repr, taken))}: apply_chat_template's own "
                         "arguments are the engine's to set (add_generation_prompt has a parameter of its own)")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise TypeError("tools must be a list of dicts ({'type': 'function', 'function': {...}})")
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))


def template_arguments(tokenizer) -> set[str]:
    """The named parameters of the tokenizer's apply_chat_template (tokenize, add_generation_prompt, return_dict
    ...): what render_chat sets itself or must stay at their defaults, never a template variable."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
