"""Matrix-vector products in int8: activations in Q8_1 (q8_1.py), four weight bytes times four
activation bytes per `dot4_i8` instead of four decoded floats per multiply-add. Per weight group
(quant.IntGroup):
    w·x ≈ scale · d · Σ q_w q_x + bias · Σx,   Σx = s for a whole block, else d · Σ q_x.

Error: the product is exact for the quantized activations up to f32 rounding (tests hold it to
dequant(W) @ dequant(Q8_1(x)) within 1e-5 relative); against the f32 activations the error is
the quantization's, at most Σ_j |w_j| · d_j / 2 (d_j the scale of element j's block), about
0.3% of Σ|w·x| for typical activations.
"""

from __future__ import annotations

import math

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, u8, u32
from zdsl.kernels.dmmv import (NSUBS, Rows, block_loop, dequant_rows, ffn_gate_up_ref,
                               old_rows, store_rows, store_swiglu, workgroup_of)
from zdsl.kernels.q8_1 import q8_1_values
from zdsl.kernels.quant import FORMATS, INT8_FORMATS, fmt
from zdsl.kernels.reduce import SUBGROUPS


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
            ADD: Spec[boolean] = False, QTYPE: Const = "q4_k", COLS: Const = 1, ROWS: Const = 1, NSUB: Const = 1,
            SG: Const = 32, WG: Const = 0):
    """y[c·m + r] (+)= Σ_k W[r, k] · x̂[c·k + k] for COLS vectors given as Q8_1 (the COLS·k
    activations quantized back to back); ADD accumulates into y (a residual connection).
    Grid: ceil(m / rows_per_workgroup)."""
    project_q8(w, xq, xd, y, k, m, int8_decoder(QTYPE), Rows(ROWS, NSUB, SG), COLS, ADD)


def project_q8(w, xq, xd, y, k, m, f, group: Rows, COLS=1, ADD=False):
    """The group's rows of y (+)= W · x̂ (dmmv_q8's body)."""
    nblocks = k // f.block
    rows = [(w, r * (nblocks * f.nbytes)) for r in group.clamped(m)]
    x_bases = [c * k for c in range(COLS)]
    old = old_rows(y, group, m, COLS, ADD)
    acc = block_loop(f.iparts, nblocks, group, group.count, COLS,
                     lambda b, part: q8_step(f, rows, xq, xd, x_bases, b, part))
    sums = group.sums([acc[r][c] for r in range(group.count) for c in range(COLS)])
    store_rows(y, sums, group, m, COLS, old)


@dmmv_q8.reference
def dmmv_q8_ref(w_bytes, xq, xd, qtype, m, k, y=None):
    """dequant(W) @ the Q8_1 activations, in float64."""
    out = (q8_1_values(xq, xd).reshape(-1, k) @ dequant_rows(w_bytes, qtype, m, k).T).reshape(-1)
    return out if y is None else out + y


def pair_workgroup(v) -> int:
    return workgroup_of(v, math.lcm(FORMATS[v.QTYPE].iparts, FORMATS[v.QTYPE2].iparts))


@zdsl.kernel(workgroup=pair_workgroup, subgroup="SG",
             variants={"QTYPE": ["q5_k"], "QTYPE2": ["q4_k"], "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS})
def dmmv_q8_pair(w: Buffer[u8], w2: Buffer[u8], xq: Buffer[u32], xd: Buffer[f32], y: Buffer[f32], y2: Buffer[f32],
                 k: u32, m: u32, m2: u32, QTYPE: Const = "q5_k", QTYPE2: Const = "q4_k", ROWS: Const = 1,
                 NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y = W · x̂ and y2 = W2 · x̂: two projections of one Q8_1 input in one dispatch, each
    weight in its own type (a delta-net layer's q5_k qkv and q4_k gate z in a Q4_K_M file); a
    dispatch beside others in its stage still costs 1–3 µs (docs/PERF.md). The first
    ceil(m / rows_per_workgroup) workgroups make y, the rest y2; only the types built ahead are
    listed, others specialize on demand. Grid: ceil(m / rows_per_workgroup) + ceil(m2 / rows_per_workgroup)."""
    split = (m + ROWS * NSUB - 1) // (ROWS * NSUB)
    wid = zdsl.workgroup_id()
    with zdsl.if_(wid < split):
        project_q8(w, xq, xd, y, k, m, int8_decoder(QTYPE), Rows(ROWS, NSUB, SG, wid))
    with zdsl.else_():
        project_q8(w2, xq, xd, y2, k, m2, int8_decoder(QTYPE2), Rows(ROWS, NSUB, SG, wid - split))


@dmmv_q8_pair.reference
def dmmv_q8_pair_ref(w_bytes, w2_bytes, xq, xd, qtype, qtype2, m, m2, k):
    """(y, y2): dmmv_q8_ref of each weight."""
    return dmmv_q8_ref(w_bytes, xq, xd, qtype, m, k), dmmv_q8_ref(w2_bytes, xq, xd, qtype2, m2, k)


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": INT8_FORMATS, "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS})
def ffn_gate_up_q8(wg: Buffer[u8], wu: Buffer[u8], ids: Buffer[u32], xq: Buffer[u32], xd: Buffer[f32],
                   act: Buffer[f32], k: u32, m: u32, EXPERTS: Spec[boolean] = True, QTYPE: Const = "q4_k",
                   ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """dmmv.ffn_gate_up with Q8_1 activations: act[s·m + r] = silu(Wg[r]·x̂) · (Wu[r]·x̂) for slot
    s = workgroup_id(1), with the pair of expert ids[s] (EXPERTS: the shared expert is one more
    expert of the stacks) or the single pair (not EXPERTS).
    Grid: (ceil(m / rows_per_workgroup), slots)."""
    f = int8_decoder(QTYPE)
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    slot = zdsl.workgroup_id(1)
    group = Rows(ROWS, NSUB, SG)
    expert_base = ids.load(slot, mask=EXPERTS, other=0) * (m * row_bytes)
    bases = [expert_base + r * row_bytes for r in group.clamped(m)]
    rows = [(wg, b) for b in bases] + [(wu, b) for b in bases]
    acc = block_loop(f.iparts, nblocks, group, 2 * ROWS, 1, lambda b, part: q8_step(f, rows, xq, xd, [0], b, part))
    store_swiglu(act, group.sums([a[0] for a in acc]), group, m, slot)


@ffn_gate_up_q8.reference
def ffn_gate_up_q8_ref(wg_bytes, wu_bytes, ids, xq, xd, qtype, m, k, experts=True):
    """ffn_gate_up_ref on the activations the Q8_1 buffers stand for."""
    return ffn_gate_up_ref(wg_bytes, wu_bytes, ids, q8_1_values(xq, xd), qtype, m, k, experts)
