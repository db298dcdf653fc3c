"""Which tokens a reply may take next (a grammar, a thinking budget), and tokens chosen on the host
for requests that want their log-probabilities.

`Steer` gives, before each step, the bitmask of the tokens allowed next (or None: any): the GPU
sampler draws among them (DecodeGraph.allow), so a constrained reply runs the GPU's own step and
sampler and reads back only its token. A grammar applies only after the thinking: while it
waits, the end of turn is masked out (the reply it constrains must come), and the thinking is
closed after half the reply's tokens at most (the engine's budget); a thinking budget closes it
after that many tokens (</think> the one token allowed). Under tool_choice auto with strict
tools, a call the model opens (its text reaches `<tool_call>`, in the thinking or after it) is
held to the call's grammar until it ends, as llama-server's lazy grammars are.

`Picker` reads the step's logits back and draws from them with the GPU sampler's own numpy
reference (the bias added, among the tokens its Steer allows), so a request gives the GPU's
tokens; it keeps each token's log-probability (of the model's logits, unbiased).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from zdsl.kernels.sampling import mask_of
from zdsl.models.qwen35.model.sampler import SamplerConfig, sample_reference
from zdsl.models.qwen35.serve.grammar import Constraint
from zdsl.models.qwen35.serve.tools import START

CALL = START.encode()


class Steer:
    """The tokens allowed at each step of one reply: `words()` before the step, `take(token)` after."""

    def __init__(self, vocab: int, *, grammar: Constraint | None = None, thinking: bool = False,
                 think_end: int | None = None, budget: int | None = None, stop_ids=frozenset(),
                 calls: Callable[[], Constraint] | None = None, piece: Callable[[int], bytes] | None = None):
        """`calls` makes the grammar of one call after its <tool_call> (Tools.grammar(lazy=True));
        `piece` gives a token's bytes, to see the model open one."""
        self.vocab, self.grammar, self.budget = vocab, grammar, budget
        self.thinking = thinking and think_end is not None
        self.think_end, self.thought = think_end, 0
        self.stop_ids = sorted(stop_ids)
        self.calls, self.piece = calls, piece
        self.call: Constraint | None = None  # the grammar of the call under way
        self.tail = b""                      # the text's end, where a <tool_call> may be starting

    def words(self) -> np.ndarray | None:
        """The bitmask (sampling.mask_of) of the tokens allowed next; None: any."""
        if self.call is not None:
            return self.call.words()
        if self.thinking and self.budget is not None and self.thought >= self.budget:
            return self._think_end_only
        if self.thinking:
            return None if self.grammar is None else self._no_end_of_turn
        return None if self.grammar is None else self.grammar.words()

    @cached_property
    def _think_end_only(self) -> np.ndarray:
        return mask_of(np.arange(self.vocab) == self.think_end)

    @cached_property
    def _no_end_of_turn(self) -> np.ndarray:
        return mask_of(~np.isin(np.arange(self.vocab), self.stop_ids))

    def take(self, token: int) -> None:
        if self.call is not None:
            self.call.take(token)
            if self.call.complete:
                self.call = None
            return
        if self.thinking:
            self.thought += 1
            self.thinking = token != self.think_end
        elif self.grammar is not None:
            self.grammar.take(token)
            return
        if self.calls is not None:
            self.tail = (self.tail + self.piece(token))[-len(CALL):]
            if self.tail == CALL:  # the model opened a call: it ends the thinking too (reasoning.py)
                self.call, self.thinking, self.tail = self.calls(), False, b""


@dataclass
class Choice:
    """A chosen token and its log-probability under the model, with the most likely others."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Picker:
    """`pick(logits)` for Generator.generate: one token a call, remembered in `choices`."""

    def __init__(self, sampler: SamplerConfig, history: list[int], n_ctx: int, steer: Steer, *,
                 top_logprobs: int | None = None, bias: dict[int, float] | None = None):
        self.sampler, self.history, self.n_ctx, self.steer = sampler, list(history), n_ctx, steer
        self.top_logprobs, self.bias = top_logprobs, bias or {}
        self.choices: list[Choice] = []

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, np.float32)
        words = self.steer.words()
        allowed = None if words is None else np.unpackbits(words.view(np.uint8), bitorder="little")[:len(logits)]
        token = self._draw(logits, None if allowed is None else allowed.astype(bool))
        self.steer.take(token)
        self.history.append(token)
        self.choices.append(self._choice(logits, token))
        return token

    def _draw(self, logits: np.ndarray, allowed) -> int:
        s = self.sampler
        counts = np.zeros(len(logits), np.uint32)
        if s.penalties:
            np.add.at(counts, np.asarray(self.history[-s.window(self.n_ctx):], np.int64), 1)
        bias = None
        if self.bias:
            bias = np.zeros(len(logits), np.float32)
            bias[list(self.bias)] = list(self.bias.values())
        # the GPU draws the token at position p with counter p - 1 (graph.py: one draw a position)
        return sample_reference(logits, counts, s, len(self.history) - 1, allowed, bias)

    def _choice(self, logits: np.ndarray, token: int) -> Choice:
        if self.top_logprobs is None:
            return Choice(token, 0.0)
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top = np.argsort(-logprobs, kind="stable")[:self.top_logprobs] if self.top_logprobs else []
        return Choice(token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in top])
