"""What the model-graph tests share: the sequence state a decode graph holds, as arrays."""

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
