"""The MoE router (the residual stream normed, in f32 and Q8_1; router logits of it, then the
top-k experts and their weights picked by the workgroup that finishes last, and the shared
expert's gate, its last logit) against numpy, in the interpreter (every subgroup size) and on
lavapipe (its own): normed input and logits to rounding; expert ids exactly (ties to the lower
expert) and weights to rounding, from the logits the kernel wrote; the arrival count back at 0."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.kernels import dmmv, moe
from zdsl.kernels import formats as F
from zdsl.kernels.norm import rms_norm_ref
from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup

EPS = 1e-6


def router_weights(rng, n, k, qtype, ties):
    """n router rows, then the shared expert's gate as row n (weights.py); with ties, copies of a
    few distinct rows: equal logits, also across the top-k boundary."""
    rows = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    if ties:
        rows = rows[rng.integers(0, max(2, n // 4), n)]
    gate = rng.standard_normal((1, k)).astype(np.float32) * 0.1
    return F.quantize(np.concatenate([rows, gate]), F.QuantType[qtype.upper()]).reshape(-1)


def route(variant, backend, request, w, x, norm_w, n, k, K):
    """Route x; check the normed input the router writes (f32 and Q8_1) against numpy."""
    out = run(variant, backend, request, variant.groups(n_expert=n), w=w, x=x,
              norm_w=norm_w, hn=np.full(k, np.nan, np.float32), xq=np.zeros(k // 4, np.uint32),
              xd=np.full(k // 16, np.nan, np.float32), logits=np.full(n + 1, np.nan, np.float32),
              arrivals=np.zeros(1, np.uint32), ids=np.full(K + 1, 7777, np.uint32), weights=np.full(K + 1, np.nan, np.float32),
              k=k, n_expert=n, eps=EPS)
    hn = rms_norm_ref(x, norm_w, EPS)
    np.testing.assert_allclose(out["hn"], hn, rtol=2e-5, atol=2e-5 * np.abs(hn).max())
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    return out


def inputs(rng, k):
    """(x, norm_w): a residual stream far from unit scale, its norm weight."""
    return rng.standard_normal(k).astype(np.float32) * 7, rng.standard_normal(k).astype(np.float32) * 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20)
@given(K=st.sampled_from([4, 8, 10]), extra=st.integers(0, 70), kb=st.integers(1, 4), qtype=st.sampled_from(["f32", "q8_0"]),
       ties=st.booleans(), rows=st.sampled_from([1, 2, 4]), nsub=st.sampled_from([1, 2, 4]),
       wg=st.sampled_from([0, 0, 128, 256]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_router(backend, request, K, extra, kb, qtype, ties, rows, nsub, wg, sg_pick, seed):
    rng = np.random.default_rng(seed)
    n, k = K + extra, 32 * kb
    w = router_weights(rng, n, k, qtype, ties)
    x, norm_w = inputs(rng, k)
    v = moe.moe_router.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub if wg == 0 else 1, WG=wg,
                                  SG=subgroup(backend, request, sg_pick))
    out = route(v, backend, request, w, x, norm_w, n, k, K)
    _, logits, _, want = moe.moe_router_ref(w, x, norm_w, EPS, qtype, n, k, K)
    np.testing.assert_allclose(out["logits"], logits, rtol=2e-5, atol=2e-5 * np.abs(logits).max())
    ids, weights = moe.route_ref(out["logits"][:n], K)
    np.testing.assert_array_equal(out["ids"], np.append(ids[0], n))  # [K]: the shared expert, appended to the stacks
    np.testing.assert_allclose(out["weights"][:K], weights[0], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(out["weights"][:K].sum(), 1, rtol=1e-5)
    np.testing.assert_allclose(out["weights"][K], 1 / (1 + np.exp(-np.float64(out["logits"][n]))), rtol=1e-6)
    np.testing.assert_allclose(out["weights"][K], want[K], rtol=1e-5)  # the shared expert's gate
    assert out["arrivals"][0] == 0


def test_router_twice_in_one_sequence(device):
    """Two tokens routed back to back in one command buffer: the second dispatch finds the count
    the first left at 0 and picks its own experts."""
    rng = np.random.default_rng(3)
    n, k, K = 61, 256, 8
    w = router_weights(rng, n, k, "f32", ties=False)
    _, norm_w = inputs(rng, k)
    xs = [inputs(rng, k)[0] for _ in range(2)]
    v = moe.moe_router.specialize(K=K, ROWS=2, SG=device.info.subgroup_size)
    up = lambda a, name: device.upload(np.ascontiguousarray(a), name=name)  # noqa: E731
    shared = dict(w=up(w, "w"), norm_w=up(norm_w, "norm_w"),
                  arrivals=up(np.zeros(1, np.uint32), "arrivals"), hn=up(np.zeros(k, np.float32), "hn"),
                  xq=up(np.zeros(k // 4, np.uint32), "xq"), xd=up(np.zeros(k // 16, np.float32), "xd"))
    own = [dict(x=up(x, "x"), logits=up(np.zeros(n + 1, np.float32), "logits"), ids=up(np.zeros(K + 1, np.uint32), "ids"),
                weights=up(np.zeros(K + 1, np.float32), "weights")) for x in xs]
    try:
        seq = device.sequence()
        for bufs in own:
            v.dispatch(seq, v.groups(n_expert=n), k=k, n_expert=n, eps=EPS, **shared, **bufs)
        seq.run()
        seq.free()
        for x, bufs in zip(xs, own):
            _, want_logits, want_ids, want_weights = moe.moe_router_ref(w, x, norm_w, EPS, "f32", n, k, K)
            np.testing.assert_allclose(bufs["logits"].read(np.float32, (n + 1,)), want_logits, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(bufs["ids"].read(np.uint32, (K + 1,)), want_ids)
            np.testing.assert_allclose(bufs["weights"].read(np.float32, (K + 1,)), want_weights, rtol=1e-5)
        assert shared["arrivals"].read(np.uint32, (1,))[0] == 0
    finally:
        for b in list(shared.values()) + [b for bufs in own for b in bufs.values()]:
            b.free()


def test_router_the_model_shape():
    """256 experts of 2048 f32 weights, 8 used, as Qwen3.5-35B-A3B, with the picks' order
    independent of the reference's: the k largest logits, largest first; the shared expert's
    gate from its row (the last) in float64."""
    rng = np.random.default_rng(7)
    n, k = 256, 2048
    w = rng.standard_normal((n + 1, k), dtype=np.float32) * 0.02
    x, norm_w = inputs(rng, k)
    out = route(moe.moe_router.specialize(K=8, SG=32), "interp", None, w.reshape(-1).view(np.uint8), x, norm_w, n, k, 8)
    hn = rms_norm_ref(x, norm_w, EPS)
    logits = out["logits"][:n]
    np.testing.assert_array_equal(out["ids"], np.append(np.argsort(-logits)[:8], n))
    p = np.exp(logits[out["ids"][:8]] - logits.max())
    np.testing.assert_allclose(out["weights"][:8], p / p.sum(), rtol=1e-5)
    np.testing.assert_allclose(out["weights"][8], 1 / (1 + np.exp(-(w[n].astype(np.float64) @ hn))), rtol=1e-5)
