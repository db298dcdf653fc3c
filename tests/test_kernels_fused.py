"""A MoE layer's expert kernels as the decode step runs them, against numpy, in the interpreter
and on lavapipe: the routed experts' and the shared expert's gate·up in one dispatch (f32 or
Q8_1 input, the shared pair as the last slot; on the int8 path act also as Q8_1, each block
quantized by the workgroup that finishes it), then every down projection added to the
residual."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_testing import BACKENDS, assert_q8_1_of, q8_1_buffers, run
from zdsl.kernels import dmmv as D
from zdsl.kernels import dmmv_q8 as DQ
from zdsl.kernels import formats as F
from zdsl.kernels.moe import route_ref
from zdsl.kernels.q8_1 import q8_1_values


def quantized(rng, rows, k, qtype, scale=0.05):
    return F.quantize(rng.standard_normal((rows, k)).astype(np.float32) * scale, F.QuantType[qtype.upper()]).reshape(-1)


def sg_for(backend, request, pick):
    sizes = [8, 32] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(qtype=st.sampled_from(["q4_k", "q8_0"]), int8=st.booleans(), K=st.sampled_from([4, 8]),
       n_expert=st.integers(9, 40), rows=st.sampled_from([1, 2]), nsub=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_moe_experts(backend, request, qtype, int8, K, n_expert, rows, nsub, seed):
    """f32 path: ffn_gate_up then moe_down_all. int8 path: ffn_gate_up_q8, which also writes
    act as Q8_1 (each block by the workgroup that finishes it), then moe_down_all_q8 on that."""
    rng = np.random.default_rng(seed)
    H, Fd = 256, 256
    wg, wu = quantized(rng, n_expert * Fd, H, qtype), quantized(rng, n_expert * Fd, H, qtype)
    wd = quantized(rng, n_expert * H, Fd, qtype)
    wg_sh, wu_sh, wd_sh = quantized(rng, Fd, H, qtype), quantized(rng, Fd, H, qtype), quantized(rng, H, Fd, qtype)
    hn = rng.standard_normal(H).astype(np.float32)
    sg = sg_for(backend, request, seed)
    ids, routed_w = route_ref(rng.standard_normal(n_expert).astype(np.float32), K)
    ids, weights = ids[0], np.append(routed_w[0], np.float32(0.7))  # [K]: the shared expert's gate
    slots = K + 1

    if int8:
        up = DQ.ffn_gate_up_q8.specialize(QTYPE=qtype, SHARED=True, Q8_OUT=True, ROWS=rows, NSUB=nsub, SG=sg)
        xq, xd = q8_1_buffers(hn)
        x_in = dict(xq=xq, xd=xd, act_arrivals=np.zeros(slots * Fd // 32, np.uint32),
                    actq=np.zeros(slots * Fd // 4, np.uint32), actd=np.full(slots * Fd // 16, np.nan, np.float32))
        seen = q8_1_values(xq, xd)
    else:
        up = D.ffn_gate_up.specialize(QTYPE=qtype, SHARED=True, ROWS=rows, NSUB=nsub, SG=sg)
        x_in, seen = dict(x=hn), hn
    out = run(up, backend, request, (-(-Fd // D.rows_per_workgroup(up)), slots), wg=wg, wu=wu, wg_sh=wg_sh,
              wu_sh=wu_sh, ids=ids, act=np.full(slots * Fd, np.nan, np.float32), k=H, m=Fd, **x_in)
    act = out["act"]
    act_ref = D.ffn_gate_up_ref(wg, wu, ids, seen, qtype, Fd, H, shared=(wg_sh, wu_sh))
    np.testing.assert_allclose(act, act_ref, rtol=5e-4, atol=5e-4 * np.abs(act_ref).max())

    y0 = rng.standard_normal(H).astype(np.float32)
    if int8:
        assert_q8_1_of(out["actq"], out["actd"], act)
        assert not out["act_arrivals"].any()
        down = DQ.moe_down_all_q8.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub, SG=sg)
        a_in, a_seen = dict(actq=out["actq"], actd=out["actd"]), q8_1_values(out["actq"], out["actd"])
    else:
        down = D.moe_down_all.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub, SG=sg)
        a_in, a_seen = dict(act=act), act
    y = run(down, backend, request, -(-H // D.rows_per_workgroup(down)), w=wd, w_sh=wd_sh, ids=ids, weights=weights,
            y=y0, k=Fd, m=H, **a_in)["y"]
    ref = D.moe_down_all_ref(wd, wd_sh, ids, weights, a_seen.astype(np.float32), y0, qtype, H, Fd)
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_moe_experts_model_shape(device):
    """The int8 path at Qwen3.5-35B-A3B's sizes (2048 wide, experts of 512, 8 of 16 routed plus
    the shared one, Q6_K shared down as Q4_K_M files have it), on the device: 144 act blocks,
    each quantized by whichever of its 32 writing workgroups finishes last."""
    rng = np.random.default_rng(8)
    H, Fd, E, K = 2048, 512, 16, 8
    sg = device.info.subgroup_size
    wg, wu = quantized(rng, E * Fd, H, "q4_k"), quantized(rng, E * Fd, H, "q4_k")
    wg_sh, wu_sh = quantized(rng, Fd, H, "q4_k"), quantized(rng, Fd, H, "q4_k")
    wd, wd_sh = quantized(rng, E * H, Fd, "q4_k"), quantized(rng, H, Fd, "q6_k")
    hn = rng.standard_normal(H).astype(np.float32)
    ids = rng.permutation(E)[:K].astype(np.uint32)
    weights = np.append(rng.dirichlet(np.ones(K)).astype(np.float32), np.float32(0.4))
    xq, xd = q8_1_buffers(hn)
    up = DQ.ffn_gate_up_q8.specialize(QTYPE="q4_k", SHARED=True, Q8_OUT=True, SG=sg)
    out = up.run(device, (Fd, K + 1), wg=wg, wu=wu, wg_sh=wg_sh, wu_sh=wu_sh, ids=ids, xq=xq, xd=xd,
                 act=np.full((K + 1) * Fd, np.nan, np.float32), act_arrivals=np.zeros((K + 1) * Fd // 32, np.uint32),
                 actq=np.zeros((K + 1) * Fd // 4, np.uint32), actd=np.full((K + 1) * Fd // 16, np.nan, np.float32),
                 k=H, m=Fd)
    act_ref = D.ffn_gate_up_ref(wg, wu, ids, q8_1_values(xq, xd), "q4_k", Fd, H, shared=(wg_sh, wu_sh))
    np.testing.assert_allclose(out["act"], act_ref, rtol=5e-4, atol=5e-4 * np.abs(act_ref).max())
    assert_q8_1_of(out["actq"], out["actd"], out["act"])
    assert not out["act_arrivals"].any()
    y0 = rng.standard_normal(H).astype(np.float32)
    down = DQ.moe_down_all_q8.specialize(QTYPE="q4_k", QTYPE_SH="q6_k", SG=sg)
    y = down.run(device, H, w=wd, w_sh=wd_sh, ids=ids, weights=weights, actq=out["actq"], actd=out["actd"], y=y0,
                 k=Fd, m=H)["y"]
    ref = D.moe_down_all_ref(wd, wd_sh, ids, weights, q8_1_values(out["actq"], out["actd"]).astype(np.float32), y0,
                             "q4_k", H, Fd, "q6_k")
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
