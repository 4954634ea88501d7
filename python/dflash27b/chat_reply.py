"""A chat reply's text as OpenAI returns it: the leading thinking block as `reasoning_content`, the rest as
`content`, and with tools the calls as `tool_calls` (tool_calls.py parses them) -- whole, or incrementally as
the reply streams.  Shared by the Decoder, the daemon's socket protocol and the HTTP front."""
from __future__ import annotations

from .tool_calls import Tool, ToolCallSplit

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """A chat template that knows thinking blocks (Qwen3.5's): its replies' reasoning is split out."""
    return bool(template) and (THINK_OPEN in template or "enable_thinking" in template)


class ReasoningSplit:
    """Splits a chat reply into reasoning (inside a leading <think> ... </think> block) and content (the rest),
    as llama-server and vLLM return them; incremental (push text pieces as they decode, then flush).
    opened: the prompt already opened the block (a template that ends its generation prompt with <think>)."""

    def __init__(self, opened: bool = False):
        self.state = "reasoning" if opened else "start"
        self.buf = ""
        self.lead = True   # strip the newline the template writes after <think>

    @staticmethod
    def _partial(buf: str, tag: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of tag (held back: it may become tag)."""
        for n in range(min(len(tag) - 1, len(buf)), 0, -1):
            if tag.startswith(buf[-n:]):
                return n
        return 0

    def push(self, text: str) -> tuple[str, str]:
        """Returns the (reasoning, content) text that is final so far."""
        self.buf += text
        r = c = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if not s or (THINK_OPEN.startswith(s) and s != THINK_OPEN):
                    return r, c   # nothing yet, or maybe the start of the tag
                if s.startswith(THINK_OPEN):
                    self.buf, self.state = s[len(THINK_OPEN):], "reasoning"
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if self.lead:
                    if not self.buf:
                        return r, c
                    self.buf, self.lead = self.buf.lstrip("\n"), False
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    r += self.buf[:i].rstrip("\n")
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "after"
                    continue
                keep = self._partial(self.buf, THINK_CLOSE)
                cut = len(self.buf) - keep
                # a newline right before </think> is the template's: hold trailing newlines back too
                while cut > 0 and self.buf[cut - 1] == "\n":
                    cut -= 1
                r, self.buf = r + self.buf[:cut], self.buf[cut:]
                return r, c
            elif self.state == "after":
                s = self.buf.lstrip("\n")
                if not s:
                    return r, c
                self.buf, self.state = s, "content"
            else:
                c, self.buf = c + self.buf, ""
                return r, c

    def flush(self) -> tuple[str, str]:
        """The rest at the end of the reply (an unclosed block stays reasoning)."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest.rstrip("\n"), ""
        if self.state == "start":
            return "", rest
        return "", rest.lstrip("\n") if self.state == "after" else rest

    @classmethod
    def split(cls, text: str, opened: bool = False) -> tuple[str, str]:
        s = cls(opened)
        r1, c1 = s.push(text)
        r2, c2 = s.flush()
        return r1 + r2, c1 + c2


class ReplySplit:
    """Reasoning, content and tool calls of one chat reply, incrementally (push text pieces, then flush).
    thinks: the template writes thinking blocks (else everything is content); think_open: the prompt opened
    one; tools: the request's tools when its calls are parsed (tool_choice not "none")."""

    def __init__(self, thinks: bool, think_open: bool = False, tools: tuple[Tool, ...] | None = None):
        self.reasoning = ReasoningSplit(think_open) if thinks else None
        self.calls = ToolCallSplit(tools) if tools else None

    def _content(self, text: str, last: bool) -> tuple[str, list[dict]]:
        if self.calls is None:
            return text, []
        c1, k1 = self.calls.push(text)
        if not last:
            return c1, k1
        c2, k2 = self.calls.flush()
        return c1 + c2, k1 + k2

    def push(self, text: str) -> tuple[str, str, list[dict]]:
        """(reasoning, content, calls) final so far."""
        r, c = self.reasoning.push(text) if self.reasoning is not None else ("", text)
        c, calls = self._content(c, False)
        return r, c, calls

    def flush(self) -> tuple[str, str, list[dict]]:
        r, c = self.reasoning.flush() if self.reasoning is not None else ("", "")
        c, calls = self._content(c, True)
        return r, c, calls

    def message(self, text: str) -> dict:
        """The whole reply as an OpenAI assistant message: content (None when only calls), reasoning_content
        (when there is any), tool_calls (when parsed)."""
        r1, c1, k1 = self.push(text)
        r2, c2, k2 = self.flush()
        reasoning, content, calls = r1 + r2, c1 + c2, k1 + k2
        msg: dict = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if self.calls is not None and calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
            if not content.strip():
                msg["content"] = None
        return msg
