"""--chat-template (vLLM's): the chat template the server renders conversations with instead of the tokenizer's,
given as a file or as the template itself. As vLLM reads it: a path that opens is a file; a value that does not
open and holds none of `{`, `}` or a newline reads as a path and is refused; any other value is the template, with
backslash escapes (`\\n`) read as Python reads them, so that a one-line shell argument can hold newlines. The
template is compiled once where the flags are read, so that a missing file or a Jinja syntax error is one line
before the engine starts."""
import os

TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template text of a --chat-template value (None: the tokenizer's own); ValueError in one line naming the
    flag when the file cannot be read or the template does not compile."""
    if value is None:
        return None
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            text, where = f.read(), repr(value)
    except (OSError, UnicodeDecodeError) as exc:
        if not any(c in value for c in TEMPLATE_CHARS):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--chat-template {value!r} reads as a file path, and it cannot be read ({reason}); a "
                             "template given in place holds {{ ... }} or {% ... %}") from None
        text, where = _unescape(value), "(the template given in place)"
    if not text.strip():
        raise ValueError(f"--chat-template {where} is empty")
    _compile(text, where)
    return text


def _unescape(value: str) -> str:
    """Backslash escapes read as Python reads them; characters outside Latin-1 kept as they are."""
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return value


def _compile(text: str, where: str) -> None:
    """The template compiled in the environment transformers renders it in (its filters and extensions), else in a
    plain sandbox (syntax only)."""
    import jinja2
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        compile_template = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {where}: Jinja syntax error on line {exc.lineno}: "
                         f"{' '.join(str(exc.message).split())}") from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"--chat-template {where}: {' '.join(str(exc).split())}") from None
