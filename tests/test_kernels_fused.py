"""The fused decode kernels (RMSNorm folded into projections; the shared expert as an extra
slot of the routed experts' kernels) against numpy, in the interpreter and on lavapipe."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.kernels import dmmv as D
from zdsl.kernels import formats as F
from zdsl.kernels.moe import route_ref

BACKENDS = ["interp", "lavapipe"]
QTYPES = ["q4_k", "q6_k", "q8_0", "f32"]


def quantized(rng, rows, k, qtype, scale=0.05):
    return F.quantize(rng.standard_normal((rows, k)).astype(np.float32) * scale, F.QuantType[qtype.upper()]).reshape(-1)


def run(variant, backend, request, groups, **args):
    if backend == "interp":
        return variant.interpret(groups, **args)
    return variant.run(request.getfixturevalue("device"), groups, **args)


def sg_for(backend, request, pick):
    sizes = [8, 32] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(qtype=st.sampled_from(QTYPES), m=st.integers(1, 19), kb=st.integers(1, 3), rows=st.sampled_from([1, 2, 4]),
       nsub=st.sampled_from([1, 2, 4]), pick=st.integers(0, 1), seed=st.integers(0, 99))
def test_dmmv_norm(backend, request, qtype, m, kb, rows, nsub, pick, seed):
    rng = np.random.default_rng(seed)
    k = 256 * kb
    w = quantized(rng, m, k, qtype)
    x = rng.standard_normal(k).astype(np.float32) * 3
    nw = rng.uniform(0.5, 1.5, k).astype(np.float32)
    v = D.dmmv_norm.specialize(QTYPE=qtype, ROWS=rows, NSUB=nsub, SG=sg_for(backend, request, pick))
    y = run(v, backend, request, -(-m // D.rows_per_workgroup(v)), w=w, x=x, norm_w=nw, y=np.full(m, np.nan, np.float32), k=k, m=m,
            eps=1e-6)["y"]
    ref = D.dmmv_norm_ref(w, x, nw, 1e-6, qtype, m, k)
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("backend", BACKENDS)
@given(qtype=st.sampled_from(["q4_k", "q8_0"]), K=st.sampled_from([4, 8]), n_expert=st.integers(9, 40),
       rows=st.sampled_from([1, 2]), nsub=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_moe_gate_up_and_down_all(backend, request, qtype, K, n_expert, rows, nsub, seed):
    rng = np.random.default_rng(seed)
    H, Fd = 256, 256
    wg, wu, wd = (quantized(rng, n_expert * Fd, H, qtype) for _ in range(3))
    wd = quantized(rng, n_expert * H, Fd, qtype)
    wg_sh, wu_sh, wd_sh = quantized(rng, Fd, H, qtype), quantized(rng, Fd, H, qtype), quantized(rng, H, Fd, qtype)
    router = rng.standard_normal(n_expert).astype(np.float32)
    sh_gate_w = rng.standard_normal(H).astype(np.float32) * 0.1
    x = rng.standard_normal(H).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, H).astype(np.float32)
    sg = sg_for(backend, request, seed)
    ids, routed_w = route_ref(router, K)
    ids, routed_w = ids[0], routed_w[0]
    up = D.moe_gate_up.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub, SG=sg)
    out = run(up, backend, request, (-(-Fd // D.rows_per_workgroup(up)), K + 1), wg=wg, wu=wu, wg_sh=wg_sh, wu_sh=wu_sh, ids=ids,
              sh_gate_w=sh_gate_w, x=x, norm_w=nw, weights=np.append(routed_w, np.float32(np.nan)),
              act=np.zeros((K + 1) * Fd, np.float32), k=H, m=Fd, eps=1e-6)
    act_ref, gate_ref = D.moe_gate_up_ref(wg, wu, wg_sh, wu_sh, ids, sh_gate_w, x, nw, 1e-6, qtype, Fd, H)
    np.testing.assert_array_equal(out["weights"][:K], routed_w)  # the routed weights are left alone
    np.testing.assert_allclose(out["weights"][K], gate_ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["act"], act_ref, rtol=5e-4, atol=5e-4 * np.abs(act_ref).max())
    y0 = rng.standard_normal(H).astype(np.float32)
    down = D.moe_down_all.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub, SG=sg)
    y = run(down, backend, request, -(-H // D.rows_per_workgroup(down)), w=wd, w_sh=wd_sh, ids=ids, weights=out["weights"],
            act=out["act"], y=y0, k=Fd, m=H)["y"]
    ref = D.moe_down_all_ref(wd, wd_sh, ids, out["weights"], out["act"], y0, qtype, H, Fd)
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
