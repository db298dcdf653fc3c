"""Sampling settings for decode: checked on the host, applied on the GPU by the kernels of
`zdsl.kernels.sampling`, which read them from a small buffer: changing them (a request's seed or
temperature) needs neither a recompile nor a new recording, unless the candidates kept
(`kernel_cap`) or the penalties' window change.

Per token the decode graph records `penalty_window` (when a penalty is on), `sample_candidates`
and `sample_draw` (see that module for the buffers); the penalties apply, as llama.cpp's do, over
the last `last_n` tokens of the context, prompt included; the order of the filters is top-k,
min-p, temperature, top-p, then the draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from zdsl.errors import ZdslError
from zdsl.kernels.sampling import CAPS, SENTINEL, sample_ref, settings_of, settings_words


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 means greedy (argmax, ties to the lowest id). top_k 0 means up to `cap`
    candidates; `cap` is the candidate count the kernels are built for. min_p is relative to the
    most likely token and applies before temperature. The penalties look at the last `last_n`
    tokens of the context, prompt included (-1: the whole context, 0: none): repeat_penalty
    divides positive logits (and multiplies negative ones) of the tokens there; presence_penalty,
    and frequency_penalty times how often each occurs, are then subtracted. The seed is fixed by
    default so runs are reproducible."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    last_n: int = 64
    seed: int = 0
    cap: int = 64

    def __post_init__(self):
        def number(name, ok, what):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
                raise ZdslError(f"sampler {name} must be {what}, got {value!r}")

        def integer(name, lo, hi, what):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
                raise ZdslError(f"sampler {name} must be {what}, got {value!r}")

        if self.cap not in CAPS[1:]:
            raise ZdslError(f"sampler cap must be one of {', '.join(map(str, CAPS[1:]))}, got {self.cap!r}")
        number("temperature", lambda v: v >= 0, "a number ≥ 0 (0 samples greedily)")
        integer("top_k", 0, self.cap, f"an integer from 0 (no limit) to the candidate cap {self.cap}")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 disables it)")
        number("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 disables it)")
        number("repeat_penalty", lambda v: v > 0, "a number > 0 (1 disables it)")
        number("presence_penalty", lambda v: True, "a finite number (0 disables it)")
        number("frequency_penalty", lambda v: True, "a finite number (0 disables it)")
        integer("last_n", -1, 2 ** 31 - 1, "-1 (the whole context), 0 (no penalties) or a number of tokens")
        integer("seed", 0, 2 ** 32 - 1, "an integer in [0, 2**32)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> bool:
        """Whether any penalty changes a logit (else the window is not kept at all)."""
        return self.last_n != 0 and (self.repeat_penalty != 1 or self.presence_penalty != 0
                                     or self.frequency_penalty != 0)

    def window(self, n_ctx: int) -> int:
        """How many of the last context tokens the penalties see, in a context of n_ctx."""
        return n_ctx if self.last_n < 0 else min(self.last_n, n_ctx)

    def kept_window(self, n_ctx: int) -> int:
        """The tokens whose counts a sequence keeps: the window with a penalty on, else none. Part
        of the sequence state: a context fed under another kept window cannot be continued."""
        return self.window(n_ctx) if self.penalties else 0

    @property
    def kernel_cap(self) -> int:
        """The CAP variant of the sampling kernels to record: greedy needs one candidate."""
        return 1 if self.greedy else self.cap

    def settings(self) -> np.ndarray:
        """The kernels' settings buffer (kernels/sampling.py). Greedy runs as top_k = 1."""
        return settings_words(repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, top_k=1 if self.greedy else self.top_k,
                              min_p=self.min_p, inv_temp=1.0 if self.greedy else np.float32(1 / self.temperature),
                              top_p=self.top_p, seed=self.seed)

    def as_sampling(self, cap: int) -> "SamplerConfig":
        """This greedy sampler as the sampling kernels of `cap` candidates run it: the best
        candidate alone (top_k = 1), the argmax the one-candidate kernels give, ties included."""
        return replace(self, temperature=1.0, top_k=1, cap=cap) if self.greedy else self

    def recorded_alike(self, other: "SamplerConfig", n_ctx: int) -> bool:
        """Whether a step recorded for `other` samples for this one once given its settings: the
        same kernels (candidates kept) and the same penalties' window."""
        return self.kernel_cap == other.kernel_cap and self.kept_window(n_ctx) == other.kept_window(n_ctx)


def check_vocab(n_vocab: int) -> None:
    if not 1 <= n_vocab < SENTINEL:
        raise ZdslError(f"vocabulary size must be in [1, {SENTINEL}), got {n_vocab}")


def sample_reference(logits, counts, config: SamplerConfig, step: int, allowed=None, bias=None) -> int:
    """numpy: the token the GPU sampler picks from `logits` given per-token `counts` of the tokens
    in the penalties' window, at random-number counter `step` (the value of step[3]), among the
    `allowed` tokens (a boolean each; None: all), with `bias` added (a value each; None: none)."""
    logits = np.asarray(logits, np.float32)
    return sample_ref(logits, counts, cap=config.kernel_cap, counter=step, allowed=allowed, bias=bias,
                      **settings_of(config.settings()))
