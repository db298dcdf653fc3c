"""What the model-graph tests share: the sequence state a decode graph holds, as arrays, and a
model of a type zdsl cannot encode."""

import numpy as np

from zdsl.models.qwen35 import synth
from zdsl.models.qwen35.gguf_file import QuantType, open_model


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


def iq3_experts(path, seed: int):
    """The tiny Q8_0 model with its routed experts' gate and up rewritten as random IQ3_XXS blocks
    (zdsl has no IQ3_XXS encoder; the reference decodes whatever blocks the file holds), their d
    set so that the products keep about unit scale."""
    from test_model_loader import rewrite

    q8 = path.with_suffix(".q8_0.gguf")
    synth.write(q8, "tiny", quant="q8_0", seed=seed)
    rng, replace = np.random.default_rng(seed), {}
    for t in open_model(q8).tensors.values():
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            blocks = rng.integers(0, 256, (int(np.prod(t.shape)) // 256, 98), dtype=np.uint8)
            blocks[:, :2] = rng.uniform(4e-4, 8e-4, (len(blocks), 1)).astype("<f2").view(np.uint8)
            replace[t.name] = (t.shape, QuantType.IQ3_XXS, blocks.reshape(-1))
    return rewrite(q8, path, replace=replace)
