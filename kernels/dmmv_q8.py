"""Matrix-vector products in int8: activations quantized to Q8_1 on the GPU, then four weight
bytes times four activation bytes per `dot4_i8` instead of four decoded floats per multiply-add.

Q8_1 here: per 32 activations, d = max|x| / 127, q = round(x / d) (as ggml), s = d·Σq.
On the GPU the quants are `xq` (u32, four int8 each, in element order: k/4 words per vector)
and the scales `xd` (f32 pairs (d, s) per block: k/16 floats per vector) — f32 rather than
ggml's f16, so no rounding beyond the quants'. Per weight group (quant.IntGroup):
    w·x ≈ scale · d · Σ q_w q_x + bias · Σx,   Σx = s for a whole block, else d · Σ q_x.

Error: the product is exact for the quantized activations up to f32 rounding (tests hold it to
dequant(W) @ dequant(Q8_1(x)) within 1e-5 relative); against the f32 activations the error is
the quantization's, at most Σ_j |w_j| · d_j / 2 (d_j the scale of element j's block), about
0.3% of Σ|w·x| for typical activations.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, i32, u8, u32
from zdsl.kernels.dmmv import (NSUBS, SUBGROUPS, Rows, block_loop, dequant_rows, ffn_gate_up_ref, store_rows,
                               store_swiglu, workgroup_of)
from zdsl.kernels.formats import q8_1_quantize
from zdsl.kernels.norm import rms_norm_ref, rms_scale
from zdsl.kernels.quant import FORMATS, INT8_FORMATS, fmt


@zdsl.kernel(workgroup=64, subgroup="SG", variants={"SG": SUBGROUPS})
def quantize_q8_1(x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], n: u32, SG: Const = 32):
    """Q8_1 blocks of x[0:n] (n a multiple of 32; several vectors back to back are one long
    vector): eight invocations per block, four values each (one 16-byte load, one u32 store).
    Grid: ceil(n / 256)."""
    i = zdsl.global_id()
    n4 = n >> 2
    store_q8_1(x.vec4[zdsl.min(i, n4 - 1)], i, n4, xq, xd)


@zdsl.kernel(workgroup=64, subgroup="SG", variants={"SG": SUBGROUPS})
def quantize_q8_1_norm(x: Buffer[f32], norm_w: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], n: u32, eps: f32,
                       SG: Const = 32):
    """Q8_1 blocks of rmsnorm(x[0:n]) · norm_w (one vector, n a multiple of 32): the int8
    products' input where a projection reads a normed vector. Every workgroup sums x² itself (n
    is a hidden size: a few KB), so the norm costs no dispatch of its own. Grid: ceil(n / 256)."""
    i = zdsl.global_id()
    n4 = n >> 2
    scale = rms_scale(lambda j: x[j], n, eps, 64, SG)
    at = zdsl.min(i, n4 - 1)
    store_q8_1(x.vec4[at] * norm_w.vec4[at] * scale, i, n4, xq, xd)


def store_q8_1(v, i, n4, xq, xd):
    """Invocation i's four values v into Q8_1 block i // 8 (eight invocations per block)."""
    a = zdsl.abs(v)
    amax = zdsl.subgroup_max(zdsl.max(zdsl.max(a.x, a.y), zdsl.max(a.z, a.w)), cluster=8)
    d = amax / 127.0
    inv = zdsl.where(amax > 0.0, 1.0 / d, 0.0)
    lanes = [round_away(t * inv) for t in (v.x, v.y, v.z, v.w)]
    packed = zdsl.bitcast(lanes[0], u32) & 0xFF
    for j in range(1, 4):
        packed = packed | ((zdsl.bitcast(lanes[j], u32) & 0xFF) << (8 * j))
    qsum = zdsl.subgroup_sum(lanes[0] + lanes[1] + lanes[2] + lanes[3], cluster=8)
    with zdsl.if_(i < n4):
        xq[i] = packed
        with zdsl.if_((i & 7) == 0):
            xd.vec2[i >> 3] = zdsl.vec(d, d * qsum.to(f32))


def round_away(v):
    """C roundf (halves away from zero) as an i32, exactly: |v| − floor(|v|) is exact."""
    a = zdsl.abs(v)
    f = zdsl.floor(a)
    r = (f + zdsl.where(a - f >= 0.5, 1.0, 0.0)).to(i32)
    return zdsl.where(v < 0.0, -r, r)


@quantize_q8_1.reference
def quantize_q8_1_ref(x):
    """(q int8, d, s) per block of 32 as ggml makes them; ggml rounds d and s to f16, the kernel
    keeps them f32 (and its 1/d may differ by an ulp, moving a q that sits on a half by one)."""
    return q8_1_quantize(np.asarray(x, np.float32).reshape(-1, 32))


@quantize_q8_1_norm.reference
def quantize_q8_1_norm_ref(x, norm_w, eps):
    return quantize_q8_1_ref(rms_norm_ref(x, norm_w, eps))


def q8_1_values(xq, xd) -> np.ndarray:
    """The activations the Q8_1 buffers stand for (q·d), as float64."""
    q = np.asarray(xq, np.uint32).view(np.int8).reshape(-1, 32).astype(np.float64)
    return (q * np.asarray(xd, np.float32).reshape(-1, 2)[:, :1]).reshape(-1)


def words_of(buf, index, n: int) -> list:
    """n u32 from word `index`, a multiple of min(n, 4): 16- or 8-byte loads."""
    if n % 4 == 0:
        vs = [buf.vec4[(index >> 2) + i] for i in range(n // 4)]
        return [v[j] for v in vs for j in range(4)]
    if n % 2 == 0:
        vs = [buf.vec2[(index >> 1) + i] for i in range(n // 2)]
        return [v[j] for v in vs for j in range(2)]
    return [buf[index + i] for i in range(n)]


def dot_words(a, b):
    total = zdsl.dot4_i8(a[0], b[0])
    for p, q in zip(a[1:], b[1:]):
        total = total + zdsl.dot4_i8(p, q)
    return total


def q8_step(f, rows, xq, xd, x_bases, b, part):
    """This invocation's share of block b against Q8_1 activations; returns [row][col] f32."""
    groups = [f.int_groups(w, base + b * f.nbytes, part) for w, base in rows]
    out = [[None] * len(x_bases) for _ in rows]
    for c, xb in enumerate(x_bases):
        first = xb + b * f.block
        for gi, g0 in enumerate(groups[0]):
            e = first + g0.offset
            xw = words_of(xq, e >> 2, len(g0.words))
            ds = xd.vec2[e >> 5]
            xsum = None
            if g0.bias is not None:
                xsum = ds.y if len(xw) == 8 else ds.x * dot_words(xw, [0x01010101] * len(xw)).to(f32)
            for r, row_groups in enumerate(groups):
                g = row_groups[gi]
                term = (g.scale * ds.x) * dot_words(g.words, xw).to(f32)
                if g.bias is not None:
                    term = zdsl.fma(g.bias, xsum, term)
                out[r][c] = term if out[r][c] is None else out[r][c] + term
    return out


def workgroup(v) -> int:
    return workgroup_of(v, FORMATS[v.QTYPE].iparts)


def int8_decoder(QTYPE: str):
    f = fmt(QTYPE)
    if not f.iparts:
        raise zdsl.ZdslError(f"no int8 decoder for {QTYPE} (have: {', '.join(INT8_FORMATS)})")
    return f


@zdsl.kernel(workgroup=workgroup, subgroup="SG",
             variants={"QTYPE": INT8_FORMATS, "COLS": list(range(1, 9)), "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, where=lambda v: v.COLS == 1 or v.ROWS == 1)
def dmmv_q8(w: Buffer[u8], xq: Buffer[u32], xd: Buffer[f32], y: Buffer[f32], k: u32, m: u32,
            ADD: Spec[boolean] = False, QTYPE: Const = "q4_k", COLS: Const = 1, ROWS: Const = 1,
            NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[c·m + r] (+)= Σ_k W[r, k] · x̂[c·k + k] for COLS vectors given as Q8_1 (quantize_q8_1
    of the COLS·k activations); ADD accumulates into y. Grid: ceil(m / rows_per_workgroup)."""
    f = int8_decoder(QTYPE)
    nblocks = k // f.block
    group = Rows(ROWS, NSUB, SG)
    rows = [(w, r * (nblocks * f.nbytes)) for r in group.clamped(m)]
    x_bases = [c * k for c in range(COLS)]
    acc = block_loop(f.iparts, nblocks, group, ROWS, COLS, lambda b, part: q8_step(f, rows, xq, xd, x_bases, b, part))
    sums = group.sums([acc[r][c] for r in range(ROWS) for c in range(COLS)])
    store_rows(y, sums, group, m, COLS, ADD)


@dmmv_q8.reference
def dmmv_q8_ref(w_bytes, xq, xd, qtype, m, k, y=None):
    """dequant(W) @ the Q8_1 activations, in float64."""
    out = (q8_1_values(xq, xd).reshape(-1, k) @ dequant_rows(w_bytes, qtype, m, k).T).reshape(-1)
    return out if y is None else out + y


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": INT8_FORMATS, "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS})
def ffn_gate_up_q8(wg: Buffer[u8], wu: Buffer[u8], ids: Buffer[u32], xq: Buffer[u32], xd: Buffer[f32],
                   act: Buffer[f32], k: u32, m: u32, EXPERTS: Spec[boolean] = True, QTYPE: Const = "q4_k",
                   ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """dmmv.ffn_gate_up with Q8_1 activations: act[s·m + r] = silu(Wg_e[r]·x̂) · (Wu_e[r]·x̂) for
    the expert e = ids[s] of slot s = workgroup_id(1) (EXPERTS), or the single pair (not EXPERTS).
    Grid: (ceil(m / rows_per_workgroup), slots)."""
    f = int8_decoder(QTYPE)
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    slot = zdsl.workgroup_id(1)
    expert_base = ids.load(slot, mask=EXPERTS, other=0) * (m * row_bytes)
    group = Rows(ROWS, NSUB, SG)
    bases = [expert_base + r * row_bytes for r in group.clamped(m)]
    rows = [(wg, b) for b in bases] + [(wu, b) for b in bases]
    acc = block_loop(f.iparts, nblocks, group, 2 * ROWS, 1, lambda b, part: q8_step(f, rows, xq, xd, [0], b, part))
    store_swiglu(act, group.sums([a[0] for a in acc]), group, m, slot)


@ffn_gate_up_q8.reference
def ffn_gate_up_q8_ref(wg_bytes, wu_bytes, ids, xq, xd, qtype, m, k, experts=True):
    """ffn_gate_up_ref on the activations the Q8_1 buffers stand for."""
    return ffn_gate_up_ref(wg_bytes, wu_bytes, ids, q8_1_values(xq, xd), qtype, m, k, experts)
