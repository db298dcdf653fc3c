"""The memory plan against a hand computation for the tiny synthetic model (Q8_0 weights), and
`zdsl model info` on files zdsl cannot run (types without a GPU kernel, other architectures)."""

import json
import re

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from test_model_loader import rewrite

from zdsl.cli import main
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.gguf_file import QuantType, open_model
from zdsl.models.qwen35.file.info import memory_plan, plan_tensors

GIB = 1 << 30


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("info") / "tiny.gguf"
    synth.write(path, "tiny", quant="q8_0")
    return memory_plan(open_model(path))


def q8(rows, width):
    return rows * width // 32 * 34          # Q8_0: 34 bytes per 32 values


def test_tiny_by_hand(plan):
    # tiny: hidden 256, vocab 1024, layers D D D A, 16 experts (4 used) of ffn 256, shared ffn 256,
    # attention 4 heads / 2 KV heads of 256, delta-net 2 key / 4 value heads of 128, conv 4.
    norms = 2 * 256 * 4
    deltanet = (q8(1024, 256) + q8(512, 256) + 1024 * 4 * 4 + 4 * 4 + 4 * 4 + 2 * q8(4, 256)
                + 128 * 4 + q8(256, 512))
    attention = q8(2048, 256) + 2 * q8(512, 256) + 2 * 256 * 4 + q8(256, 1024)
    experts = 3 * 16 * q8(256, 256)
    shared = 16 * 256 * 4 + 256 * 4 + 3 * q8(256, 256)      # router, shared gate, gate/up/down
    embd, head = q8(1024, 256), q8(1024, 256) + 256 * 4     # + output_norm
    total = embd + head + 4 * (norms + experts + shared) + 3 * deltanet + attention
    assert plan.weight_bytes == total
    assert plan.expert_bytes == 4 * experts
    assert plan.read_per_token == total - embd + q8(1, 256) - 4 * experts * 12 // 16
    assert plan.bytes_by_type == {"Q8_0": total - plan.bytes_by_type["F32"], "F32": plan.bytes_by_type["F32"]}
    assert plan.kv_bytes_per_token == {"f16": 1 * 2 * 256 * 2 * 2, "q8_0": 1 * 2 * 256 * 2 * 34 // 32,
                                       "q4_0,q8_0": 2 * 256 * (18 + 34) // 32, "q4_0": 2 * 256 * 2 * 18 // 32}
    assert plan.kv_bytes(("q8_0", "q4_0")) == plan.kv_bytes("q4_0,q8_0")
    assert plan.ssm_state_bytes == 3 * 4 * 128 * 128 * 4
    assert plan.conv_state_bytes == 3 * 4 * 1024 * 4                  # a ring of 4 slots for the 3 past inputs


def test_max_context(plan):
    fixed = plan.weight_bytes + plan.recurrent_state_bytes
    assert plan.fixed_bytes() == fixed
    assert plan.max_context(fixed + 100 * 2048, "f16") == 100
    assert plan.max_context(fixed + 100 * 2048 + 2047, "f16") == 100
    assert plan.max_context(fixed + 100 * 832, "q4_0,q8_0") == 100
    assert plan.max_context(fixed - 1) == 0
    assert plan.max_context(GIB) == 4096                    # capped at the trained context
    assert plan.max_context(GIB, sequences=2) == 8192
    assert plan.max_context(fixed + 2 * plan.recurrent_state_bytes + 100 * 2048, sequences=3) == 100
    assert plan.max_context(fixed + 1000 * 2048, reserve_bytes=500 * 2048) == 500


def test_plan_before_writing_equals_plan_of_the_file(plan):
    hp = synth.preset("tiny")
    assert plan_tensors(hp, [(n, q, s) for n, s, q in synth.plan(hp, "q8_0")]) == plan


def test_35b_a3b_figures_from_the_model_doc():
    """The sizes docs/MODEL.md quotes for a Q4_K_M-like 35B-A3B."""
    hp = synth.preset("35b-a3b")
    p = plan_tensors(hp, [(n, q, s) for n, s, q in synth.plan(hp)])
    assert p.kv_bytes_per_token["f16"] == 20 * 1024                       # 20 KiB per token at f16
    assert p.kv_bytes_per_token["q8_0"] == 10880                           # ~10 KiB at 8 bits
    assert p.ssm_state_bytes == 60 * (1 << 20)                             # 60 MiB of delta-net state
    assert p.conv_state_bytes == 30 * 4 * 8192 * 4                         # the doc's 3 past inputs, in a ring of 4
    head = 248320 * 2048 // 256 * 210                                      # Q6_K output head, ~0.4 GB
    assert 0.4e9 < head < 0.45e9 and head < p.read_per_token
    assert 1.7e9 < p.read_per_token < 2.1e9                                # "about 1.9 GB"
    routers = 40 * 256 * 2048 * 4                                          # F32 routers, ~80 MB
    assert p.bytes_by_type["F32"] > routers
    assert p.max_context(24 << 30) == ((24 << 30) - p.fixed_bytes()) // (20 * 1024)    # ~221k tokens


# -- zdsl model info on files zdsl cannot run ------------------------------------------------------

TQ2_0_BYTES = 66                            # per 256 values (ternary; no GPU kernel)


def info_json(path, capsys) -> dict:
    assert main(["model", "info", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def info_table(path, capsys) -> str:
    assert main(["model", "info", str(path)]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    path = tmp_path_factory.mktemp("info") / "tiny-q8.gguf"
    synth.write(path, "tiny", quant="q8_0")
    return path


def gate_as(qtype, tiny, path):
    """The tiny model with blk.0.attn_gate.weight (512 x 256) stored as `qtype` (zero bytes: info
    reads no values)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return rewrite(tiny, path, replace={"blk.0.attn_gate.weight": ((512, 256), qtype,
                                                                   np.zeros((512, 256 // block * size), np.uint8))})


def test_info_marks_a_type_without_gpu_kernel_and_still_plans(tiny_q8, tmp_path, capsys):
    path = gate_as(QuantType.TQ2_0, tiny_q8, tmp_path / "tq2.gguf")
    r = info_json(path, capsys)
    assert not r["runnable"] and "blk.0.attn_gate.weight is TQ2_0" in r["problem"]
    assert r["no_gpu_kernel"] == ["blk.0.attn_gate.weight"]
    types = {t["name"]: t for t in r["types"]}
    assert types["TQ2_0"] == {"name": "TQ2_0", "tensors": 1, "bytes": 512 * TQ2_0_BYTES, "gpu_kernel": False}
    assert types["Q8_0"]["gpu_kernel"] and types["F32"]["gpu_kernel"]
    assert r["hparams"]["n_layers"] == 4 and r["plan"]["weight_bytes"] == sum(t["bytes"] for t in r["types"])
    assert r["plan"]["bytes_by_type"]["TQ2_0"] == 512 * TQ2_0_BYTES
    out = info_table(path, capsys)
    assert re.search(r"│ TQ2_0 +│ +1 │ +33.00 KiB │ no GPU kernel yet", out)
    assert re.search(r"│ zdsl +│ cannot run it: .*TQ2_0", out) and "DDDA" in out
    assert "no GPU kernel yet for 1 of 76 tensors: blk.0.attn_gate.weight" in out


def test_info_tells_a_type_the_reference_reads_from_one_with_a_gpu_kernel(tiny_q8, tmp_path, capsys):
    q8_1 = gate_as(QuantType.Q8_1, tiny_q8, tmp_path / "q8_1.gguf")
    r = info_json(q8_1, capsys)
    assert r["problem"] is None and r["no_gpu_kernel"] == ["blk.0.attn_gate.weight"] and not r["runnable"]
    assert "cannot run it on the GPU yet (no GPU kernel yet for 1 of 76 tensors)" in info_table(q8_1, capsys)
    r = info_json(gate_as(QuantType.IQ4_XS, tiny_q8, tmp_path / "iq4.gguf"), capsys)
    assert r["runnable"] and r["no_gpu_kernel"] == [] and {t["name"] for t in r["types"]} == {"IQ4_XS", "Q8_0", "F32"}


def test_info_describes_an_architecture_zdsl_does_not_run(tiny_q8, tmp_path, capsys):
    llama = rewrite(tiny_q8, tmp_path / "llama.gguf", arch="llama",
                    replace={"blk.1.ffn_up_exps.weight": ((16, 256, 256), QuantType.TQ2_0,
                                                          np.zeros((16, 256, TQ2_0_BYTES), np.uint8))})
    r = info_json(llama, capsys)
    assert r["architecture"] == "llama" and "'llama' model" in r["problem"] and not r["runnable"]
    assert r["hparams"] is None and r["plan"] is None
    assert r["metadata"]["llama.block_count"] == 4 and r["metadata"]["general.architecture"] == "llama"
    assert r["metadata"]["tokenizer.ggml.tokens"] == "[1,024 × string]"
    assert r["no_gpu_kernel"] == ["blk.1.ffn_up_exps.weight"]
    out = info_table(llama, capsys)
    assert re.search(r"│ architecture +│ llama ", out) and re.search(r"│ llama.block_count +│ 4 ", out)
    assert re.search(r"│ TQ2_0 +│ +1 │ .*│ no GPU kernel yet", out) and "cannot run it" in out


@pytest.mark.parametrize("content, message", [(None, "no such file"), (b"PK\x03\x04" + bytes(64), "not a GGUF"),
                                              ("half", "is truncated")])
def test_info_refuses_what_it_cannot_parse_in_one_line(tiny_q8, tmp_path, capsys, content, message):
    path = tmp_path / "bad.gguf"
    if content == "half":
        content = tiny_q8.read_bytes()[: tiny_q8.stat().st_size // 2]
    if content is not None:
        path.write_bytes(content)
    assert main(["model", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("quant", ["q4_k_m", "mxfp4_moe"])
def test_info_gives_the_type_of_every_tensor_family(tmp_path, capsys, quant):
    """Per family (the name without blk.N.), the types and how many tensors have each, as the
    synthetic recipe assigned them: Q4_K_M gives ffn_down_exps Q6_K in some layers only."""
    path = tmp_path / f"tiny-{quant}.gguf"
    hp = synth.write(path, "tiny", quant=quant)
    want = {}
    for name, _, qtype in synth.plan(hp, quant):
        fam = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
        want.setdefault(fam, {}).setdefault(qtype.name, 0)
        want[fam][qtype.name] += 1
    assert info_json(path, capsys)["families"] == want
    if quant == "q4_k_m":
        assert want["ffn_down_exps"] == {"Q4_K": 2, "Q6_K": 2}
        assert re.search(r"│ ffn_down_exps +│ Q4_K × 2, Q6_K × 2 +│", info_table(path, capsys))
    else:
        assert want["ffn_gate_exps"] == {"MXFP4": 4} and want["attn_qkv"] == {"Q8_0": 3}
