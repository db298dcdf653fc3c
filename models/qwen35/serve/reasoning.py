"""The reply's thinking apart from its answer: the text before `</think>` is `reasoning_content`,
the rest `content`, split alike whether the text comes at once or piece by piece.

Qwen3.5's chat template opens `<think>` in the prompt when thinking is on, so the reply starts
inside it; a reply may also open one itself at its very start. A `<tool_call>` ends the thinking
too and stays in the answer, where it becomes a call: as llama-server parses Qwen3.5's replies,
since the model may call from inside its thinking without closing it. Whitespace at either end of the
thinking, and at the start of the answer after it, is the format's, not the model's words: it
is dropped, as llama-server does.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
CALL = "<tool_call>"  # ends the thinking, kept as the answer's start


def held(text: str, mark: str) -> int:
    """How many characters at the end of `text` could be the start of `mark`."""
    return max((k for k in range(1, len(mark)) if text.endswith(mark[:k])), default=0)


class ReasoningSplit:
    """Raw reply text in, (reasoning, content) out; `flush()` at the end releases what was held."""

    def __init__(self, thinking: bool):
        self.thinking = thinking     # inside <think> now
        self.opening = not thinking  # the reply may still open a <think> of its own
        self.pending = ""            # text not released yet: maybe a tag's start, or trailing space
        self.started = False         # released non-space text in the current part
        self.reasoned = False        # the reply had a thinking part

    def add(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.opening:
            stripped = self.pending.lstrip()
            if OPEN.startswith(stripped) and stripped != OPEN:
                return "", ""  # the reply's first text may be a <think>
            self.opening = False
            if stripped.startswith(OPEN):
                self.thinking, self.pending = True, stripped[len(OPEN):]
            else:
                self.started = True  # an answer with no thinking: its text as it comes
        if self.thinking:
            self.reasoned = True
            ends = [(self.pending.find(mark), mark) for mark in (CLOSE, CALL) if mark in self.pending]
            if not ends:
                hold = max(held(self.pending, CLOSE), held(self.pending, CALL))
                return self._release(len(self.pending) - hold, thinking=True), ""
            end, mark = min(ends)
            reasoning = self._release(end, thinking=True, last=True)
            if mark == CLOSE:
                self.pending = self.pending[len(CLOSE):]
            self.thinking, self.started = False, False
        content = self._release(len(self.pending), thinking=False)
        return reasoning, content

    def _release(self, end: int, *, thinking: bool, last: bool = False) -> str:
        """pending[:end], without the part's leading whitespace and holding its trailing
        whitespace while thinking (it may end the thinking); `last`: the part ends at `end`."""
        text, self.pending = self.pending[:end], self.pending[end:]
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if thinking:
            keep = text if last else text.rstrip()
            if not last:
                self.pending = text[len(keep):] + self.pending
            return keep.rstrip() if last else keep
        return text

    def flush(self) -> tuple[str, str]:
        if self.opening:
            self.opening, self.started = False, True
        if self.thinking:
            return self._release(len(self.pending), thinking=True, last=True), ""
        return "", self._release(len(self.pending), thinking=False)
