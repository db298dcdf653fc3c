"""What the model-graph tests share: the sequence state a decode graph holds, as arrays, and the
near ties of the MoE router that a reference may take the other way."""

import numpy as np


def state_of(g):
    """Every cache and recurrent state the graph holds, as arrays (the KV rows up to the position)."""
    out = {}
    for i, (k, v) in g.kv.items():
        n = g.position * g.hp.n_kv_heads * g.hp.head_dim
        out[f"k{i}"], out[f"v{i}"] = k.read(np.float16, (n,)).astype(np.float32), v.read(np.float16, (n,)).astype(np.float32)
    for i in g.hp.deltanet_layers:
        out[f"ssm{i}"] = g.ssm_state[i].read(np.float32, (g.ssm_state[i].nbytes // 4,))
        out[f"conv{i}"] = g.conv_state[i].read(np.float32, (g.conv_state[i].nbytes // 4,))
    return out


def sampler_state_of(g):
    """What the sampler carries from step to step: its counter and, with penalties, the window
    (how often each token occurs in it, and its ring of the last tokens, slot position % window)."""
    out = {"counter": int(g.step_words[3])}
    if g.sampler.penalties:
        out["counts"] = g.counts.read(np.uint32, (g.counts.nbytes // 4,))
        out["window"] = g.penalty_ring.read(np.uint32, (min(g.position, g.sampler.window(g.n_ctx)),))
    return out


def router_ties(out, name: str, K: int, tie: float, pos0: int, ties: list, flip=None):
    """`out`, the reference's product by weight `name` for positions pos0, pos0 + 1, … (a row
    each); where it is a router's logits: each row whose K-th and (K+1)-th logits lie within `tie`
    of its largest |logit| adds (layer, position) to `ties`, and the row of `flip` = (layer,
    position), if here, has those two swapped (the other expert routed)."""
    if not name.endswith("ffn_gate_inp.weight"):
        return out
    layer, order = int(name.split(".")[1]), np.argsort(out, axis=-1)
    rows = np.arange(len(out))
    gap = (out[rows, order[:, -K]] - out[rows, order[:, -K - 1]]) / np.abs(out).max(axis=-1)
    ties.extend((layer, pos0 + r) for r in np.nonzero(gap < tie)[0])
    if flip is not None and flip[0] == layer and 0 <= flip[1] - pos0 < len(out):
        r = flip[1] - pos0
        out = out.copy()
        out[r, order[r, -K]], out[r, order[r, -K - 1]] = out[r, order[r, -K - 1]], out[r, order[r, -K]]
    return out
