"""The normed input every projection reads, deferred (q8_1.py): norm_q8_1 against numpy in the
interpreter (every subgroup size) and on lavapipe (its own): hn = x ⊙ w exactly (one f32
product), ss = Σx² per block to f32 rounding, and its Q8_1 blocks exactly those of the hn it
wrote (assert_q8_1_of). That a consumer's rms from ss is rmsnorm's scale is checked with the
consumers (test_kernels_dmmv, test_kernels_fused) and end to end (test_decode)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup
from zdsl.kernels import q8_1
from zdsl.kernels.norm import rms_norm_ref


def normed(variant, backend, request, x, w):
    n = x.size
    return run(variant, backend, request, -(-n // (4 * variant.params["WG"])), x=x, norm_w=w,
               hn=np.full(n, np.nan, np.float32), xq=np.zeros(n // 4, np.uint32),
               xd=np.full(n // 16, np.nan, np.float32), ss=np.full(n // 32, np.nan, np.float32), n=n)


@pytest.mark.parametrize("backend", BACKENDS)
@given(blocks=st.integers(1, 100), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 99))
def test_norm_q8_1(backend, request, blocks, wg, sg_pick, scale, seed):
    """Any whole number of blocks: fewer quads than invocations, and several workgroups."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(32 * blocks) * scale).astype(np.float32)
    w = rng.uniform(-1.5, 1.5, x.size).astype(np.float32)
    out = normed(q8_1.norm_q8_1.specialize(WG=wg, SG=subgroup(backend, request, sg_pick)), backend, request, x, w)
    hn, ss = q8_1.norm_q8_1_ref(x, w)
    np.testing.assert_array_equal(out["hn"], hn)
    np.testing.assert_allclose(out["ss"], ss, rtol=1e-5)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])


def test_norm_q8_1_model_width():
    """The residual stream of Qwen3.5-35B-A3B (2048), with a block of zeros (d = 0, q = 0): the
    rms its consumers take from ss times hn is rmsnorm(x) · w."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(2048, dtype=np.float32), rng.uniform(0.5, 1.5, 2048).astype(np.float32)
    x[64:96] = 0
    out = normed(q8_1.norm_q8_1.specialize(WG=64, SG=32), "interp", None, x, w)
    np.testing.assert_allclose(out["hn"] * q8_1.rms_ref(out["ss"], 1e-6), rms_norm_ref(x, w, 1e-6), rtol=2e-6)
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    assert out["xd"][4] == 0 and not out["xq"][16:24].any() and out["ss"][2] == 0
