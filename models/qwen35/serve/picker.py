"""Tokens chosen on the host, for requests the GPU sampler cannot serve alone: log-probabilities,
a logit bias, a grammar (structured output, forced tool calls), a thinking budget.

The step's logits are read back, shaped, and drawn from with the GPU sampler's own numpy
reference (sampler.sample_reference), so an unshaped greedy request gives the GPU's tokens. A
grammar applies only after the thinking: while it waits, the end of turn is masked out (the reply
it constrains must come), and the thinking is closed after half the reply's tokens at most (the
engine's budget); a thinking budget closes it after that many tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from zdsl.models.qwen35.model.sampler import SamplerConfig, sample_reference
from zdsl.models.qwen35.serve.grammar import Constraint


@dataclass
class Choice:
    """A chosen token and its log-probability under the model, with the most likely others."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class Picker:
    """`pick(logits)` for Generator.generate: one token a call, remembered in `choices`."""

    def __init__(self, sampler: SamplerConfig, history: list[int], n_ctx: int, *, top_logprobs: int | None = None,
                 bias: dict[int, float] | None = None, grammar: Constraint | None = None, thinking: bool = False,
                 think_end: int | None = None, budget: int | None = None, stop_ids=frozenset()):
        self.sampler, self.history, self.n_ctx = sampler, list(history), n_ctx
        self.top_logprobs, self.bias = top_logprobs, bias or {}
        self.grammar, self.thinking, self.think_end, self.budget = grammar, thinking, think_end, budget
        self.stop_ids = sorted(stop_ids)
        self.thought = 0
        self.choices: list[Choice] = []

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, np.float32)
        shaped = logits.copy()
        for token, value in self.bias.items():
            shaped[token] += value
        if self.thinking and self.budget is not None and self.thought >= self.budget:
            token = self.think_end
        else:
            if self.thinking and self.grammar is not None:
                shaped[self.stop_ids] = -np.inf
            elif self.grammar is not None:
                shaped[~self.grammar.allowed()] = -np.inf
            token = self._draw(shaped)
        if self.thinking:
            self.thought += 1
            self.thinking = token != self.think_end
        elif self.grammar is not None:
            self.grammar.take(token)
        self.history.append(token)
        self.choices.append(self._choice(logits, token))
        return token

    def _draw(self, logits: np.ndarray) -> int:
        s = self.sampler
        counts = np.zeros(len(logits), np.uint32)
        if s.penalties:
            np.add.at(counts, np.asarray(self.history[-s.window(self.n_ctx):], np.int64), 1)
        return sample_reference(logits, counts, s, len(self.history))

    def _choice(self, logits: np.ndarray, token: int) -> Choice:
        if self.top_logprobs is None:
            return Choice(token, 0.0)
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        top = np.argsort(-logprobs, kind="stable")[:self.top_logprobs] if self.top_logprobs else []
        return Choice(token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in top])
