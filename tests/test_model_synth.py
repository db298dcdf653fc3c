"""Synthetic models: presets carry the real shapes, files load, logits are lively, writing is fast."""

import time
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

from zdsl.errors import ModelError
from zdsl.models.qwen35.cli.commands import model as model_cli
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import QuantType, open_model
from zdsl.models.qwen35.model.reference import ReferenceModel


def test_35b_a3b_preset_has_the_real_shapes():
    hp = synth.preset("35b-a3b")
    assert (hp.arch, hp.hidden, hp.n_layers, hp.vocab) == ("qwen35moe", 2048, 40, 248320)
    assert (hp.n_experts, hp.n_experts_used, hp.expert_ffn, hp.shared_ffn) == (256, 8, 512, 512)
    assert (hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.rope_dims, hp.rope_base) == (16, 2, 256, 64, 1e7)
    assert (hp.ssm_k_heads, hp.ssm_v_heads, hp.ssm_head_dim, hp.conv_kernel) == (16, 32, 128, 4)
    assert hp.attention_layers == list(range(3, 40, 4)) and hp.conv_channels == 8192
    assert hp.context_length == 262144


def test_35b_a3b_plan_is_q4_k_m_sized():
    tensors = synth.plan(synth.preset("35b-a3b"))
    # globals + every layer's 2 norms and 8 MoE tensors + 9 per delta-net layer + 6 per attention layer
    assert len(tensors) == 3 + 40 * (2 + 8) + 30 * 9 + 10 * 6
    size = Counter()
    for name, shape, q in tensors:
        size[q] += int(np.prod(shape[:-1])) * synth.row_bytes(q, shape[-1])
    total = sum(size.values())
    assert 19e9 < total < 22.5e9, total                   # real Q4_K_M 35B-A3B files are ~20-22 GB
    assert set(size) == {QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.F32}
    types = {n: q for n, _, q in tensors}
    assert types["output.weight"] == QuantType.Q6_K and types["blk.3.attn_v.weight"] == QuantType.Q6_K
    assert types["blk.0.ffn_gate_inp.weight"] == QuantType.F32 and types["blk.0.ssm_conv1d.weight"] == QuantType.F32
    assert types["blk.5.ffn_up_exps.weight"] == QuantType.Q4_K


def test_35b_a3b_dynamic_mix_follows_the_published_recipe():
    tensors = synth.plan(synth.preset("35b-a3b"), "iq3_xxs_dynamic")
    types = {n: q for n, _, q in tensors}
    assert types["blk.7.ffn_gate_exps.weight"] == types["blk.7.ffn_up_exps.weight"] == QuantType.IQ3_XXS
    assert types["blk.7.ffn_down_exps.weight"] == QuantType.IQ4_XS
    for family in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_qkv", "attn_gate", "ssm_out",
                   "ssm_alpha", "ssm_beta"):
        assert types[f"blk.4.{family}.weight"] == QuantType.Q8_0, family
    assert types["blk.0.ffn_gate_inp.weight"] == QuantType.F32 and types["output.weight"] == QuantType.Q6_K
    total = sum(int(np.prod(s[:-1])) * synth.row_bytes(q, s[-1]) for _, s, q in tensors)
    assert 15e9 < total < 18e9, total  # 3.06 bits per expert gate/up weight, 4.25 per down


def test_35b_a3b_two_bit_mix():
    tensors = synth.plan(synth.preset("35b-a3b"), "iq2_xxs_dynamic")
    types = {n: q for n, _, q in tensors}
    assert types["blk.7.ffn_gate_exps.weight"] == types["blk.7.ffn_up_exps.weight"] == QuantType.IQ2_XXS
    for family in ("ffn_down_exps", "attn_qkv", "attn_gate", "ssm_out"):
        assert types[f"blk.4.{family}.weight"] == QuantType.IQ3_XXS, family
    assert types["blk.3.attn_q.weight"] == types["blk.3.attn_output.weight"] == QuantType.IQ3_XXS
    assert types["blk.4.ffn_up_shexp.weight"] == types["blk.4.ssm_beta.weight"] == QuantType.Q8_0
    total = sum(int(np.prod(s[:-1])) * synth.row_bytes(q, s[-1]) for _, s, q in tensors)
    assert 10e9 < total < 12.5e9, total  # 2.06 bits per expert gate/up weight, 3.06 per down


@pytest.mark.parametrize("qtype", [QuantType.IQ3_XXS, QuantType.IQ4_XS, QuantType.IQ4_NL, QuantType.IQ1_S, QuantType.IQ1_M])
def test_random_rows_of_a_type_without_encoder_have_the_asked_rms(qtype):
    """Random blocks in the type's layout, scaled per block to the std asked (up to f16 rounding)."""
    rows = synth.random_rows(0.03, 12, 512, qtype, np.random.default_rng(1))
    block = synth.block_shape(qtype)[0]
    values = synth.dequantize(rows, qtype, (12, 512)).reshape(-1, block)
    np.testing.assert_allclose(np.sqrt(np.mean(values ** 2, axis=1)), 0.03, rtol=2e-3)
    assert len(np.unique(rows, axis=0)) == 12
    with pytest.raises(ModelError, match="cannot write Q2_K"):
        synth.random_rows(0.03, 12, 512, QuantType.Q2_K, np.random.default_rng(1))


@pytest.mark.parametrize("name", ["tiny", "tiny-dense"])
@pytest.mark.parametrize("quant", synth.QUANTS)
def test_tiny_presets_write_fast_load_and_are_lively(tmp_path, name, quant):
    path = tmp_path / "m.gguf"
    t0 = time.process_time()  # CPU time: other jobs on a shared machine do not count
    hp = synth.write(path, name, quant=quant)
    assert time.process_time() - t0 < 5.0  # measured 0.1-0.7 s; 2.04 s once, the first in a worker under load
    m = open_model(path)
    assert m.hparams == hp
    expected = {n: q for n, _, q in synth.plan(hp, quant)}
    assert {n: t.qtype for n, t in m.tensors.items()} == expected
    logits = ReferenceModel(m).forward(np.arange(1, 1000, 15))
    assert np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 1.5
    assert len(set(logits.argmax(1).tolist())) > 30


def test_seed_and_layers(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth.write(a, "tiny-dense", quant="q8_0", seed=1)
    synth.write(b, "tiny-dense", quant="q8_0", seed=1)
    hp = synth.write(c, "tiny-dense", quant="q8_0", seed=2, layers=8)
    assert a.read_bytes() == b.read_bytes()
    assert hp.n_layers == 8 and hp.attention_layers == [3, 7]
    ra, rc = open_model(a).raw("blk.0.attn_qkv.weight"), open_model(c).raw("blk.0.attn_qkv.weight")
    assert not np.array_equal(ra, rc)


def test_a_pool_of_writers_writes_the_same_file(tmp_path, monkeypatch):
    """Large files are written by a pool of processes; the bytes must not depend on it (tall
    tensors drawn from pools of rows included: POOL_ROWS shrunk so the tiny preset has them)."""
    monkeypatch.setattr(synth, "POOL_ROWS", 64)
    monkeypatch.setattr(synth, "PARALLEL_BYTES", 1 << 62)
    synth.write(tmp_path / "one.gguf", "tiny", seed=4)
    monkeypatch.setattr(synth, "PARALLEL_BYTES", 0)
    synth.write(tmp_path / "pool.gguf", "tiny", seed=4)
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "pool.gguf").read_bytes()
    embd = open_model(tmp_path / "pool.gguf").raw("token_embd.weight").reshape(1024, -1)
    assert len(np.unique(embd, axis=0)) <= 64 < 1024  # rows really came from the pool


def test_progress_reaches_the_data_size(tmp_path):
    calls = []
    synth.write(tmp_path / "m.gguf", "tiny", quant="f16", progress=lambda d, t: calls.append((d, t)))
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == calls[-1][1]
    assert done[-1] == sum(t.nbytes for t in open_model(tmp_path / "m.gguf").tensors.values())


def test_bad_arguments(tmp_path):
    with pytest.raises(ModelError, match="unknown preset"):
        synth.write(tmp_path / "x.gguf", "huge")
    with pytest.raises(ModelError, match="--layers must be at least 1"):
        synth.write(tmp_path / "x.gguf", "tiny", layers=0)
    with pytest.raises(ModelError, match="cannot write"):
        synth.write(tmp_path / "no" / "such" / "dir.gguf", "tiny", quant="f32")
    with pytest.raises(ModelError, match="blk.0.ffn_down_shexp.weight would be Q6_K, .* multiples of 256 values, not 400"):
        synth.write(tmp_path / "x.gguf", "tiny", shared_ffn=400)
    with pytest.raises(ModelError, match="'tiny-dense' is dense"):
        synth.write(tmp_path / "x.gguf", "tiny-dense", shared_ffn=512)


def test_cli_synth_then_info(tmp_path):
    out = tmp_path / "cli.gguf"
    r = CliRunner().invoke(model_cli, ["synth", str(out), "--preset", "tiny-dense", "--quant", "q8_0", "--layers", "2"])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and open_model(out).hparams.n_layers == 2
    r = CliRunner().invoke(model_cli, ["info", str(out), "--vram", "0.5GiB"])
    assert r.exit_code == 0, r.output
    assert "qwen35" in r.output and "dense SwiGLU 768" in r.output and "context in 512.00 MiB" in r.output
    r = CliRunner().invoke(model_cli, ["synth", str(out), "--quant", "q8_0", "--layers", "1", "--shared-ffn", "352"])
    assert r.exit_code == 0, r.output
    hp = open_model(out).hparams
    assert (hp.expert_ffn, hp.shared_ffn) == (256, 352)
    r = CliRunner().invoke(model_cli, ["synth", str(out), "--layers", "2", "--tensor-type", r"blk\.1\.ffn_up_exps=iq4_xs",
                                       "--tensor-type", "ffn_up=q6_k", "--tensor-type", "norm=q8_0"])
    assert r.exit_code == 0, r.output
    types = {name: t.qtype for name, t in open_model(out).tensors.items()}
    assert types["blk.1.ffn_up_exps.weight"] == QuantType.IQ4_XS  # the first match wins
    assert types["blk.0.ffn_up_exps.weight"] == types["blk.0.ffn_up_shexp.weight"] == QuantType.Q6_K
    assert types["blk.0.ffn_gate_exps.weight"] == QuantType.Q4_K and types["output_norm.weight"] == QuantType.F32
    for bad, says in (("ffn_up", "write PATTERN=TYPE"), ("(=q4_k", "regular expression"), ("x=q9_k", "GGUF type"),
                      ("x=tq2_0", "cannot write TQ2_0")):
        r = CliRunner().invoke(model_cli, ["synth", str(out), "--tensor-type", bad])
        assert r.exit_code != 0 and says in str(r.exception or r.output), (bad, r.output)
