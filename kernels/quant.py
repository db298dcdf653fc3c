"""GGUF weight blocks decoded on the GPU, inside kernels (DSL); `quant_numpy.py` is the same
formats in numpy, the reference these decoders are tested against.

Each format splits a block into `parts` equal shares; invocation `part` of a block decodes its
share as a few `Group`s of consecutive elements, each `w = scale · q + bias` (bias may be
None). Matrix-vector kernels then compute `scale · Σ q·x + bias · Σ x` per group, so the
per-element work is one multiply-add. K-quant shares come `Factored` (per-group small scales
under per-block factors), which kernels sum with fewer operations. The weight buffer is raw
bytes (`Buffer[u8]`), read with the widest loads each layout's alignment allows (16-byte where
blocks keep it, u16 pairs where they only keep 2).

The 256-element formats interleave: invocation `part` takes elements 4·part .. 4·part + 3 of
each of the block's eight 32-element runs, so the eight invocations of a block read each run's
activations as one contiguous 128-byte piece (a share of whole runs would scatter every
activation load over four cache lines).

Quantized values reach f32 without an int→float conversion (a quarter-rate instruction on
NVIDIA): `unit` moves a field under the exponent of 1.0, giving 1 + q/2^bits in two integer
operations, and the group's scale and bias absorb the 2^bits and the 1.

The int8-dot path (`int_groups`, `iparts`) instead packs each element as a signed byte, four to
a u32, for `zdsl.dot4_i8` against Q8_1 activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import zdsl
from zdsl import f16, f32, i32, u8, u16, u32
from zdsl.kernels.quant_numpy import MXFP4_LEVELS, QuantType, iq_grid, set_iq1_m_d_bits

# IQ4_NL / IQ4_XS: the 16 non-linear levels a 4-bit index selects (ggml's kvalues_iq4nl).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass
class Group:
    offset: object  # element offset in the block (traced u32 or int)
    q: list  # f32 values
    scale: object  # f32 value or None (q already dequantized)
    bias: object = None


@dataclass
class Factored:
    """Groups under two block factors: w = d·c·(a·q + b) + m·e, with c and e per group (the
    groups' scale and bias fields, small integers as f32) and a, b constants of the format. A
    kernel sums it as d·Σ c·(a·P + b·X) + m·Σ e·X over the groups (P = Σ q·x, X = Σ x): two or
    three operations per group, where forming each group's own scale and bias takes more."""
    groups: list
    d: object
    a: float
    b: float
    m: object = None

    def expand(self) -> list[Group]:
        out = []
        for g in self.groups:
            s = self.d * g.scale
            bias = s * float(self.b) if self.b else None
            if g.bias is not None:
                bias = self.m * g.bias if bias is None else zdsl.fma(self.m, g.bias, bias)
            out.append(Group(g.offset, g.q, s * float(self.a), bias))
        return out


@dataclass
class IntGroup:
    """Elements offset .. offset + 4·len(words) as signed bytes, w = scale · q + bias. A group
    stays inside one 32-element Q8_1 block and starts at a multiple of 4·min(len(words), 4)
    elements; a group of 32 elements is a whole Q8_1 block (its Σx is the block's s)."""
    offset: object
    words: list  # u32, four int8 each
    scale: object
    bias: object = None


# ---- byte access ------------------------------------------------------------------------------

def words_at(w, addr, n: int, align: int) -> list:
    """n little-endian u32 from byte address `addr`, which is `align`-aligned (a power of two):
    16- or 8-byte vector loads where alignment allows, u32 loads around them where it is only 2
    (halves_at), bytes where it is 1 (blocks of an odd size: MXFP4's 17)."""
    if align == 2 and n > 1:
        return halves_at(w, addr, n)
    out = []
    while len(out) < n:
        left = n - len(out)
        at = addr + 4 * len(out)
        if align >= 16 and left >= 4:
            v = w.view(u32.vec(4))[at >> 4]
            out += [v.x, v.y, v.z, v.w]
        elif align >= 8 and left >= 2:
            v = w.view(u32.vec(2))[at >> 3]
            out += [v.x, v.y]
        elif align >= 4:
            out.append(w.view(u32)[at >> 2])
        elif align >= 2:
            h = at >> 1
            out.append(w.view(u16)[h] | (w.view(u16)[h + 1] << 16))
        else:
            b = w.view(u8)
            out.append(b[at] | (b[at + 1] << 8) | (b[at + 2] << 16) | (b[at + 3] << 24))
    return out


def halves_at(w, addr, n: int) -> list:
    """n u32 from a 2-aligned byte address, as n aligned u32 loads and one u16 rather than 2n u16
    loads (where a warp's lanes read different rows, each load is up to 32 cache sectors to look
    up): word i is the high half of aligned word i and the low half of word i + 1 where addr is
    not 4-aligned, else aligned word i itself. The last half loaded is the last two bytes wanted
    (the low half of word n, or unused), so nothing past them is read: a buffer may end there."""
    shift = (addr & 2) * 8  # 0 or 16
    first = addr >> 2
    aligned = [w.view(u32)[first + i] for i in range(n)] + [w.view(u16)[(addr + 4 * n - 2) >> 1]]
    # (b << 16) << (16 − shift): b's low half on top, or 0 where shift is 0 (no shift by 32)
    return [(aligned[i] >> shift) | ((aligned[i + 1] << 16) << (16 - shift)) for i in range(n)]


def f16_at(w, byte_addr):
    return zdsl.f16_bits(w.view(u16)[byte_addr >> 1])


def half(word, high: bool):
    """The f16 in the low (or high) half of a u32, as f32."""
    return zdsl.f16_bits(word >> 16 if high else word)


def byte_of(word, i):
    """Byte i (an int or a traced u32) of a u32."""
    return (word >> (8 * i)) & 0xFF


def sbyte(word, i):
    """Byte i of a u32 as a signed value (i32)."""
    return zdsl.bitcast(word << (24 - 8 * i), i32) >> 24


def unit(word, lo: int, bits: int):
    """1 + q / 2^bits as f32, q being the `bits`-wide field at bit `lo` of `word`: the field moves
    to the top of the mantissa under the exponent of 1.0 (a shift and a masked or)."""
    top = 23 - bits
    t = word << (top - lo) if top > lo else word >> (lo - top) if lo > top else word
    return zdsl.bitcast((t & (((1 << bits) - 1) << top)) | 0x3F800000, f32)


def unit_group(offset, values, bits: int, scale, bias=None) -> Group:
    """A Group of `unit` values standing for w = scale · q + bias."""
    s = scale * float(1 << bits)
    return Group(offset, values, s, -s if bias is None else bias - s)


def byte_units(words, bits: int, shift: int = 0) -> list:
    """`unit` of the `bits`-wide field at bit `shift` of every byte of `words`, in byte order."""
    return [unit(wd, 8 * i + shift, bits) for wd in words for i in range(4)]


def unit_group_of(g: "IntGroup") -> Group:
    """An IntGroup's signed bytes as `unit` values (1 + (q + 128)/256, no conversion
    instruction) under w = 256·scale·unit − 384·scale + bias: for kernels that need the values
    themselves rather than their int8 dot products (the matrix-unit tiles)."""
    bias = g.scale * -384.0
    return Group(g.offset, byte_units([wd ^ 0x80808080 for wd in g.words], 8), g.scale * 256.0,
                 bias if g.bias is None else bias + g.bias)


def low_nibbles(words):
    return [wd & 0x0F0F0F0F for wd in words]


def high_nibbles(words):
    return [(wd >> 4) & 0x0F0F0F0F for wd in words]


def signed_bytes(words, offset: int):
    """Bytes q (all < 128 + offset) as the signed bytes q − offset: the add cannot carry out of
    a byte, and flipping bit 7 turns q − offset + 128 into q − offset."""
    return [(wd + (0x01010101 * (128 - offset))) ^ 0x80808080 for wd in words]


def spread_bits(bits4, pos: int):
    """Bits 0..3 of `bits4` to bit `pos` of bytes 0..3 (one multiply, no carries)."""
    return (bits4 * (0x00204081 << pos)) & (0x01010101 << pos)


def split_part(part, pieces: int):
    """(int8 part, piece) of share `part` when each part is split into `pieces` (a power of
    two): more invocations share a block where a tile has more of them than parts."""
    if pieces == 1:
        return part, 0
    return part >> (pieces.bit_length() - 1), part & (pieces - 1)


# ---- formats ----------------------------------------------------------------------------------

class Format:
    name: str
    block: int  # elements per block
    nbytes: int  # bytes per block
    parts: int  # invocations sharing one block (f32 activations)
    iparts: int = 0  # invocations sharing one block in the int8-dot path (0: none)
    ispan: int = 0  # elements an aligned run of int8 parts covers without gaps (0: the whole block)
    ipieces: int = 1  # pieces an int8 part may be split into (int_groups' `pieces`)
    f16_fields: tuple = ()  # byte offsets of the block's f16 scales (synthetic weights keep them finite)
    e8m0_fields: tuple = ()  # byte offsets of E8M0 exponents (synthetic weights keep them moderate)

    @property
    def align(self) -> int:
        """The alignment of every block start (rows are packed blocks in a 16-aligned buffer)."""
        return math.gcd(self.nbytes, 16)

    def load(self, w, base, offset, n: int, step: int = 16) -> list:
        """n u32 at byte `offset` of the block at `base`; a traced offset is a multiple of `step`."""
        known = (offset & -offset or 16) if isinstance(offset, int) else step
        return words_at(w, base + offset, n, min(self.align, known))

    def table(self):
        """(dtype, values) of a constant table the decoder looks up (the IQ codebooks), or None."""
        return None

    def table_bytes(self) -> int:
        """The shared memory `setup` takes."""
        t = self.table()
        return 0 if t is None else t[0].nbytes * len(t[1])

    def setup(self):
        """Per-kernel state made once at the kernel's start, in uniform control flow: the table,
        copied into shared memory; `decode` takes it as `ctx` (None: a constant table)."""
        t = self.table()
        return None if t is None else shared_table(*t)

    def lookup(self, ctx):
        """The table `decode` reads: setup's shared copy, or the constants themselves."""
        return ctx if ctx is not None else zdsl.table(*self.table())

    def decode(self, w, base, part, ctx=None) -> list[Group] | Factored:
        """Invocation `part`'s share of the block at byte `base`."""
        raise NotImplementedError

    def groups(self, w, base, part, ctx=None) -> list[Group]:
        """The share as plain Groups (each with its own scale and bias)."""
        share = self.decode(w, base, part, ctx)
        return share.expand() if isinstance(share, Factored) else share

    def int_groups(self, w, base, part, ctx=None, pieces=1) -> list[IntGroup]:
        """Invocation `part`'s share as signed bytes, ctx as in decode: iparts · pieces shares
        a block, pieces (a power of two, at most ipieces) splitting each int8 part into equal
        runs of its bytes (split_part)."""
        raise NotImplementedError

    def finite_scales(self, rng, blocks, bound: float):
        """Random blocks (a uint8 array, nbytes last) given f16 scales uniform in ±bound and E8M0
        exponents of 2⁻¹⁰ … 2⁻¹, in place: synthetic weights whose products stay finite."""
        for at in self.f16_fields:
            blocks[..., at:at + 2] = rng.uniform(-bound, bound, blocks.shape[:-1] + (1,)).astype("<f2").view("u1")
        for at in self.e8m0_fields:
            blocks[..., at] = rng.integers(118, 128, blocks.shape[:-1])


class F32(Format):
    name, block, nbytes, parts = "f32", 32, 128, 8

    def decode(self, w, base, part, ctx=None):
        v = w.view(f32.vec(4))[(base >> 4) + part]
        return [Group(part * 4, [v.x, v.y, v.z, v.w], None)]


class F16(Format):
    name, block, nbytes, parts = "f16", 32, 64, 4

    def decode(self, w, base, part, ctx=None):
        words = self.load(w, base, part * 16, 4)
        return [Group(part * 8, [half(wd, hi) for wd in words for hi in (False, True)], None)]


class BF16(Format):
    name, block, nbytes, parts = "bf16", 32, 64, 4

    def decode(self, w, base, part, ctx=None):
        words = self.load(w, base, part * 16, 4)
        q = [zdsl.bf16_bits(wd >> 16) if hi else zdsl.bf16_bits(wd) for wd in words for hi in (False, True)]
        return [Group(part * 8, q, None)]


class Q8_0(Format):
    """34 bytes: f16 d, 32 × int8. w = d·q."""
    name, block, nbytes, parts, iparts, f16_fields = "q8_0", 32, 34, 4, 4, (0,)

    def quants(self, w, base, part):
        return f16_at(w, base), self.load(w, base, 2 + part * 8, 2, step=2)

    def decode(self, w, base, part, ctx=None):
        d, words = self.quants(w, base, part)
        unsigned = [wd ^ 0x80808080 for wd in words]  # q + 128
        return [unit_group(part * 8, byte_units(unsigned, 8), 8, d, d * -128.0)]

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        d, words = self.quants(w, base, part)
        return [IntGroup(part * 8, words, d)]


class Q4_0(Format):
    """18 bytes: f16 d, 16 bytes of nibbles; element j is the low nibble of byte j, element j+16
    the high nibble. w = d·(q − 8)."""
    name, block, nbytes, parts, iparts, f16_fields = "q4_0", 32, 18, 2, 1, (0,)

    def decode(self, w, base, part, ctx=None):
        d = f16_at(w, base)
        words = self.load(w, base, 2 + part * 8, 2, step=2)
        return [unit_group(part * 8, byte_units(words, 4), 4, d, d * -8.0),
                unit_group(part * 8 + 16, byte_units(words, 4, 4), 4, d, d * -8.0)]

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        d = f16_at(w, base)
        words = self.load(w, base, 2, 4)
        return [IntGroup(0, low_nibbles(words) + high_nibbles(words), d, d * -8.0)]


class Q4_1(Format):
    """20 bytes: f16 d, f16 m, 16 bytes of nibbles (as Q4_0). w = d·q + m."""
    name, block, nbytes, parts, iparts, f16_fields = "q4_1", 32, 20, 2, 1, (0, 2)

    def decode(self, w, base, part, ctx=None):
        head = self.load(w, base, 0, 1)[0]
        d, m = half(head, False), half(head, True)
        words = self.load(w, base, 4 + part * 8, 2, step=8)
        return [unit_group(part * 8, byte_units(words, 4), 4, d, m),
                unit_group(part * 8 + 16, byte_units(words, 4, 4), 4, d, m)]

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        head, *words = self.load(w, base, 0, 5)
        return [IntGroup(0, low_nibbles(words) + high_nibbles(words), half(head, False), half(head, True))]


def five_bits(qs_words, qh, first: int, high: bool):
    """Bytes of 5-bit values: the low (or high) nibbles of `qs_words` with bit (first + element)
    of qh as bit 4, for the elements of consecutive bytes."""
    nib = high_nibbles(qs_words) if high else low_nibbles(qs_words)
    return [n | spread_bits((qh >> (first + 4 * i)) & 0xF, 4) for i, n in enumerate(nib)]


class Q5_0(Format):
    """22 bytes: f16 d, u32 qh, 16 bytes of nibbles (as Q4_0); bit j of qh is bit 4 of element j.
    w = d·(q − 16)."""
    name, block, nbytes, parts, iparts, f16_fields = "q5_0", 32, 22, 2, 1, (0,)

    def decode(self, w, base, part, ctx=None):
        d = f16_at(w, base)
        qh = self.load(w, base, 2, 1)[0]
        words = self.load(w, base, 6 + part * 8, 2, step=2)
        first = part * 8
        return [unit_group(first, byte_units(five_bits(words, qh, first, False), 5), 5, d, d * -16.0),
                unit_group(first + 16, byte_units(five_bits(words, qh, first + 16, True), 5), 5, d, d * -16.0)]

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        d = f16_at(w, base)
        qh, *words = self.load(w, base, 2, 5)
        return [IntGroup(0, five_bits(words, qh, 0, False) + five_bits(words, qh, 16, True), d, d * -16.0)]


class Q5_1(Format):
    """24 bytes: f16 d, f16 m, u32 qh, 16 bytes of nibbles (as Q5_0). w = d·q + m."""
    name, block, nbytes, parts, iparts, f16_fields = "q5_1", 32, 24, 2, 1, (0, 2)

    def decode(self, w, base, part, ctx=None):
        head, qh = self.load(w, base, 0, 2)
        d, m = half(head, False), half(head, True)
        words = self.load(w, base, 8 + part * 8, 2, step=8)
        first = part * 8
        return [unit_group(first, byte_units(five_bits(words, qh, first, False), 5), 5, d, m),
                unit_group(first + 16, byte_units(five_bits(words, qh, first + 16, True), 5), 5, d, m)]

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        head, qh, *words = self.load(w, base, 0, 6)
        q = five_bits(words, qh, 0, False) + five_bits(words, qh, 16, True)
        return [IntGroup(0, q, half(head, False), half(head, True))]


class Q2_K(Format):
    """84 bytes: 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit values,
    f16 d, f16 dmin. Element 128h + 32s + l is bits 2s of byte 32h + l, in sub-block (e / 16).
    w = d·sc·q − dmin·m."""
    name, block, nbytes, parts, iparts, f16_fields = "q2_k", 256, 84, 8, 4, (80, 82)
    ispan, ipieces = 128, 4

    def head(self, w, base, h):
        dd = self.load(w, base, 80, 1)[0]
        return half(dd, False), half(dd, True), self.load(w, base, 8 * h, 2, step=8)

    def decode(self, w, base, part, ctx=None):
        dd, *scales = self.load(w, base, 80, 1) + self.load(w, base, 0, 4)
        d, dmin = half(dd, False), half(dd, True)
        out = []
        for h in range(2):
            word = self.load(w, base, 16 + 32 * h + 4 * part, 1, step=4)[0]
            for s in range(4):  # scale byte 8h + 2s + part/4
                sc = byte_of(scales[2 * h + (s >> 1)], 2 * (s & 1) + (part >> 2))
                out.append(Group(128 * h + 32 * s + 4 * part, [unit(word, 8 * i + 2 * s, 2) for i in range(4)],
                                 (sc & 0xF).to(f32), (sc >> 4).to(f32)))
        return Factored(out, d, 4, -4, -dmin)  # q = 4·(unit − 1)

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        part, piece = split_part(part, pieces)
        h, r, n = part >> 1, part & 1, 4 // pieces
        l0 = 16 * r + 4 * n * piece
        d, dmin, scales = self.head(w, base, h)
        words = self.load(w, base, 16 + 32 * h + l0, n, step=4 * n)
        out = []
        for s in range(4):
            sc = byte_of(scales[s >> 1], r + 2 * (s & 1))
            q = [(wd >> (2 * s)) & 0x03030303 for wd in words]
            out.append(IntGroup(128 * h + 32 * s + l0, q, d * (sc & 0xF).to(f32), -(dmin * (sc >> 4).to(f32))))
        return out


class Q3_K(Format):
    """110 bytes: 32 bytes hmask, 64 bytes of 2-bit values, 12 bytes of 6-bit scales, f16 d.
    Element 128h + 32s + l: low bits 2s of byte 32h + l, high bit (4h + s) of hmask[l]; q = low
    + 4·high − 4. Scale i (of e / 16): nibble i / 8 of byte i % 8, bits 2·(i / 4) of byte 8 + i % 4
    as bits 4-5, minus 32. w = d·scale·q."""
    name, block, nbytes, parts, iparts, f16_fields = "q3_k", 256, 110, 8, 4, (108,)
    ispan, ipieces = 128, 4

    def scale(self, words, h, s: int, t):
        """scale − 32 of sub-block 8h + 2s + t, as f32."""
        low = (byte_of(words[s >> 1], t + 2 * (s & 1)) >> (4 * h)) & 0xF
        high = (words[2] >> (8 * (t + 2 * (s & 1)) + 4 * h + 2 * (s >> 1))) & 3
        return (low | (high << 4)).to(f32) - 32.0

    def three_bits(self, qs, hm, h, s: int):
        return [((q >> (2 * s)) & 0x03030303) | (((m >> (4 * h + s)) & 0x01010101) << 2) for q, m in zip(qs, hm)]

    def decode(self, w, base, part, ctx=None):
        d = f16_at(w, base + 108)
        scales = self.load(w, base, 96, 3)
        hm = self.load(w, base, 4 * part, 1, step=4)
        out = []
        for h in range(2):
            qs = self.load(w, base, 32 + 32 * h + 4 * part, 1, step=4)
            for s in range(4):
                out.append(Group(128 * h + 32 * s + 4 * part, byte_units(self.three_bits(qs, hm, h, s), 3),
                                 self.scale(scales, h, s, part >> 2)))
        return Factored(out, d, 8, -12)  # q − 4 = 8·(unit − 1) − 4

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        part, piece = split_part(part, pieces)
        h, r, n = part >> 1, part & 1, 4 // pieces
        l0 = 16 * r + 4 * n * piece
        d = f16_at(w, base + 108)
        scales = self.load(w, base, 96, 3)
        qs = self.load(w, base, 32 + 32 * h + l0, n, step=4 * n)
        hm = self.load(w, base, l0, n, step=4 * n)
        return [IntGroup(128 * h + 32 * s + l0, signed_bytes(self.three_bits(qs, hm, h, s), 4),
                         d * self.scale(scales, h, s, r)) for s in range(4)]


def k_scales(head):
    """Q4_K/Q5_K: (scales, mins) of all 8 sub-blocks as f32, from the block's first 16 bytes as
    4 u32: the 6-bit values put together four at a time."""
    a, b, c = head[1:]
    sc = [a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)]
    mn = [b & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030)]
    return ([byte_of(sc[s >> 2], s & 3).to(f32) for s in range(8)],
            [byte_of(mn[s >> 2], s & 3).to(f32) for s in range(8)])


def k_scale_min(head, j):
    """Q4_K/Q5_K: (scale, min) of sub-blocks 2j and 2j+1 (j traced, 0..3), from the block's first
    16 bytes as 4 u32: 6-bit values, packed two sub-blocks per 16 bits."""
    sh = 16 * (j & 1)
    a, b, c = ((wd >> sh) & 0xFFFF for wd in head[1:])  # bytes 2j', 2j'+1 of each 4-byte row
    low = j < 2
    sc = zdsl.where(low, a & 0x3F3F, (c & 0x0F0F) | ((a >> 2) & 0x3030))
    mn = zdsl.where(low, b & 0x3F3F, ((c >> 4) & 0x0F0F) | ((b >> 2) & 0x3030))
    return [((sc >> (8 * t)) & 0xFF).to(f32) for t in (0, 1)], [((mn >> (8 * t)) & 0xFF).to(f32) for t in (0, 1)]


class Q4_K(Format):
    """144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles.
    Elements 64j..64j+31 are the low nibbles of bytes 32j..32j+31 (sub-block 2j), elements
    64j+32..64j+63 their high nibbles (sub-block 2j+1). w = d·sc·q − dmin·m."""
    name, block, nbytes, parts, iparts, f16_fields = "q4_k", 256, 144, 8, 4, (0, 2)
    ispan, ipieces = 64, 4

    def decode(self, w, base, part, ctx=None):
        head = self.load(w, base, 0, 4)
        d, dmin = half(head[0], False), half(head[0], True)
        sc, mn = k_scales(head)
        out = []
        for j in range(4):
            word = self.load(w, base, 16 + 32 * j + 4 * part, 1, step=4)[0]
            for t, s in ((0, 2 * j), (1, 2 * j + 1)):
                out.append(Group(32 * s + 4 * part, [unit(word, 8 * i + 4 * t, 4) for i in range(4)], sc[s], mn[s]))
        return Factored(out, d, 16, -16, -dmin)  # q = 16·(unit − 1)

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        part, piece = split_part(part, pieces)
        n = 8 // pieces
        l0 = 4 * n * piece
        head = self.load(w, base, 0, 4)
        d, dmin = half(head[0], False), half(head[0], True)
        sc, mn = k_scale_min(head, part)
        words = self.load(w, base, 16 + 32 * part + l0, n, step=4 * n)
        return [IntGroup(64 * part + 32 * t + l0, nib, d * sc[t], -(dmin * mn[t]))
                for t, nib in enumerate((low_nibbles(words), high_nibbles(words)))]


class Q5_K(Format):
    """176 bytes: f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of
    nibbles. As Q4_K, plus bit (2j + high) of qh[l] as bit 4 of element 64j + 32·high + l."""
    name, block, nbytes, parts, iparts, f16_fields = "q5_k", 256, 176, 8, 4, (0, 2)
    ispan, ipieces = 64, 4

    @staticmethod
    def with_high(nibbles, qh, bit):
        return [n | (((h >> bit) & 0x01010101) << 4) for n, h in zip(nibbles, qh)]

    def decode(self, w, base, part, ctx=None):
        head = self.load(w, base, 0, 4)
        d, dmin = half(head[0], False), half(head[0], True)
        sc, mn = k_scales(head)
        qh = self.load(w, base, 16 + 4 * part, 1, step=4)
        out = []
        for j in range(4):
            words = self.load(w, base, 48 + 32 * j + 4 * part, 1, step=4)
            for t, nib in enumerate((low_nibbles(words), high_nibbles(words))):
                s = 2 * j + t
                out.append(Group(32 * s + 4 * part, byte_units(self.with_high(nib, qh, s), 5), sc[s], mn[s]))
        return Factored(out, d, 32, -32, -dmin)  # q = 32·(unit − 1)

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        part, piece = split_part(part, pieces)
        n = 8 // pieces
        l0 = 4 * n * piece
        head = self.load(w, base, 0, 4)
        d, dmin = half(head[0], False), half(head[0], True)
        sc, mn = k_scale_min(head, part)
        qh = self.load(w, base, 16 + l0, n, step=4 * n)
        words = self.load(w, base, 48 + 32 * part + l0, n, step=4 * n)
        return [IntGroup(64 * part + 32 * t + l0, self.with_high(nib, qh, 2 * part + t), d * sc[t], -(dmin * mn[t]))
                for t, nib in enumerate((low_nibbles(words), high_nibbles(words)))]


def six_bits(ql, qh, g: int):
    """Q6_K: the 6-bit values of group g (0..3) of four bytes: low (g < 2) or high nibbles of the
    ql word, bits 2g of the qh word above them."""
    nib = (ql >> 4 if g >= 2 else ql) & 0x0F0F0F0F
    return nib | ((qh << (4 - 2 * g) if g < 2 else qh >> (2 * g - 4)) & 0x30303030)


class Q6_K(Format):
    """210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d.
    For half n and l in 0..31, byte ql[64n+l], ql[64n+l+32] and qh[32n+l] give elements
    128n + l + {0, 32, 64, 96} with scales 8n + l/16 + {0, 2, 4, 6}. w = d·scale·(q − 32)."""
    name, block, nbytes, parts, iparts, f16_fields = "q6_k", 256, 210, 8, 4, (208,)
    ispan, ipieces = 128, 4

    def quants(self, w, base, n, l0, count):
        """Per g = 0..3, the bytes of 6-bit values of elements 128n + 32g + l0 .. + 4·count, and
        the sub-blocks' scales (d·scale) as f32."""
        d = f16_at(w, base + 208)
        step = min(8, 4 * count)
        ql_a = self.load(w, base, 64 * n + l0, count, step=step)
        ql_b = self.load(w, base, 64 * n + 32 + l0, count, step=step)
        qh = self.load(w, base, 128 + 32 * n + l0, count, step=step)
        scales = self.load(w, base, 192 + 8 * n, 2, step=8)
        out = []
        for g in range(4):
            sc = d * sbyte(scales[g >> 1], (l0 >> 4) + 2 * (g & 1)).to(f32)
            out.append(([six_bits(ql, h, g) for ql, h in zip(ql_b if g & 1 else ql_a, qh)], sc))
        return out

    def decode(self, w, base, part, ctx=None):
        d = f16_at(w, base + 208)
        out = []
        for n in range(2):
            ql_a, ql_b, qh = (self.load(w, base, at + 4 * part, 1, step=4)[0] for at in (64 * n, 64 * n + 32, 128 + 32 * n))
            for g in range(4):  # scale byte 8n + 2g + part/4
                sc = sbyte(w.view(u16)[(base + 192 + 8 * n + 2 * g) >> 1], part >> 2).to(f32)
                q = six_bits(ql_b if g & 1 else ql_a, qh, g)
                out.append(Group(128 * n + 32 * g + 4 * part, byte_units([q], 6), sc))
        return Factored(out, d, 64, -96)  # q − 32 = 64·(unit − 1) − 32

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        part, piece = split_part(part, pieces)
        count = 4 // pieces
        n, l0 = part >> 1, (part & 1) * 16 + 4 * count * piece
        return [IntGroup(128 * n + 32 * g + l0, signed_bytes(q, 32), sc)
                for g, (q, sc) in enumerate(self.quants(w, base, n, l0, count))]


def shared_table(dtype, values: list):
    """A constant table copied into shared memory by the whole workgroup, for a kernel's set-up:
    the lanes of a subgroup look up different entries at once, which a constant table serves one
    address at a time on some GPUs. A table larger than the workgroup is copied in a loop the GPU
    runs: one read of the constant table in the code (an unrolled copy of the IQ grids' 1024 or
    2048 words read it hundreds of times, and lavapipe's compiler, which makes each read of a
    constant array a copy of the whole array, ran out of memory)."""
    n = len(values)
    constants = zdsl.table(dtype, values)
    table = zdsl.shared(dtype, n)
    wg = zdsl.workgroup_size(0) * zdsl.workgroup_size(1) * zdsl.workgroup_size(2)
    if n <= wg:
        i = zdsl.local_index()
        with zdsl.if_(i < n):
            table[i] = constants[i]
    else:
        for i in zdsl.range(zdsl.local_index(), n, wg):
            table[i] = constants[i]
    zdsl.barrier()
    return table


class Levels(Format):
    """Formats whose 4-bit codes index a table of 16 levels (LEVELS). Matrix-vector kernels copy
    it into shared memory at their start (`setup`, shared_table); kernels without the set-up (the
    embedding lookup) read the constant table."""
    LEVELS: tuple = ()

    def table(self):
        return f32, [float(v) for v in self.LEVELS]

    def levels(self, words, shift, ctx):
        """The levels of the nibbles at bit `shift` (0 or 4, maybe traced) of the bytes of `words`."""
        table = self.lookup(ctx)
        return [table[(wd >> (8 * i + shift)) & 0xF] for wd in words for i in range(4)]


class IQ4(Levels):
    """Shared by the two IQ4 formats: 4-bit indices into IQ4_LEVELS."""
    LEVELS = IQ4_LEVELS


class IQ4_NL(IQ4):
    """18 bytes: f16 d, 16 bytes of 4-bit indices laid out as Q4_0. w = d·level."""
    name, block, nbytes, parts, f16_fields = "iq4_nl", 32, 18, 2, (0,)

    def decode(self, w, base, part, ctx=None):
        d = f16_at(w, base)
        words = self.load(w, base, 2 + part * 8, 2, step=2)
        return [Group(part * 8 + 16 * high, self.levels(words, 4 * high, ctx), d) for high in (0, 1)]


class IQ4_XS(IQ4):
    """136 bytes: f16 d, u16 of 2-bit high scale parts, 4 bytes of 4-bit low scale parts, 128
    bytes of indices; sub-block i (32 elements) is bytes 16i..16i+15 as in IQ4_NL, with scale
    (low nibble i | high bits 2i << 4) − 32. w = d·scale·level."""
    name, block, nbytes, parts, f16_fields = "iq4_xs", 256, 136, 16, (0,)

    def decode(self, w, base, part, ctx=None):
        head = self.load(w, base, 0, 2)
        d = half(head[0], False)
        lane, out = part & 7, []
        for k in range(4):  # sub-blocks i = 2k + part/8, elements 4·lane.. of each: nibbles 4·(lane/4) of bytes 4·(lane%4)..
            i = 2 * k + (part >> 3)
            low = (head[1] >> (4 * i)) & 0xF
            high = (head[0] >> (16 + 2 * i)) & 3
            words = self.load(w, base, 8 + 16 * i + 4 * (lane & 3), 1, step=4)
            out.append(Group(32 * i + 4 * lane, self.levels(words, 4 * (lane >> 2), ctx),
                             (low | (high << 4)).to(f32) - 32.0))
        return Factored(out, d, 1, 0)


class MXFP4(Levels):
    """17 bytes: an E8M0 exponent e, 16 bytes of 4-bit codes laid out as in Q4_0, indexing the FP4
    (E2M1) values doubled (quant_numpy.MXFP4_LEVELS). w = 2^(e − 128)·level. Blocks of 17 bytes start
    at any byte, so the codes are read a byte at a time."""
    name, block, nbytes, parts, e8m0_fields = "mxfp4", 32, 17, 2, (0,)
    LEVELS = tuple(int(v) for v in MXFP4_LEVELS)

    def decode(self, w, base, part, ctx=None):
        e = w.view(u8)[base]
        d = zdsl.bitcast(zdsl.where(e < 2, zdsl.where(e == 0, 0x00200000, 0x00400000, u32), (e - 1) << 23, u32), f32)
        words = self.load(w, base, 1 + part * 8, 2, step=1)
        return [Group(part * 8 + 16 * high, self.levels(words, 4 * high, ctx), d) for high in (0, 1)]


def sign_bits(index):
    """The 8 signs a 7-bit index stands for (quant_numpy.sign_byte): the index, and an eighth bit that
    makes the number of negatives even."""
    parity = index ^ (index >> 4)
    parity = parity ^ (parity >> 2)
    return index | (((parity ^ (parity >> 1)) & 1) << 7)


def quad_signs(aux, q):
    """The signs of elements 4q … 4q + 3 of a run (bits 0-3; higher bits belong to later
    elements), from the run's u32 of four 7-bit sign indices (IQ2_XXS, IQ3_XXS)."""
    return sign_bits((aux >> (7 * (q >> 1))) & 0x7F) >> (4 * (q & 1))


def signed_values(point, signs) -> list:
    """The 4 bytes of a grid word as f32, byte j negated where bit j of `signs` is set."""
    return [byte_of(point, j).to(f32) * (1.0 - 2.0 * ((signs >> j) & 1).to(f32)) for j in range(4)]


def iq2_scale(d, ls):
    """IQ2's d·(0.5 + ls)·0.25 for a 4-bit scale ls."""
    return d * (0.5 + ls.to(f32)) * 0.25


class Grid(Format):
    """IQ formats whose indices name points of a fixed grid (quant_numpy.iq_grid), held as a table of
    u32 words, 4 values a word (`grid_words`; Format.table: copied into shared memory where
    kernels set up; kernels without the set-up, the embedding lookup, read the constant table)."""
    qtype: QuantType

    def grid_words(self) -> list[int]:
        return [int(w) for w in iq_grid(self.qtype).view("<u4").reshape(-1)]

    def table(self):
        return u32, self.grid_words()


@cache
def two_bit_words(qtype) -> list[int]:
    """A grid of three levels (IQ2's 8, 25, 43; IQ1's −1, 0, 1) as 2-bit codes, each value its
    level's rank, lowest first: 16 bits a point, two points a u32."""
    grid = iq_grid(qtype)
    levels = sorted(set(int(v) for v in grid.flat))
    points = [sum(levels.index(int(v)) << (2 * j) for j, v in enumerate(row)) for row in grid]
    return [points[i] | (points[i + 1] << 16) for i in range(0, len(points), 2)]


class TwoBitGrid(Grid):
    """Grids of 8 values from three levels, kept as two_bit_words: a quarter of their bytes."""

    def grid_words(self) -> list[int]:
        return two_bit_words(self.qtype)

    @staticmethod
    def codes(grid, index, half):
        """The codes of elements 4·half … 4·half + 3 of grid point `index`: the low 8 bits (higher
        bits belong to other elements)."""
        return grid[index >> 1] >> (16 * (index & 1) + 8 * half)


def iq2_bytes(codes):
    """IQ2's values 8, 25, 43 of four 2-bit codes (the low 8 bits of `codes`), a byte each."""
    b = (codes & 3) | ((codes & 0xC) << 6) | ((codes & 0x30) << 12) | ((codes & 0xC0) << 18)
    return 0x08080808 + 17 * b + ((b >> 1) & 0x01010101)


class IQ3_XXS(Grid):
    """98 bytes: f16 d, 64 grid indices (a byte each, naming 4 values of quant_numpy.iq3_grid), and
    per 32-element run a u32 of four 7-bit sign indices (8 elements each; the eighth sign makes
    the count of negatives even) under a 4-bit scale ls. w = d·(0.5 + ls)·0.5 · ±grid. Part p
    takes elements 4p … 4p + 3 of each run: one index byte and four signs; in the int8 path, run
    p whole. The grid is a table of 256 u32 (four bytes each), copied into shared memory where
    kernels set up."""
    name, block, nbytes, parts, iparts, f16_fields = "iq3_xxs", 256, 98, 8, 8, (0,)
    ispan = 32
    qtype = QuantType.IQ3_XXS

    @staticmethod
    def scale(d, aux):
        """A run's d·(0.5 + ls)·0.5, ls the top 4 bits of its u32 of sign indices."""
        return d * (0.5 + (aux >> 28).to(f32)) * 0.5

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        out = []
        for run in range(8):
            aux = self.load(w, base, 66 + 4 * run, 1)[0]
            point = grid[w.view(u8)[base + 2 + 8 * run + part]]
            out.append(Group(32 * run + 4 * part, signed_values(point, quad_signs(aux, part)), self.scale(d, aux)))
        return out

    def int_groups(self, w, base, part, ctx=None, pieces=1):
        """Run `part` whole: its 8 grid points as bytes (4 … 62), negated where the signs say so;
        a byte's negation is (b ^ 0xFF) + 1, which cannot carry into the next byte."""
        grid = self.lookup(ctx)
        aux = self.load(w, base, 66 + 4 * part, 1)[0]
        indices = self.load(w, base, 2 + 8 * part, 2, step=2)
        words = []
        for i in range(8):
            point = grid[(indices[i >> 2] >> (8 * (i & 3))) & 0xFF]
            ones = spread_bits(quad_signs(aux, i) & 0xF, 0)
            words.append((point ^ (ones * 0xFF)) + ones)
        return [IntGroup(32 * part, words, self.scale(f16_at(w, base), aux))]


class IQ2_XXS(TwoBitGrid):
    """66 bytes: f16 d, then per 32-element run two u32: four grid indices (a byte each, naming 8
    values of 8, 25 or 43), and four 7-bit sign indices (8 elements each, as IQ3_XXS's) under a
    4-bit scale ls. w = d·(0.5 + ls)·0.25 · ±grid. Part p takes elements 4p … 4p + 3 of each run:
    half p & 1 of grid point p >> 1 and four of its signs. The grid is a table of 128 u32
    (two_bit_words), copied into shared memory where kernels set up."""
    name, block, nbytes, parts, f16_fields = "iq2_xxs", 256, 66, 8, (0,)
    qtype = QuantType.IQ2_XXS

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        out = []
        for run in range(8):
            aux = self.load(w, base, 2 + 8 * run + 4, 1)[0]
            point = iq2_bytes(self.codes(grid, w.view(u8)[base + 2 + 8 * run + (part >> 1)], part & 1))
            out.append(Group(32 * run + 4 * part, signed_values(point, quad_signs(aux, part)), iq2_scale(d, aux >> 28)))
        return out


class IQ2_XS(TwoBitGrid):
    """74 bytes: f16 d, 32 u16 (8 elements each: a 9-bit grid index naming 8 values of 8, 25 or
    43, under a 7-bit sign index as IQ2_XXS's), and 8 bytes of 4-bit scales ls (16 elements
    each, low nibble first). w = d·(0.5 + ls)·0.25 · ±grid. Part p takes elements 4p … 4p + 3 of
    each run: half p & 1 of the run's grid point p >> 1, under the run's scale p >> 2. The grid
    is a table of 256 u32 (two_bit_words), copied into shared memory where kernels set up."""
    name, block, nbytes, parts, f16_fields = "iq2_xs", 256, 74, 8, (0,)
    qtype = QuantType.IQ2_XS

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        scales = self.load(w, base, 66, 2)
        out = []
        for run in range(8):
            q = w.view(u16)[((base + 2 + 8 * run) >> 1) + (part >> 1)]
            point = iq2_bytes(self.codes(grid, q & 511, part & 1))
            signs = sign_bits(q >> 9) >> (4 * (part & 1))
            ls = (byte_of(scales[run >> 2], run & 3) >> (4 * (part >> 2))) & 0xF
            out.append(Group(32 * run + 4 * part, signed_values(point, signs), iq2_scale(d, ls)))
        return out


class IQ2_S(TwoBitGrid):
    """82 bytes: f16 d, 32 low bytes of 10-bit grid indices (8 elements each, naming 8 values of 8,
    25 or 43), 32 sign bytes (bit j: element j negative), 8 bytes of the indices' top 2 bits (four
    a byte), and 8 bytes of 4-bit scales ls (16 elements each, low nibble first). w = d·(0.5 +
    ls)·0.25 · ±grid. Part p takes elements 4p … 4p + 3 of each run: half p & 1 of the run's grid
    point p >> 1 under the run's scale p >> 2. The grid is a table of 512 u32 (2 KiB;
    two_bit_words), copied into shared memory where kernels set up."""
    name, block, nbytes, parts, f16_fields = "iq2_s", 256, 82, 8, (0,)
    qtype = QuantType.IQ2_S

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        high, scales = self.load(w, base, 66, 2), self.load(w, base, 74, 2)
        b, k = w.view(u8), part >> 1
        out = []
        for run in range(8):
            index = b[base + 2 + 4 * run + k] | (((byte_of(high[run >> 2], run & 3) >> (2 * k)) & 3) << 8)
            point = iq2_bytes(self.codes(grid, index, part & 1))
            signs = b[base + 34 + 4 * run + k] >> (4 * (part & 1))
            ls = (byte_of(scales[run >> 2], run & 3) >> (4 * (part >> 2))) & 0xF
            out.append(Group(32 * run + 4 * part, signed_values(point, signs), iq2_scale(d, ls)))
        return out


class IQ3_S(Grid):
    """110 bytes: f16 d, 64 low bytes of 9-bit grid indices (4 elements each, naming 4 odd values
    1 … 15), 8 bytes of the indices' top bits (bit i of byte r: index 8r + i), 32 sign bytes (bit
    j: element j negative), and 4 bytes of 4-bit scales ls (32 elements each, low nibble first).
    w = d·(1 + 2·ls) · ±grid. Part p takes elements 4p … 4p + 3 of each run: its grid point p and
    half p & 1 of its sign byte p >> 1. The grid is a table of 512 u32 (four bytes each), copied
    into shared memory where kernels set up."""
    name, block, nbytes, parts, f16_fields = "iq3_s", 256, 110, 8, (0,)
    qtype = QuantType.IQ3_S

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        high, scales = self.load(w, base, 66, 2), self.load(w, base, 106, 1)[0]
        b = w.view(u8)
        out = []
        for run in range(8):
            index = b[base + 2 + 8 * run + part] | (((byte_of(high[run >> 2], run & 3) >> part) & 1) << 8)
            signs = b[base + 74 + 4 * run + (part >> 1)] >> (4 * (part & 1))
            ls = (scales >> (4 * run)) & 0xF
            out.append(Group(32 * run + 4 * part, signed_values(grid[index], signs), d * ((ls << 1) | 1).to(f32)))
        return out


class IQ1(TwoBitGrid):
    """Shared by IQ1_S and IQ1_M: 11-bit indices name 8 values of −1, 0 or 1 (quant_numpy.iq_grid;
    IQ1_M uses IQ1_S's), kept as 2-bit codes c = value + 1 (two_bit_words): a table of 1024 u32
    (4 KiB), copied into shared memory where kernels set up. w = dl·(value + delta), delta = ±1/8
    per point; in unit form 4·dl·(1 + c/4) + dl·(delta − 5)."""
    qtype = QuantType.IQ1_S

    def group(self, grid, offset, index, half, dl, negative) -> Group:
        """Elements 4·half … 4·half + 3 of grid point `index`, w = dl·(value ± 1/8)."""
        codes = self.codes(grid, index, half)
        delta = zdsl.where(negative, -0.125, 0.125)
        return unit_group(offset, [unit(codes, 2 * j, 2) for j in range(4)], 2, dl, dl * (delta - 1.0))


class IQ1_S(IQ1):
    """50 bytes: f16 d, 32 low bytes of 11-bit grid indices (8 elements each), and per 32-element
    run a u16: the run's four indices' top 3 bits (bits 0, 3, 6, 9), a 3-bit scale ls (bit 12)
    and the sign of delta (bit 15). w = d·(2·ls + 1)·(grid ± 1/8). Part p takes elements
    4p … 4p + 3 of each run: half p & 1 of its grid point p >> 1."""
    name, block, nbytes, parts, f16_fields = "iq1_s", 256, 50, 8, (0,)

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        d = f16_at(w, base)
        k = part >> 1
        out = []
        for run in range(8):
            qh = w.view(u16)[(base + 34 + 2 * run) >> 1]
            index = w.view(u8)[base + 2 + 4 * run + k] | (((qh >> (3 * k)) & 7) << 8)
            dl = d * (((qh >> 11) & 0xE) | 1).to(f32)  # 2·ls + 1
            out.append(self.group(grid, 32 * run + 4 * part, index, part & 1, dl, (qh & 0x8000) != 0))
        return out


class IQ1_M(IQ1):
    """56 bytes: 32 low bytes of 11-bit grid indices (8 elements each), 16 bytes of nibbles (index
    i: nibble i; its top 3 bits, and bit 3 the sign of delta), and four u16 of 3-bit scales ls
    (16 elements each, bits 0, 3, 6, 9) whose top nibbles hold the f16 d, lowest first. w =
    d·(2·ls + 1)·(grid ± 1/8). Part p takes elements 4p … 4p + 3 of each run: half p & 1 of its
    grid point p >> 1, under its scale p >> 2."""
    name, block, nbytes, parts = "iq1_m", 256, 56, 8

    def finite_scales(self, rng, blocks, bound: float):
        set_iq1_m_d_bits(blocks, rng.uniform(-bound, bound, blocks.shape[:-1]).astype("<f2").view("<u2"))

    def decode(self, w, base, part, ctx=None):
        grid = self.lookup(ctx)
        sc = self.load(w, base, 48, 2)  # the four u16
        d = zdsl.f16_bits(((sc[0] >> 12) & 0xF) | ((sc[0] >> 24) & 0xF0) | ((sc[1] >> 4) & 0xF00)
                          | ((sc[1] >> 16) & 0xF000))
        high = self.load(w, base, 32, 4)
        k = part >> 1
        out = []
        for run in range(8):  # grid points 4·run + k, scale 2·run + (part >> 2)
            nibble = (byte_of(high[run >> 1], 2 * (run & 1) + (part >> 2)) >> (4 * (k & 1))) & 0xF
            index = w.view(u8)[base + 4 * run + k] | ((nibble & 7) << 8)
            ls = (sc[run >> 2] >> (16 * ((run >> 1) & 1) + 6 * (run & 1) + 3 * (part >> 2))) & 7
            dl = d * ((ls << 1) | 1).to(f32)
            out.append(self.group(grid, 32 * run + 4 * part, index, part & 1, dl, (nibble & 8) != 0))
        return out


FORMATS: dict[str, Format] = {f.name: f for f in (F32(), F16(), BF16(), Q8_0(), Q4_0(), Q4_1(), Q5_0(), Q5_1(),
                                                  Q2_K(), Q3_K(), Q4_K(), Q5_K(), Q6_K(), IQ4_NL(), IQ4_XS(),
                                                  MXFP4(), IQ3_XXS(), IQ2_XXS(), IQ2_XS(), IQ2_S(), IQ3_S(),
                                                  IQ1_S(), IQ1_M())}
INT8_FORMATS = [name for name, f in FORMATS.items() if f.iparts]


def fmt(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise zdsl.ZdslError(f"no GPU decoder for weight type {name} (have: {', '.join(FORMATS)})") from None


__all__ = ["Group", "Factored", "IntGroup", "Format", "FORMATS", "INT8_FORMATS", "IQ4_LEVELS", "fmt", "f16_at",
           "words_at", "f16"]
