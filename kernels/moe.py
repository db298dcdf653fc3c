"""Mixture-of-experts routing on the GPU: which experts a token uses and with what weights. The
products themselves are `dmmv.moe_gate_up` and `dmmv.moe_down_all` (or `dmmv.ffn_gate_up` and
`dmmv.moe_down`), which read the `ids` and `weights` written here."""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.kernels.sampling import SUBGROUPS, block_topk


@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"K": [8, 10], "WG": [64, 256], "R": [1, 4], "SG": SUBGROUPS})
def moe_route(logits: Buffer[f32], ids: Buffer[u32], weights: Buffer[f32], n_expert: u32,
              K: Const = 8, WG: Const = 64, R: Const = 4, SG: Const = 32):
    """Token t = workgroup_id: ids[t·K + j] = the expert with the j-th largest router logit among
    logits[t·n_expert : (t+1)·n_expert] (equal logits: lower expert first), weights[t·K + j] = its
    softmax probability renormalised over the K picked. The full softmax denominator cancels in
    that renormalisation, so only the picked logits are exponentiated. Needs n_expert ≥ K.
    Grid: number of tokens."""
    row = zdsl.workgroup_id()

    def load(index, valid):
        return logits.load(row * n_expert + index, mask=valid, other=0.0), index

    val_sh, id_sh, first = block_topk(load, n_expert, K, R, WG, SG)
    with zdsl.if_(zdsl.local_index() < K):
        z0 = val_sh[first]
        total = zdsl.var(0.0)
        for s in range(K):
            total += zdsl.exp(val_sh[first + s] - z0)
        j = zdsl.local_index()
        ids[row * K + j] = id_sh[first + j]
        weights[row * K + j] = zdsl.exp(val_sh[first + j] - z0) / total


@moe_route.reference
def moe_route_ref(logits, K=8):
    """(ids, weights) per token row of `logits` (tokens × n_expert)."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    if logits.shape[1] < K:
        raise ValueError(f"moe_route needs at least K={K} experts, got {logits.shape[1]}")
    experts = np.arange(logits.shape[1])
    ids = np.stack([np.lexsort((experts, -row.astype(np.float64)))[:K] for row in logits])
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    picked = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.uint32), (picked / picked.sum(axis=1, keepdims=True)).astype(np.float32)
