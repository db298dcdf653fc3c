"""The FFN's products in a decode step: the fused gate·up SwiGLU (a dense FFN's one pair, or the
MoE experts the router picked on the GPU, the shared expert among them as the stacks' last), and
the down projections of the experts, weighted and summed into the residual; and for a chunk of
tokens, the experts' products over their pairs grouped by expert (moe.moe_group), each weight
block decoded once for several tokens. They run the block loops of dmmv.py, so the same tiles,
types and int8 path serve them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f32, u8, u32
from zdsl.kernels import inputs, mma
from zdsl.kernels.dmmv import (EXPERT_QTYPES, GATE_UP_QTYPES, NSUBS, QTYPES, Rows, as_read, block_step, decoder,
                               dequant_rows, input_bytes, old_rows, row_dots, row_groups, store_rows, workgroup)
from zdsl.kernels.q8_1 import q8_1_values
from zdsl.kernels.quant import FORMATS, INT8_FORMATS, fmt
from zdsl.kernels.reduce import SUBGROUPS


def _gate_up_traffic(v, s) -> int:
    return (s.slots * s.m * (inputs.row_bytes(v.QTYPE, s.k) + inputs.row_bytes(v.QTYPE_UP or v.QTYPE, s.k))
            + input_bytes(s.k, v.Q8) + 4 * s.slots * s.m)


def _gate_up_fits(v) -> bool:
    """The int8 path only where both types have an int8 decoder."""
    return not v.Q8 or (v.QTYPE in INT8_FORMATS and (v.QTYPE_UP or v.QTYPE) in INT8_FORMATS)


def gate_up_decoders(QTYPE: str, QTYPE_UP: str, Q8: bool) -> list:
    """One decoder for gate and up rows (QTYPE_UP "" or the same type), or one each (files may
    mix them); set up once, at the kernel's start."""
    if not QTYPE_UP or QTYPE_UP == QTYPE:
        return [decoder(QTYPE, Q8)]
    return [decoder(QTYPE, Q8), decoder(QTYPE_UP, Q8)]


def gate_up_dots(decoders: list, wg, wu, expert, x, xq, xd, bases, k, m, group: Rows):
    """The gate rows' partial products, then the up rows': in one pass over x with one decoder,
    else a pass each."""
    if len(decoders) == 1:
        return expert_dots(*decoders[0], [wg, wu], expert, x, xq, xd, bases, k, m, group)
    return [a for dec, w in zip(decoders, (wg, wu)) for a in expert_dots(*dec, [w], expert, x, xq, xd, bases, k, m,
                                                                         group)]


@zdsl.kernel(workgroup=workgroup, subgroup="SG",
             variants={"QTYPE": GATE_UP_QTYPES, "Q8": [False, True], "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, where=_gate_up_fits,
             key=("k", "m", "slots", "rows"), sizes=("slots", "rows"),
             grid=lambda v, s: (row_groups(v, s.m), s.slots, getattr(s, "rows", 1)),
             traffic=_gate_up_traffic)
def ffn_gate_up(wg: Buffer[u8], wu: Buffer[u8], ids: Buffer[u32], x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32],
                act: Buffer[f32], k: u32, m: u32, row: u32 = 0, ids_stride: u32 = 0, act_stride: u32 = 0,
                EXPERTS: Spec[boolean] = True, QTYPE: Const = "q4_k",
                QTYPE_UP: Const = "", Q8: Const = False, ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32,
                WG: Const = 0):
    """act[s·m + r] = silu(Wg[r]·x) · (Wu[r]·x) for slot s = workgroup_id(1), with the pair of
    expert ids[s] (EXPERTS) or the single pair (not EXPERTS: a dense FFN; `ids` unused); x in f32,
    or with Q8 as Q8_1 (xq, xd). A MoE layer's shared expert is one more expert of the stacks
    (the graph appends it; the router names it in ids[K]), so routed and shared experts are one
    dispatch with one code path. Gate and up rows are read in one pass over x; Wu's type is
    QTYPE_UP where it differs from Wg's ("" where not). For row `row` of a batch (batch.py): x,
    xq and xd at that row, ids and act that many of their strides in; plus the grid's z (a
    launch may name `rows`)."""
    row = row + zdsl.workgroup_id(2)
    x, xq, xd = x.at(row * k), xq.at(row * (k // 4)), xd.at(row * (k // 16))
    ids, act = ids.at(row * ids_stride), act.at(row * act_stride)
    group = Rows(ROWS, NSUB, SG)
    slot = zdsl.workgroup_id(1)
    expert = ids.load(slot, mask=EXPERTS, other=0)
    acc = gate_up_dots(gate_up_decoders(QTYPE, QTYPE_UP, Q8), wg, wu, expert, x, xq, xd, [0], k, m, group)
    store_swiglu(act, tile_sums(group, acc), group, m, [slot])


def expert_dots(f, ctx, Q8: bool, stacks, expert, x, xq, xd, x_bases, k, m, group: Rows):
    """row_dots of the group's rows of expert `expert` in each stack of `stacks` (m rows per
    expert; the first stack's rows first) (f, ctx, Q8 from dmmv.decoder)."""
    nblocks = k // f.block
    row_bytes = nblocks * f.nbytes
    base = expert * (m * row_bytes)
    rows = [(w, base + r * row_bytes) for w in stacks for r in group.clamped(m)]
    return row_dots(f, ctx, Q8, rows, x, xq, xd, x_bases, nblocks, group)


def tile_sums(group: Rows, acc):
    """acc[row][col] summed over the group, flat: [row · cols + col] (store_rows' order)."""
    return group.sums([a for row in acc for a in row])


def store_swiglu(act, sums, group: Rows, m, cols, live=None):
    """act[cols[c]·m + row] = silu(gate) · up for each column c (where live[c]), from tile_sums
    of the group's gate rows, then its up rows."""
    n, ncols = group.count, len(cols)
    values = [zdsl.silu(sums[r * ncols + c]) * sums[(n + r) * ncols + c] for r in range(n) for c in range(ncols)]
    store_rows(act, values, group, m, ncols, None, cols, live)


def experts_of(w_bytes, qtype, m, k) -> int:
    f = FORMATS[qtype]
    return len(np.asarray(w_bytes).reshape(-1)) // (m * (k // f.block) * f.nbytes)


def ffn_gate_up_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k, experts=True, qtype_up=None):
    """act of every slot: the experts `ids` of the stacks (the shared one among them), or the
    one pair (not experts); Wu in qtype_up where given."""
    nexp = experts_of(wg_bytes, qtype, m, k)
    g = dequant_rows(wg_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    u = dequant_rows(wu_bytes, qtype_up or qtype, nexp * m, k).reshape(nexp, m, k)
    xv = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):  # silu of a large negative gate: −0, as on the GPU
        out = [(lambda a: a / (1 + np.exp(-a)))(g[e] @ xv) * (u[e] @ xv) for e in (list(ids) if experts else [0])]
    return np.concatenate(out)


def ffn_gate_up_q8_ref(wg_bytes, wu_bytes, ids, xq, xd, qtype, m, k, experts=True, qtype_up=None):
    """ffn_gate_up_ref on the activations the Q8_1 buffers stand for."""
    return ffn_gate_up_ref(wg_bytes, wu_bytes, ids, q8_1_values(xq, xd), qtype, m, k, experts, qtype_up)


@ffn_gate_up.example
def ffn_gate_up_example(use, rng, check):
    """A dense pair (1 slot) or experts picked from the stacks (the shared expert is one of them),
    for each of the launch's rows (a step of several tokens or streams: x, ids and act a row each,
    the grid's z), so that a check sees every row."""
    q, q8, experts = use.fixed["QTYPE"], use.fixed.get("Q8", False), use.fixed["EXPERTS"]
    qu = use.fixed.get("QTYPE_UP") or q
    k, m, slots, n_rows = use.sizes["k"], use.sizes["m"], use.sizes["slots"], use.sizes.get("rows", 1)
    n_exp = use.buffers["wg"] // (m * inputs.row_bytes(q, k))
    m = min(m, inputs.CHECK_ROWS) if check else m
    n_exp = min(n_exp, 2 * slots + 1) if check and experts else n_exp
    args = dict(wg=inputs.rows(rng, q, n_exp * m, k), wu=inputs.rows(rng, qu, n_exp * m, k),
                ids=inputs.experts(rng, n_exp, slots, n_rows), **inputs.activations(rng, n_rows * k, q8),
                act=np.zeros(n_rows * slots * m, np.float32), k=k, m=m, slots=slots, rows=n_rows,
                ids_stride=slots if experts else 0, act_stride=slots * m)

    def expect(p):
        want = []
        for r in range(n_rows):
            ids = args["ids"][r * slots:(r + 1) * slots]
            if q8:
                xq, xd = args["xq"][r * k // 4:(r + 1) * k // 4], args["xd"][r * k // 16:(r + 1) * k // 16]
                want.append(ffn_gate_up_q8_ref(args["wg"], args["wu"], ids, xq, xd, q, m, k, experts, qu))
            else:
                want.append(ffn_gate_up_ref(args["wg"], args["wu"], ids, args["x"][r * k:(r + 1) * k], q, m, k,
                                            experts, qu))
        return {"act": (np.concatenate(want), 2e-4)}

    def rotate(n):
        if experts:
            return {"ids": [inputs.experts(rng, n_exp, slots, n_rows) for _ in range(n - 1)]}
        return {"wg": inputs.copies(args["wg"], n), "wu": inputs.copies(args["wu"], n)}
    return zdsl.Example(args, expect, rotate)


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "ROWS": [1, 2, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, key=("k", "m", "rows"), sizes=("rows",),
             grid=lambda v, s: (row_groups(v, s.m), 1, getattr(s, "rows", 1)),
             traffic=lambda v, s: s.slots * (s.m * inputs.row_bytes(v.QTYPE, s.k) + 4 * s.k) + 8 * s.m)
def moe_down(w: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32], y: Buffer[f32],
             k: u32, m: u32, slots: u32, row: u32 = 0, ids_stride: u32 = 0, act_stride: u32 = 0,
             ADD: Spec[boolean] = True, QTYPE: Const = "q4_k", ROWS: Const = 1,
             NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[r] (+)= Σ_s weights[s] · (W_{ids[s]}[r] · act[s·k : s·k + k]) — the routed experts' down
    projection and their weighted sum in one dispatch (also the shared expert, with one slot
    whose weight is its sigmoid gate). For row `row` of a batch (batch.py): y at that row, ids and
    weights that many ids_strides in, act that many act_strides; plus the grid's z (a launch may
    name `rows`)."""
    row = row + zdsl.workgroup_id(2)
    ids, weights = ids.at(row * ids_stride), weights.at(row * ids_stride)
    act, y = act.at(row * act_stride), y.at(row * m)
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


def moe_down_ref(w_bytes, ids, weights, act, qtype, m, k, y=None):
    nexp = experts_of(w_bytes, qtype, m, k)
    wd = dequant_rows(w_bytes, qtype, nexp * m, k).reshape(nexp, m, k)
    a = act.reshape(-1, k).astype(np.float64)
    out = sum(float(wt) * (wd[e] @ a[s]) for s, (e, wt) in enumerate(zip(ids, weights)))
    return out if y is None else out + y


@moe_down.example
def moe_down_example(use, rng, check):
    """`slots` experts' down projections added to y, for each of the launch's rows (ids, weights,
    act and y a row each, the grid's z)."""
    q, k, m, slots = use.fixed["QTYPE"], use.sizes["k"], use.sizes["m"], use.sizes["slots"]
    n_rows = use.sizes.get("rows", 1)
    n_exp = use.buffers["w"] // (m * inputs.row_bytes(q, k))
    m = min(m, inputs.CHECK_ROWS) if check else m
    n_exp = min(n_exp, 2 * slots + 1) if check else n_exp
    args = dict(w=inputs.rows(rng, q, n_exp * m, k), ids=inputs.experts(rng, n_exp, slots, n_rows),
                weights=rng.uniform(0.05, 0.5, n_rows * slots).astype(np.float32),
                act=inputs.normal(rng, n_rows * slots * k), y=inputs.normal(rng, n_rows * m), k=k, m=m, slots=slots,
                rows=n_rows, ids_stride=slots, act_stride=slots * k)
    y0 = args["y"].copy()

    def expect(p):
        return {"y": (np.concatenate([moe_down_ref(args["w"], args["ids"][r * slots:(r + 1) * slots],
                                                   args["weights"][r * slots:(r + 1) * slots],
                                                   args["act"][r * slots * k:(r + 1) * slots * k], q, m, k,
                                                   y0[r * m:(r + 1) * m]) for r in range(n_rows)]), 1e-4)}
    return zdsl.Example(args, expect,
                        lambda n: {"ids": [inputs.experts(rng, n_exp, slots, n_rows) for _ in range(n - 1)]})


# ---- the MoE down projection of a decode step: every expert, added to x ----

def _down_all_traffic(v, s) -> int:
    stack = v.K if v.QTYPE_SH else v.K + 1  # the experts the stack serves
    shared = s.m * inputs.row_bytes(v.QTYPE_SH, s.k) if v.QTYPE_SH else 0
    return stack * s.m * inputs.row_bytes(v.QTYPE, s.k) + shared + 4 * (v.K + 1) * (s.k + 2) + 8 * s.m


@zdsl.kernel(workgroup=workgroup, subgroup="SG", variants={"QTYPE": EXPERT_QTYPES, "QTYPE_SH": ["", "q6_k"],
                                                           "ROWS": [1, 2], "K": [8], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS, "WG": [0, 128, 160, 256]},
             where=lambda v: v.QTYPE_SH == "" or (FORMATS[v.QTYPE].block, FORMATS[v.QTYPE].parts) == (256, FORMATS["q6_k"].parts),
             key=("k", "m", "rows"), sizes=("rows",), grid=lambda v, s: (row_groups(v, s.m), 1, getattr(s, "rows", 1)),
             traffic=_down_all_traffic)
def moe_down_all(w: Buffer[u8], w_sh: Buffer[u8], ids: Buffer[u32], weights: Buffer[f32], act: Buffer[f32],
                 y: Buffer[f32], k: u32, m: u32, row: u32 = 0, QTYPE: Const = "q4_k", QTYPE_SH: Const = "",
                 K: Const = 8, ROWS: Const = 1, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[r] += Σ_{s≤K} weights[s] · (W_s[r] · act[s·k:]): the K routed experts and the shared
    expert (slot K) in one pass, added to the residual. W_s is expert ids[s] of w, the shared
    expert too when it has the experts' type (the graph appends it to their stack); files that
    keep it at more bits give it as w_sh, of type QTYPE_SH, which costs a second code path. ids,
    weights, act and y are at row `row` of a batch's (batch.py: K + 1 slots a row), plus the
    grid's z (a launch may name `rows`)."""
    row = row + zdsl.workgroup_id(2)
    ids, weights = ids.at(row * (K + 1)), weights.at(row * (K + 1))
    act, y = act.at(row * ((K + 1) * k)), y.at(row * m)
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


def moe_down_all_ref(w_bytes, w_sh_bytes, ids, weights, act, y, qtype, m, k, qtype_sh=None):
    """`ids` names all K + 1 experts of w_bytes when w_sh_bytes is None, else the K routed ones."""
    if w_sh_bytes is None:
        return y + moe_down_ref(w_bytes, ids, weights, act, qtype, m, k)
    K = len(ids)
    routed = moe_down_ref(w_bytes, ids, weights[:K], act[:K * k], qtype, m, k)
    shared = float(weights[K]) * (dequant_rows(w_sh_bytes, qtype_sh or qtype, m, k) @ act[K * k:].astype(np.float64))
    return y + routed + shared


@moe_down_all.example
def moe_down_all_example(use, rng, check):
    """The shared expert appended to the experts' stack (QTYPE_SH empty), or apart in its own type,
    for each of the launch's rows (K + 1 slots of ids, weights and act and a y a row, the grid's z)."""
    q, K, apart = use.fixed["QTYPE"], use.fixed["K"], use.fixed["QTYPE_SH"] or None
    k, m, n_rows = use.sizes["k"], use.sizes["m"], use.sizes.get("rows", 1)
    n_exp = use.buffers["w"] // (m * inputs.row_bytes(q, k))
    m = min(m, inputs.CHECK_ROWS) if check else m
    n_exp = min(n_exp, K + 4) if check else n_exp
    slots = K if apart else K + 1  # the experts the stack serves
    args = dict(w=inputs.rows(rng, q, n_exp * m, k), w_sh=inputs.rows(rng, apart, m, k) if apart else np.zeros(16, np.uint8),
                ids=inputs.experts(rng, n_exp, K + 1, n_rows),
                weights=rng.uniform(0.05, 0.5, n_rows * (K + 1)).astype(np.float32),
                act=inputs.normal(rng, n_rows * (K + 1) * k), y=inputs.normal(rng, n_rows * m), k=k, m=m, rows=n_rows)
    y0 = args["y"].copy()

    def expect(p):
        def row(r):
            at, n = r * (K + 1), K + 1
            return moe_down_all_ref(args["w"], args["w_sh"] if apart else None, args["ids"][at:at + slots],
                                    args["weights"][at:at + n], args["act"][at * k:(at + n) * k],
                                    y0[r * m:(r + 1) * m], q, m, k, apart)
        return {"y": (np.concatenate([row(r) for r in range(n_rows)]), 1e-4)}
    return zdsl.Example(args, expect,
                        lambda n: {"ids": [inputs.experts(rng, n_exp, K + 1, n_rows) for _ in range(n - 1)]})


# ---- a chunk of T tokens (prefill): each picked expert's weights read once for all its pairs ----
#
# moe.moe_group lists the pairs (j = token·K + slot) of each expert together; a workgroup owns
# ROWS rows of one expert and walks that expert's pairs COLS at a time, so each weight block it
# decodes serves COLS tokens. Grid: (row groups, n_expert · SPLIT), whatever the routing; the
# SPLIT workgroups of an expert take turns over its tiles, and an expert no token picked runs none.
# Tuning keys leave out the chunk's length: one choice serves every chunk, tuned on full ones
# (`zdsl tune --prompt 512`), which a long prompt is made of.

def expert_tiles(offsets, pairs, COLS: int, SPLIT: int, group: Rows, body):
    """body(e, js, live) for each tile of this workgroup: expert e = workgroup_id(1) // SPLIT,
    tiles s, s + SPLIT, … (s = workgroup_id(1) % SPLIT) of COLS of its pairs
    pairs[offsets[e] : offsets[e + 1]]; js are the tile's pairs (past the expert's last, that
    one again), live which of them are its own."""
    wid = zdsl.workgroup_id(1)
    e = wid // SPLIT
    end = offsets[e + 1]
    for first in zdsl.range(offsets[e] + (wid % SPLIT) * COLS, end, SPLIT * COLS):
        places = [first + c for c in range(COLS)]
        body(e, [pairs[zdsl.min(p, end - 1)] for p in places], [p < end for p in places])
        if group.size > group.SG:
            zdsl.barrier()  # the next tile's sums reuse the shared memory this one's read


def _experts_used(s) -> int:
    return min(s.n_expert, s.t * s.topk)


def _gate_up_grouped_traffic(v, s) -> int:
    q8 = getattr(v, "Q8", False)  # the matrix-unit kernel reads x in f32 and has no Q8
    up = getattr(v, "QTYPE_UP", "") or v.QTYPE
    return (_experts_used(s) * s.m * (inputs.row_bytes(v.QTYPE, s.k) + inputs.row_bytes(up, s.k))
            + s.t * input_bytes(s.k, q8) + 4 * s.t * s.topk * (s.m + 2) + 4 * s.n_expert)


# Defaults ROWS = 2, COLS = 4: on the H100 a 256-token chunk of the 35B-A3B spends 72.5 ms in the
# grouped down products and 31.4 in gate·up with ROWS 1, 57.7 and 27.5 with 2, 79.8 (down) with
# 4: each row group reads its expert's activation rows again, and that traffic, not the weights,
# bounds them (shared-memory tiles are the next step).
_GROUPED = dict(workgroup=workgroup, subgroup="SG", tune={"NSUB": NSUBS, "SPLIT": [1, 2, 4]},
                key=("k", "m", "n_expert"), grid=lambda v, s: (row_groups(v, s.m), s.n_expert * v.SPLIT),
                cpu=dict(ROWS=1))


@zdsl.kernel(variants={"QTYPE": EXPERT_QTYPES, "Q8": [False, True], "ROWS": [1, 2], "COLS": [4, 8], "SG": SUBGROUPS},
             where=_gate_up_fits, sizes=("t", "n_expert"), traffic=_gate_up_grouped_traffic, **_GROUPED)
def moe_gate_up_grouped(wg: Buffer[u8], wu: Buffer[u8], offsets: Buffer[u32], pairs: Buffer[u32], x: Buffer[f32],
                        xq: Buffer[u32], xd: Buffer[f32], act: Buffer[f32], k: u32, m: u32, topk: u32,
                        QTYPE: Const = "q4_k", QTYPE_UP: Const = "", Q8: Const = False, ROWS: Const = 2,
                        COLS: Const = 4, NSUB: Const = 1, SPLIT: Const = 1, SG: Const = 32, WG: Const = 0):
    """act[j·m + r] = silu(Wg_e[r]·x_i) · (Wu_e[r]·x_i) for every pair j = i·topk + slot of
    expert e, grouped by moe.moe_group (offsets, pairs); x_i is row i of the T normed rows (k
    values each), in f32 or with Q8 as Q8_1 (xq, xd); Wu in QTYPE_UP where it differs ("" where
    not)."""
    group = Rows(ROWS, NSUB, SG)
    decs = gate_up_decoders(QTYPE, QTYPE_UP, Q8)

    def tile(e, js, live):
        bases = [(j // topk) * k for j in js]
        acc = gate_up_dots(decs, wg, wu, e, x, xq, xd, bases, k, m, group)
        store_swiglu(act, tile_sums(group, acc), group, m, js, live)
    expert_tiles(offsets, pairs, COLS, SPLIT, group, tile)


def moe_gate_up_grouped_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k, f16=False, qtype_up=None):
    """act of every pair j (the expert ids[j], token j // K of the rows x; K = len(ids) / rows);
    with f16 the weights and x rounded to f16 first; Wu in qtype_up where given."""
    xs = as_read(x, f16).reshape(-1, k)
    rows = xs[np.arange(len(ids)) // (len(ids) // len(xs))]
    g, u = (as_read(_stack(w, q, m, k), f16)[np.asarray(ids)] for w, q in ((wg_bytes, qtype),
                                                                            (wu_bytes, qtype_up or qtype)))
    gate, up = np.einsum("jrk,jk->jr", g, rows), np.einsum("jrk,jk->jr", u, rows)
    with np.errstate(over="ignore"):  # silu of a large negative gate: −0, as on the GPU
        return (gate / (1 + np.exp(-gate)) * up).reshape(-1)


def _stack(w_bytes, qtype, m, k) -> np.ndarray:
    """A stack of experts, dequantized: (experts, m, k)."""
    nexp = experts_of(w_bytes, qtype, m, k)
    return dequant_rows(w_bytes, qtype, nexp * m, k).reshape(nexp, m, k)


def _grouped_case(use, rng, check):
    """The shapes of a grouped example (fewer rows, experts and tokens for a check) and a routing
    of its t tokens to K of its experts, grouped as moe.moe_group does."""
    k, m, n_exp, t, K = (use.sizes[n] for n in ("k", "m", "n_expert", "t", "topk"))
    if check:
        m, n_exp, t = min(m, inputs.CHECK_ROWS), min(n_exp, 12), min(t, 5)
    ids = inputs.experts(rng, n_exp, K, t)
    counts = np.bincount(ids, minlength=n_exp)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    routing = dict(offsets=offsets, pairs=np.argsort(ids, kind="stable").astype(np.uint32), t=t, topk=K,
                   n_expert=n_exp)
    return SimpleNamespace(q=use.fixed["QTYPE"], k=k, m=m, n_exp=n_exp, t=t, K=K, ids=ids, routing=routing)


def _gate_up_example(use, rng, check, q8: bool, f16: bool, tol: float):
    c = _grouped_case(use, rng, check)
    xs = [inputs.activations(rng, c.k, q8) for _ in range(c.t)]
    acts = {name: np.concatenate([a[name] for a in xs]) for name in xs[0]}
    qu = use.fixed.get("QTYPE_UP") or c.q
    args = dict(wg=inputs.rows(rng, c.q, c.n_exp * c.m, c.k), wu=inputs.rows(rng, qu, c.n_exp * c.m, c.k), **acts,
                act=np.zeros(c.t * c.K * c.m, np.float32), k=c.k, m=c.m, **c.routing)

    def expect(p):
        x = q8_1_values(args["xq"], args["xd"]) if q8 else args["x"]
        return {"act": (moe_gate_up_grouped_ref(args["wg"], args["wu"], c.ids, x, c.q, c.m, c.k, f16, qu), tol)}
    return zdsl.Example(args, expect)


def _down_example(use, rng, check, f16: bool, tol: float):
    c = _grouped_case(use, rng, check)
    args = dict(w=inputs.rows(rng, c.q, c.n_exp * c.m, c.k), act=inputs.normal(rng, c.t * c.K * c.k),
                y=np.zeros(c.t * c.K * c.m, np.float32), k=c.k, m=c.m, **c.routing)
    return zdsl.Example(args, lambda p: {"y": (moe_down_grouped_ref(args["w"], c.ids, args["act"], c.q, c.m, c.k, f16),
                                               tol)})


@moe_gate_up_grouped.example
def moe_gate_up_grouped_example(use, rng, check):
    return _gate_up_example(use, rng, check, use.fixed.get("Q8", False), False, 2e-4)


def _down_grouped_traffic(v, s) -> int:
    return _experts_used(s) * s.m * inputs.row_bytes(v.QTYPE, s.k) + 4 * s.t * s.topk * (s.k + s.m + 1) + 4 * s.n_expert


@zdsl.kernel(variants={"QTYPE": EXPERT_QTYPES, "ROWS": [1, 2], "COLS": [4, 8], "SG": SUBGROUPS},
             sizes=("t", "n_expert", "topk"), traffic=_down_grouped_traffic, **_GROUPED)
def moe_down_grouped(w: Buffer[u8], offsets: Buffer[u32], pairs: Buffer[u32], act: Buffer[f32], y: Buffer[f32],
                     k: u32, m: u32, QTYPE: Const = "q4_k", ROWS: Const = 2, COLS: Const = 4, NSUB: Const = 1,
                     SPLIT: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[j·m + r] = W_e[r] · act[j·k : j·k + k] for every pair j of expert e, grouped by
    moe.moe_group; moe.moe_combine_rows weighs and adds them to the residual."""
    group = Rows(ROWS, NSUB, SG)
    dec = decoder(QTYPE, False)

    def tile(e, js, live):
        acc = expert_dots(*dec, [w], e, act, None, None, [j * k for j in js], k, m, group)
        store_rows(y, tile_sums(group, acc), group, m, COLS, None, js, live)
    expert_tiles(offsets, pairs, COLS, SPLIT, group, tile)


def moe_down_grouped_ref(w_bytes, ids, act, qtype, m, k, f16=False):
    """y of every pair j: expert ids[j]'s down rows times act[j·k : j·k + k] (with f16 both
    rounded to f16 first)."""
    a = as_read(act, f16).reshape(-1, k)
    return np.einsum("jrk,jk->jr", as_read(_stack(w_bytes, qtype, m, k), f16)[np.asarray(ids)], a).reshape(-1)


@moe_down_grouped.example
def moe_down_grouped_example(use, rng, check):
    return _down_example(use, rng, check, False, 1e-4)


# The same grouped products on matrix units (mma.py): a workgroup owns BM rows of one expert's
# weights (BM/2 gate rows and their up rows for gate·up) and walks the expert's pairs BN at a
# time; each K step's weight tile is decoded once for BN tokens into shared memory.

def _coop_tiles(offsets, pairs, BN: int, SPLIT: int, tiles: mma.Tiles, body):
    """body(e, js, first, end) for each tile of BN pairs of this workgroup's expert (as
    expert_tiles): js a shared array of the tile's pairs (past the expert's last, that one
    again), first and end its place in pairs."""
    wid = zdsl.workgroup_id(1)
    e = wid // SPLIT
    end = offsets[e + 1]
    js = zdsl.shared(u32, BN)
    for first in zdsl.range(offsets[e] + (wid % SPLIT) * BN, end, SPLIT * BN):
        def place(u):
            js[u] = pairs[zdsl.min(first + u, end - 1)]
        tiles.spread(BN, place)  # read after the product's first barrier
        body(e, js, first, end)
        zdsl.barrier()  # the next tile rewrites js and C


def _coop_grid(stacks: int):
    return lambda v, s: (-(-s.m // (v.BM // stacks)), s.n_expert * v.SPLIT)


_COOP = dict(workgroup=mma.workgroup, subgroup="SG", where=mma.fits, tune={"SPLIT": [1, 2], "BK": mma.STEPS},
             key=("k", "m", "n_expert"))
# Tiles of BM weight rows (of an expert; half gate, half up rows for gate·up) by BN pairs, one
# 16-row tile per subgroup. In whole-block steps of 256, 64 × 16: a routed expert gets ~16 of a
# 512-token chunk's pairs, and 64 rows are the most the 48 KiB of shared memory hold beside them
# (each row tile reads its pairs' rows again). H200, 511-token chunk of the 35B-A3B, against 32 ×
# 32: routed down 58.8 → 44.4 ms, shared gate·up 11.3 → 8.0 (a workgroup per 16 tokens:
# prefill.py's SPLIT). Types that step by 128 have room for larger tiles (below). These are the
# defaults; the H100's tuned entries take steps of 64 for Q4_K (gate·up 64 × 32, 566 →
# 528 µs; down 64 × 16, 348 → 260), where the driver gives a lane far fewer registers.
_COOP_TILES = {"BM": [32, 64], "BN": [16, 32], "SG": [32]}


# The gate·up takes 128 rows (64 gate, 64 up) × 16 pairs in steps of 128 where the type steps so:
# a step's 16 activation rows serve twice the rows of 64-row tiles (H100, zdsl profile
# --prompt 511 of the 35B-A3B, one row tile per subgroup: 26.5 ms against 29.9 for 64 × 16 in steps
# of 256, pp512 5,645.8 against 5,437.4; 96 × 16 in steps of 128: 33.6; 64 × 16 in steps of 128:
# 44.4; 64 × 32: 34.2; 48 × 32 in steps of 256: 33.5). Each subgroup takes two row tiles (four
# subgroups): the activations' tile is read from shared memory four times a step instead of eight,
# and the 128 invocations decode one int8 part each (timed alone on the H100: 554 µs against
# 572 with eight subgroups; four row tiles a subgroup: 840).
@zdsl.kernel(variants={"QTYPE": EXPERT_QTYPES, **_COOP_TILES, "BM": [32, 64, 128]}, sizes=("t", "n_expert"),
             grid=_coop_grid(2), traffic=_gate_up_grouped_traffic, **_COOP)
def moe_gate_up_coop(wg: Buffer[u8], wu: Buffer[u8], offsets: Buffer[u32], pairs: Buffer[u32], x: Buffer[f32],
                     act: Buffer[f32], k: u32, m: u32, topk: u32, QTYPE: Const = "q4_k",
                     BM: Const = mma.by_steps(128, 64), BN: Const = 16, BK: Const = mma.by_steps(128, 0),
                     TM: Const = mma.by_steps(2, 1), TN: Const = 1, SPLIT: Const = 1, SG: Const = 32):
    """moe_gate_up_grouped on matrix units, x in f32 and k a multiple of BK: workgroup (g, e)
    makes rows g·BM/2 … of expert e's gate and up products for its pairs, then their SwiGLU."""
    half = BM // 2
    tiles = mma.Tiles(BM, BN, BK, TM, TN, SG, QTYPE)
    f, ctx, r0, rows = mma.weight_rows(QTYPE, k, m, half)

    def tile(e, js, first, end):
        mma.product(tiles, f, ctx, [(wg, rows(e)), (wu, rows(e))], x, lambda n: (js[n] // topk) * k, k)

        def store(u):
            n, i = u // half, u % half
            with zdsl.if_((first + n < end) & (r0 + i < m)):
                act[js[n] * m + r0 + i] = zdsl.silu(tiles.c[n * BM + i]) * tiles.c[n * BM + half + i]
        tiles.spread(BN * half, store)
    _coop_tiles(offsets, pairs, BN, SPLIT, tiles, tile)


def moe_gate_up_coop_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k):
    """moe_gate_up_grouped_ref with the weights and x rounded to f16."""
    return moe_gate_up_grouped_ref(wg_bytes, wu_bytes, ids, x, qtype, m, k, f16=True)


@moe_gate_up_coop.example
def moe_gate_up_coop_example(use, rng, check):
    return _gate_up_example(use, rng, check, False, True, 1e-3)


# The experts' down (k = the expert width, 512: four steps of 128) takes 64 × 32 tiles where the
# type steps by 128: each expert's rows decoded once for its ~16 pairs, where 16-token tiles
# decode them again from its 17th pair on (H100, zdsl profile --prompt 511 of the
# 35B-A3B: 20.6 ms against 23.7).
@zdsl.kernel(variants={"QTYPE": EXPERT_QTYPES, **_COOP_TILES}, sizes=("t", "n_expert", "topk"),
             grid=_coop_grid(1), traffic=_down_grouped_traffic, **_COOP)
def moe_down_coop(w: Buffer[u8], offsets: Buffer[u32], pairs: Buffer[u32], act: Buffer[f32], y: Buffer[f32],
                  k: u32, m: u32, QTYPE: Const = "q4_k", BM: Const = 64, BN: Const = mma.by_steps(32, 16),
                  BK: Const = mma.by_steps(128, 0), TM: Const = 1, TN: Const = 1, SPLIT: Const = 1,
                  SG: Const = 32):
    """moe_down_grouped on matrix units, k a multiple of BK: workgroup (g, e) makes rows g·BM …
    of y for expert e's pairs."""
    tiles = mma.Tiles(BM, BN, BK, TM, TN, SG, QTYPE)
    f, ctx, r0, rows = mma.weight_rows(QTYPE, k, m, BM)

    def tile(e, js, first, end):
        mma.product(tiles, f, ctx, [(w, rows(e))], act, lambda n: js[n] * k, k)

        def store(u):
            n, i = u // BM, u % BM
            with zdsl.if_((first + n < end) & (r0 + i < m)):
                y[js[n] * m + r0 + i] = tiles.c[u]
        tiles.spread(BN * BM, store)
    _coop_tiles(offsets, pairs, BN, SPLIT, tiles, tile)


def moe_down_coop_ref(w_bytes, ids, act, qtype, m, k):
    """moe_down_grouped_ref with the weights and act rounded to f16."""
    return moe_down_grouped_ref(w_bytes, ids, act, qtype, m, k, f16=True)


@moe_down_coop.example
def moe_down_coop_example(use, rng, check):
    return _down_example(use, rng, check, True, 1e-3)
