"""MoE routing and the shared-expert gate against numpy, in the interpreter (every subgroup
size) and on lavapipe (its own): top-k expert ids exactly (ties to the lower expert), weights to
rounding."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.kernels import moe

BACKENDS = ["interp", "lavapipe"]


def run(variant, backend, request, groups, **args):
    if backend == "interp":
        return variant.interpret(groups, **args)
    return variant.run(request.getfixturevalue("device"), groups, **args)


def subgroup(backend, request, pick):
    sizes = [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]
    return sizes[pick % len(sizes)]


def router_logits(rng, tokens, n, ties):
    if ties:  # few distinct values: many equal logits, also across the top-k boundary
        return rng.integers(-3, 3, (tokens, n)).astype(np.float32)
    return rng.standard_normal((tokens, n), dtype=np.float32) * 2


@pytest.mark.parametrize("backend", BACKENDS)
@given(k=st.sampled_from([4, 8, 10]), extra=st.integers(0, 600), tokens=st.integers(1, 3), ties=st.booleans(),
       wg=st.sampled_from([64, 256]), r=st.sampled_from([1, 4]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_route(backend, request, k, extra, tokens, ties, wg, r, sg_pick, seed):
    n = k + extra
    logits = router_logits(np.random.default_rng(seed), tokens, n, ties)
    out = run(moe.moe_route.specialize(K=k, WG=wg, R=r, SG=subgroup(backend, request, sg_pick)), backend, request,
              tokens, logits=logits, ids=np.zeros(tokens * k, np.uint32), weights=np.zeros(tokens * k, np.float32),
              n_expert=n)
    ids, weights = moe.moe_route_ref(logits, k)
    np.testing.assert_array_equal(out["ids"].reshape(tokens, k), ids)
    np.testing.assert_allclose(out["weights"].reshape(tokens, k), weights, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(out["weights"].reshape(tokens, k).sum(axis=1), 1, rtol=1e-5)


def test_route_the_model_shape():
    """256 experts, 8 used, as Qwen3.5-35B-A3B, with the picks' order independent of the
    reference's: the k largest logits, largest first."""
    logits = np.random.default_rng(7).standard_normal(256, dtype=np.float32)
    out = moe.moe_route.specialize(K=8, WG=64, R=4, SG=32).interpret(
        1, logits=logits, ids=np.zeros(8, np.uint32), weights=np.zeros(8, np.float32), n_expert=256)
    np.testing.assert_array_equal(out["ids"], np.argsort(-logits)[:8])
    p = np.exp(logits[out["ids"]] - logits.max())
    np.testing.assert_allclose(out["weights"], p / p.sum(), rtol=1e-5)
