"""The memory plan against a hand computation for the tiny synthetic model (Q8_0 weights)."""

import pytest

from zdsl.models.qwen35 import synth
from zdsl.models.qwen35.gguf_file import open_model
from zdsl.models.qwen35.info import memory_plan, plan_tensors

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
                                       "q4_0/q8_0": 2 * 256 * (18 + 34) // 32}
    assert plan.ssm_state_bytes == 3 * 4 * 128 * 128 * 4
    assert plan.conv_state_bytes == 3 * 4 * 1024 * 4                  # a ring of 4 slots for the 3 past inputs


def test_max_context(plan):
    fixed = plan.weight_bytes + plan.recurrent_state_bytes
    assert plan.fixed_bytes() == fixed
    assert plan.max_context(fixed + 100 * 2048, "f16") == 100
    assert plan.max_context(fixed + 100 * 2048 + 2047, "f16") == 100
    assert plan.max_context(fixed + 100 * 832, "q4_0/q8_0") == 100
    assert plan.max_context(fixed - 1) == 0
    assert plan.max_context(GIB) == 4096                    # capped at the trained context
    assert plan.max_context(GIB, sequences=2) == 8192
    assert plan.max_context(fixed + 2 * plan.recurrent_state_bytes + 100 * 2048, sequences=3) == 100
    assert plan.max_context(fixed + 1000 * 2048, reserve_bytes=500 * 2048) == 500


def test_plan_before_writing_equals_plan_of_the_file(plan):
    hp = synth.preset("tiny")
    assert plan_tensors(hp, [(n, q, s) for n, s, q in synth.plan(hp, "q8_0")]) == plan


def test_35b_a3b_figures_from_the_model_doc():
    """The sizes docs/qwen35-model.md quotes for a Q4_K_M-like 35B-A3B."""
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
