"""Keep a measured choice only if it makes the model's whole decode step faster.

A kernel timed alone, with a timestamp after each dispatch, is a poor proxy for the same kernel
inside a chain of ~450 dependent dispatches: on the H100 the variants that won alone were 1.04×
faster per token when timed alone and 0.99× in decode. So when a model file is at hand on a
device that runs code, the kernel-by-kernel ranking only nominates. Each nominee is recorded into
the model's real decode step (`DecodeGraph.retune`) and whole steps are timed against the current
choice, interleaved (A B, B A, ...) so that drifting clocks hit both alike; a nominee stays only
if the step gets faster by more than the spread of those pairs. A last interleaved run of the
tuned step against the untuned one gives the gain the command reports; if it is not a gain,
nothing is kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from zdsl.autotune import tuner
from zdsl.autotune.database import Database, Entry
from zdsl.kernels import sampling

from ..model.sampler import SamplerConfig

MIN_GAIN = 0.002  # a nominee must save at least this fraction of a step (and more than the noise)


def step_ms(graph, position: int, warm: int, tokens: int) -> float:
    """Wall ms per token of `tokens` steps of `graph` (a DecodeGraph) replayed back to back (one
    submission), from `position`, after `warm` steps there."""
    graph.seek(position)
    graph.decode_burst(warm)
    start = time.perf_counter()
    graph.decode_burst(tokens)
    return (time.perf_counter() - start) * 1e3 / tokens


@dataclass
class Comparison:
    a_ms: float      # median ms per token with the current choice
    b_ms: float      # ... with the nominee
    gain: float      # median over rounds of a/b: above 1, the nominee is faster
    noise: float     # scaled median absolute deviation of those ratios
    rounds: int

    @property
    def significant(self) -> bool:
        return self.gain - 1 > max(MIN_GAIN, 2 * self.noise)


@dataclass
class Trial:
    result: tuner.Result
    nominee: tuner.Candidate
    comparison: Comparison
    kept: bool


@dataclass
class Report:
    trials: list[Trial]
    untried: list[tuner.Result]          # uses with nominees the budget left untried
    final: Comparison | None             # untuned (a) against tuned (b), when anything was kept
    entries: list[Entry]                 # what to write: empty unless the final run confirms a gain


class InPlace:
    """Times whole decode steps of `graph` (a DecodeGraph) with candidate tuning databases."""

    def __init__(self, graph, *, position: int = 512, tokens: int = 32, warm: int = 4, rounds: int = 5,
                 final_rounds: int = 9, nominees: int = 2):
        self.graph, self.tokens, self.warm = graph, tokens, warm
        self.rounds, self.final_rounds, self.nominees = rounds, final_rounds, nominees
        self.position = max(0, min(position, graph.n_ctx - warm - tokens))

    def step_ms(self, db: Database, sampler: SamplerConfig) -> float:
        self.graph.retune(db, sampler)
        return step_ms(self.graph, self.position, self.warm, self.tokens)

    def compare(self, a: Database, b: Database, sampler: SamplerConfig, rounds: int) -> Comparison:
        times = {"a": [], "b": []}
        for r in range(rounds):
            for side in ("ab" if r % 2 == 0 else "ba"):
                times[side].append(self.step_ms(a if side == "a" else b, sampler))
        ratios = [x / y for x, y in zip(times["a"], times["b"])]
        gain = statistics.median(ratios)
        noise = 1.4826 * statistics.median(abs(x - gain) for x in ratios)
        return Comparison(statistics.median(times["a"]), statistics.median(times["b"]), gain, noise, rounds)

    def run(self, results: list[tuner.Result], info, deadline: float, progress=None) -> Report:
        """Try the nominees of each measured result, most promising use first; return what was
        kept and the final untuned-against-tuned comparison."""
        greedy = SamplerConfig(temperature=0)
        order = sorted((r for r in results if _nominees(r, self.nominees)),
                       key=lambda r: -r.use.count * (r.default.us - r.best.us))
        kept: list[Entry] = []
        trials, untried = [], []
        for r in order:
            if time.monotonic() > deadline:
                untried.append(r)
                continue
            sampler = _sampler_for(r, greedy)
            for nominee in _nominees(r, self.nominees):
                if progress:
                    progress(f"in place: {r.use.kernel.name} {r.use.label} {nominee.label}")
                mine = tuner.entries(r, info, nominee)
                cmp = self.compare(Database.of(kept), Database.of(kept + mine), sampler, self.rounds)
                trials.append(Trial(r, nominee, cmp, cmp.significant))
                if cmp.significant:
                    kept += tuner.entries(r, info, nominee, step_ms=round(cmp.b_ms, 4),
                                          step_gain=round(cmp.gain, 4))
                    break
        final = None
        if kept:
            if progress:
                progress("in place: tuned against untuned")
            final = self.compare(Database.of([]), Database.of(kept), greedy, self.final_rounds)
        self.graph.retune(None, greedy)
        confirmed = kept if final is not None and final.gain > 1 else []
        return Report(trials, untried, final, confirmed)


def _nominees(r: tuner.Result, n: int) -> list[tuner.Candidate]:
    """Up to n accepted candidates other than the default that were faster than it alone."""
    if r.method != "measured" or r.default.us is None:
        return []
    return [c for c in r.ranked if c is not r.default and c.us < r.default.us][:n]


def _sampler_for(r: tuner.Result, greedy: SamplerConfig) -> SamplerConfig:
    """The sampler whose kernels the use's step runs: a sampled one for a candidate pass of
    CAP > 1, greedy otherwise."""
    if r.use.kernel is sampling.sample_candidates and r.use.key.get("CAP", 1) > 1:
        return SamplerConfig(cap=r.use.key["CAP"])
    return greedy
