"""RMSNorm kernels against numpy (float64) in the interpreter (every subgroup size) and on
lavapipe (its own): rows of any length, odd ones included, per-head rows, the silu gate."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.kernels import norm

BACKENDS = ["interp", "lavapipe"]


def run(variant, backend, request, groups, **args):
    if backend == "interp":
        return variant.interpret(groups, **args)
    return variant.run(request.getfixturevalue("device"), groups, **args)


def subgroup(backend, request, pick):
    sizes = [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 4), n=st.integers(1, 3000), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 99))
def test_rms_norm(backend, request, rows, n, wg, sg_pick, eps, scale, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * scale).astype(np.float32)
    w = rng.standard_normal(n, dtype=np.float32)
    out = run(norm.rms_norm.specialize(WG=wg, SG=subgroup(backend, request, sg_pick)), backend, request, rows,
              x=x, w=w, out=np.full((rows, n), np.nan, np.float32), n=n, eps=eps)["out"]
    np.testing.assert_allclose(out, norm.rms_norm_ref(x, w, eps), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(heads=st.integers(1, 6), d=st.integers(1, 300), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       seed=st.integers(0, 99))
def test_rms_norm_gated_per_head(backend, request, heads, d, wg, sg_pick, seed):
    """The delta-net output norm: each head of d values normalised on its own, one shared weight."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((heads, d), dtype=np.float32)
    z = (rng.standard_normal((heads, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d, dtype=np.float32)
    out = run(norm.rms_norm_gated.specialize(WG=wg, SG=subgroup(backend, request, sg_pick)), backend, request, heads,
              x=x, z=z, w=w, out=np.full((heads, d), np.nan, np.float32), n=d, eps=1e-6)["out"]
    expect = np.stack([norm.rms_norm_ref(x[h], w, 1e-6) for h in range(heads)]) * (z / (1 + np.exp(-z.astype(np.float64))))
    np.testing.assert_allclose(out, expect, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(out, norm.rms_norm_gated_ref(x, z, w, 1e-6), rtol=2e-5, atol=2e-6)


def test_model_widths():
    """The residual stream (2048) and a q/k norm over 16 heads of 256, as in Qwen3.5-35B-A3B."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(2048, dtype=np.float32), rng.standard_normal(2048, dtype=np.float32)
    out = norm.rms_norm.specialize(WG=256, SG=32).interpret(1, x=x, w=w, out=np.zeros(2048, np.float32), n=2048,
                                                          eps=1e-6)["out"]
    np.testing.assert_allclose(out, x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w, rtol=2e-5, atol=2e-6)
    q, wq = rng.standard_normal((16, 256), dtype=np.float32), rng.standard_normal(256, dtype=np.float32)
    out = norm.rms_norm.specialize(WG=64, SG=64).interpret(16, x=q, w=wq, out=np.zeros_like(q), n=256, eps=1e-6)["out"]
    np.testing.assert_allclose(out, norm.rms_norm_ref(q, wq, 1e-6), rtol=2e-5, atol=2e-6)
