"""The MTP head (multi-token prediction): the layout synth writes (llama.cpp's: the block after
the trunk's, `blk.N.nextn.*` beside its attention and FFN tensors, `nextn_predict_layers` = 1),
what `zdsl model info` says of it, the graph's view of its weights, and its numpy forward
(reference.ReferenceModel.mtp) written out here from the head's math."""

import numpy as np
import pytest

from zdsl.cli import main
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import GGUFFile, open_model
from zdsl.models.qwen35.file.info import memory_plan
from zdsl.models.qwen35.model.reference import ReferenceModel, rmsnorm
from zdsl.models.qwen35.model.weights import file_ranges, graph_weights
from zdsl.kernels.quant_numpy import dequantize


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"], ids=["moe", "dense"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "mtp.gguf"
    synth.write(path, request.param, seed=11, mtp=True)
    return open_model(path)


def test_synth_writes_the_head_as_llama_cpp_reads_it(model):
    hp, f = model.hparams, GGUFFile(model.path)
    n = hp.n_layers
    assert f.get(f"{hp.arch}.block_count") == n + 1 and f.get(f"{hp.arch}.nextn_predict_layers") == 1
    H = hp.hidden
    assert f.info(f"blk.{n}.nextn.eh_proj.weight").ne == (2 * H, H)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        assert f.info(f"blk.{n}.nextn.{norm}.weight").ne == (H,)
    assert f.info(f"blk.{n}.attn_q.weight").ne == (H, 2 * hp.n_heads * hp.head_dim)
    ffn = "ffn_gate_exps" if hp.moe else "ffn_gate"
    assert f"blk.{n}.{ffn}.weight" in f and f"blk.{n}.ssm_a" not in f
    assert model.has_mtp and len(hp.attention) == n
    plan = memory_plan(model)
    head = sum(t.nbytes for name, t in f.tensors.items() if name.startswith(f"blk.{n}."))
    assert plan.mtp_bytes == head and plan.mtp_read_per_draft > f.info("output.weight").nbytes


def test_info_shows_the_head(model, capsys):
    assert main(["model", "info", str(model.path)]) == 0
    out = capsys.readouterr().out
    assert "+ 1 MTP" in out and "MTP head" in out and f"block {model.hparams.n_layers}: gated attention" in out


def test_the_graph_reads_eh_proj_as_two_halves(model):
    """eh_proj · [e; h] = eh_proj.e · e + eh_proj.h · h: each half's bytes are each row's blocks."""
    n = model.hparams.n_layers
    name = f"blk.{n}.nextn.eh_proj.weight"
    t = graph_weights(model)
    whole = model.dequant(name)
    raw = np.asarray(np.memmap(model.path, np.uint8, "r"))
    for half, cols in (("e", slice(0, whole.shape[1] // 2)), ("h", slice(whole.shape[1] // 2, None))):
        g = t.tensors[f"{name}.{half}"]
        data = np.concatenate([raw[o:o + k] for o, k in file_ranges(model, g)])
        got = dequantize(data.reshape(g.shape[0], -1), g.qtype, g.shape)
        assert np.array_equal(got, whole[:, cols])
    assert name not in t and f"blk.{n}.attn_q.weight" in t


def mtp_by_hand(ref, token, h, position, kv):
    """One row of the head, from the math: [enorm(e); hnorm(h)] through eh_proj, a gated
    attention block over `kv` (the head's K and V rows before `position`, as lists) and the FFN,
    then shared_head_norm and the trunk's output head."""
    hp, w = ref.hp, ref.w
    p = f"blk.{hp.n_layers}."
    e = ref.file.dequant("token_embd.weight", np.array([token]))[0]
    x = w(p + "nextn.eh_proj.weight") @ np.concatenate([rmsnorm(e, w(p + "nextn.enorm.weight"), hp.eps),
                                                         rmsnorm(h, w(p + "nextn.hnorm.weight"), hp.eps)])
    hd, nh, nkv = hp.head_dim, hp.n_heads, hp.n_kv_heads
    xn = rmsnorm(x, w(p + "attn_norm.weight"), hp.eps)
    qg = (w(p + "attn_q.weight") @ xn).reshape(nh, 2 * hd)
    q = rmsnorm(qg[:, :hd], w(p + "attn_q_norm.weight"), hp.eps)
    k = rmsnorm((w(p + "attn_k.weight") @ xn).reshape(nkv, hd), w(p + "attn_k_norm.weight"), hp.eps)
    v = (w(p + "attn_v.weight") @ xn).reshape(nkv, hd)
    half = hp.rope_dims // 2
    angle = position * hp.rope_base ** (-np.arange(half) * 2.0 / hp.rope_dims)
    c, s = np.cos(angle), np.sin(angle)

    def rope(a):
        a = a.copy()
        a1, a2 = a[:, :half].copy(), a[:, half:hp.rope_dims].copy()
        a[:, :half], a[:, half:hp.rope_dims] = a1 * c - a2 * s, a1 * s + a2 * c
        return a
    q, k = rope(q), rope(k)
    kv[0].append(k), kv[1].append(v)
    K, V = np.array(kv[0]), np.array(kv[1])  # (positions, nkv, hd)
    o = np.empty((nh, hd))
    for head in range(nh):
        g = head // (nh // nkv)
        scores = K[:, g] @ q[head] / np.sqrt(hd)
        prob = np.exp(scores - scores.max())
        o[head] = (prob / prob.sum()) @ V[:, g]
    o = o * (1 / (1 + np.exp(-qg[:, hd:])))
    x = x + w(p + "attn_output.weight") @ o.reshape(-1)
    hn = rmsnorm(x, w(p + "post_attention_norm.weight"), hp.eps)
    x = x + (ref.moe(hp.n_layers, hn[None])[0] if hp.moe else ref.ffn(hp.n_layers, hn[None])[0])
    out = rmsnorm(x, w(p + "nextn.shared_head_norm.weight"), hp.eps)
    return w("output.weight") @ out, out


def test_reference_head_is_its_math_row_by_row_and_overwrites_what_it_cuts(model):
    ref = ReferenceModel(model, dtype=np.float64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.hparams.vocab, 5)
    h = rng.standard_normal((5, model.hparams.hidden))
    state = ref.new_state()
    logits, out = ref.mtp(tokens, h, 0, state)  # all rows at once
    kv = ([], [])
    for q in range(5):
        want_logits, want_out = mtp_by_hand(ref, tokens[q], h[q], q, kv)
        assert np.allclose(logits[q], want_logits, rtol=1e-6, atol=1e-6)
        assert np.allclose(out[q], want_out, rtol=1e-6, atol=1e-6)
    # a draft at position 3 again: rows 3 and 4 are replaced, as a cut step's are
    other = rng.integers(0, model.hparams.vocab, 1)
    again, _ = ref.mtp(other, h[3:4], 3, state)
    kv = (kv[0][:3], kv[1][:3])
    assert np.allclose(again[0], mtp_by_hand(ref, other[0], h[3], 3, kv)[0], rtol=1e-6, atol=1e-6)
