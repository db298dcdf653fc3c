"""The normed input every projection reads (q8_1.norm_q8_1 / write_normed) against numpy in the
interpreter (every subgroup size) and on lavapipe (its own): hn = rmsnorm(x) · w to f32 rounding
of the float64 norm, its Q8_1 blocks exactly those of the hn it wrote (assert_q8_1_of), and with
HALVES its f16 rows exactly the hn it wrote rounded."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup
from zdsl.kernels import q8_1
from zdsl.kernels.norm import rms_norm_ref


def normed(variant, backend, request, x, w, eps, rows=1):
    """Each of `rows` rows of x normed (one workgroup per row)."""
    n = w.size
    halves = dict(h=np.full(rows * n, np.nan, np.float16)) if variant.params.get("HALVES") else {}
    return run(variant, backend, request, variant.groups(rows=rows), x=x, norm_w=w,
               hn=np.full(rows * n, np.nan, np.float32), xq=np.zeros(rows * n // 4, np.uint32),
               xd=np.full(rows * n // 16, np.nan, np.float32), n=n, eps=eps, **halves)


@pytest.mark.parametrize("backend", BACKENDS)
@given(blocks=st.integers(1, 100), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), scale=st.sampled_from([1e-3, 1.0, 30.0]), halves=st.booleans(),
       seed=st.integers(0, 99))
def test_norm_q8_1(backend, request, blocks, wg, sg_pick, eps, scale, halves, seed):
    """Any whole number of blocks: fewer quads than invocations, and several rounds of them."""
    rng = np.random.default_rng(seed)
    rows = 1 + seed % 3  # one vector (decode), or a prompt chunk's rows
    x = (rng.standard_normal((rows, 32 * blocks)) * scale).astype(np.float32)
    w = rng.uniform(-1.5, 1.5, 32 * blocks).astype(np.float32)
    out = normed(q8_1.norm_q8_1.specialize(WG=wg, HALVES=halves, SG=subgroup(backend, request, sg_pick)), backend,
                 request, x.reshape(-1), w, eps, rows)
    ref = np.concatenate([rms_norm_ref(row, w, eps) for row in x])
    np.testing.assert_allclose(out["hn"], ref, rtol=2e-5, atol=2e-6 * scale)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    if halves:
        np.testing.assert_array_equal(out["h"], out["hn"].astype(np.float16))


def test_norm_q8_1_model_width():
    """The residual stream of Qwen3.5-35B-A3B (2048), with a block of zeros (d = 0, q = 0)."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(2048, dtype=np.float32), rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    x[64:96] = 0
    out = normed(q8_1.norm_q8_1.specialize(WG=256, SG=32), "interp", None, x, w, 1e-6)
    np.testing.assert_allclose(out["hn"], x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * w, rtol=2e-5)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    assert out["xd"][4] == 0 and not out["xq"][16:24].any()
