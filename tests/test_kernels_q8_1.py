"""The normed input every projection reads (q8_1.norm_q8_1 / write_normed) against numpy in the
interpreter (every subgroup size) and on lavapipe (its own): hn = rmsnorm(x) · w to f32 rounding
of the float64 norm, and its Q8_1 blocks exactly those of the hn it wrote (assert_q8_1_of)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup
from zdsl.kernels import q8_1
from zdsl.kernels.norm import rms_norm_ref


def normed(variant, backend, request, x, w, eps):
    n = x.size
    return run(variant, backend, request, 1, x=x, norm_w=w, hn=np.full(n, np.nan, np.float32),
               xq=np.zeros(n // 4, np.uint32), xd=np.full(n // 16, np.nan, np.float32), n=n, eps=eps)


@pytest.mark.parametrize("backend", BACKENDS)
@given(blocks=st.integers(1, 100), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 99))
def test_norm_q8_1(backend, request, blocks, wg, sg_pick, eps, scale, seed):
    """Any whole number of blocks: fewer quads than invocations, and several rounds of them."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(32 * blocks) * scale).astype(np.float32)
    w = rng.uniform(-1.5, 1.5, x.size).astype(np.float32)
    out = normed(q8_1.norm_q8_1.specialize(WG=wg, SG=subgroup(backend, request, sg_pick)), backend, request, x, w, eps)
    np.testing.assert_allclose(out["hn"], rms_norm_ref(x, w, eps), rtol=2e-5, atol=2e-6 * scale)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])


def test_norm_q8_1_model_width():
    """The residual stream of Qwen3.5-35B-A3B (2048), with a block of zeros (d = 0, q = 0)."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(2048, dtype=np.float32), rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    x[64:96] = 0
    out = normed(q8_1.norm_q8_1.specialize(WG=256, SG=32), "interp", None, x, w, 1e-6)
    np.testing.assert_allclose(out["hn"], x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w, rtol=2e-5)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    assert out["xd"][4] == 0 and not out["xq"][16:24].any()
