"""GGUF weight blocks decoded inside kernels.

Each format splits a block into `parts` equal shares; invocation `part` of a block decodes its
share as a few `Group`s of consecutive elements, each `w = scale · q + bias` (bias may be
None). Matrix-vector kernels then compute `scale · Σ q·x + bias · Σ x` per group, so the
per-element work is one multiply-add. The weight buffer is raw bytes (`Buffer[u8]`), read
through u16 / u32 views at the alignment each layout guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass

import zdsl
from zdsl import f16, f32, i32, u16, u32


@dataclass
class Group:
    offset: object  # element offset in the block (traced u32)
    q: list  # f32 values
    scale: object  # f32 value or None (q already dequantized)
    bias: object = None


# ---- byte access ------------------------------------------------------------------------------

def u32_at(w, byte_addr, aligned4: bool):
    """The little-endian u32 at a byte address (4-aligned, or only 2-aligned: two u16 reads)."""
    if aligned4:
        return w.view(u32)[byte_addr >> 2]
    h = byte_addr >> 1
    return w.view(u16)[h] | (w.view(u16)[h + 1] << 16)


def f16_at(w, byte_addr):
    return zdsl.f16_bits(w.view(u16)[byte_addr >> 1])


def byte_of(word, i: int):
    return (word >> (8 * i)) & 0xFF


def sbyte_of(word, i: int):
    """Byte i of a u32 as a signed value (f32)."""
    return (zdsl.bitcast(word << (24 - 8 * i), i32) >> 24).to(f32)


def nibbles(word, high: bool):
    """The four low (or high) nibbles of the bytes of a u32, as f32."""
    shift = 4 if high else 0
    return [((word >> (8 * i + shift)) & 0xF).to(f32) for i in range(4)]


def select_word(words, i):
    """words[i // 4] for a traced byte index i (words: a short Python list of u32 values)."""
    out = words[-1]
    for n in range(len(words) - 2, -1, -1):
        out = zdsl.where(i < 4 * (n + 1), words[n], out)
    return out


def dyn_byte(words, i):
    """Byte i (traced) of the bytes packed in `words`."""
    return (select_word(words, i) >> ((i & 3) * 8)) & 0xFF


# ---- formats ----------------------------------------------------------------------------------

class Format:
    name: str
    block: int  # elements per block
    nbytes: int  # bytes per block
    parts: int  # invocations sharing one block

    def groups(self, w, base, part) -> list[Group]:
        raise NotImplementedError

    @property
    def aligned4(self) -> bool:
        return self.nbytes % 4 == 0


class F32(Format):
    name, block, nbytes, parts = "f32", 32, 128, 8

    def groups(self, w, base, part):
        v = w.view(f32.vec(4))[(base >> 4) + part]
        return [Group(part * 4, [v.x, v.y, v.z, v.w], None)]


class F16(Format):
    name, block, nbytes, parts = "f16", 32, 64, 8

    def groups(self, w, base, part):
        a = u32_at(w, base + part * 8, True)
        b = u32_at(w, base + part * 8 + 4, True)
        q = [zdsl.f16_bits(a), zdsl.f16_bits(a >> 16), zdsl.f16_bits(b), zdsl.f16_bits(b >> 16)]
        return [Group(part * 4, q, None)]


class BF16(Format):
    name, block, nbytes, parts = "bf16", 32, 64, 8

    def groups(self, w, base, part):
        a = u32_at(w, base + part * 8, True)
        b = u32_at(w, base + part * 8 + 4, True)
        q = [zdsl.bf16_bits(a), zdsl.bf16_bits(a >> 16), zdsl.bf16_bits(b), zdsl.bf16_bits(b >> 16)]
        return [Group(part * 4, q, None)]


class Q8_0(Format):
    """34 bytes: f16 d, 32 × int8. w = d·q."""
    name, block, nbytes, parts = "q8_0", 32, 34, 8

    def groups(self, w, base, part):
        word = u32_at(w, base + 2 + part * 4, False)
        return [Group(part * 4, [sbyte_of(word, i) for i in range(4)], f16_at(w, base))]


class Q4_0(Format):
    """18 bytes: f16 d, 16 bytes of nibbles; element j is the low nibble of byte j, element j+16
    the high nibble. w = d·(q − 8)."""
    name, block, nbytes, parts = "q4_0", 32, 18, 4

    def groups(self, w, base, part):
        d = f16_at(w, base)
        word = u32_at(w, base + 2 + part * 4, False)
        return [Group(part * 4, nibbles(word, False), d, d * -8.0),
                Group(part * 4 + 16, nibbles(word, True), d, d * -8.0)]


def k_scale_min(w, base, sub):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block `sub` (traced, 0..7) from 12 packed bytes."""
    words = [u32_at(w, base + 4 + 4 * n, True) for n in range(3)]
    lo = sub < 4
    sc_lo, m_lo = dyn_byte(words, sub) & 63, dyn_byte(words, sub + 4) & 63
    hi_byte = dyn_byte(words, sub + 4)
    sc_hi = (hi_byte & 0xF) | ((dyn_byte(words, sub & 3) >> 6) << 4)
    m_hi = (hi_byte >> 4) | ((dyn_byte(words, sub) >> 6) << 4)
    return zdsl.where(lo, sc_lo, sc_hi).to(f32), zdsl.where(lo, m_lo, m_hi).to(f32)


class Q4_K(Format):
    """144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
    Elements 64j..64j+31 are the low nibbles of bytes 32j..32j+31 (sub-block 2j), elements
    64j+32..64j+63 their high nibbles (sub-block 2j+1). w = d·sc·q − dmin·m."""
    name, block, nbytes, parts = "q4_k", 256, 144, 16

    def groups(self, w, base, part):
        j, q4 = part >> 2, part & 3
        d, dmin = f16_at(w, base), f16_at(w, base + 2)
        qa = u32_at(w, base + 16 + 32 * j + 8 * q4, True)
        qb = u32_at(w, base + 16 + 32 * j + 8 * q4 + 4, True)
        out = []
        for high in (False, True):
            sc, m = k_scale_min(w, base, 2 * j + int(high))
            out.append(Group(64 * j + 32 * int(high) + 8 * q4, nibbles(qa, high) + nibbles(qb, high),
                             d * sc, -(dmin * m)))
        return out


class Q5_K(Format):
    """176 bytes: f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of
    nibbles. As Q4_K, plus bit (2j + high) of qh[l] as bit 4 of element 64j + 32·high + l."""
    name, block, nbytes, parts = "q5_k", 256, 176, 16

    def groups(self, w, base, part):
        j, q4 = part >> 2, part & 3
        d, dmin = f16_at(w, base), f16_at(w, base + 2)
        qa = u32_at(w, base + 48 + 32 * j + 8 * q4, True)
        qb = u32_at(w, base + 48 + 32 * j + 8 * q4 + 4, True)
        ha = u32_at(w, base + 16 + 8 * q4, True)
        hb = u32_at(w, base + 16 + 8 * q4 + 4, True)
        out = []
        for high in (False, True):
            sc, m = k_scale_min(w, base, 2 * j + int(high))
            shift = 2 * j + int(high)
            q = []
            for word, hword in ((qa, ha), (qb, hb)):
                for i in range(4):
                    lo = (word >> (8 * i + 4 * int(high))) & 0xF
                    hi = ((hword >> (8 * i)) >> shift) & 1
                    q.append((lo | (hi << 4)).to(f32))
            out.append(Group(64 * j + 32 * int(high) + 8 * q4, q, d * sc, -(dmin * m)))
        return out


class Q6_K(Format):
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.
    For half n and l in 0..31, byte ql[64n+l], ql[64n+l+32] and qh[32n+l] give elements
    128n + l + {0, 32, 64, 96} with scales 8n + l/16 + {0, 2, 4, 6}. w = d·scale·(q − 32)."""
    name, block, nbytes, parts = "q6_k", 256, 210, 16

    def groups(self, w, base, part):
        n, l0 = part >> 3, (part & 7) * 4
        d = f16_at(w, base + 208)
        ql_a = u32_at(w, base + 64 * n + l0, False)
        ql_b = u32_at(w, base + 64 * n + 32 + l0, False)
        qh = u32_at(w, base + 128 + 32 * n + l0, False)
        sbase = base + 192 + 8 * n + (l0 >> 4)
        out = []
        for g, (word, high) in enumerate(((ql_a, False), (ql_b, False), (ql_a, True), (ql_b, True))):
            addr = sbase + 2 * g
            half = w.view(u16)[addr >> 1]
            sc = (zdsl.bitcast((half >> ((addr & 1) * 8)) << 24, i32) >> 24).to(f32)
            q = []
            for i in range(4):
                lo = (word >> (8 * i + 4 * int(high))) & 0xF
                hi = (qh >> (8 * i + 2 * g)) & 3
                q.append((lo | (hi << 4)).to(f32))
            out.append(Group(128 * n + l0 + 32 * g, q, d * sc, d * sc * -32.0))
        return out


FORMATS: dict[str, Format] = {f.name: f for f in (F32(), F16(), BF16(), Q8_0(), Q4_0(), Q4_K(), Q5_K(), Q6_K())}


def fmt(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise zdsl.ZdslError(f"no GPU decoder for weight type {name} (have: {', '.join(FORMATS)})") from None


__all__ = ["Group", "Format", "FORMATS", "fmt", "u32_at", "f16_at", "f16"]
