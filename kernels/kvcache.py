"""KV cache formats: how attention's K and V rows are stored, written and read, in one place.

A row is one token's d values of one KV head. `f16` stores them as they are. `q8_0` and `q4_0`
cut the row into blocks of 32 values, each an f16 scale d and 32 codes, rounded as GGUF's Q8_0
and Q4_0 blocks are (kernels/formats.py): q8_0 value = d·q with q an int8 and d = max|x| / 127;
q4_0 value = d·(c − 8) with c a 4-bit code and d = −(the value of largest |x|) / 8. A quantized
row holds its codes first (each block's as GGUF orders them: q4_0's low nibbles are values 0–15,
the high ones 16–31) and its scales after them, so the codes a lane reads are aligned as the row
is; bytes per value are the GGUF type's (q8_0 34 / 32, q4_0 18 / 32).

On the GPU an invocation writes (`store`) or reads (`load`) four consecutive values of a row at
a time, in registers: a writer's eight neighbouring invocations hold a block between them. The
kernels that write the caches (attention.attn_prep, attn_prep_rows) and those that read them
(attn_decode, attn_prefill) take the formats of K and V as Consts (`KT`, `VT`) and go through
here; the caches are declared f16 (the f16 format's unit) and the other formats view the same
bytes. The formats are not in those kernels' declared variants: the nine (K, V) pairs would
multiply what `zdsl build` compiles (7,972 variants against 4,068), so a run's formats are
fixed by its launches and their pipelines compile on first use, cached as any other.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import f16, f32, u16, u32
from zdsl.errors import ZdslError
from zdsl.kernels.formats import QuantType, dequantize, quantize
from zdsl.kernels.q8_1 import quantize_8bit
from zdsl.kernels.quant import words_at

BLOCK = 32  # values per block of the quantized formats


class KVFormat:
    """A format: its name, GGUF type and block (values, bytes); the subclasses read and write it:
    `fetch` loads what four values take, `unpack` makes the values of it (a reader that keeps
    loads in flight holds them as fetched, in fewer registers), `load` does both."""

    def __init__(self, name: str, qtype: QuantType, block: int, nbytes: int):
        self.name, self.qtype, self.block, self.nbytes = name, qtype, block, nbytes

    def row_bytes(self, d):
        """Bytes of a row of d values (an int, or a traced u32 inside a kernel)."""
        return d // self.block * self.nbytes

    def check(self, d: int) -> None:
        if d % self.block:
            raise ZdslError(f"a {self.name} KV cache stores heads in blocks of {self.block} values, but this "
                            f"model's heads have {d}: use --kv-type f16")

    def load(self, cache, row, quad, d: int):
        """Values 4·quad .. 4·quad + 3 of row `row` (traced) as an f32 vec4."""
        return self.unpack(self.fetch(cache, row, quad, d))

    # -- numpy
    def encode(self, x) -> np.ndarray:
        """Values (..., d) -> rows (..., row_bytes) uint8, as the GPU writes them (up to a code
        where a value sits on a rounding boundary)."""
        x = np.asarray(x, np.float32)
        lead, nb = x.shape[:-1], x.shape[-1] // self.block
        blocks = quantize(x, self.qtype).reshape(*lead, nb, self.nbytes)
        if self.block == 1:
            return blocks.reshape(*lead, -1)
        return np.concatenate([blocks[..., 2:].reshape(*lead, -1), blocks[..., :2].reshape(*lead, -1)], axis=-1)

    def decode(self, data, d: int) -> np.ndarray:
        """The rows in `data` (bytes of any dtype) -> values (rows, d) f32."""
        b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, self.row_bytes(d))
        nb = d // self.block
        if self.block > 1:
            codes, scales = b[:, :nb * (self.nbytes - 2)], b[:, nb * (self.nbytes - 2):]
            b = np.concatenate([scales.reshape(-1, nb, 2), codes.reshape(-1, nb, self.nbytes - 2)], axis=-1)
        return dequantize(b.reshape(-1), self.qtype, (len(b), d)).astype(np.float32)


class F16(KVFormat):
    def fetch(self, cache, row, quad, d: int) -> tuple:
        """What `load` reads, as read (a reader keeps loads in flight in fewer registers)."""
        return (cache.vec4[row * (d // 4) + quad],)

    def unpack(self, raw: tuple):
        """`fetch`'s words as the f32 vec4 of the values."""
        return raw[0].to(f32)

    def store(self, cache, row, quad, v, ok, d) -> None:
        """This invocation's values v (vec4) as values 4·quad .. of row `row`, where `ok`;
        quads 8k .. 8k + 7 (a block) are held by eight consecutive invocations: call in control
        flow uniform over each eight."""
        with zdsl.if_(ok):
            cache.vec4[row * (d // 4) + quad] = v.to(f16.vec(4))


class Q8_0(KVFormat):
    def fetch(self, cache, row, quad, d: int) -> tuple:
        base = row * self.row_bytes(d)
        (word,) = words_at(cache, base + 4 * quad, 1, _align(self.row_bytes(d)))
        return word, cache.view(u16)[(base + d + 2 * (quad // 8)) >> 1]  # the scale's bits

    def unpack(self, raw: tuple):
        word, scale = raw
        return (zdsl.unpack_bytes(word ^ 0x80808080) - 128.0) * zdsl.f16_bits(scale)  # the int8 codes, exactly

    def store(self, cache, row, quad, v, ok, d) -> None:
        scale, _, word = quantize_8bit(v)
        base = row * self.row_bytes(d)
        with zdsl.if_(ok):
            _store_word(cache, base + 4 * quad, word)
            with zdsl.if_(quad % 8 == 0):
                cache.view(f16)[(base + d + 2 * (quad // 8)) >> 1] = scale.to(f16)


class Q4_0(KVFormat):
    def fetch(self, cache, row, quad, d: int) -> tuple:
        base, i = row * self.row_bytes(d), quad % 8
        (word,) = words_at(cache, base + 16 * (quad // 8) + 4 * (i % 4), 1, _align(self.row_bytes(d)))
        codes = (word >> (4 * (i // 4))) & 0x0F0F0F0F  # values 0–15 of a block low, 16–31 high
        return codes, cache.view(u16)[(base + d // 2 + 2 * (quad // 8)) >> 1]

    def unpack(self, raw: tuple):
        codes, scale = raw
        return (zdsl.unpack_bytes(codes) - 8.0) * zdsl.f16_bits(scale)

    def store(self, cache, row, quad, v, ok, d) -> None:
        hi = zdsl.subgroup_max(zdsl.max(zdsl.max(v.x, v.y), zdsl.max(v.z, v.w)), cluster=8)
        lo = zdsl.subgroup_min(zdsl.min(zdsl.min(v.x, v.y), zdsl.min(v.z, v.w)), cluster=8)
        scale = zdsl.where(hi >= -lo, hi, lo) / -8.0  # the value of largest |x| (a tie: the positive)
        inv = zdsl.where(scale != 0.0, 1.0 / scale, 0.0)
        codes = [zdsl.min(zdsl.floor(x * inv + 8.5), 15.0).to(u32) for x in (v.x, v.y, v.z, v.w)]
        packed = codes[0] | (codes[1] << 8) | (codes[2] << 16) | (codes[3] << 24)
        word = packed | (zdsl.subgroup_shuffle_xor(packed, 4) << 4)  # values 16–31 into the high nibbles
        base, i = row * self.row_bytes(d), quad % 8
        with zdsl.if_(ok & (i < 4)):
            _store_word(cache, base + 16 * (quad // 8) + 4 * i, word)
            with zdsl.if_(i == 0):
                cache.view(f16)[(base + d // 2 + 2 * (quad // 8)) >> 1] = scale.to(f16)


def _align(row_bytes: int) -> int:
    """The alignment of every row's start (for words_at: 16 at most)."""
    return min(row_bytes & -row_bytes, 16)


def _store_word(cache, addr, word) -> None:
    """A u32 at byte `addr`, as two u16: rows are only 2-byte aligned for some d, which the
    writers take at run time (one row a token: the narrow stores cost nothing that counts)."""
    cache.view(u16)[addr >> 1] = word & 0xFFFF
    cache.view(u16)[(addr >> 1) + 1] = word >> 16


FORMATS = {f.name: f for f in (F16("f16", QuantType.F16, 1, 2), Q8_0("q8_0", QuantType.Q8_0, BLOCK, 34),
                               Q4_0("q4_0", QuantType.Q4_0, BLOCK, 18))}
KV_TYPES = list(FORMATS)
DEFAULT = ("f16", "f16")  # the (K, V) formats a run uses unless told


def kv_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ZdslError(f"unknown KV cache type '{name}'; known: {', '.join(FORMATS)}") from None


def kv_types(text: str) -> tuple[str, str]:
    """The (K, V) formats of a `--kv-type` value: one name for both ("q8_0"), or "K,V" ("q4_0,q8_0")."""
    names = [n.strip().lower() for n in text.split(",")]
    if len(names) not in (1, 2) or not all(names):
        raise ZdslError(f"--kv-type '{text}': give one KV cache type for K and V, or two as K,V "
                        f"(e.g. q4_0,q8_0); known: {', '.join(FORMATS)}")
    k, v = (kv_format(n).name for n in (names * 2)[:2])
    return k, v
