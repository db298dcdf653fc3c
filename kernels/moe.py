"""Mixture-of-experts routing on the GPU: which experts a token uses and with what weights, and
the normed input the experts read (the router norms the residual stream itself). The products
themselves are `ffn.ffn_gate_up` and `ffn.moe_down_all`, which
read the `ids` and `weights` written here. The shared expert is slot K: expert n_expert of the
stacks (the graph appends it to the routed experts' weights), with its sigmoid gate as weight. For a chunk of tokens (a prompt) the same picks come from batched router
logits (`moe_route_rows`), the (token, expert) pairs are grouped by expert (`moe_group`) for
`ffn.moe_gate_up_grouped` and `ffn.moe_down_grouped`, and `moe_combine_rows` sums them into x."""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Coherent, Const, f32, i32, u8, u32
from zdsl.kernels import dmmv, inputs
from zdsl.kernels.norm import rms_norm_ref
from zdsl.kernels.q8_1 import store_q8_1
from zdsl.kernels.quant import fmt
from zdsl.kernels.reduce import SUBGROUPS
from zdsl.kernels.sampling import few_topk


class NormedInput:
    """x ⊙ norm_w as the matrix-vector steps load activations (`.vec4[i]`), adding Σx² of every
    quad it loads to `squares`: a workgroup that walks all of x once gets rmsnorm's sum on the way."""

    def __init__(self, x, norm_w, squares):
        self.x, self.norm_w, self.squares = x, norm_w, squares

    @property
    def vec4(self):
        return self

    def __getitem__(self, i):
        v = self.x.vec4[i]
        self.squares.set(zdsl.fma(v.x, v.x, zdsl.fma(v.y, v.y, zdsl.fma(v.z, v.z, zdsl.fma(v.w, v.w, self.squares)))))
        return v * self.norm_w.vec4[i]


@zdsl.kernel(workgroup=dmmv.workgroup, subgroup="SG", variants={"QTYPE": ["f32"], "K": [8], "ROWS": [1, 2, 4],
                                                               "SG": SUBGROUPS},
             tune={"NSUB": dmmv.NSUBS, "WG": [0, 128, 256]}, key=("k", "n_expert", "rows"),
             sizes=("rows",), grid=lambda v, s: (dmmv.row_groups(v, s.n_expert + 1), 1, getattr(s, "rows", 1)),
             traffic=lambda v, s: ((s.n_expert + 1) * inputs.row_bytes(v.QTYPE, s.k) + 13 * s.k + s.k // 4
                                   + 8 * (s.n_expert + 1) + 8 * (v.K + 1) + 4))
def moe_router(w: Buffer[u8], x: Buffer[f32], norm_w: Buffer[f32], hn: Buffer[f32], xq: Buffer[u32],
               xd: Buffer[f32], logits: Coherent[f32], arrivals: Buffer[u32], ids: Buffer[u32], weights: Buffer[f32],
               k: u32, n_expert: u32, eps: f32, row: u32 = 0, QTYPE: Const = "f32", K: Const = 8, ROWS: Const = 1,
               NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """The experts of one token, from the residual stream x, in one dispatch. Each workgroup
    computes its rows of the router logits[e] = W[e] · hn, hn = rmsnorm(x) · norm_w, as
    (W[e] · (x ⊙ norm_w)) · rsqrt(mean(x²) + eps): it walks all of x for its rows anyway, so
    it sums x² on the way and no norm dispatch comes first. W has n_expert + 1 rows: the last is
    the shared expert's gate (weights.py), so logits[n_expert] is its gate's logit. Workgroups
    also write hn, in f32 and as Q8_1 (xq, xd: the experts' int8 input; q8_1.py), a few blocks
    of 32 each. The one that finishes last (arrivals[0] counts them: 0 before, 0 after) picks
    ids[j] = the expert with the j-th largest logit (equal logits: lower expert first) and
    weights[j] = its softmax probability renormalised over the K picked. The full softmax
    denominator cancels in that renormalisation, so only the picked logits are exponentiated.
    Slot K is the shared expert: ids[K] = n_expert (its place in the stacks) and weights[K] =
    sigmoid(logits[n_expert]). Needs n_expert ≥ K and k a multiple of 32. Every buffer but w is
    read and written at row `row` (one sequence of a batch, batch.py; arrivals: its word), plus
    the grid's z: a launch may name `rows`, one layer of the grid each."""
    row = row + zdsl.workgroup_id(2)
    x, hn, xq, xd = x.at(row * k), hn.at(row * k), xq.at(row * (k // 4)), xd.at(row * (k // 16))
    logits, arrivals = logits.at(row * (n_expert + 1)), arrivals.at(row)
    ids, weights = ids.at(row * (K + 1)), weights.at(row * (K + 1))
    f = fmt(QTYPE)
    ctx = f.setup()
    nblocks = k // f.block
    group = dmmv.Rows(ROWS, NSUB, SG)
    m = n_expert + 1
    rows = [(w, r * (nblocks * f.nbytes)) for r in group.clamped(m)]
    squares = zdsl.var(0.0)
    acc = dmmv.block_dots(f, ctx, rows, NormedInput(x, norm_w, squares), [0], nblocks, group)
    sums = group.sums([acc[r][0] for r in range(ROWS)] + [squares])
    inv_rms = zdsl.rsqrt(sums[ROWS] / k.to(f32) + eps)
    dmmv.store_rows(logits, [v * inv_rms for v in sums[:ROWS]], group, m, 1)
    WG = zdsl.workgroup_size()
    t = zdsl.local_index()
    blocks, per_pass = k >> 5, WG // 8  # Q8_1 blocks of hn, and a workgroup's per pass (eight quads each)
    for first in zdsl.range(zdsl.workgroup_id() * per_pass, blocks, zdsl.num_workgroups() * per_pass):
        block = first + t // 8
        i = zdsl.min(block, blocks - 1) * 8 + t % 8
        value = x.vec4[i] * norm_w.vec4[i] * inv_rms
        with zdsl.if_(block < blocks):
            hn.vec4[i] = value
        store_q8_1(value, i, block < blocks, xq, xd)
    with zdsl.if_(zdsl.last_workgroup(arrivals, per_z=True)):
        def load(index, valid):
            return logits.load(index, mask=valid, other=0.0), index

        pick_experts(load, n_expert, K, WG, SG, ids, weights, 0)
        with zdsl.if_(t == 0):
            ids[K] = n_expert
            weights[K] = zdsl.sigmoid(logits[n_expert])


def pick_experts(load, n_expert, K: int, WG: int, SG: int, ids, weights, base, counts=None):
    """ids[base + j] = the expert with the j-th largest logit (equal logits: lower expert first)
    and weights[base + j] = its softmax probability renormalised over the K picked, for j < K;
    load(index, valid) gives (logit, index). The full softmax denominator cancels in the
    renormalisation, so only the picked logits are exponentiated. With `counts`, each pick also
    adds 1 to counts[expert] (the grouping's tally). Call in uniform control flow."""
    val_sh, id_sh, first = few_topk(load, n_expert, K, WG, SG)
    z0 = val_sh[first]
    for j in zdsl.range(zdsl.local_index(), K, WG):
        total = zdsl.var(0.0)
        for s in range(K):
            total += zdsl.exp(val_sh[first + s] - z0)
        e = id_sh[first + j]
        ids[base + j] = e
        weights[base + j] = zdsl.exp(val_sh[first + j] - z0) / total
        if counts is not None:
            zdsl.atomic_add(counts, e, 1)


def moe_router_ref(w_bytes, x, norm_w, eps, qtype, n_expert, k, K=8):
    """(hn, logits, ids, weights) of one token; w_bytes holds n_expert + 1 rows, the last the shared
    expert's gate; slot K is the shared expert: ids[K] = n_expert, weights[K] its gate."""
    hn = rms_norm_ref(x, norm_w, eps)
    logits = dmmv.dmmv_ref(w_bytes, hn, qtype, n_expert + 1, k)
    ids, weights = route_ref(logits[:n_expert], K)
    gate = 1 / (1 + np.exp(-np.float64(logits[n_expert])))
    return hn, logits, np.append(ids[0], np.uint32(n_expert)), np.append(weights[0], np.float32(gate))


def route_ref(logits, K=8):
    """(ids, weights) per token row of `logits` (tokens × n_expert), the router's picks."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    if logits.shape[1] < K:
        raise ValueError(f"routing needs at least K={K} experts, got {logits.shape[1]}")
    experts = np.arange(logits.shape[1])
    ids = np.stack([np.lexsort((experts, -row.astype(np.float64)))[:K] for row in logits])
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    picked = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.uint32), (picked / picked.sum(axis=1, keepdims=True)).astype(np.float32)


@moe_router.example
def moe_router_example(use, rng, check):
    """One token's routing for each of the launch's rows (x and every output a row each, the
    grid's z)."""
    q, K, k, eps = use.fixed["QTYPE"], use.fixed["K"], use.sizes["k"], use.sizes["eps"]
    n_rows = use.sizes.get("rows", 1)
    n_exp = min(use.sizes["n_expert"], inputs.CHECK_ROWS) if check else use.sizes["n_expert"]
    w = inputs.rows(rng, q, n_exp + 1, k)  # row n_exp: the shared gate
    norm_w = inputs.normal(rng, k)

    def token():
        x = inputs.normal(rng, k, 3.0)
        # the ids are checked exactly: no near ties
        while check and not _clear_picks(moe_router_ref(w, x, norm_w, eps, q, n_exp, k, K)[1][:n_exp], K):
            x = inputs.normal(rng, k, 3.0)
        return x
    args = dict(w=w, x=np.concatenate([token() for _ in range(n_rows)]), norm_w=norm_w,
                hn=np.zeros(n_rows * k, np.float32), xq=np.zeros(n_rows * k // 4, np.uint32),
                xd=np.zeros(n_rows * k // 16, np.float32), logits=np.zeros(n_rows * (n_exp + 1), np.float32),
                arrivals=np.zeros(n_rows, np.uint32), ids=np.zeros(n_rows * (K + 1), np.uint32),
                weights=np.zeros(n_rows * (K + 1), np.float32), k=k, n_expert=n_exp, eps=eps, rows=n_rows)

    def expect(p):
        hn, logits, ids, weights = (np.concatenate(parts) for parts in zip(*[
            moe_router_ref(w, args["x"][r * k:(r + 1) * k], norm_w, eps, q, n_exp, k, K) for r in range(n_rows)]))
        return {"hn": (hn, 1e-4), "xd": (inputs.q8_1_scales(hn), 1e-4), "logits": (logits, 1e-4), "ids": (ids, 0),
                "weights": (weights, 1e-4), "arrivals": (np.zeros(n_rows), 0)}
    return zdsl.Example(args, expect, lambda n: {"w": inputs.copies(args["w"], n)})


def _clear_picks(logits, K) -> bool:
    """Whether the K + 1 largest logits are further apart than rounding moves them."""
    top = np.sort(logits)[::-1][:K + 1]
    return bool(np.all(-np.diff(top) > 1e-3 * np.abs(logits).max()))


# ---- a chunk of T tokens (prefill): routing, and the pairs grouped by expert ----
#
# A pair j = token·K + slot is one (token, picked expert). The router's logits for the T tokens
# come from one batched product; `moe_route_rows` picks each token's experts and tallies them,
# `moe_group` lists the pairs of each expert together, `ffn.moe_gate_up_grouped` and
# `ffn.moe_down_grouped` run each expert's weights once over all of its pairs, and
# `moe_combine_rows` adds each token's weighted pairs (and the shared expert) to the residual.

MAX_EXPERTS = 512  # experts moe_group can group: its table of where each expert's pairs start


def _route_rows_grid(v, s) -> int:
    if s.n_expert < v.K:
        raise zdsl.ZdslError(f"routing picks K={v.K} experts of each token, but there are only {s.n_expert}")
    return s.t


def _group_grid(v, s) -> int:
    if s.n_expert > MAX_EXPERTS:
        raise zdsl.ZdslError(f"moe_group groups at most {MAX_EXPERTS} experts, not {s.n_expert}: raise MAX_EXPERTS")
    return 1


def _route_rows_traffic(v, s) -> int:
    return 4 * s.t * s.stride + 8 * s.t * v.K + 8 * s.n_expert


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"K": [8], "WG": [64, 256], "SG": SUBGROUPS},
             key=("n_expert",), sizes=("t",), grid=_route_rows_grid, traffic=_route_rows_traffic)
def moe_route_rows(logits: Buffer[f32], ids: Buffer[u32], weights: Buffer[f32], counts: Buffer[i32], n_expert: u32,
                   stride: u32, K: Const = 8, WG: Const = 64, SG: Const = 32):
    """The experts of token i = workgroup_id(), from its router logits logits[i·stride :
    i·stride + n_expert] (stride ≥ n_expert: the batched router product may append the shared
    expert's gate to each row): ids[i·K + j], weights[i·K + j] as moe_router picks them. Each
    pick adds 1 to counts[expert] (0 before the dispatch), the tally moe_group turns into lists."""
    row = zdsl.workgroup_id()

    def load(index, valid):
        return logits.load(row * stride + index, mask=valid, other=0.0), index

    pick_experts(load, n_expert, K, WG, SG, ids, weights, row * K, counts)


def moe_route_rows_ref(logits, n_expert, K=8):
    """(ids, weights, counts) of the token rows of `logits` (the first n_expert of each row)."""
    ids, weights = route_ref(np.atleast_2d(logits)[:, :n_expert], K)
    return ids.reshape(-1), weights.reshape(-1), np.bincount(ids.reshape(-1), minlength=n_expert).astype(np.int32)


@moe_route_rows.example
def moe_route_rows_example(use, rng, check):
    K, n, t = use.fixed["K"], use.sizes["n_expert"], use.sizes["t"]
    stride = use.sizes.get("stride", n)
    t = min(t, 5) if check else t
    logits = inputs.normal(rng, t * stride, 2.0)
    args = dict(logits=logits, ids=np.zeros(t * K, np.uint32), weights=np.zeros(t * K, np.float32),
                counts=np.zeros(n, np.int32), n_expert=n, stride=stride, t=t)

    def expect(p):
        ids, weights, counts = moe_route_rows_ref(logits.reshape(t, stride), n, K)
        return {"ids": (ids, 0), "weights": (weights, 1e-5), "counts": (counts, 0)}
    return zdsl.Example(args, expect)


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"K": [8], "WG": [256], "SG": SUBGROUPS},
             key=("n_expert",), grid=_group_grid, traffic=lambda v, s: 12 * s.n_expert + 12 * s.t * v.K)
def moe_group(ids: Buffer[u32], counts: Buffer[i32], offsets: Buffer[u32], pairs: Buffer[u32], t: u32,
              n_expert: u32, K: Const = 8, WG: Const = 256, SG: Const = 32):
    """The pairs of the T tokens grouped by expert, by one workgroup: offsets[e] = Σ_{e' < e}
    counts[e'] (offsets[n_expert] = T·K) and pairs[offsets[e] : offsets[e + 1]] the pairs j with
    ids[j] = e, in any order. Each pair takes its place by an atomic decrement of its expert's
    count, so counts end at 0, ready for the next chunk. n_expert ≤ MAX_EXPERTS."""
    tid, lane, sub = zdsl.local_index(), zdsl.lane_id(), zdsl.subgroup_id()
    nsub = WG // SG
    start = zdsl.shared(u32, MAX_EXPERTS)
    subtotal = zdsl.shared(u32, nsub)
    carry = zdsl.var(0, u32)
    for base in zdsl.range(0, n_expert, WG):  # an exclusive prefix sum, WG experts at a time
        e = base + tid
        c = counts.load(e, mask=e < n_expert, other=0).to(u32)
        upto = zdsl.subgroup_prefix_sum(c)
        with zdsl.if_(lane == SG - 1):
            subtotal[sub] = upto
        zdsl.barrier()
        before = zdsl.var(carry + upto - c)
        chunk = zdsl.var(0, u32)
        for w in range(nsub):
            chunk += subtotal[w]
            before += zdsl.where(sub > w, subtotal[w], 0, u32)
        with zdsl.if_(e < n_expert):
            offsets[e] = before
            start[e] = before
        zdsl.barrier()  # subtotal is read before the next round writes it
        carry += chunk
    with zdsl.if_(tid == 0):
        offsets[n_expert] = carry
    for j in zdsl.range(tid, t * K, WG):
        e = ids[j]
        left = zdsl.atomic_add(counts, e, -1).to(u32)  # the expert's places not yet taken, this one's among them
        pairs[start[e] + left - 1] = j


def moe_group_ref(ids, n_expert):
    """(offsets, pairs) with each expert's pairs in increasing order (the kernel's order within
    an expert is any)."""
    ids = np.asarray(ids).reshape(-1)
    counts = np.bincount(ids, minlength=n_expert)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32), np.argsort(ids, kind="stable").astype(np.uint32)


def sorted_within_experts(offsets, pairs) -> np.ndarray:
    """pairs with each expert's run sorted: the kernel's grouping in the reference's order."""
    pairs = np.array(pairs, copy=True)
    for a, b in zip(offsets[:-1], offsets[1:]):
        pairs[a:b] = np.sort(pairs[a:b])
    return pairs


@moe_group.example
def moe_group_example(use, rng, check):
    K, n, t = use.fixed["K"], use.sizes["n_expert"], use.sizes["t"]
    t = min(t, 5) if check else t
    ids = inputs.experts(rng, n, K, t)
    counts = np.bincount(ids, minlength=n).astype(np.int32)
    args = dict(ids=ids, counts=counts, offsets=np.zeros(n + 1, np.uint32), pairs=np.zeros(t * K, np.uint32),
                t=t, n_expert=n)
    offsets, pairs = moe_group_ref(ids, n)

    def expect(p):  # pairs: checked as a multiset per expert through ids (any order within one)
        return {"offsets": (offsets, 0), "counts": (np.zeros(n), 0)}
    return zdsl.Example(args, expect)


@zdsl.kernel(workgroup="WG", variants={"SHARED": [False, True], "WG": [64, 256]}, key=("k",), sizes=("t",),
             grid=lambda v, s: (-(-s.k // (4 * v.WG)), s.t),
             traffic=lambda v, s: 4 * s.t * s.k * (2 + s.topk + (1 if v.SHARED else 0)) + 4 * s.t * s.topk)
def moe_combine_rows(x: Buffer[f32], weights: Buffer[f32], y: Buffer[f32], shared: Buffer[f32], logits: Buffer[f32],
                     k: u32, topk: u32, n_expert: u32, stride: u32, SHARED: Const = False, WG: Const = 64):
    """x[i] += Σ_s weights[i·topk + s] · y[i·topk + s] for token i = workgroup_id(1), the rows
    of k values (k a multiple of 4) of its pairs' down projections; with SHARED also
    shared[i] · sigmoid(logits[i·stride + n_expert]): the shared expert's output (a batched
    product's row) times its gate, whose logit the batched router product appends to the
    token's logits. Four values per invocation."""
    row = zdsl.workgroup_id(1)
    k4 = k >> 2
    q = zdsl.workgroup_id(0) * WG + zdsl.local_index()
    with zdsl.if_(q < k4):
        at = row * k4 + q
        acc = zdsl.var(x.vec4[at])
        for s in zdsl.range(0, topk):
            j = row * topk + s
            acc.set(acc + y.vec4[j * k4 + q] * weights[j])
        if SHARED:
            acc.set(acc + shared.vec4[at] * zdsl.sigmoid(logits[row * stride + n_expert]))
        x.vec4[at] = acc


def moe_combine_rows_ref(x, weights, y, topk, shared=None, gate_logits=None):
    """x + Σ_s weights · y per token row (+ shared · sigmoid(gate_logits)), in float64."""
    t = np.asarray(x).reshape(len(weights) // topk, -1).shape[0]
    xs = np.asarray(x, np.float64).reshape(t, -1)
    ys = np.asarray(y, np.float64).reshape(t, topk, -1)
    out = xs + np.einsum("ts,tsk->tk", np.asarray(weights, np.float64).reshape(t, topk), ys)
    if shared is not None:
        gate = 1 / (1 + np.exp(-np.asarray(gate_logits, np.float64)))
        out += np.asarray(shared, np.float64).reshape(t, -1) * gate[:, None]
    return out.reshape(-1)


@moe_combine_rows.example
def moe_combine_rows_example(use, rng, check):
    k, t, topk = use.sizes["k"], use.sizes["t"], use.sizes["topk"]
    n, stride = use.sizes["n_expert"], use.sizes["stride"]
    t = min(t, 3) if check else t
    sh = use.fixed.get("SHARED", False)
    args = dict(x=inputs.normal(rng, t * k), weights=rng.uniform(0.05, 0.5, t * topk).astype(np.float32),
                y=inputs.normal(rng, t * topk * k), shared=inputs.normal(rng, t * k),
                logits=inputs.normal(rng, t * stride),
                k=k, topk=topk, n_expert=n, stride=stride, t=t)
    x0 = args["x"].copy()
    gates = args["logits"].reshape(t, stride)[:, n]

    def expect(p):
        want = moe_combine_rows_ref(x0, args["weights"], args["y"], topk, args["shared"] if sh else None, gates)
        return {"x": (want, 1e-5)}
    return zdsl.Example(args, expect)


def moe_block_ref(logits, h, x, wg_bytes, wu_bytes, wd_bytes, qtype: str, qtype_down: str, n_expert: int, m: int,
                  K: int, shared=None):
    """The routed MoE block over T tokens in float64: per token row, x + Σ_slot weight ·
    down_e(silu(gate_e · h) ⊙ (up_e · h)) over its experts e (m wide), picked with their
    weights from the first n_expert logits of the row (route_ref); with `shared` (T rows) also
    shared · sigmoid(logits[:, n_expert]). h: the T normed rows the experts read (the Q8_1
    values where the kernels read Q8_1). Stacks may hold more experts (the shared one)."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    t, k = logits.shape[0], np.asarray(h).size // logits.shape[0]
    hs = np.asarray(h, np.float64).reshape(t, k)

    def stack(w_bytes, q, rows, cols):
        used = np.asarray(w_bytes).reshape(-1)[:n_expert * rows * inputs.row_bytes(q, cols)]
        return dmmv.dequant_rows(used, q, n_expert * rows, cols).reshape(n_expert, rows, cols)

    g, u, d = stack(wg_bytes, qtype, m, k), stack(wu_bytes, qtype, m, k), stack(wd_bytes, qtype_down, k, m)
    ids, weights = route_ref(logits[:, :n_expert], K)
    out = np.asarray(x, np.float64).reshape(t, k).copy()
    with np.errstate(over="ignore"):  # silu of a large negative gate: −0
        for i in range(t):
            for e, wt in zip(ids[i], weights[i]):
                a = g[e] @ hs[i]
                out[i] += float(wt) * (d[e] @ (a / (1 + np.exp(-a)) * (u[e] @ hs[i])))
    if shared is not None:
        gate = 1 / (1 + np.exp(-logits[:, n_expert].astype(np.float64)))
        out += np.asarray(shared, np.float64).reshape(t, k) * gate[:, None]
    return out.reshape(-1)
