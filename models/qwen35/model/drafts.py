"""Draft tokens for speculative decoding (speculate.py): guesses of what the model says next,
cheap to make, that one step of several tokens then checks.

A drafter's `draft(history, k)` sees the sequence so far (the prompt, the generated tokens, and
last the one not yet fed) and guesses up to k tokens after it. Drafts are a function of the
history alone, never of the model's random draws: that is what makes checking them keep the
output exactly that of plain decoding (speculate.py).
"""

from __future__ import annotations

import numpy as np

NGRAM_LONGEST, NGRAM_SHORTEST = 4, 2  # a single repeated token matches too often to be worth a step


class NgramDrafts:
    """Prompt lookup: find the latest earlier place where the history's last n tokens occurred
    (n from NGRAM_LONGEST down to NGRAM_SHORTEST) and guess that what followed there follows
    again. Code being edited, quoted text, a document a question is about: text the prompt or
    the reply already holds. The n-grams are indexed as the history grows (one generation's
    history only grows), so a draft costs a dictionary look-up, not a scan of the context."""

    def __init__(self):
        self.after: dict[tuple, int] = {}  # n-gram → where the token after its latest occurrence is
        self.indexed = 0  # the history's tokens whose following n-grams are indexed

    def draft(self, history: list[int], k: int) -> list[int]:
        self._index(history)
        for n in range(min(NGRAM_LONGEST, len(history)), NGRAM_SHORTEST - 1, -1):
            at = self.after.get(tuple(history[-n:]))
            if at is not None:
                out: list[int] = []
                for j in range(k):  # past the history's end the copy goes on copying itself (a loop)
                    out.append(history[at + j] if at + j < len(history) else out[at + j - len(history)])
                return out
        return []

    def _index(self, history: list[int]) -> None:
        """Index every n-gram that ends before the history's last token (it has a successor)."""
        for end in range(max(self.indexed, 1), len(history)):
            for n in range(NGRAM_SHORTEST, min(NGRAM_LONGEST, end) + 1):
                self.after[tuple(history[end - n:end])] = end
        self.indexed = max(self.indexed, len(history))


class ChosenDrafts:
    """Drafts of a chosen acceptance, for measuring speed where real drafts cannot be judged
    (synthetic weights): the tokens of `reference`, the greedy continuation of a prompt of
    `prompt_len` tokens, each replaced by another token with probability 1 − `accept`. Greedy
    verification then accepts each draft with probability `accept` until the first wrong one.
    `costs`, a drafter whose drafts these replace, is run all the same: its time is the drafts'
    (the MTP head's)."""

    def __init__(self, reference: list[int], prompt_len: int, accept: float, vocab: int, seed: int = 0,
                 costs=None):
        self.reference, self.prompt_len, self.accept, self.vocab = reference, prompt_len, accept, vocab
        self.rng = np.random.default_rng(seed)
        self.costs = costs

    def draft(self, history: list[int], k: int) -> list[int]:
        if self.costs is not None:
            self.costs.draft(history, k)
        at = len(history) - self.prompt_len  # the reference's index of the token after history
        out = []
        for token in self.reference[at:at + k]:
            if self.rng.random() >= self.accept:
                token = (token + 1 + int(self.rng.integers(self.vocab - 1))) % self.vocab  # any other token
            out.append(token)
        return out
