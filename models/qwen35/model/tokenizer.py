"""The GGUF's own byte-level BPE tokenizer and chat template, as llama.cpp applies them.

Built with the `tokenizers` library from `tokenizer.ggml.tokens/merges/token_type`: the
Qwen pre-tokenizer regex splits the text, byte-level BPE encodes each piece. CONTROL tokens
(`<|im_start|>` ...) are recognised only with `parse_special=True`; USER_DEFINED tokens
(`<think>` ...) always, as in llama.cpp. The chat template is the file's Jinja template.
"""

from __future__ import annotations

import os
import re
from functools import cached_property

from gguf import TokenType

from zdsl.errors import ModelError

from ..file.gguf_file import field_contents, read_gguf

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (from the models' tokenizer.json files).
# qwen35 adds \p{M} (combining marks) to the letter classes of qwen2.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": _QWEN2, "qwen35": _QWEN35, "deepseek-r1-qwen": _QWEN2}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class Tokenizer:
    """Encode/decode text and render chat prompts for one GGUF vocabulary."""

    def __init__(self, metadata):
        """`metadata(key, default)` returns a GGUF metadata value (see `from_gguf`)."""
        model = metadata("tokenizer.ggml.model", None)
        if model != "gpt2":
            raise ModelError(f"tokenizer model '{model}' is not supported; zdsl reads byte-level BPE "
                             "('gpt2') vocabularies as in Qwen GGUF files")
        pre = metadata("tokenizer.ggml.pre", "qwen2")
        if pre not in PRE_TOKENIZERS:
            raise ModelError(f"pre-tokenizer '{pre}' is not supported; expected one of {', '.join(PRE_TOKENIZERS)}")
        self.tokens: list[str] = list(metadata("tokenizer.ggml.tokens", []))
        self.types: list[int] = [int(t) for t in metadata("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(self.tokens))]
        self.merges: list[str] = list(metadata("tokenizer.ggml.merges", []))
        self.pre = pre
        self.bos_id: int | None = metadata("tokenizer.ggml.bos_token_id", None)
        self.eos_id: int | None = metadata("tokenizer.ggml.eos_token_id", None)
        self.chat_template: str | None = metadata("tokenizer.chat_template", None)
        self._hf = self._build()
        self._bytes = _byte_decoder()

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Read only the tokenizer metadata of any GGUF file (vocab-only files included)."""
        fields = read_gguf(path).fields
        return cls(lambda key, default: field_contents(path, key, fields[key]) if key in fields else default)

    @classmethod
    def from_model(cls, model) -> Tokenizer:
        """From an open `ModelFile`."""
        return cls(lambda key, default: model.get(key, default))

    def _build(self):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HF

        vocab = {t: i for i, t in enumerate(self.tokens)}
        # a merge whose parts or result the vocabulary lacks can never apply: llama.cpp keeps
        # it and never uses it, `tokenizers` refuses the whole vocabulary, so it is left out
        merges = [(a, b) for a, _, b in (m.partition(" ") for m in self.merges)
                  if a in vocab and b in vocab and a + b in vocab]
        hf = HF(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKENIZERS[self.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, k in zip(self.tokens, self.types) if k == TokenType.CONTROL])
        hf.add_tokens([AddedToken(t, special=False, normalized=False)
                       for t, k in zip(self.tokens, self.types) if k == TokenType.USER_DEFINED])
        return hf

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, k in enumerate(self.types) if k == TokenType.CONTROL)

    def token_id(self, text: str) -> int:
        try:
            return self.tokens.index(text)
        except ValueError:
            raise ModelError(f"token {text!r} is not in the vocabulary") from None

    def encode(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; with parse_special, control tokens written in the text
        (`<|im_start|>`) become their ids instead of being spelled out byte by byte."""
        self._hf.encode_special_tokens = not parse_special
        return self._hf.encode(text, add_special_tokens=False).ids

    def piece(self, token: int) -> bytes:
        """The bytes one token stands for (control and user tokens: their text)."""
        text = self.tokens[token]
        if self.types[token] in (TokenType.CONTROL, TokenType.USER_DEFINED):
            return text.encode()
        return bytes(self._bytes[c] for c in text if c in self._bytes)

    def decode(self, tokens, *, skip_special: bool = False) -> str:
        """Text of a token sequence; incomplete UTF-8 at the end becomes U+FFFD."""
        data = b"".join(self.piece(t) for t in tokens if not (skip_special and t in self.special_ids))
        return data.decode("utf-8", errors="replace")

    def chat_ids(self, messages: list[dict], *, enable_thinking: bool = True, **extra) -> list[int]:
        """Token ids of a conversation as the chat template renders it (`extra`: more of its
        variables, e.g. `tools`), a generation prompt after.
        An assistant message that carries the token ids the model sampled ("ids") keeps them,
        spliced where the template puts its text: the text encoded again could give other ids,
        and a conversation kept in the caches across turns must match the tokens they hold."""
        marks, shown = {}, []
        for i, m in enumerate(messages):
            if "ids" in m:
                mark = f"\ue000zdsl reply {i}\ue000"   # private-use characters: no text has them
                marks[mark] = m["ids"]
                m = {k: v for k, v in m.items() if k != "ids"} | {"content": mark}
            shown.append(m)
        text = self.apply_chat_template(shown, enable_thinking=enable_thinking, **extra)
        ids: list[int] = []
        for piece in re.split("(\ue000zdsl reply \\d+\ue000)", text):
            ids += marks[piece] if piece in marks else self.encode(piece, parse_special=True) if piece else []
        return ids

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            enable_thinking: bool = True, **extra) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the file's template."""
        if not self.chat_template:
            raise ModelError("this GGUF has no tokenizer.chat_template; pass a raw prompt instead")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking,
                                   bos_token=self.tokens[self.bos_id] if self.bos_id is not None else "",
                                   eos_token=self.tokens[self.eos_id] if self.eos_id is not None else "", **extra)
        except TemplateError as e:
            raise ModelError(f"the chat template failed: {e}; check the messages' roles and fields") from None

    def hf_json(self) -> str:
        """The tokenizer as the `tokenizers` library serialises it (what grammar engines read)."""
        return self._hf.to_str()
