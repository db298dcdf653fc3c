"""Mixture-of-experts routing on the GPU: which experts a token uses and with what weights, and
the normed input the experts read (the router norms the residual stream itself). The products
themselves are `ffn.ffn_gate_up` and `ffn.moe_down_all`, which
read the `ids` and `weights` written here. The shared expert is slot K: expert n_expert of the
stacks (the graph appends it to the routed experts' weights), with its sigmoid gate as weight."""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Coherent, Const, f32, u8, u32
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
             tune={"NSUB": dmmv.NSUBS, "WG": [0, 128, 256]}, key=("k", "n_expert"),
             grid=lambda v, s: dmmv.row_groups(v, s.n_expert + 1),
             traffic=lambda v, s: ((s.n_expert + 1) * inputs.row_bytes(v.QTYPE, s.k) + 13 * s.k + s.k // 4
                                   + 8 * (s.n_expert + 1) + 8 * (v.K + 1) + 4))
def moe_router(w: Buffer[u8], x: Buffer[f32], norm_w: Buffer[f32], hn: Buffer[f32], xq: Buffer[u32],
               xd: Buffer[f32], logits: Coherent[f32], arrivals: Buffer[u32], ids: Buffer[u32], weights: Buffer[f32],
               k: u32, n_expert: u32, eps: f32, QTYPE: Const = "f32", K: Const = 8, ROWS: Const = 1,
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
    sigmoid(logits[n_expert]). Needs n_expert ≥ K and k a multiple of 32."""
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
    with zdsl.if_(zdsl.last_workgroup(arrivals)):
        def load(index, valid):
            return logits.load(index, mask=valid, other=0.0), index

        val_sh, id_sh, first = few_topk(load, n_expert, K, WG, SG)
        z0 = val_sh[first]
        for j in zdsl.range(t, K, WG):
            total = zdsl.var(0.0)
            for s in range(K):
                total += zdsl.exp(val_sh[first + s] - z0)
            ids[j] = id_sh[first + j]
            weights[j] = zdsl.exp(val_sh[first + j] - z0) / total
        with zdsl.if_(t == 0):
            ids[K] = n_expert
            weights[K] = zdsl.sigmoid(logits[n_expert])


@moe_router.reference
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
    q, K, k, eps = use.fixed["QTYPE"], use.fixed["K"], use.sizes["k"], use.sizes["eps"]
    n_exp = min(use.sizes["n_expert"], inputs.CHECK_ROWS) if check else use.sizes["n_expert"]
    args = dict(w=inputs.rows(rng, q, n_exp + 1, k), x=inputs.normal(rng, k, 3.0),  # row n_exp: the shared gate
                norm_w=inputs.normal(rng, k), hn=np.zeros(k, np.float32), xq=np.zeros(k // 4, np.uint32),
                xd=np.zeros(k // 16, np.float32), logits=np.zeros(n_exp + 1, np.float32),
                arrivals=np.zeros(1, np.uint32), ids=np.zeros(K + 1, np.uint32), weights=np.zeros(K + 1, np.float32),
                k=k, n_expert=n_exp, eps=eps)

    def reference():
        return moe_router_ref(args["w"], args["x"], args["norm_w"], eps, q, n_exp, k, K)
    while check and not _clear_picks(reference()[1][:n_exp], K):  # the ids are checked exactly: no near ties
        args["x"] = inputs.normal(rng, k, 3.0)

    def expect(p):
        hn, logits, ids, weights = reference()
        return {"hn": (hn, 1e-4), "xd": (inputs.q8_1_scales(hn), 1e-4), "logits": (logits, 1e-4), "ids": (ids, 0),
                "weights": (weights, 1e-4), "arrivals": (np.zeros(1), 0)}
    return zdsl.Example(args, expect, lambda n: {"w": inputs.copies(args["w"], n)})


def _clear_picks(logits, K) -> bool:
    """Whether the K + 1 largest logits are further apart than rounding moves them."""
    top = np.sort(logits)[::-1][:K + 1]
    return bool(np.all(-np.diff(top) > 1e-3 * np.abs(logits).max()))
