"""Q8_1, the activation format of the int8 products, and the normed vectors projections read.

Q8_1 here: per 32 activations, d = max|x| / 127, q = round(x / d) (halves away from zero, as
ggml), s = d·Σq. On the GPU the quants are `xq` (u32, four int8 each, in element order: k/4
words per vector) and the scales `xd` (f32 pairs (d, s) per block: k/16 floats per vector) —
f32 rather than ggml's f16, so no rounding beyond the quants'.

The projections of a decode step read three vectors in Q8_1: the residual stream normed
(attn_norm, post_attention_norm, output_norm), the attention output and the delta-net output.
Each is written once, by whoever finishes it, in f32 (for weights without an int8 decoder) and
as Q8_1, so no projection quantizes for itself.

A normed vector rmsnorm(x) · w is written *deferred*: hn = x ⊙ w (f32 and Q8_1) and `ss`, the
Σx² of each block of 32; its consumers scale their dot products by rsqrt(Σ ss / n + eps)
(`RmsPartials`). Every piece is local to a block of 32, so whoever finishes a block of x can
write it — the expert down projection, whose workgroups own 32 rows each, writes the next
layer's input that way (dmmv.moe_down_all), and the router the experts' — and no
dispatch waits for the whole of x just to norm it. `norm_q8_1` writes it where no kernel
before does (after the embedding; the dense FFN's residuals). The attention and delta-net
kernels write their (unnormed) outputs. The SwiGLU output feeding the down projections stays
f32 (see docs/PERF.md).

Tried and dropped, on the H100: the residual norm in the last workgroup of the dispatch that adds
to x (2048 workgroups serializing on one arrival counter: ~13 µs against ~5 µs for the extra
dispatch), and the SwiGLU output quantized by the last writer of each block (the fences and
atomics of thousands of workgroups cost more than the smaller reads saved: 3% slower).
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, i32, u32
from zdsl.kernels.formats import q8_1_quantize
from zdsl.kernels.reduce import SUBGROUPS


def store_q8_1(v, i, valid, xq, xd):
    """Invocation i's four values v (a vec4) into Q8_1 block i // 8, where `valid`. Eight
    consecutive invocations hold a block: call in control flow uniform over each eight."""
    a = zdsl.abs(v)
    amax = zdsl.subgroup_max(zdsl.max(zdsl.max(a.x, a.y), zdsl.max(a.z, a.w)), cluster=8)
    d = amax / 127.0
    inv = zdsl.where(amax > 0.0, 1.0 / d, 0.0)
    lanes = [round_away(t * inv) for t in (v.x, v.y, v.z, v.w)]
    packed = zdsl.bitcast(lanes[0], u32) & 0xFF
    for j in range(1, 4):
        packed = packed | ((zdsl.bitcast(lanes[j], u32) & 0xFF) << (8 * j))
    qsum = zdsl.subgroup_sum(lanes[0] + lanes[1] + lanes[2] + lanes[3], cluster=8)
    with zdsl.if_(valid):
        xq[i] = packed
        with zdsl.if_((i & 7) == 0):
            xd.vec2[i >> 3] = zdsl.vec(d, d * qsum.to(f32))


def round_away(v):
    """C roundf (halves away from zero) as an i32, exactly: |v| − floor(|v|) is exact."""
    a = zdsl.abs(v)
    f = zdsl.floor(a)
    r = (f + zdsl.where(a - f >= 0.5, 1.0, 0.0)).to(i32)
    return zdsl.where(v < 0.0, -r, r)


MAX_PARTIALS = 256  # blocks of a normed vector a consumer sums (n ≤ 8192): its loads are unrolled


class RmsPartials:
    """The rms scale of a deferred normed vector, rsqrt(Σ ss / n + eps), for its consumer:
    created at the top of a kernel (each lane loads its share of the per-block Σx², all in
    flight together, ahead of the kernel's own loads), `.scale()` where the dot products are
    finished. Valid in every lane of each subgroup; no barrier."""

    def __init__(self, ss, n, SG: int):
        blocks, lane = n >> 5, zdsl.lane_id()
        index = [lane + SG * j for j in range(-(-MAX_PARTIALS // SG))]
        self.parts = [ss.load(i, mask=i < blocks, other=0.0) for i in index]
        self.n = n

    def scale(self, eps):
        total = self.parts[0]
        for p in self.parts[1:]:
            total = total + p
        return zdsl.rsqrt(zdsl.subgroup_sum(total) / self.n.to(f32) + eps)


def store_normed(v, w, i, valid, hn, xq, xd, ss):
    """Quad i of a deferred normed vector from x's values v and the norm weights w (vec4s):
    hn, its Q8_1, and the Σx² of its block. Eight consecutive invocations hold a block: call in
    control flow uniform over each eight."""
    value = v * w
    with zdsl.if_(valid):
        hn.vec4[i] = value
    store_q8_1(value, i, valid, xq, xd)
    squares = zdsl.subgroup_sum(zdsl.dot(v, v), cluster=8)
    with zdsl.if_(valid & ((i & 7) == 0)):
        ss[i >> 3] = squares


def check_partials(n: int, name: str) -> None:
    if n % 32 or n // 32 > MAX_PARTIALS:
        raise zdsl.ZdslError(f"{name} is {n} wide; zdsl's normed vectors need a multiple of 32 up to "
                             f"{32 * MAX_PARTIALS}")


@zdsl.kernel(workgroup=64, subgroup="SG", variants={"SG": SUBGROUPS})
def quantize_q8_1(x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], n: u32, SG: Const = 32):
    """Q8_1 blocks of x[0:n] (n a multiple of 32; several vectors back to back are one long
    vector): eight invocations per block, four values each (one 16-byte load, one u32 store).
    Grid: ceil(n / 256)."""
    i = zdsl.global_id()
    n4 = n >> 2
    store_q8_1(x.vec4[zdsl.min(i, n4 - 1)], i, i < n4, xq, xd)


@quantize_q8_1.reference
def quantize_q8_1_ref(x):
    """(q int8, d, s) per block of 32 as ggml makes them; ggml rounds d and s to f16, the kernel
    keeps them f32 (and its 1/d may differ by an ulp, moving a q that sits on a half by one)."""
    return q8_1_quantize(np.asarray(x, np.float32).reshape(-1, 32))


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256], "SG": SUBGROUPS})
def norm_q8_1(x: Buffer[f32], norm_w: Buffer[f32], hn: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32],
              ss: Buffer[f32], n: u32, WG: Const = 64, SG: Const = 32):
    """rmsnorm(x[0:n]) · norm_w deferred (n a multiple of 32): hn = x ⊙ norm_w in f32 and as
    Q8_1, and ss = Σx² per block, which the next projections read. One quad per invocation.
    Grid: ceil(n / (4·WG))."""
    i = zdsl.global_id()
    n4 = n >> 2
    at = zdsl.min(i, n4 - 1)
    store_normed(x.vec4[at], norm_w.vec4[at], i, i < n4, hn, xq, xd, ss)


@norm_q8_1.reference
def norm_q8_1_ref(x, norm_w):
    """(hn f32, ss): the deferred normed vector (its Q8_1 is q8_1_ref(hn))."""
    x = np.asarray(x, np.float32)
    return x * np.asarray(norm_w, np.float32), squares_ref(x)


def squares_ref(x) -> np.ndarray:
    """Σx² per block of 32, as ss holds it."""
    return (np.asarray(x, np.float64).reshape(-1, 32) ** 2).sum(axis=1)


def rms_ref(ss, eps) -> float:
    """The scale a consumer applies: rsqrt(mean(x²) + eps) from the block sums."""
    ss = np.asarray(ss, np.float64)
    return float(1 / np.sqrt(ss.sum() / (32 * ss.size) + eps))


def q8_1_ref(x) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 (..., n), d f32 (..., n/32)) as the kernels quantize: d = max|x| / 127 and
    q = round(x · (1/d)), halves away from zero, in f32. (ggml differs only in rounding d to f16.)"""
    x = np.asarray(x, np.float32)
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    t = b * inv[:, None]
    q = (np.sign(t) * np.floor(np.abs(t) + np.float32(0.5))).astype(np.int8)
    return q.reshape(x.shape), d.reshape(*x.shape[:-1], -1)


def q8_1_buffers(x) -> tuple[np.ndarray, np.ndarray]:
    """(xq, xd): the Q8_1 buffers of x as the kernels write them (q8_1_ref; q8_1_values inverts)."""
    q, d = q8_1_ref(np.asarray(x, np.float32).reshape(-1))
    return q.view(np.uint32), np.stack([d, d * q.reshape(-1, 32).sum(axis=1)], axis=1).astype(np.float32).reshape(-1)


def q8_1_values(xq, xd) -> np.ndarray:
    """The activations the Q8_1 buffers stand for (q·d), as float64."""
    q = np.asarray(xq, np.uint32).view(np.int8).reshape(-1, 32).astype(np.float64)
    return (q * np.asarray(xd, np.float32).reshape(-1, 2)[:, :1]).reshape(-1)
