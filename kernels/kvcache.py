"""KV cache formats: how attention's K and V rows are stored, written and read, in one place.

A row is one token's d values of one KV head. `f16` stores them as they are. `q8_0` and `q4_0`
cut the row into blocks of 32 values, each an f16 scale d and 32 codes, rounded as GGUF's Q8_0
and Q4_0 blocks are (kernels/quant_numpy.py): q8_0 value = d·q with q an int8 and d = max|x| / 127;
q4_0 value = d·(c − 8) with c a 4-bit code and d = −(the value of largest |x|) / 8. A quantized
row holds its codes first (each block's as GGUF orders them: q4_0's low nibbles are values 0–15,
the high ones 16–31) and its scales after them, so the codes a lane reads are aligned as the row
is; bytes per value are the GGUF type's (q8_0 34 / 32, q4_0 18 / 32). `q3_rot` (experimental, no
GGUF type) turns each block by a Walsh–Hadamard transform before rounding it to 3 bits (KVQ3Rot);
the attention kernels turn q alike and turn o back.

On the GPU an invocation writes (`store`) or reads (`load`) four consecutive values of a row at
a time, in registers: a writer's eight neighbouring invocations hold a block between them. The
kernels that write the caches (attention.attn_prep, attn_prep_rows) and those that read them
(attn_decode, attn_prefill) take the formats of K and V as Consts (`KT`, `VT`) and go through
here; the caches are declared f16 (the f16 format's unit) and the other formats view the same
bytes. The formats are not in those kernels' declared variants: the (K, V) pairs would
multiply what `zdsl build` compiles (7,972 variants against 4,068), so a run's formats are
fixed by its launches and their pipelines compile on first use, cached as any other.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

import zdsl
from zdsl import f16, f32, u16, u32
from zdsl.errors import ZdslError
from zdsl.kernels.quant_numpy import QuantType, dequantize, quantize
from zdsl.kernels.q8_1 import quantize_8bit
from zdsl.kernels.quant import words_at

BLOCK = 32  # values per block of the quantized formats


class KVFormat:
    """A format: its name, GGUF type and block (values, bytes); the subclasses read and write it:
    `fetch` loads what four values take, `unpack` makes the values of it (a reader that keeps
    loads in flight holds them as fetched, in fewer registers), `load` does both."""

    rotated = False  # whether rows hold each block's values turned by `hadamard32`

    def __init__(self, name: str, qtype: QuantType | None, block: int, nbytes: int):
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

    def values(self, data, d: int) -> np.ndarray:
        """The values the rows stand for: `decode`'s (what `load` reads), turned back where the
        format rotates them."""
        return self.turned(self.decode(data, d))

    def turned(self, x) -> np.ndarray:
        """numpy's `turn`: x (..., d) turned block by block where the format rotates, else x."""
        return hadamard(x) if self.rotated else x

    def turn(self, v, i):
        """A block of values held by eight neighbouring invocations (v, this one's four; i its
        place among them) turned as this format turns its rows, which turns them back too (H is
        its own inverse), or v where it does not rotate: q for K's format, o for V's."""
        return hadamard32(v, i) if self.rotated else v


class KVF16(KVFormat):
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


class KVQ8_0(KVFormat):
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


class KVQ4_0(KVFormat):
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


class KVQ3Rot(KVFormat):
    """3 bits a value after a rotation (experimental): each block of 32 values is turned by the
    Walsh–Hadamard transform (`hadamard32`), which spreads an outlier over the block so that one
    scale serves it better, then rounded to value = (2c − 7)·d, c a 3-bit code, d = max|x| / 7
    (eight levels, symmetric, none at 0). A row holds the low two bits of its codes (a byte per
    four values), then their high bits (a nibble per four), then the f16 scales: 3.5 bits a
    value. Attention needs no dequantized copy: q·(Hk) = (Hq)·k once attn_prep turns q as it
    turns k, and Σ p·(Hv) = H(Σ p·v), which the kernels that finish o turn back (H = H⁻¹).
    Turned, a block's values grow up to √32 times (all of one sign and size): values past
    65,504 / √32 ≈ 11,600 leave f16's range where the matrix units take them."""

    rotated = True

    def fetch(self, cache, row, quad, d: int) -> tuple:
        base, align = row * self.row_bytes(d), _align(self.row_bytes(d))
        (low,) = words_at(cache, base + 4 * (quad // 4), 1, align)
        (high,) = words_at(cache, base + d // 4 + 4 * (quad // 8), 1, align)
        bits = ((low >> (8 * (quad % 4))) & 0xFF) | (((high >> (4 * (quad % 8))) & 0xF) << 8)
        return bits, cache.view(u16)[(base + d // 4 + d // 8 + 2 * (quad // 8)) >> 1]

    def unpack(self, raw: tuple):
        bits, scale = raw
        # value e's three bits into byte e: its low pair from bits 2e, its high bit from bit 8 + e
        codes = ((bits & 0x3) | ((bits & 0xC) << 6) | ((bits & 0x30) << 12) | ((bits & 0xC0) << 18)
                 | ((bits & 0x100) >> 6) | ((bits & 0x200) << 1) | ((bits & 0x400) << 8) | ((bits & 0x800) << 15))
        return (zdsl.unpack_bytes(codes) * 2.0 - 7.0) * zdsl.f16_bits(scale)

    def store(self, cache, row, quad, v, ok, d) -> None:
        i = quad % 8
        x = hadamard32(v, i)
        big = zdsl.max(zdsl.max(zdsl.abs(x.x), zdsl.abs(x.y)), zdsl.max(zdsl.abs(x.z), zdsl.abs(x.w)))
        top = zdsl.subgroup_max(big, cluster=8)
        inv = zdsl.where(top > 0.0, 3.5 / top, 0.0)  # 1 / (2d)
        codes = [zdsl.min(zdsl.max(zdsl.floor(e * inv + 4.0), 0.0), 7.0).to(u32) for e in (x.x, x.y, x.z, x.w)]
        low, high = codes[0] & 3, codes[0] >> 2
        for e in range(1, 4):
            low, high = low | ((codes[e] & 3) << (2 * e)), high | ((codes[e] >> 2) << e)
        low_word = zdsl.subgroup_sum(low << (8 * (i % 4)), cluster=4)  # the bytes of four neighbours
        high_word = zdsl.subgroup_sum(high << (4 * i), cluster=8)
        base = row * self.row_bytes(d)
        with zdsl.if_(ok & (i % 4 == 0)):
            _store_word(cache, base + 4 * (quad // 4), low_word)
            with zdsl.if_(i == 0):
                _store_word(cache, base + d // 4 + 4 * (quad // 8), high_word)
                cache.view(f16)[(base + d // 4 + d // 8 + 2 * (quad // 8)) >> 1] = (top / 7.0).to(f16)

    def encode(self, x) -> np.ndarray:
        x = np.asarray(x, np.float32)
        lead, d = x.shape[:-1], x.shape[-1]
        blocks = hadamard(x).reshape(*lead, d // BLOCK, BLOCK)
        top = np.abs(blocks).max(axis=-1, keepdims=True)
        inv = np.divide(np.float32(3.5), top, out=np.zeros_like(top), where=top > 0)
        codes = np.clip(np.floor(blocks * inv + np.float32(4)), 0, 7).astype(np.uint8).reshape(*lead, d // 4, 4)
        low = sum(((codes[..., e] & 3) << (2 * e)).astype(np.uint8) for e in range(4)).astype(np.uint8)
        nibbles = sum(((codes[..., e] >> 2) << e).astype(np.uint8) for e in range(4)).astype(np.uint8)
        high = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
        scales = (top[..., 0] / np.float32(7)).astype(np.float16).view(np.uint8).reshape(*lead, -1)
        return np.concatenate([low, high, scales], axis=-1)

    def decode(self, data, d: int) -> np.ndarray:
        b = np.ascontiguousarray(data).view(np.uint8).reshape(-1, self.row_bytes(d))
        low, high = b[:, :d // 4], b[:, d // 4:d // 4 + d // 8]
        scales = np.ascontiguousarray(b[:, d // 4 + d // 8:]).view(np.float16).astype(np.float32)
        nibbles = np.stack([high & 15, high >> 4], axis=-1).reshape(len(b), d // 4)
        codes = np.stack([((low >> (2 * e)) & 3) | (((nibbles >> e) & 1) << 2) for e in range(4)], axis=-1)
        return (2.0 * codes.reshape(len(b), d) - 7.0).astype(np.float32) * np.repeat(scales, BLOCK, axis=1)


def hadamard32(v, i):
    """H·x / √32 of a block of 32 values that eight neighbouring invocations hold, four each in
    order (i: this one's place among them, its lane's in an aligned cluster of eight lanes), H
    Sylvester's Hadamard matrix: orthonormal and symmetric, so it undoes itself. Two butterfly
    stages within the invocation, three across lanes: call in control flow uniform over each eight."""
    a, b, c, e = v.x, v.y, v.z, v.w
    a, b, c, e = a + b, a - b, c + e, c - e
    x = zdsl.vec(a + c, b + e, a - c, b - e)
    for mask in (1, 2, 4):
        other = zdsl.subgroup_shuffle_xor(x, mask)
        x = zdsl.where((i & mask) != 0, other - x, x + other)
    return x * (1.0 / math.sqrt(BLOCK))


def hadamard(x) -> np.ndarray:
    """numpy's hadamard32 over each block of 32 along the last axis (f32)."""
    x = np.asarray(x, np.float64)
    h = np.array([[1.0]])
    while len(h) < BLOCK:
        h = np.block([[h, h], [h, -h]])
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK) @ h / math.sqrt(BLOCK)
    return blocks.reshape(x.shape).astype(np.float32)


def _align(row_bytes: int) -> int:
    """The alignment of every row's start (for words_at: 16 at most)."""
    return min(row_bytes & -row_bytes, 16)


def _store_word(cache, addr, word) -> None:
    """A u32 at byte `addr`, as two u16: rows are only 2-byte aligned for some d, which the
    writers take at run time (one row a token: the narrow stores cost nothing that counts)."""
    cache.view(u16)[addr >> 1] = word & 0xFFFF
    cache.view(u16)[(addr >> 1) + 1] = word >> 16


KV_FORMATS = {f.name: f for f in (KVF16("f16", QuantType.F16, 1, 2), KVQ8_0("q8_0", QuantType.Q8_0, BLOCK, 34),
                                  KVQ4_0("q4_0", QuantType.Q4_0, BLOCK, 18), KVQ3Rot("q3_rot", None, BLOCK, 14))}


class KVTypes(NamedTuple):
    """The formats of the K and of the V cache, by name (KV_FORMATS): a tuple, so `k, v = kv`."""

    k: str
    v: str


KV_DEFAULT = KVTypes("f16", "f16")  # what a run uses unless told


def kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ZdslError(f"unknown KV cache type '{name}'; known: {', '.join(KV_FORMATS)}") from None


def kv_types(text: str) -> KVTypes:
    """The formats of a `--kv-type` value: one name for both ("q8_0"), or "K,V" ("q4_0,q8_0")."""
    names = [n.strip().lower() for n in text.split(",")]
    if len(names) not in (1, 2) or not all(names):
        raise ZdslError(f"--kv-type '{text}': give one KV cache type for K and V, or two as K,V "
                        f"(e.g. q4_0,q8_0); known: {', '.join(KV_FORMATS)}")
    return KVTypes(*(kv_format(n).name for n in (names * 2)[:2]))
