"""Q8_1, the activation format of the int8 products, and the normed vectors projections read.

Q8_1 here: per 32 activations, d = max|x| / 127, q = round(x / d) (halves away from zero, as
ggml), s = d·Σq. On the GPU the quants are `xq` (u32, four int8 each, in element order: k/4
words per vector) and the scales `xd` (f32 pairs (d, s) per block: k/16 floats per vector) —
f32 rather than ggml's f16, so no rounding beyond the quants'.

The projections of a decode step read three vectors in Q8_1: the residual stream normed
(attn_norm, post_attention_norm, output_norm), the attention output and the delta-net output.
Each is written once, by whoever finishes it, in f32 (for weights without an int8 decoder) and
as Q8_1, so no projection normalises or quantizes for itself: `norm_q8_1` for the residual
stream (one small dispatch after each addition to it), except before a MoE block, where the
router norms x itself as it reads it (moe.moe_router); the attention and delta-net kernels for
their outputs. The SwiGLU output feeding the down projections stays f32 (why: below).

Tried and dropped, on the H100: the residual norm in the last workgroup of the dispatch that adds
to x (2048 workgroups serializing on one arrival counter: ~13 µs against ~5 µs for the extra
dispatch), and the SwiGLU output quantized by the last writer of each block (the fences and
atomics of thousands of workgroups cost more than the smaller reads saved: 3% slower).
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f16, f32, i32, u32
from zdsl.kernels.quant_numpy import q8_1_quantize
from zdsl.kernels.norm import rms_norm_ref
from zdsl.kernels.reduce import SUBGROUPS, workgroup_sums


def quantize_8bit(v):
    """ggml's 8-bit rounding of a block of 32 held four values (a vec4) per invocation by eight
    consecutive invocations: d = max|x| / 127, q = round(x / d) (through 1/d). Returns (d, this
    invocation's four q as i32, the four packed as int8 bytes of a u32). Call in control flow
    uniform over each eight."""
    a = zdsl.abs(v)
    amax = zdsl.subgroup_max(zdsl.max(zdsl.max(a.x, a.y), zdsl.max(a.z, a.w)), cluster=8)
    d = amax / 127.0
    inv = zdsl.where(amax > 0.0, 1.0 / d, 0.0)
    lanes = [round_away(t * inv) for t in (v.x, v.y, v.z, v.w)]
    packed = zdsl.bitcast(lanes[0], u32) & 0xFF
    for j in range(1, 4):
        packed = packed | ((zdsl.bitcast(lanes[j], u32) & 0xFF) << (8 * j))
    return d, lanes, packed


def store_q8_1(v, i, valid, xq, xd):
    """Invocation i's four values v (a vec4) into Q8_1 block i // 8, where `valid`. Eight
    consecutive invocations hold a block: call in control flow uniform over each eight."""
    d, lanes, packed = quantize_8bit(v)
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


def write_normed(x, norm_w, hn, xq, xd, n, eps, WG: int, SG: int, row=0, gate=None, h=None):
    """hn = rmsnorm(x) · norm_w (· silu(gate), a buffer laid out as x, where given) for row `row`
    of n values, in f32 and, unless xq is None, as Q8_1 (xq, xd; rows back to back; n a multiple
    of 32), and in f16 where h is given (what products on matrix units read), by one workgroup
    of WG invocations. Two passes over x (Σx²,
    then the outputs) in 16-byte loads; invocation t takes quads t, t + WG, …, so eight
    neighbours hold a block. The loops are GPU loops, not unrolled: in the decode step this
    kernel's code comes from memory every time (the weights streaming through L2 evict it), and
    code costs more than the latency that unrolled loads would overlap (docs/DESIGN.md)."""
    n4 = n >> 2
    first = row * n4
    t = zdsl.local_index()
    acc = zdsl.var(0.0)
    for i in zdsl.range(t, n4, WG):
        v = x.vec4[first + i]
        acc += zdsl.dot(v, v)
    (total,) = workgroup_sums([acc], WG, SG)
    scale = zdsl.rsqrt(total / n.to(f32) + eps)
    for base in zdsl.range(0, n4, WG):  # uniform trip count: store_q8_1 works across invocations
        i = base + t
        ok = i < n4
        at = zdsl.min(i, n4 - 1)
        v = x.vec4[first + at] * norm_w.vec4[at] * scale
        if gate is not None:
            v = v * zdsl.silu(gate.vec4[first + at])
        with zdsl.if_(ok):
            hn.vec4[first + i] = v
            if h is not None:
                h.vec4[first + i] = v.to(f16.vec(4))
        if xq is not None:
            store_q8_1(v, first + i, ok, xq, xd)


@zdsl.kernel(workgroup=64, subgroup="SG", variants={"SG": SUBGROUPS}, grid=lambda v, s: -(-s.n // 256))
def quantize_q8_1(x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], n: u32, SG: Const = 32):
    """Q8_1 blocks of x[0:n] (n a multiple of 32; several vectors back to back are one long
    vector): eight invocations per block, four values each (one 16-byte load, one u32 store)."""
    i = zdsl.global_id()
    n4 = n >> 2
    store_q8_1(x.vec4[zdsl.min(i, n4 - 1)], i, i < n4, xq, xd)


def quantize_q8_1_ref(x):
    """(q int8, d, s) per block of 32 as ggml makes them; ggml rounds d and s to f16, the kernel
    keeps them f32 (and its 1/d may differ by an ulp, moving a q that sits on a half by one)."""
    return q8_1_quantize(np.asarray(x, np.float32).reshape(-1, 32))


def _norm_traffic(v, s) -> int:
    return s.rows * (13 * s.n + s.n // 4 + (2 * s.n if v.HALVES else 0))


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"WG": [64, 256, 512], "HALVES": [False, True], "SG": SUBGROUPS},
             key=("n",), sizes=("rows",), grid=lambda v, s: s.rows, traffic=_norm_traffic)
def norm_q8_1(x: Buffer[f32], norm_w: Buffer[f32], hn: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], h: Buffer[f16],
              n: u32, eps: f32, HALVES: Const = False, WG: Const = 512, SG: Const = 32):
    """hn = rmsnorm(x) · norm_w per row of n values, in f32 and as Q8_1 (n a multiple of 32), with
    HALVES also in f16 (h): what the next projections read, on the int8 path or on matrix units
    (the f16 rows made here rather than by a dispatch of their own). One workgroup per row (a
    residual stream is a few thousand values): the launch's `rows`, one at decode, a chunk's
    tokens at prefill."""
    write_normed(x, norm_w, hn, xq, xd, n, eps, WG, SG, row=zdsl.workgroup_id(), h=h if HALVES else None)


def norm_q8_1_ref(x, norm_w, eps):
    """(hn f32, q int8, d, s): the normed vector and the Q8_1 blocks of it."""
    hn = rms_norm_ref(x, norm_w, eps)
    return (hn, *quantize_q8_1_ref(hn))


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


@norm_q8_1.example
def norm_q8_1_example(use, rng, check):
    from zdsl.kernels import inputs

    n, eps, rows = use.sizes["n"], use.sizes["eps"], use.sizes["rows"]
    args = dict(x=inputs.normal(rng, rows * n, 3.0), norm_w=rng.uniform(0.5, 1.5, n).astype(np.float32),
                hn=np.zeros(rows * n, np.float32), xq=np.zeros(rows * n // 4, np.uint32),
                xd=np.zeros(rows * n // 16, np.float32), n=n, eps=eps, rows=rows)

    if use.fixed.get("HALVES", False):
        args.update(h=np.zeros(rows * n, np.float16))

    def expect(p):  # hn to rounding, its Q8_1 scales, its f16 rows
        hn = np.concatenate([norm_q8_1_ref(x, args["norm_w"], eps)[0] for x in args["x"].reshape(rows, n)])
        halves = {"h": (hn.astype(np.float16), 1e-3)} if "h" in args else {}
        return {"hn": (hn, 1e-4), "xd": (inputs.q8_1_scales(hn), 1e-4), **halves}
    return zdsl.Example(args, expect)
