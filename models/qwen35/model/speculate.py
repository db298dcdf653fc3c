"""Speculative decoding: drafted tokens (drafts.py) checked in one step of several tokens
(DecodeGraph.decode_tokens), the sequence cut back to what was kept (DecodeGraph.cut).

A step feeds the token not yet fed and k drafts d1 … dk, and the sampler draws after every row,
with the random counter of that row's position: what plain decoding would draw there. Draft
d(j+1) is kept while it equals the draw after row j; the first draw that differs is the model's
own next token, and everything after it is cut away. So the output is plain decoding's token for
token, greedy or sampled with the same seed. For sampling this is the standard speculative
sampling rule for a draft that is one token for sure (drafts are a function of the history,
drafts.py): accept d with probability p(d), else draw from p without d, renormalised, which is
what "the draw from p, if it differs from d" is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from zdsl.errors import ZdslError

SPEC_MODES = ("auto", "mtp", "ngram", "none")
DRAFT_MAX = 3  # at 70% acceptance 3 drafts give 2.5 tokens a step and a 4th adds 0.24, for a larger step


@dataclass
class SpecStats:
    """What speculation did in one generation."""
    steps: int = 0      # steps of several tokens (a draft and the token before it)
    drafted: int = 0
    accepted: int = 0
    plain: int = 0      # one-token steps, where there was no draft

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens generated per step of the sequence, plain steps included."""
        n = self.steps + self.plain
        return (self.accepted + n) / n if n else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "plain_steps": self.plain, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.acceptance, 4), "tokens_per_step": round(self.tokens_per_step, 3)}

    def summary(self) -> str:
        return f"drafts accepted {self.accepted}/{self.drafted} ({100 * self.acceptance:.0f}%), " \
               f"{self.tokens_per_step:.2f} tokens a step"


@dataclass
class Speculation:
    """How a Generator drafts: `drafts(prompt_ids, head)` makes the drafter of one generation
    (`head`: the generator's MTP head, mtp.py, where `mtp` asks for one; else None); at most
    `draft_max` drafts a step (the graph's step_tokens is one more). `auto` is resolved by the
    Generator, which knows whether its file has a head (`resolved`)."""
    drafts: Callable[[list[int], object], object]
    draft_max: int = DRAFT_MAX
    name: str = "ngram"
    mtp: bool = False

    def resolved(self, has_mtp: bool) -> Speculation | None:
        """`auto` as the file decides: its MTP head where it has one, else plain decoding."""
        if self.name != "auto":
            return self
        return Speculation(mtp_drafts, self.draft_max, "mtp", mtp=True) if has_mtp else None


def mtp_drafts(prompt: list[int], head) -> object:
    from zdsl.models.qwen35.model.mtp import MtpDrafts

    return MtpDrafts(head)


def ngram_drafts(prompt: list[int], head) -> object:
    from zdsl.models.qwen35.model.drafts import NgramDrafts

    return NgramDrafts()


def speculation(mode: str, draft_max: int | None, sampler) -> Speculation | None:
    """The Speculation of `--spec mode --draft-max n`, or None for plain decoding. `auto` drafts
    with the file's MTP head where it has one (the Generator resolves it) and decodes plainly
    otherwise: n-gram drafts pay on repetitive text only, and a wrong draft costs a step of
    several tokens, so a user turns them on for the text that repeats."""
    if mode not in SPEC_MODES:
        raise ZdslError(f"--spec {mode!r}: choose one of {', '.join(SPEC_MODES)}")
    if draft_max is not None and not 1 <= draft_max <= 15:
        raise ZdslError(f"--draft-max must be from 1 to 15, got {draft_max}")
    if mode == "none" or (mode == "auto" and sampler.penalties):
        return None
    if sampler.penalties:
        raise ZdslError("speculative decoding samples without repetition penalties (their window would count "
                        "drafts that are cut away); use --repeat-penalty 1 and no presence/frequency penalty, "
                        "or --spec none")
    k = draft_max or DRAFT_MAX
    if mode == "mtp":
        return Speculation(mtp_drafts, k, "mtp", mtp=True)
    return Speculation(ngram_drafts, k, mode)


class Verifier:
    """Steps of one sequence (a DecodeGraph of step_tokens > the draft max) that check drafts."""

    def __init__(self, graph, drafter, draft_max: int, stats: SpecStats):
        self.graph, self.drafter, self.draft_max, self.stats = graph, drafter, draft_max, stats

    def step(self, history: list[int], room: int, stop_ids=frozenset()) -> list[int]:
        """Feed the last token of `history` (not yet fed) and the drafts after it; return the tokens
        the model says next (1 to room of them), ending at the first of `stop_ids`. The sequence is
        left after the last token fed: the last returned one is the next to feed."""
        g = self.graph
        k = min(self.draft_max, room - 1)
        drafts = self.drafter.draft(history, k)  # k = 0 too: a drafter may catch up on what was fed (mtp.py)
        if not drafts:
            self.stats.plain += 1
            return [g.decode(history[-1])]
        said = g.decode_tokens([history[-1], *drafts])
        kept = next((j for j, d in enumerate(drafts) if said[j] != d), len(drafts))
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += kept
        kept = next((j for j, t in enumerate(said[:kept]) if t in stop_ids), kept)  # nothing is fed past a stop
        if kept < len(drafts):
            g.cut(g.position - len(drafts) + kept)
        return said[:kept + 1]
