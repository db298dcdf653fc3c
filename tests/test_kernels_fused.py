"""A MoE layer's expert kernels as the decode step runs them, against numpy, in the interpreter
and on lavapipe: the routed experts' and the shared expert's gate·up in one dispatch (f32 or
Q8_1 input; the shared expert appended to the experts' stacks, named in the last slot), then
every down projection added to the residual."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_testing import BACKENDS, run
from zdsl.kernels import ffn as D
from zdsl.kernels import quant_numpy as F
from zdsl.kernels.moe import route_ref
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values


def quantized(rng, rows, k, qtype, scale=0.05):
    return F.quantize(rng.standard_normal((rows, k)).astype(np.float32) * scale, F.QuantType[qtype.upper()]).reshape(-1)


def sg_for(backend, request, pick):
    sizes = [8, 32] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@given(qtype=st.sampled_from(["q4_k", "q6_k", "q8_0"]), int8=st.booleans(), K=st.sampled_from([4, 8]),
       n_expert=st.integers(9, 40), rows=st.sampled_from([1, 2]), nsub=st.sampled_from([1, 2, 4]),
       down_wg=st.sampled_from([0, 0, 128, 160]), q6_shared=st.booleans(), seed=st.integers(0, 99))
def test_moe_experts(backend, request, qtype, int8, K, n_expert, rows, nsub, down_wg, q6_shared, seed):
    """gate·up of the routed experts and the shared one (ffn_gate_up on f32 input, or
    with Q8 on Q8_1), the shared expert being expert n_expert of the stacks; then
    moe_down_all on the f32 act: its workgroup sizes (160: a row's blocks in one pass at the 35B
    shapes), with the shared down appended to the stack or, q6_k beside q4_k experts, apart."""
    rng = np.random.default_rng(seed)
    H, Fd = 256, 256
    stack = lambda rows, k, q: quantized(rng, (n_expert + 1) * rows, k, q)  # noqa: E731  (the shared one last)
    wg, wu = stack(Fd, H, qtype), stack(Fd, H, qtype)
    sh_type = "q6_k" if q6_shared and qtype == "q4_k" else qtype
    if sh_type == qtype:
        wd, wd_sh = stack(H, Fd, qtype), None
    else:
        wd, wd_sh = quantized(rng, n_expert * H, Fd, qtype), quantized(rng, H, Fd, sh_type)
    hn = rng.standard_normal(H).astype(np.float32)
    sg = sg_for(backend, request, seed)
    ids, routed_w = route_ref(rng.standard_normal(n_expert).astype(np.float32), K)
    ids, weights = np.append(ids[0], np.uint32(n_expert)), np.append(routed_w[0], np.float32(0.7))  # [K]: shared
    if int8:
        up = D.ffn_gate_up.specialize(QTYPE=qtype, Q8=True, ROWS=rows, NSUB=nsub, SG=sg)
        xq, xd = q8_1_buffers(hn)
        x_in, seen = dict(xq=xq, xd=xd), q8_1_values(xq, xd)
    else:
        up = D.ffn_gate_up.specialize(QTYPE=qtype, ROWS=rows, NSUB=nsub, SG=sg)
        x_in, seen = dict(x=hn), hn
    act = run(up, backend, request, up.groups(m=Fd, slots=K + 1), wg=wg, wu=wu, ids=ids,
              act=np.full((K + 1) * Fd, np.nan, np.float32), k=H, m=Fd, **x_in)["act"]
    act_ref = D.ffn_gate_up_ref(wg, wu, ids, seen, qtype, Fd, H)
    np.testing.assert_allclose(act, act_ref, rtol=5e-4, atol=5e-4 * np.abs(act_ref).max())

    y0 = rng.standard_normal(H).astype(np.float32)
    down_wg = down_wg if down_wg % sg == 0 else 0
    down = D.moe_down_all.specialize(QTYPE=qtype, QTYPE_SH="" if sh_type == qtype else sh_type, K=K, ROWS=rows,
                                     NSUB=1 if down_wg else nsub, WG=down_wg, SG=sg)
    y = run(down, backend, request, down.groups(m=H), w=wd,
            w_sh=np.zeros(16, np.uint8) if wd_sh is None else wd_sh, ids=ids, weights=weights, act=act, y=y0,
            k=Fd, m=H)["y"]
    ref = D.moe_down_all_ref(wd, wd_sh, ids if wd_sh is None else ids[:K], weights, act, y0, qtype, H, Fd, sh_type)
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
