"""The GGUF loader on synthetic files: hyperparameters, tensor table, access, and every bad file."""

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from zdsl.errors import ModelError
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import QuantType, open_model, read_gguf, tensor_specs
from zdsl.models.qwen35.model.reference import ReferenceModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "tiny.gguf"
    synth.write(path, "tiny", quant="q8_0")
    return path


def rewrite(src, dst, *, arch=None, drop=(), replace=None, fuse=False, kv=None):
    """Copy a GGUF, changing what a test needs: architecture, metadata (`kv`: key -> (value, type,
    array sub-type)), dropped tensors, tensors replaced by (numpy-order shape, type, raw bytes),
    or q/k/v and gate/up fused as some converters do."""
    r = GGUFReader(src)
    a = arch or r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, a)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        name = name.replace(r.fields["general.architecture"].contents() + ".", a + ".")
        if name not in (kv or {}):
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for name, (value, vtype, sub) in (kv or {}).items():
        w.add_key_value(name, value, vtype, sub_type=sub)
    tensors = {t.name: (tuple(int(d) for d in reversed(t.shape.tolist())), t.tensor_type,
                        np.asarray(t.data).view(np.uint8)) for t in r.tensors}
    if fuse:
        for name in list(tensors):
            for parts, fused, axis in ((("attn_q", "attn_k", "attn_v"), "attn_qkv", 0),
                                       (("ffn_gate_exps", "ffn_up_exps"), "ffn_gate_up_exps", 1)):
                if name.endswith(parts[0] + ".weight"):
                    names = [name.replace(parts[0], p) for p in parts]
                    shapes, types, datas = zip(*(tensors.pop(n) for n in names))
                    shape = list(shapes[0])
                    shape[axis] = sum(s[axis] for s in shapes)
                    rows = [d.reshape(*s[:-1], -1) for d, s in zip(datas, shapes)]
                    tensors[name.replace(parts[0], fused)] = (tuple(shape), types[0], np.concatenate(rows, axis))
    for name, new in (replace or {}).items():
        tensors[name] = new
    for name, (shape, qtype, data) in tensors.items():
        if name in drop:
            continue
        data = np.ascontiguousarray(data).view(np.uint8)
        byte_shape = (*shape[:-1], data.size // int(np.prod(shape[:-1])))
        w.add_tensor(name, data.reshape(-1), raw_shape=byte_shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def one_line_error(path, match):
    with pytest.raises(ModelError, match=match) as e:
        open_model(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_hparams_and_tensor_table(tiny):
    m = open_model(tiny)
    assert m.hparams == synth.preset("tiny")
    hp = m.hparams
    assert hp.attention == (False, False, False, True)
    assert hp.attention_layers == [3] and hp.deltanet_layers == [0, 1, 2]
    assert hp.conv_channels == 2 * 2 * 128 + 4 * 128
    specs = tensor_specs(hp)
    assert set(m.tensors) == set(specs)
    for name, spec in specs.items():
        assert m.info(name).ne == spec.ne
    assert m.shape("blk.0.ffn_gate_exps.weight") == (16, 256, 256)
    assert m.qtype("blk.0.ssm_a") == QuantType.F32
    assert m.qtype("blk.3.attn_q.weight") == QuantType.Q8_0


def test_fast_metadata_reader_agrees_with_gguf(tiny):
    ours, stock = read_gguf(tiny), GGUFReader(tiny)
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]


def test_raw_is_a_view_and_dequant_matches_gguf(tiny):
    m = open_model(tiny)
    raw = m.raw("blk.3.attn_q.weight")
    assert isinstance(raw.base, np.ndarray) or isinstance(raw, np.memmap)
    assert not raw.flags.writeable and raw.shape == (2048, 256 // 32 * 34)
    w = m.dequant("blk.3.attn_q.weight")
    assert w.dtype == np.float32 and w.shape == (2048, 256)
    np.testing.assert_array_equal(w, quants.dequantize(np.array(raw), QuantType.Q8_0))
    e5 = m.dequant("blk.1.ffn_down_exps.weight", 5)
    np.testing.assert_array_equal(e5, m.dequant("blk.1.ffn_down_exps.weight")[5])
    rows = m.dequant("token_embd.weight", [7, 3])
    np.testing.assert_array_equal(rows, m.dequant("token_embd.weight")[[7, 3]])
    assert m.output_name == "output.weight"


def test_fused_variants_load_and_give_the_same_logits(tiny, tmp_path):
    fused = rewrite(tiny, tmp_path / "fused.gguf", fuse=True)
    m = open_model(fused)
    assert "blk.3.attn_qkv.weight" in m and "blk.3.attn_q.weight" not in m
    assert m.info("blk.0.ffn_gate_up_exps.weight").ne == (256, 512, 16)
    toks = [1, 5, 300, 7, 9]
    np.testing.assert_allclose(ReferenceModel(fused).forward(toks), ReferenceModel(tiny).forward(toks),
                               rtol=0, atol=1e-4)


def test_fused_files_decode_on_the_gpu_as_the_unfused(tiny, tmp_path, device):
    """The decode graph reads fused tensors as their parts (weights.py): the same bytes reach
    the same kernels, so the logits are identical, not merely close."""
    from zdsl.models.qwen35.model.graph import DecodeGraph
    from zdsl.models.qwen35.model.sampler import SamplerConfig

    fused = open_model(rewrite(tiny, tmp_path / "fused.gguf", fuse=True))
    logits = []
    for m in (open_model(tiny), fused):
        graph = DecodeGraph(m, device, 8, SamplerConfig(temperature=0), progress=False)
        logits.append([(graph.decode(t), graph.logits()) for t in (1, 5, 300, None, None)])
        graph.close()
    for (tok_a, a), (tok_b, b) in zip(*logits):
        assert tok_a == tok_b
        np.testing.assert_array_equal(a, b)


def test_graph_weights_split_fused_tensors_stack_shared_experts_and_join_gates():
    """Fused tensors split into row ranges, the shared expert stacked as expert E (kept apart
    where it has a type or width of its own), its gate as the router's last row, β and α joined
    (as F32 values where their types differ); gates of another shape are refused with the names."""
    from zdsl.models.qwen35.model.weights import GraphWeights, Part

    hp = synth.preset("tiny")
    files = {n: (s, q) for n, s, q in synth.plan(hp, "q4_k_m")}
    E, F, H = hp.n_experts, hp.expert_ffn, hp.hidden
    q, kv = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
    a = hp.attention.index(True)
    qt, kt, vt = (files[f"blk.{a}.attn_{x}.weight"][1] for x in "qkv")
    files[f"blk.{a}.attn_qkv.weight"] = ((2 * q + 2 * kv, H), qt)
    for x in "qkv":
        del files[f"blk.{a}.attn_{x}.weight"]
    files["blk.0.ffn_gate_up_exps.weight"] = ((E, 2 * F, H), files.pop("blk.0.ffn_gate_exps.weight")[1])
    del files["blk.0.ffn_up_exps.weight"]
    w = GraphWeights(hp, files)
    fused = f"blk.{a}.attn_qkv.weight"
    assert [w.tensors[f"blk.{a}.attn_{x}.weight"].parts for x in "qkv"] == [
        (Part(fused, (0, 2 * q)),), (Part(fused, (2 * q, 2 * q + kv)),), (Part(fused, (2 * q + kv, 2 * q + 2 * kv)),)]
    assert w.shape(f"blk.{a}.attn_k.weight") == (kv, H) and fused not in w
    assert w.shape("blk.0.ffn_up_exps.weight") == (E + 1, F, H)
    assert w.tensors["blk.0.ffn_up_exps.weight"].parts == (Part("blk.0.ffn_gate_up_exps.weight", (F, 2 * F)),
                                                           Part("blk.0.ffn_up_shexp.weight"))
    assert "blk.0.ffn_gate_shexp.weight" not in w and "blk.0.ffn_up_shexp.weight" not in w
    for i in range(hp.n_layers):  # the shared down joins the stack only in the experts' type
        down, shared = f"blk.{i}.ffn_down_exps.weight", f"blk.{i}.ffn_down_shexp.weight"
        same = files[down][1] == files[shared][1]
        assert (shared in w) != same and w.shape(down)[0] == E + same
    assert {files[f"blk.{i}.ffn_down_exps.weight"][1] for i in range(hp.n_layers)} == {QuantType.Q4_K, QuantType.Q6_K}
    d = hp.attention.index(False)  # a delta-net layer: β's rows, then α's, one tensor
    beta, alpha = f"blk.{d}.ssm_beta.weight", f"blk.{d}.ssm_alpha.weight"
    assert w.shape(f"blk.{d}.ssm_beta_alpha.weight") == (2 * hp.ssm_v_heads, H)
    assert w.tensors[f"blk.{d}.ssm_beta_alpha.weight"].parts == (Part(beta), Part(alpha))
    assert beta not in w and alpha not in w and f"blk.{a}.ssm_beta_alpha.weight" not in w
    assert w.shape("blk.0.ffn_gate_inp.weight") == (E + 1, H) and "blk.0.ffn_gate_inp_shexp.weight" not in w
    assert w.tensors["blk.0.ffn_gate_inp.weight"].parts == (Part("blk.0.ffn_gate_inp.weight"),
                                                           Part("blk.0.ffn_gate_inp_shexp.weight"))
    for x in ("gate", "up"):  # a shared expert of its own type stays out of the stacks, in that layer only
        files[f"blk.1.ffn_{x}_shexp.weight"] = (files[f"blk.1.ffn_{x}_shexp.weight"][0], QuantType.Q8_0)
    w = GraphWeights(hp, files)
    assert w.shape("blk.1.ffn_gate_exps.weight") == w.shape("blk.1.ffn_up_exps.weight") == (E, F, H)
    assert w.tensors["blk.1.ffn_up_shexp.weight"].qtype == QuantType.Q8_0 and w.shape("blk.1.ffn_up_shexp.weight") == (F, H)
    assert w.shape("blk.2.ffn_up_exps.weight") == (E + 1, F, H) and "blk.2.ffn_up_shexp.weight" not in w
    for x in ("gate", "up", "down"):  # a wider shared expert of the experts' types stays out of them too
        (rows, cols), qtype = files[f"blk.2.ffn_{x}_shexp.weight"]
        files[f"blk.2.ffn_{x}_shexp.weight"] = ((rows, 2 * cols) if x == "down" else (2 * rows, cols), qtype)
    w = GraphWeights(hp, files)
    assert w.shape("blk.2.ffn_up_exps.weight") == (E, F, H) and w.shape("blk.2.ffn_up_shexp.weight") == (2 * F, H)
    assert w.shape("blk.2.ffn_down_exps.weight")[0] == E and w.shape("blk.2.ffn_down_shexp.weight") == (H, 2 * F)
    # gates of two types join as F32 values (dequantized on upload); of two shapes, refused
    files[alpha] = (files[alpha][0], QuantType.F16)
    files["blk.1.ffn_gate_inp_shexp.weight"] = (files["blk.1.ffn_gate_inp_shexp.weight"][0], QuantType.F16)
    w = GraphWeights(hp, files)
    joined, router = w.tensors[f"blk.{d}.ssm_beta_alpha.weight"], w.tensors["blk.1.ffn_gate_inp.weight"]
    assert (joined.qtype, joined.shape, joined.parts, joined.dequantized) == (
        QuantType.F32, (2 * hp.ssm_v_heads, H), (Part(beta), Part(alpha)), True)
    assert (router.qtype, router.shape, router.dequantized) == (QuantType.F32, (E + 1, H), True)
    assert not w.tensors["blk.2.ffn_gate_inp.weight"].dequantized
    files[alpha] = ((hp.ssm_v_heads + 1, H), QuantType.F16)
    with pytest.raises(ModelError, match=f"{alpha} .F16.* differs in shape from {beta}"):
        GraphWeights(hp, files)
    files[alpha] = files[beta]
    files["blk.1.ffn_gate_inp_shexp.weight"] = ((H + 32,), QuantType.F32)
    with pytest.raises(ModelError, match="blk.1.ffn_gate_inp_shexp.weight .F32.* differs in length from a row of"):
        GraphWeights(hp, files)


def test_layer_kinds_from_recurrent_layers_and_mtp_blocks(tiny, tmp_path):
    recurrent = [True, False, True, False, False]  # 4 trunk layers + 1 MTP block (never recurrent)
    kv = {"qwen35moe.attention.recurrent_layers": (recurrent, GGUFValueType.ARRAY, GGUFValueType.BOOL),
          "qwen35moe.block_count": (5, GGUFValueType.UINT32, None),
          "qwen35moe.nextn_predict_layers": (1, GGUFValueType.UINT32, None)}
    m0 = open_model(tiny)  # layer 1 becomes attention: give it a copy of layer 3's tensors
    drop = {n for n in m0.tensors if n.startswith("blk.1.")}
    replace = {n.replace("blk.3.", "blk.1."): (m0.shape(n), m0.qtype(n), np.array(m0.raw(n)))
               for n in m0.tensors if n.startswith("blk.3.")}
    drop -= set(replace)
    m = open_model(rewrite(tiny, tmp_path / "r.gguf", kv=kv, replace=replace, drop=drop))
    assert m.hparams.attention == (False, True, False, True)
    assert (m.hparams.n_layers, m.hparams.nextn_layers) == (4, 1)
    assert np.isfinite(ReferenceModel(m).forward([1, 2, 3])).all()


def test_missing_file(tmp_path):
    one_line_error(tmp_path / "nope.gguf", "no such file")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    one_line_error(p, "not a GGUF")


@pytest.mark.parametrize("keep", [0.6, 0.999])
def test_truncated_data(tiny, tmp_path, keep):
    p = tmp_path / "cut.gguf"
    data = tiny.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    one_line_error(p, "is truncated: tensor .* ends at byte")


def test_token_text_that_is_not_utf8_reads_on(tiny, tmp_path):
    """A flipped bit that leaves a token string invalid UTF-8: llama.cpp keeps strings as bytes
    and reads on; zdsl reads the token with U+FFFD in place of the bad bytes."""
    data = bytearray(tiny.read_bytes())
    at = data.index("Ġ".encode())  # C4 A0 in UTF-8, in the first token that has it
    data[at + 1] = ord("A")  # a lead byte with no continuation byte: not UTF-8
    p = tmp_path / "flipped.gguf"
    p.write_bytes(bytes(data))
    tokens = open_model(p).get("tokenizer.ggml.tokens")
    assert any("\ufffd" in t for t in tokens) and len(tokens) == len(open_model(tiny).get("tokenizer.ggml.tokens"))


def test_truncated_header(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny.read_bytes()[:5000])
    one_line_error(p, "truncated or corrupt GGUF header")


def test_other_architecture(tiny, tmp_path):
    msg = one_line_error(rewrite(tiny, tmp_path / "llama.gguf", arch="llama"), "'llama' model")
    assert "qwen35moe" in msg


def test_missing_tensor(tiny, tmp_path):
    one_line_error(rewrite(tiny, tmp_path / "m.gguf", drop={"blk.2.ssm_alpha.weight"}),
                   "lacks tensor blk.2.ssm_alpha.weight")


def test_missing_metadata(tiny, tmp_path):
    src = rewrite(tiny, tmp_path / "a.gguf")
    r = GGUFReader(src)
    assert "qwen35moe.ssm.state_size" in r.fields
    # drop the key by renaming it in a copy of the header bytes
    data = bytearray(src.read_bytes())
    i = data.find(b"qwen35moe.ssm.state_size")
    data[i:i + 9] = b"qwen35moX"
    p = tmp_path / "b.gguf"
    p.write_bytes(bytes(data))
    one_line_error(p, "lacks metadata key 'qwen35moe.ssm.state_size'")


def test_wrong_shape(tiny, tmp_path):
    bad = np.zeros((256, 256), np.float32)  # attn_gate should be 512 x 256
    one_line_error(rewrite(tiny, tmp_path / "s.gguf", replace={"blk.0.attn_gate.weight": ((256, 256), QuantType.F32, bad)}),
                   r"blk.0.attn_gate.weight has shape \[256, 256\] but the metadata implies \[256, 512\]")


def test_unsupported_type(tiny, tmp_path):
    block, size = 256, 66  # TQ2_0 (ternary: no Qwen3.5 file uses it, zdsl has no decoder)
    data = np.zeros((512, 256 // block * size), np.uint8)
    msg = one_line_error(rewrite(tiny, tmp_path / "t.gguf", replace={"blk.0.attn_gate.weight": ((512, 256), QuantType.TQ2_0, data)}),
                         "blk.0.attn_gate.weight is TQ2_0, which zdsl cannot run")
    assert "Q4_K" in msg


def test_vector_tensor_must_be_float(tiny, tmp_path):
    data = quants.quantize(np.ones((1, 256), np.float32), QuantType.Q8_0)
    one_line_error(rewrite(tiny, tmp_path / "n.gguf", replace={"blk.0.attn_norm.weight": ((256,), QuantType.Q8_0, data)}),
                   "attn_norm.weight is Q8_0")


def test_cli_prints_one_error_line(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope")
    r = subprocess.run([sys.executable, "-m", "zdsl.cli", "model", "info", str(p)], capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error: ")


def test_tied_head_uses_the_embedding(tiny, tmp_path):
    m = open_model(rewrite(tiny, tmp_path / "tied.gguf", drop={"output.weight"}))
    assert m.output_name == "token_embd.weight" and "output.weight" not in m
    ref, trace = ReferenceModel(m), {}
    logits = ref.forward([4, 8, 15], trace=trace)
    x = trace["layer3"]
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * m.dequant("output_norm.weight")
    np.testing.assert_allclose(logits, h @ m.dequant("token_embd.weight").T, rtol=1e-5, atol=1e-4)
