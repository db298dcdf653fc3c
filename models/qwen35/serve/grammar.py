"""Constrained decoding: which tokens may come next under a grammar, by llguidance.

llguidance (the engine llama.cpp uses) was picked over xgrammar by measurement and weight: on a
248,320-token vocabulary its mask takes 0.012 ms a token (median; 0.04 ms p90) for a JSON schema,
and it needs nothing beyond its wheel, where xgrammar imports torch, transformers and triton.
Grammars are written in llguidance's Lark dialect (`%json {schema}` embeds a JSON schema).
"""

from __future__ import annotations

import json
import threading

import numpy as np

from zdsl.errors import ZdslError

_lock = threading.Lock()
_tokenizers: dict[int, object] = {}


class GrammarError(ZdslError):
    """A grammar (or JSON schema) the engine cannot use."""


def _engine_tokenizer(tokenizer, stop_ids):
    """llguidance's view of `tokenizer` (its byte-level BPE as `tokenizers` JSON), made once per
    tokenizer: it costs ~0.7 s on a 248k vocabulary."""
    import llguidance

    with _lock:
        key = id(tokenizer)
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.LLTokenizer(tokenizer.hf_json(), n_vocab=tokenizer.vocab_size,
                                                      eos_token=sorted(stop_ids))
        return _tokenizers[key]


def json_lark(schema: dict, strict: bool = True) -> str:
    """A Lark rule body matching JSON text valid under `schema`, compact (no free whitespace, so
    every output stays short); unless `strict`, keywords the engine lacks are ignored."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, "lenient": not strict}})


def check(lark: str, tokenizer, stop_ids) -> None:
    """Refuse a grammar llguidance cannot compile (a bad JSON schema), in one line."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark),
                                                  _engine_tokenizer(tokenizer, stop_ids))
    if error and not error.startswith("WARNING"):
        raise GrammarError(error.splitlines()[0])


class Constraint:
    """One reply's grammar: the mask of the tokens allowed next, and the tokens taken."""

    def __init__(self, lark: str, tokenizer, stop_ids):
        import llguidance

        self.vocab = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(_engine_tokenizer(tokenizer, stop_ids),
                                            llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.mask = np.zeros((self.vocab + 31) // 32, np.uint32)

    def words(self) -> np.ndarray:
        """The bitmask of the tokens that may come next (bit i % 32 of word i // 32; the end of
        turn where the grammar is done): what the GPU sampler reads (sampling.mask_of)."""
        self.matcher.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        return self.mask

    def allowed(self) -> np.ndarray:
        """A boolean per token: may it come next."""
        return np.unpackbits(self.words().view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
