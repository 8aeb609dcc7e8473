"""A chat answer's reasoning apart from its content (vLLM's `--reasoning-parser`): the text a model writes inside
its think tags becomes `reasoning_content` (streamed as `delta.reasoning_content`), what follows the closing tag
the `content`. Text, not token ids: it works whatever the tokenizer makes of the tags.

Parsers, by vLLM's names: `qwen3` (the answer may open with `<think>`, after optional whitespace; without it, all is
content; a think block never closed, as when max_tokens cuts it, is all reasoning) and `deepseek_r1` (the template
opens the block in the prompt: everything before `</think>` is reasoning, all of it if none comes).
Streaming holds back only what may still be part of a tag, so the pieces a client gets concatenate to exactly what
a non-streamed answer holds.
"""
from dataclasses import dataclass

PARSERS = {"qwen3": ("<think>", "</think>", False), "deepseek_r1": ("<think>", "</think>", True)}


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (without being all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class ThinkSplitter:
    start: str
    end: str
    mode: str = "start"          # "start" (not yet known whether a think block opens), "reasoning", "content"
    held: str = ""
    opened: bool = False         # a think block was seen (a non-streamed answer's reasoning_content is then a str)

    @classmethod
    def of(cls, parser: str) -> "ThinkSplitter":
        start, end, in_block = PARSERS[parser]
        return cls(start, end, "reasoning" if in_block else "start", opened=in_block)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that the next piece of the answer makes certain; `final` flushes what was held."""
        buf, self.held = self.held + text, ""
        reasoning = content = ""
        while buf:
            if self.mode == "start":
                head = buf.lstrip()
                if head.startswith(self.start):
                    buf, self.mode, self.opened = head[len(self.start):], "reasoning", True
                elif not final and self.start.startswith(head):      # whitespace, or the tag's first characters
                    self.held = buf
                    break
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                i = buf.find(self.end)
                if i >= 0:
                    reasoning += buf[:i]
                    buf, self.mode = buf[i + len(self.end):], "content"
                    continue
                keep = 0 if final else _partial_tail(buf, self.end)
                reasoning += buf[:len(buf) - keep]
                self.held = buf[len(buf) - keep:]
                break
            else:
                content += buf
                break
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning_content, content): None where the answer has none."""
    splitter = ThinkSplitter.of(parser)
    reasoning, content = splitter.feed(text, final=True)
    return (reasoning if splitter.opened else None), (content or None)
