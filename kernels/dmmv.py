"""Decode matrix-vector products over quantized GGUF weights: y[c, r] = Σ_k W[r, k] · x[c, k].

A workgroup owns ROWS consecutive output rows. Its invocations walk the rows' blocks together:
`parts` invocations share a block (each block's invocations read its activations as contiguous
128-byte pieces, see quant.py), WG/parts blocks are in flight per step, and each invocation
keeps ROWS × COLS partial sums that a subgroup (then shared-memory) reduction combines.
Activations and their group sums are loaded once per block and reused for every row, so ROWS > 1
divides the activation traffic, which is several times the weight traffic of a 4-bit format. The same step serves the plain product,
MoE experts chosen on the GPU, the fused gate·up SwiGLU (gate and up rows in one loop), and the
weighted sum over experts of the down projection (experts and blocks in one flat loop, so all
experts' loads are in flight together).
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, u8, u32
from gguf import GGMLQuantizationType as QuantType
from gguf.quants import dequantize
from zdsl.kernels.quant import FORMATS, Factored, fmt
from zdsl.kernels.reduce import SUBGROUPS, workgroup_sums

QTYPES = list(FORMATS)
# The types GGUF files use for expert tensors (other types and K still specialize on demand).
EXPERT_QTYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "iq4_xs"]
NSUBS = [1, 2, 4]  # subgroups per workgroup, each with rows of its own (the tuner's choice; see Rows)


def workgroup(v) -> int:
    """WG = 0 picks the smallest workgroup that is whole subgroups and whole blocks; the tuner
    may ask for more subgroups per workgroup (sharing its rows), or for NSUB subgroups with
    rows of their own."""
    return workgroup_of(v, FORMATS[v.QTYPE].parts)


def workgroup_of(v, parts: int) -> int:
    if v.NSUB > 1:
        if v.WG or v.SG % parts:
            raise zdsl.ZdslError(f"NSUB = {v.NSUB} subgroups with rows of their own need WG = 0 and a subgroup "
                                 f"size that is whole blocks ({parts} invocations), not WG = {v.WG}, SG = {v.SG}")
        return v.NSUB * v.SG
    wg = v.WG or max(v.SG, parts)
    if wg % v.SG or wg % parts:
        raise zdsl.ZdslError(f"workgroup {wg} must be a multiple of the subgroup size {v.SG} and of {parts}")
    return wg


class Rows:
    """Which rows an invocation works on, and with whom. A group of invocations owns ROWS
    consecutive rows and walks their blocks together: the whole workgroup (NSUB = 1), or each
    of its NSUB subgroups. Subgroups with rows of their own need no shared memory or barrier
    to finish, and let a short row (one subgroup's work) run in workgroups big enough to fill
    a GPU that caps the workgroups resident per core."""

    def __init__(self, ROWS: int, NSUB: int, SG: int, workgroup=None):
        wg = zdsl.workgroup_id() if workgroup is None else workgroup  # the workgroup's index among the rows' owners
        if NSUB == 1:
            self.index, self.size = zdsl.local_index(), zdsl.workgroup_size()
            self.first = wg * ROWS
        else:
            self.index, self.size = zdsl.lane_id(), SG
            self.first = (wg * NSUB + zdsl.subgroup_id()) * ROWS
        self.count, self.SG = ROWS, SG

    def clamped(self, m):
        """The row indices, the ones past m clamped to m − 1 (their loads stay in bounds; their
        results are not stored)."""
        return [zdsl.min(self.first + r, m - 1) for r in range(self.count)]

    def sums(self, values):
        """Each value summed over the group; valid in every invocation of it."""
        return workgroup_sums(values, self.size, self.SG)

    def leader(self):
        return self.index == 0


def rows_per_workgroup(v) -> int:
    """The grid of a matrix-vector variant is ceil(m / rows_per_workgroup(v))."""
    return v.params["ROWS"] * v.params["NSUB"]


def block_step(f, ctx, rows, x, x_bases, b, part):
    """This invocation's share of block b: partial dot products of the weight rows (a list of
    (buffer, byte offset of the row)) with the activation vectors starting at x_bases;
    returns [row][col] f32 values. Activations and their group sums serve every row."""
    shares = [f.decode(w, base + b * f.nbytes, part, ctx) for w, base in rows]
    factored = isinstance(shares[0], Factored)
    groups = shares[0].groups if factored else shares[0]
    out = [[None] * len(x_bases) for _ in rows]
    for c, xb in enumerate(x_bases):
        first = xb + b * f.block
        xs = [load_x(x, first + g.offset, len(g.q)) for g in groups]
        if factored:
            need = shares[0].b or shares[0].m is not None
            sums = [sum_values(xv) if need else None for xv in xs]
            shifts = [s * (shares[0].b / shares[0].a) if shares[0].b else None for s in sums]
            for r, share in enumerate(shares):
                out[r][c] = factored_dot(share, xs, sums, shifts)
        else:
            sums = [sum_values(xv) if g.bias is not None else None for g, xv in zip(groups, xs)]
            for r, share in enumerate(shares):
                out[r][c] = plain_dot(share, xs, sums)
    return out


def plain_dot(groups, xs, sums):
    """Σ over groups of scale · Σ q·x + bias · Σ x."""
    total = None
    for g, xv, xsum in zip(groups, xs, sums):
        term = sum_products(g.q, xv)
        term = term * g.scale if g.scale is not None else term
        if g.bias is not None:
            term = zdsl.fma(g.bias, xsum, term)
        total = term if total is None else total + term
    return total


def factored_dot(share, xs, sums, shifts):
    """(d·a)·Σ c·(P + (b/a)·X) + m·Σ e·X over the groups (quant.Factored); shifts = (b/a)·X."""
    acc = mins = None
    for g, xv, xsum, shift in zip(share.groups, xs, sums, shifts):
        p = sum_products(g.q, xv)
        p = p + shift if shift is not None else p
        acc = p * g.scale if acc is None else zdsl.fma(g.scale, p, acc)
        if g.bias is not None:
            mins = g.bias * xsum if mins is None else zdsl.fma(g.bias, xsum, mins)
    total = acc * (share.d * float(share.a)) if share.a != 1 else acc * share.d
    return total if mins is None else zdsl.fma(share.m, mins, total)


def block_dots(f, ctx, rows, x, x_bases, nblocks, group: Rows):
    """Per-invocation partial dot products over all blocks; returns acc[row][col] (zdsl vars)."""
    return block_loop(f.parts, nblocks, group, len(rows), len(x_bases),
                      lambda b, part: block_step(f, ctx, rows, x, x_bases, b, part))


def block_loop(parts, nblocks, group: Rows, nrows, ncols, step):
    """Sum step(b, part) — [row][col] values — over the blocks this invocation visits: `parts`
    invocations per block, group.size / parts blocks at a time."""
    part = group.index % parts
    acc = [[zdsl.var(0.0) for _ in range(ncols)] for _ in range(nrows)]
    for b in zdsl.range(group.index // parts, nblocks, group.size // parts):
        values = step(b, part)
        for r in range(nrows):
            for c in range(ncols):
                acc[r][c] += values[r][c]
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


def old_rows(y, group: Rows, m, COLS, ADD):
    """What store_rows adds to: y[c·m + row] for the group's rows (0 where not ADD), loaded by
    its leader before the block loop so that the load's latency hides behind the blocks'.
    ADD: a Spec or a Python bool (False: nothing to add, None)."""
    if ADD is False:
        return None
    lead = group.leader()
    return [y.load(c * m + zdsl.min(group.first + r, m - 1), mask=lead if ADD is True else ADD & lead, other=0.0)
            for r in range(group.count) for c in range(COLS)]


def store_rows(y, sums, group: Rows, m, COLS, old=None):
    """y[c·m + row] = sums[r·COLS + c] (+ old[r·COLS + c], from old_rows) for the group's rows
    that exist."""
    with zdsl.if_(group.leader()):
        for r in range(group.count):
            with zdsl.if_(group.first + r < m):
                for c in range(COLS):
                    i = r * COLS + c
                    y[c * m + group.first + r] = sums[i] + old[i] if old else sums[i]


@zdsl.kernel(workgroup=workgroup, subgroup="SG",
             variants={"QTYPE": QTYPES, "COLS": list(range(1, 9)), "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, where=lambda v: v.COLS == 1 or v.ROWS == 1)
def dmmv(w: Buffer[u8], x: Buffer[f32], y: Buffer[f32], k: u32, m: u32, ADD: Spec[boolean] = False,
         QTYPE: Const = "q4_k", COLS: Const = 1, ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[c·m + r] (+)= Σ_k W[r, k] · x[c·k + k] for COLS activation vectors; ADD accumulates
    into y (a residual connection). Grid: ceil(m / rows_per_workgroup)."""
    f = fmt(QTYPE)
    ctx = f.setup()
    nblocks = k // f.block
    group = Rows(ROWS, NSUB, SG)
    rows = [(w, r * (nblocks * f.nbytes)) for r in group.clamped(m)]
    old = old_rows(y, group, m, COLS, ADD)
    acc = block_dots(f, ctx, rows, x, [c * k for c in range(COLS)], nblocks, group)
    sums = group.sums([acc[r][c] for r in range(ROWS) for c in range(COLS)])
    store_rows(y, sums, group, m, COLS, old)


def dequant_rows(w_bytes, qtype: str, m: int, k: int) -> np.ndarray:
    rows = np.asarray(w_bytes, np.uint8).reshape(m, -1)
    return dequantize(rows, QuantType[qtype.upper()]).reshape(m, k).astype(np.float64)


@dmmv.reference
def dmmv_ref(w_bytes, x, qtype, m, k, y=None):
    out = (x.reshape(-1, k).astype(np.float64) @ dequant_rows(w_bytes, qtype, m, k).T).reshape(-1)
    return out if y is None else out + y


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS})
def ffn_gate_up(wg: Buffer[u8], wu: Buffer[u8], ids: Buffer[u32], x: Buffer[f32], act: Buffer[f32], k: u32, m: u32,
                EXPERTS: Spec[boolean] = True, QTYPE: Const = "q4_k", ROWS: Const = 1, NSUB: Const = 1,
                SG: Const = 32, WG: Const = 0):
    """act[s·m + r] = silu(Wg[r]·x) · (Wu[r]·x) for slot s = workgroup_id(1), with the pair of
    expert ids[s] (EXPERTS) or the single pair (not EXPERTS: a dense FFN; `ids` unused). A MoE
    layer's shared expert is one more expert of the stacks (the graph appends it; the router
    names it in ids[K]), so routed and shared experts are one dispatch with one code path.
    Gate and up rows are read in one pass over x. Grid: (ceil(m / rows_per_workgroup), slots)."""
    f = fmt(QTYPE)
    ctx = f.setup()
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    slot = zdsl.workgroup_id(1)
    group = Rows(ROWS, NSUB, SG)
    expert_base = ids.load(slot, mask=EXPERTS, other=0) * (m * row_bytes)
    bases = [expert_base + r * row_bytes for r in group.clamped(m)]
    acc = block_dots(f, ctx, [(wg, b) for b in bases] + [(wu, b) for b in bases], x, [0], nblocks, group)
    store_swiglu(act, group.sums([a[0] for a in acc]), group, m, slot)


def store_swiglu(act, sums, group: Rows, m, slot):
    """act[slot·m + row] = silu(gate) · up, from sums = the group's gate rows, then its up rows."""
    n = group.count
    with zdsl.if_(group.leader()):
        for r in range(n):
            with zdsl.if_(group.first + r < m):
                act[slot * m + group.first + r] = zdsl.silu(sums[r]) * sums[n + r]


def experts_of(w_bytes, qtype, m, k) -> int:
    f = FORMATS[qtype]
    return len(np.asarray(w_bytes).reshape(-1)) // (m * (k // f.block) * f.nbytes)


@ffn_gate_up.reference
def ffn_gate_up_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k, experts=True):
    """act of every slot: the experts `ids` of the stacks (the shared one among them), or the
    one pair (not experts)."""
    nexp = experts_of(wg_bytes, qtype, m, k)
    g = dequant_rows(wg_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    u = dequant_rows(wu_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    xv = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):  # silu of a large negative gate: −0, as on the GPU
        out = [(lambda a: a / (1 + np.exp(-a)))(g[e] @ xv) * (u[e] @ xv) for e in (list(ids) if experts else [0])]
    return np.concatenate(out)


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS})
def moe_down(w: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32], y: Buffer[f32],
             k: u32, m: u32, slots: u32, ADD: Spec[boolean] = True, QTYPE: Const = "q4_k", ROWS: Const = 1,
             NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[r] (+)= Σ_s weights[s] · (W_{ids[s]}[r] · act[s·k : s·k + k]) — the routed experts' down
    projection and their weighted sum in one dispatch (also the shared expert, with one slot
    whose weight is its sigmoid gate). Grid: ceil(m / rows_per_workgroup)."""
    f = fmt(QTYPE)
    ctx = f.setup()
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    group = Rows(ROWS, NSUB, SG)
    offsets = [r * row_bytes for r in group.clamped(m)]
    part = group.index % f.parts
    old = old_rows(y, group, m, 1, ADD)
    total = [zdsl.var(0.0) for _ in range(ROWS)]
    for item in zdsl.range(group.index // f.parts, slots * nblocks, group.size // f.parts):
        s = item // nblocks
        base = ids[s] * (m * row_bytes)
        step = block_step(f, ctx, [(w, base + o) for o in offsets], act, [s * k], item - s * nblocks, part)
        weight = weights[s]
        for r in range(ROWS):
            total[r] += weight * step[r][0]
    store_rows(y, group.sums(total), group, m, 1, old)


@moe_down.reference
def moe_down_ref(w_bytes, ids, weights, act, qtype, m, k, y=None):
    nexp = experts_of(w_bytes, qtype, m, k)
    wd = dequant_rows(w_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    a = act.reshape(-1, k).astype(np.float64)
    out = sum(float(wt) * (wd[e] @ a[s]) for s, (e, wt) in enumerate(zip(ids, weights)))
    return out if y is None else out + y


# ---- the MoE down projection of a decode step: every expert, added to x ----

@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": EXPERT_QTYPES, "QTYPE_SH": ["", "q6_k"],
                                                           "ROWS": [1, 2], "K": [8], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS, "WG": [0, 128, 160, 256]},
             where=lambda v: v.QTYPE_SH == "" or (FORMATS[v.QTYPE].block, FORMATS[v.QTYPE].parts) == (256, FORMATS["q6_k"].parts))
def moe_down_all(w: Buffer[u8], w_sh: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32],
                 y: Buffer[f32], k: u32, m: u32, QTYPE: Const = "q4_k", QTYPE_SH: Const = "", K: Const = 8,
                 ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[r] += Σ_{s≤K} weights[s] · (W_s[r] · act[s·k:]): the K routed experts and the shared
    expert (slot K) in one pass, added to the residual. W_s is expert ids[s] of w, the shared
    expert too when it has the experts' type (the graph appends it to their stack); files that
    keep it at more bits give it as w_sh, of type QTYPE_SH, which costs a second code path.
    Grid: ceil(m / rows_per_workgroup)."""
    f = fmt(QTYPE)
    f_sh = fmt(QTYPE_SH or QTYPE)
    if (f_sh.block, f_sh.parts) != (f.block, f.parts):
        raise zdsl.ZdslError(f"moe_down_all needs the shared expert's blocks shaped like the experts' "
                             f"({f_sh.name} vs {f.name})")
    ctx = f.setup()
    ctx_sh = f_sh.setup() if f_sh is not f else ctx
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    group = Rows(ROWS, NSUB, SG)
    offsets = [r * row_bytes for r in group.clamped(m)]
    part = group.index % f.parts
    old = old_rows(y, group, m, 1, True)
    total = [zdsl.var(0.0) for _ in range(ROWS)]

    def add(step, weight):
        for r in range(ROWS):
            total[r] += weight * step[r][0]

    for item in zdsl.range(group.index // f.parts, (K + 1) * nblocks, group.size // f.parts):
        s = item // nblocks
        b = item - s * nblocks
        weight = weights[s]

        def routed(slot):
            base = ids[slot] * (m * row_bytes)
            add(block_step(f, ctx, [(w, base + o) for o in offsets], act, [s * k], b, part), weight)

        if not QTYPE_SH:
            routed(s)
        else:
            with zdsl.if_(s < K):
                routed(zdsl.min(s, K - 1))
            with zdsl.else_():
                sh_bytes = nblocks * f_sh.nbytes
                rows_sh = [(w_sh, r * sh_bytes) for r in group.clamped(m)]
                add(block_step(f_sh, ctx_sh, rows_sh, act, [s * k], b, part), weight)
    store_rows(y, group.sums(total), group, m, 1, old)


@moe_down_all.reference
def moe_down_all_ref(w_bytes, w_sh_bytes, ids, weights, act, y, qtype, m, k, qtype_sh=None):
    """`ids` names all K + 1 experts of w_bytes when w_sh_bytes is None, else the K routed ones."""
    if w_sh_bytes is None:
        return y + moe_down_ref(w_bytes, ids, weights, act, qtype, m, k)
    K = len(ids)
    routed = moe_down_ref(w_bytes, ids, weights[:K], act[:K * k], qtype, m, k)
    shared = float(weights[K]) * (dequant_rows(w_sh_bytes, qtype_sh or qtype, m, k) @ act[K * k:].astype(np.float64))
    return y + routed + shared
