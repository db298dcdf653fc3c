"""A chat reply as OpenAI's clients take it: the model's raw text split into its thinking
(`reasoning_content`), its answer (`content`) and its calls (`tool_calls`), whole or as the
deltas of a stream, and its tokens' log-probabilities."""

from __future__ import annotations

from zdsl.models.qwen35.serve.api import Job
from zdsl.models.qwen35.serve.reasoning import ReasoningSplit
from zdsl.models.qwen35.serve.tools import CallParser


class Reply:
    """Feed it the raw text piece by piece (`add`, then `flush`); each call gives the delta of
    the stream, and `message()` the whole reply."""

    def __init__(self, job: Job):
        self.split = ReasoningSplit(job.thinking) if job.split_reasoning else None
        self.calls = CallParser(job.tools) if job.tools.schemas and job.tools.choice != "none" else None
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def add(self, text: str) -> dict:
        return self._delta(*(self.split.add(text) if self.split else ("", text)), end=False)

    def flush(self) -> dict:
        return self._delta(*(self.split.flush() if self.split else ("", "")), end=True)

    def _delta(self, reasoning: str, content: str, end: bool) -> dict:
        calls = []
        if self.calls is not None:
            content, calls = self.calls.add(content)
            if end:
                text, more = self.calls.flush()
                content, calls = content + text, calls + more
        self.reasoning.append(reasoning)
        self.content.append(content)
        return ({"reasoning_content": reasoning} if reasoning else {}) | ({"content": content} if content else {}) \
            | ({"tool_calls": calls} if calls else {})

    @property
    def called(self) -> bool:
        return self.calls is not None and bool(self.calls.calls)

    def finish(self, reason: str) -> str:
        """The finish reason: "tool_calls" where the reply called, else the generation's."""
        return "tool_calls" if self.called else reason

    def message(self) -> dict:
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        message = {"role": "assistant", "content": None if self.called and not content else content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.called:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.calls.calls]
        return message


def chat_logprobs(choices, tokenizer) -> list[dict]:
    """OpenAI's chat `logprobs.content` entries of the tokens chosen."""
    def entry(token: int, logprob: float) -> dict:
        data = tokenizer.piece(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}
    return [entry(c.token, c.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in c.top]} for c in choices]


def completion_logprobs(choices, tokenizer, offset: int) -> dict:
    """The legacy completions' `logprobs` of the tokens chosen, their text starting at `offset`."""
    texts = [tokenizer.piece(c.token).decode("utf-8", errors="replace") for c in choices]
    starts = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [c.logprob for c in choices],
            "top_logprobs": [{tokenizer.piece(t).decode("utf-8", errors="replace"): lp for t, lp in c.top}
                             for c in choices], "text_offset": starts}
