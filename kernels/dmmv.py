"""Decode matrix-vector products over quantized GGUF weights: y[c, r] = Σ_k W[r, k] · x[c, k].

A workgroup owns ROWS consecutive output rows. Its invocations walk the rows' blocks together:
`parts` invocations share a block (each block's invocations read its activations as contiguous
128-byte pieces, see quant.py), WG/parts blocks are in flight per step, and each invocation
keeps ROWS × COLS partial sums that a subgroup (then shared-memory) reduction combines.
Activations and their group sums are loaded once per block and reused for every row, so ROWS > 1
divides the activation traffic, which is several times the weight traffic of a 4-bit format.
The same step serves the plain product here and the FFN's (ffn.py: MoE experts chosen on the
GPU, the fused gate·up SwiGLU, the weighted sum over experts of the down projection).

With Q8 the activations come in Q8_1 (q8_1.py) and the products are int8: four weight bytes
times four activation bytes per `dot4_i8` instead of four decoded floats per multiply-add. Per
weight group (quant.IntGroup):
    w·x ≈ scale · d · Σ q_w q_x + bias · Σx,   Σx = s for a whole block, else d · Σ q_x.
The product is exact for the quantized activations up to f32 rounding (tests hold it to
dequant(W) @ dequant(Q8_1(x)) within 1e-5 relative); against the f32 activations the error is
the quantization's, at most Σ_j |w_j| · d_j / 2 (d_j the scale of element j's block), about
0.3% of Σ|w·x| for typical activations.
"""

from __future__ import annotations

import math

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, u8, u32
from gguf import GGMLQuantizationType as QuantType
from gguf.quants import dequantize
from zdsl.kernels import inputs
from zdsl.kernels.q8_1 import q8_1_values
from zdsl.kernels.quant import FORMATS, INT8_FORMATS, Factored, Grid, fmt
from zdsl.kernels.reduce import SUBGROUPS, workgroup_sums

# The weight types built ahead (`zdsl build`) for every kernel that takes one: all but the IQ grid
# types (quant.Grid, IQ1_S … IQ3_S), which published files use for routed experts (the "dynamic"
# quants keep the other tensors at K-quants or Q8_0). Those are built ahead for the expert kernels
# only (EXPERT_QTYPES, and ffn_gate_up: GATE_UP_QTYPES) and specialize on demand elsewhere, as any
# type or K not listed does; built everywhere, their 952 variants added ~2 minutes to the build.
QTYPES = [name for name, f in FORMATS.items() if not isinstance(f, Grid)]
# The types GGUF files use for expert tensors.
EXPERT_QTYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s",
                 "iq3_xxs", "iq3_s", "iq4_xs", "mxfp4"]
# ffn_gate_up also runs the routed experts' gate·up at decode.
GATE_UP_QTYPES = QTYPES + [q for q in EXPERT_QTYPES if q not in QTYPES]
NSUBS = [1, 2, 4]  # subgroups per workgroup, each with rows of its own (the tuner's choice; see Rows)


def workgroup(v) -> int:
    """WG = 0 picks the smallest workgroup that is whole subgroups and whole blocks; the tuner
    may ask for more subgroups per workgroup (sharing its rows), or for NSUB subgroups with
    rows of their own."""
    f = FORMATS[v.QTYPE]
    return workgroup_of(v, f.iparts if getattr(v, "Q8", False) else f.parts)


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


def row_groups(v, m) -> int:
    """The workgroups that own m rows: the grid of a matrix-vector variant v (values namespace)."""
    return -(-m // (v.ROWS * v.NSUB))


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


def q8_step(f, rows, xq, xd, x_bases, b, part, ctx=None):
    """This invocation's share of block b against Q8_1 activations (ctx: f's set-up); returns
    [row][col] f32."""
    groups = [f.int_groups(w, base + b * f.nbytes, part, ctx) for w, base in rows]
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


def int8_decoder(QTYPE: str):
    f = fmt(QTYPE)
    if not f.iparts:
        raise zdsl.ZdslError(f"no int8 decoder for {QTYPE} (have: {', '.join(INT8_FORMATS)})")
    return f


def old_rows(y, group: Rows, m, COLS, ADD, cols=None):
    """What store_rows adds to: y[c·m + row] for the group's rows and the columns c in `cols`
    (default 0 .. COLS − 1; 0 where not ADD), loaded by its leader before the block loop so that
    the load's latency hides behind the blocks'. ADD: a Spec or a Python bool (False: nothing
    to add, None)."""
    if ADD is False:
        return None
    lead = group.leader()
    return [y.load(c * m + zdsl.min(group.first + r, m - 1), mask=lead if ADD is True else ADD & lead, other=0.0)
            for r in range(group.count) for c in (cols if cols is not None else range(COLS))]


def store_rows(y, sums, group: Rows, m, COLS, old=None, cols=None, live=None):
    """y[c·m + row] = sums[r·COLS + c] (+ old[r·COLS + c], from old_rows) for the group's rows
    that exist, c in `cols` (default 0 .. COLS − 1), skipping the columns whose `live` is false."""
    cols = cols if cols is not None else list(range(COLS))
    with zdsl.if_(group.leader()):
        for r in range(group.count):
            with zdsl.if_(group.first + r < m):
                for i, c in enumerate(cols):
                    value = sums[r * COLS + i] + old[r * COLS + i] if old else sums[r * COLS + i]
                    if live is None:
                        y[c * m + group.first + r] = value
                    else:
                        with zdsl.if_(live[i]):
                            y[c * m + group.first + r] = value


def decoder(QTYPE: str, Q8: bool):
    """(format, its set-up, Q8) for row_dots: the set-up (shared tables, a barrier) runs once, at
    the kernel's start, outside any loop over tiles."""
    f = int8_decoder(QTYPE) if Q8 else fmt(QTYPE)
    return f, f.setup(), Q8


def row_dots(f, ctx, Q8: bool, rows, x, xq, xd, x_bases, nblocks, group: Rows):
    """acc[row][col]: this invocation's partial products of the weight rows (buffer, byte offset)
    with the activation vectors at x_bases: f32 x, or with Q8 Q8_1 xq/xd (f, ctx, Q8 from
    `decoder`). Each weight block is decoded once for all the columns."""
    if Q8:
        return block_loop(f.iparts, nblocks, group, len(rows), len(x_bases),
                          lambda b, part: q8_step(f, rows, xq, xd, x_bases, b, part, ctx))
    return block_dots(f, ctx, rows, x, x_bases, nblocks, group)


def project(w, x, xq, xd, y, k, m, QTYPE: str, Q8: bool, group: Rows, COLS=1, ADD=False, cols=None, live=None):
    """The group's rows of y (+)= W · x for COLS activation vectors: f32 x, or Q8_1 xq/xd. The
    vectors are 0 .. COLS − 1, or those `cols` names (stores skipped where `live` is false)."""
    f, ctx, _ = decoder(QTYPE, Q8)
    nblocks = k // f.block
    rows = [(w, r * (nblocks * f.nbytes)) for r in group.clamped(m)]
    x_bases = [c * k for c in (cols if cols is not None else range(COLS))]
    old = old_rows(y, group, m, COLS, ADD, cols)
    acc = row_dots(f, ctx, Q8, rows, x, xq, xd, x_bases, nblocks, group)
    sums = group.sums([acc[r][c] for r in range(group.count) for c in range(COLS)])
    store_rows(y, sums, group, m, COLS, old, cols, live)


def input_bytes(k: int, Q8: bool) -> int:
    """Bytes of one activation vector of k values: f32, or Q8_1 (k quants, k/16 scale floats)."""
    return k + k // 4 if Q8 else 4 * k


def _dmmv_fits(v) -> bool:
    return (v.ROWS <= 2 or v.ROWS * v.COLS <= 8) and (not v.Q8 or v.QTYPE in INT8_FORMATS)


# With a few columns (a step of several tokens or streams) a group of two rows loads each block's
# COLS activation vectors once for both; a group of one row loads them again for every weight row.
# Groups of 4 rows take at most 2 columns: 4 rows of 4 columns measured slower on the H100 than 2.
FEW_COLUMN_ROWS = zdsl.Derived(lambda v: 1 if v.COLS == 1 else 2)


@zdsl.kernel(workgroup=workgroup, subgroup="SG",
             variants={"QTYPE": QTYPES, "Q8": [False, True], "COLS": list(range(1, 9)), "ROWS": [1, 2, 4],
                       "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, where=_dmmv_fits, key=("k", "m"), cpu={"ROWS": 1},
             grid=lambda v, s: row_groups(v, s.m),
             traffic=lambda v, s: (s.m * inputs.row_bytes(v.QTYPE, s.k) + v.COLS * input_bytes(s.k, v.Q8)
                                   + 4 * v.COLS * s.m * (2 if v.ADD else 1)))
def dmmv(w: Buffer[u8], x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], y: Buffer[f32], k: u32, m: u32,
         ADD: Spec[boolean] = False, QTYPE: Const = "q4_k", Q8: Const = False, COLS: Const = 1,
         ROWS: Const = FEW_COLUMN_ROWS, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[c·m + r] (+)= Σ_k W[r, k] · x[c·k + k] for COLS activation vectors, given in f32 (x) or,
    with Q8, as Q8_1 (xq, xd: the COLS·k activations quantized back to back); ADD accumulates
    into y (a residual connection)."""
    project(w, x, xq, xd, y, k, m, QTYPE, Q8, Rows(ROWS, NSUB, SG), COLS, ADD)


def dequant_rows(w_bytes, qtype: str, m: int, k: int) -> np.ndarray:
    rows = np.asarray(w_bytes, np.uint8).reshape(m, -1)
    return dequantize(rows, QuantType[qtype.upper()]).reshape(m, k).astype(np.float64)


def as_read(a, f16: bool = False) -> np.ndarray:
    """`a` in float64 as a kernel reads it: with f16, rounded to f16 first (the matrix units' operands)."""
    a = np.asarray(a, np.float32)
    return (a.astype(np.float16) if f16 else a).astype(np.float64)


def dmmv_ref(w_bytes, x, qtype, m, k, y=None, f16=False):
    """Y = X · dequant(W)ᵀ (+ y), rows of X back to back, in float64 (W and X rounded to f16 with f16)."""
    w = as_read(dequant_rows(w_bytes, qtype, m, k), f16)
    out = (as_read(x, f16).reshape(-1, k) @ w.T).reshape(-1)
    return out if y is None else out + y


def dmmv_q8_ref(w_bytes, xq, xd, qtype, m, k, y=None):
    """dmmv with Q8: dequant(W) @ the Q8_1 activations, in float64."""
    return dmmv_ref(w_bytes, q8_1_values(xq, xd), qtype, m, k, y)


def project_ref(args: dict, qtype: str, m: int, k: int, y=None):
    """dmmv_ref of an example's arguments: f32 `x` or Q8_1 `xq`, `xd`."""
    if "xq" in args:
        return dmmv_q8_ref(args["w"], args["xq"], args["xd"], qtype, m, k, y)
    return dmmv_ref(args["w"], args["x"], qtype, m, k, y)


@dmmv.example
def dmmv_example(use, rng, check):
    q, q8, add = use.fixed["QTYPE"], use.fixed.get("Q8", False), use.fixed.get("ADD", False)
    cols = use.fixed.get("COLS", 1)  # every column's vector and output: a check sees each column
    k = use.sizes["k"]
    m = min(use.sizes["m"], inputs.CHECK_ROWS) if check else use.sizes["m"]
    args = dict(w=inputs.rows(rng, q, m, k), **inputs.activations(rng, cols * k, q8),
                y=inputs.normal(rng, cols * m) if add else np.zeros(cols * m, np.float32), k=k, m=m)
    y0 = args["y"].copy() if add else None
    return zdsl.Example(args, lambda p: {"y": (project_ref(args, q, m, k, y0), 1e-4)},
                        lambda n: {"w": inputs.copies(args["w"], n)})


def pair_workgroup(v) -> int:
    return workgroup_of(v, math.lcm(FORMATS[v.QTYPE].iparts, FORMATS[v.QTYPE2].iparts))


@zdsl.kernel(workgroup=pair_workgroup, subgroup="SG",
             variants={"QTYPE": ["q5_k"], "QTYPE2": ["q4_k"], "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, key=("k", "m", "m2"),
             grid=lambda v, s: row_groups(v, s.m) + row_groups(v, s.m2),
             traffic=lambda v, s: (s.m * inputs.row_bytes(v.QTYPE, s.k) + s.m2 * inputs.row_bytes(v.QTYPE2, s.k)
                                   + input_bytes(s.k, True) + 4 * (s.m + s.m2)))
def dmmv_q8_pair(w: Buffer[u8], w2: Buffer[u8], xq: Buffer[u32], xd: Buffer[f32], y: Buffer[f32], y2: Buffer[f32],
                 k: u32, m: u32, m2: u32, QTYPE: Const = "q5_k", QTYPE2: Const = "q4_k", ROWS: Const = 1,
                 NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y = W · x̂ and y2 = W2 · x̂: two projections of one Q8_1 input in one dispatch, each
    weight in its own type (a delta-net layer's q5_k qkv and q4_k gate z in a Q4_K_M file); a
    dispatch beside others in its stage still costs 1–3 µs (docs/DESIGN.md). The first
    row_groups(m) workgroups make y, the rest y2; only the types built ahead are listed, others
    specialize on demand."""
    split = (m + ROWS * NSUB - 1) // (ROWS * NSUB)
    wid = zdsl.workgroup_id()
    with zdsl.if_(wid < split):
        project(w, None, xq, xd, y, k, m, QTYPE, True, Rows(ROWS, NSUB, SG, wid))
    with zdsl.else_():
        project(w2, None, xq, xd, y2, k, m2, QTYPE2, True, Rows(ROWS, NSUB, SG, wid - split))


def dmmv_q8_pair_ref(w_bytes, w2_bytes, xq, xd, qtype, qtype2, m, m2, k):
    """(y, y2): dmmv_q8_ref of each weight."""
    return dmmv_q8_ref(w_bytes, xq, xd, qtype, m, k), dmmv_q8_ref(w2_bytes, xq, xd, qtype2, m2, k)


@dmmv_q8_pair.example
def dmmv_q8_pair_example(use, rng, check):
    q, q2 = use.fixed["QTYPE"], use.fixed["QTYPE2"]
    k, m, m2 = use.sizes["k"], use.sizes["m"], use.sizes["m2"]
    m, m2 = (min(m, inputs.CHECK_ROWS), min(m2, inputs.CHECK_ROWS - 2)) if check else (m, m2)  # the split shows
    args = dict(w=inputs.rows(rng, q, m, k), w2=inputs.rows(rng, q2, m2, k), **inputs.activations(rng, k, True),
                y=np.zeros(m, np.float32), y2=np.zeros(m2, np.float32), k=k, m=m, m2=m2)

    def expect(p):
        y, y2 = dmmv_q8_pair_ref(args["w"], args["w2"], args["xq"], args["xd"], q, q2, m, m2, k)
        return {"y": (y, 1e-4), "y2": (y2, 1e-4)}
    return zdsl.Example(args, expect, lambda n: {"w": inputs.copies(args["w"], n), "w2": inputs.copies(args["w2"], n)})
