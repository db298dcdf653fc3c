"""Decode matrix-vector products over quantized GGUF weights: y[c, r] = Σ_k W[r, k] · x[c, k].

A workgroup owns ROWS consecutive output rows. Its invocations walk the rows' blocks together:
`parts` invocations share a block (coalesced reads), WG/parts blocks are in flight per step, and
each invocation keeps ROWS × COLS partial sums that a subgroup (then shared-memory) reduction
combines. The same loop serves the plain product, MoE experts chosen on the GPU, the fused
gate·up SwiGLU, and the weighted sum over experts of the down projection.
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, u8, u32
from gguf import GGMLQuantizationType as QuantType
from gguf.quants import dequantize
from zdsl.kernels.quant import FORMATS, fmt

QTYPES = list(FORMATS)
SUBGROUPS = [8, 16, 32, 64]


def workgroup(v) -> int:
    """WG = 0 picks the smallest workgroup that is whole subgroups and whole blocks; the tuner
    may ask for more subgroups per workgroup."""
    parts = FORMATS[v.QTYPE].parts
    wg = v.WG or max(v.SG, parts)
    if wg % v.SG or wg % parts:
        raise zdsl.ZdslError(f"workgroup {wg} must be a multiple of the subgroup size {v.SG} and of {parts}")
    return wg


def block_dots(f, w, row_bases, x, x_bases, nblocks, WG):
    """Per-invocation partial dot products of len(row_bases) weight rows with len(x_bases)
    activation vectors; returns acc[row][col] (zdsl vars)."""
    part = zdsl.local_index() % f.parts
    acc = [[zdsl.var(0.0) for _ in x_bases] for _ in row_bases]
    for b in zdsl.range(zdsl.local_index() // f.parts, nblocks, WG // f.parts):
        groups = [f.groups(w, base + b * f.nbytes, part) for base in row_bases]
        for c, xb in enumerate(x_bases):
            first = xb + b * f.block
            xs = [load_x(x, first + g.offset, len(g.q)) for g in groups[0]]
            for r in range(len(row_bases)):
                total = None
                for g, xv in zip(groups[r], xs):
                    term = sum_products(g.q, xv)
                    term = term * g.scale if g.scale is not None else term
                    if g.bias is not None:
                        term = zdsl.fma(g.bias, sum_values(xv), term)
                    total = term if total is None else total + term
                acc[r][c] += total
    return acc


def load_x(x, start, count):
    """count consecutive activations from element `start` (a multiple of 4): 16-byte loads."""
    out = []
    for i in range(count // 4):
        v = x.vec4[(start >> 2) + i]
        out += [v.x, v.y, v.z, v.w]
    return out


def sum_products(a, b):
    total = a[0] * b[0]
    for p, q in zip(a[1:], b[1:]):
        total = zdsl.fma(p, q, total)
    return total


def sum_values(a):
    total = a[0]
    for v in a[1:]:
        total = total + v
    return total


def workgroup_sums(values, WG, SG):
    """Sum each value over the workgroup; the results are valid in every invocation."""
    sums = [zdsl.subgroup_sum(v) for v in values]
    nsub = WG // SG
    if nsub == 1:
        return sums
    partial = zdsl.shared(f32, len(values) * nsub)
    with zdsl.if_(zdsl.lane_id() == 0):
        for i, s in enumerate(sums):
            partial[i * nsub + zdsl.subgroup_id()] = s
    zdsl.barrier()
    out = []
    for i in range(len(values)):
        total = partial[i * nsub]
        for n in range(1, nsub):
            total = total + partial[i * nsub + n]
        out.append(total)
    return out


@zdsl.kernel(workgroup=workgroup, subgroup="SG",
             variants={"QTYPE": QTYPES, "COLS": list(range(1, 9)), "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             where=lambda v: v.COLS == 1 or v.ROWS == 1)
def dmmv(w: Buffer[u8], x: Buffer[f32], y: Buffer[f32], k: u32, m: u32, ADD: Spec[boolean] = False,
         QTYPE: Const = "q4_k", COLS: Const = 1, ROWS: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[c·m + r] (+)= Σ_k W[r, k] · x[c·k + k] for COLS activation vectors; ADD accumulates
    into y (a residual connection). Grid: ceil(m / ROWS) workgroups."""
    f = fmt(QTYPE)
    WG = zdsl.workgroup_size()
    nblocks = k // f.block
    row0 = zdsl.workgroup_id() * ROWS
    rows = [zdsl.min(row0 + r, m - 1) for r in range(ROWS)]
    acc = block_dots(f, w, [r * nblocks * f.nbytes for r in rows], x, [c * k for c in range(COLS)], nblocks, WG)
    sums = workgroup_sums([acc[r][c] for r in range(ROWS) for c in range(COLS)], WG, SG)
    with zdsl.if_(zdsl.local_index() == 0):
        for r in range(ROWS):
            with zdsl.if_(row0 + r < m):
                for c in range(COLS):
                    out = c * m + row0 + r
                    y[out] = sums[r * COLS + c] + y.load(out, mask=ADD, other=0.0)


def dequant_rows(w_bytes, qtype: str, m: int, k: int) -> np.ndarray:
    rows = np.asarray(w_bytes, np.uint8).reshape(m, -1)
    return dequantize(rows, QuantType[qtype.upper()]).reshape(m, k).astype(np.float64)


@dmmv.reference
def dmmv_ref(w_bytes, x, qtype, m, k, y=None):
    out = (x.reshape(-1, k).astype(np.float64) @ dequant_rows(w_bytes, qtype, m, k).T).reshape(-1)
    return out if y is None else out + y


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "ROWS": [1, 2, 4], "SG": SUBGROUPS})
def ffn_gate_up(wg: Buffer[u8], wu: Buffer[u8], ids: Buffer[u32], x: Buffer[f32], act: Buffer[f32],
                k: u32, m: u32, EXPERTS: Spec[boolean] = True, QTYPE: Const = "q4_k", ROWS: Const = 1,
                SG: Const = 32, WG: Const = 0):
    """act[s·m + r] = silu(Wg_e[r]·x) · (Wu_e[r]·x) for the expert e = ids[s] of slot
    s = workgroup_id(1) (EXPERTS), or for the single matrix pair (not EXPERTS: a dense FFN or the
    shared expert; `ids` is then unused). Gate and up are read in one pass over x.
    Grid: (ceil(m / ROWS), slots)."""
    f = fmt(QTYPE)
    WG = zdsl.workgroup_size()
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    slot = zdsl.workgroup_id(1)
    expert_base = ids.load(slot, mask=EXPERTS, other=0) * (m * row_bytes)
    row0 = zdsl.workgroup_id() * ROWS
    rows = [zdsl.min(row0 + r, m - 1) for r in range(ROWS)]
    bases = [expert_base + r * row_bytes for r in rows]
    gate = block_dots(f, wg, bases, x, [0], nblocks, WG)
    up = block_dots(f, wu, bases, x, [0], nblocks, WG)
    sums = workgroup_sums([gate[r][0] for r in range(ROWS)] + [up[r][0] for r in range(ROWS)], WG, SG)
    with zdsl.if_(zdsl.local_index() == 0):
        for r in range(ROWS):
            with zdsl.if_(row0 + r < m):
                act[slot * m + row0 + r] = zdsl.silu(sums[r]) * sums[ROWS + r]


@ffn_gate_up.reference
def ffn_gate_up_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k, experts=True):
    nexp = len(np.asarray(wg_bytes).reshape(-1)) // (m * (k // FORMATS[qtype].block) * FORMATS[qtype].nbytes)
    g = dequant_rows(wg_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    u = dequant_rows(wu_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    sel = list(ids) if experts else [0]
    xv = x.astype(np.float64)
    out = [(lambda a: a / (1 + np.exp(-a)))(g[e] @ xv) * (u[e] @ xv) for e in sel]
    return np.concatenate(out)


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "ROWS": [1, 2, 4], "SG": SUBGROUPS})
def moe_down(w: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32], y: Buffer[f32],
             k: u32, m: u32, slots: u32, ADD: Spec[boolean] = True, QTYPE: Const = "q4_k", ROWS: Const = 1,
             SG: Const = 32, WG: Const = 0):
    """y[r] (+)= Σ_s weights[s] · (W_{ids[s]}[r] · act[s·k : s·k + k]) — the routed experts' down
    projection and their weighted sum in one dispatch (also the shared expert, with one slot
    whose weight is its sigmoid gate). Grid: ceil(m / ROWS)."""
    f = fmt(QTYPE)
    WG = zdsl.workgroup_size()
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    row0 = zdsl.workgroup_id() * ROWS
    rows = [zdsl.min(row0 + r, m - 1) for r in range(ROWS)]
    total = [zdsl.var(0.0) for _ in range(ROWS)]
    for s in zdsl.range(slots):
        base = ids[s] * (m * row_bytes)
        acc = block_dots(f, w, [base + r * row_bytes for r in rows], act, [s * k], nblocks, WG)
        weight = weights[s]
        for r in range(ROWS):
            total[r] += weight * acc[r][0]
    sums = workgroup_sums(total, WG, SG)
    with zdsl.if_(zdsl.local_index() == 0):
        for r in range(ROWS):
            with zdsl.if_(row0 + r < m):
                y[row0 + r] = sums[r] + y.load(row0 + r, mask=ADD, other=0.0)


@moe_down.reference
def moe_down_ref(w_bytes, ids, weights, act, qtype, m, k, y=None):
    nexp = len(np.asarray(w_bytes).reshape(-1)) // (m * (k // FORMATS[qtype].block) * FORMATS[qtype].nbytes)
    wd = dequant_rows(w_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    a = act.reshape(-1, k).astype(np.float64)
    out = sum(float(wt) * (wd[e] @ a[s]) for s, (e, wt) in enumerate(zip(ids, weights)))
    return out if y is None else out + y
