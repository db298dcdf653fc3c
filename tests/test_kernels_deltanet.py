"""Delta-net decode kernels against numpy (float64) in the interpreter (every subgroup size) and on
lavapipe (its own): the conv and its state shift for any channel count, the fused step over
random shapes, thread layouts and states, the model's shape, and several tokens in a row against
the model reference's `deltanet_recurrent`. Tolerances: f32 to ~1e-5 relative."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zdsl.kernels import deltanet as dn
from zdsl.models.qwen35 import reference as model

BACKENDS = ["interp", "lavapipe"]
EPS = 1e-6


def run(variant, backend, request, groups, **args):
    if backend == "interp":
        return variant.interpret(groups, **args)
    return variant.run(request.getfixturevalue("device"), groups, **args)


def subgroup_sizes(backend, request):
    return [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]


def conv(backend, request, mix, w, state, wg=64):
    C, KC = w.shape
    return run(dn.deltanet_conv.specialize(KC=KC, WG=wg), backend, request, -(-C // wg), mix=mix, w=w, state=state,
               out=np.full(C, np.nan, np.float32), channels=C)


def step(backend, request, x, state, n_k_heads, wg, sg):
    """x: the step's inputs (conv, z, b, a, ssm_a, dt_bias, norm_w)."""
    Hv, D = state.shape[:2]
    return run(dn.deltanet_step.specialize(D=D, WG=wg, SG=sg), backend, request, Hv, **x, state=state,
               out=np.full(Hv * D, np.nan, np.float32), n_k_heads=n_k_heads, eps=EPS)


def step_inputs(rng, Hk, Hv, D, conv_scale=1.0):
    return dict(conv=(rng.standard_normal((2 * Hk + Hv) * D) * conv_scale).astype(np.float32),
                z=(rng.standard_normal(Hv * D) * 2).astype(np.float32),
                b=(rng.standard_normal(Hv) * 2).astype(np.float32),
                a=(rng.standard_normal(Hv) * 2).astype(np.float32),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
                dt_bias=rng.standard_normal(Hv, dtype=np.float32),
                norm_w=rng.standard_normal(D, dtype=np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@given(channels=st.integers(1, 3000), kc=st.integers(2, 5), wg=st.sampled_from([64, 256]), seed=st.integers(0, 99))
def test_conv(backend, request, channels, kc, wg, seed):
    rng = np.random.default_rng(seed)
    mix = (rng.standard_normal(channels) * 3).astype(np.float32)
    w = rng.standard_normal((channels, kc), dtype=np.float32)
    state = (rng.standard_normal((kc - 1, channels)) * 3).astype(np.float32)
    out = conv(backend, request, mix, w, state, wg)
    want, want_state = dn.deltanet_conv_ref(mix, w, state)
    np.testing.assert_allclose(out["out"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["state"], want_state)  # the shift moves values, exactly


# (D, WG) layouts for lavapipe, whose LLVM takes seconds per new pipeline: one and several rows
# per invocation, a row part smaller than a subgroup, a head dim that is no power of two.
LAVAPIPE_LAYOUTS = [(8, 16), (16, 32), (24, 48), (32, 64)]


@pytest.mark.parametrize("backend", BACKENDS)
@given(hk=st.integers(1, 3), ratio=st.integers(1, 3), d=st.sampled_from([8, 16, 24, 32, 64]),
       rp_log=st.integers(0, 6), sg_pick=st.integers(0, 3), layout=st.sampled_from(LAVAPIPE_LAYOUTS),
       state_scale=st.sampled_from([0.0, 0.1, 3.0]), conv_scale=st.sampled_from([1e-3, 1.0]), seed=st.integers(0, 99))
def test_step(backend, request, hk, ratio, d, rp_log, sg_pick, layout, state_scale, conv_scale, seed):
    """Value head h reads key head h % n_k_heads; any split of the rows over row parts (RP)."""
    sizes = subgroup_sizes(backend, request)
    sg = sizes[sg_pick % len(sizes)]
    if backend == "interp":
        rp = 2 ** rp_log
        wg = d // 4 * rp
        assume(d % rp == 0 and wg % sg == 0 and wg <= 1024)
    else:
        d, wg = layout
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    x = step_inputs(rng, hk, hv, d, conv_scale)
    state = (rng.standard_normal((hv, d, d)) * state_scale).astype(np.float32)
    out = step(backend, request, x, state, hk, wg, sg)
    want, want_state = dn.deltanet_step_ref(**x, state=state, n_k_heads=hk, eps=EPS)
    np.testing.assert_allclose(out["state"].reshape(hv, d, d), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["out"], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_shape(backend, request):
    """16 key heads, 32 value heads of 128 (64 KiB of state each), through every built layout."""
    rng = np.random.default_rng(4)
    x = step_inputs(rng, 16, 32, 128)
    state = (rng.standard_normal((32, 128, 128)) * 0.5).astype(np.float32)
    want, want_state = dn.deltanet_step_ref(**x, state=state, n_k_heads=16, eps=EPS)
    for v in dn.deltanet_step.space(tuple(subgroup_sizes(backend, request))):
        if backend == "interp" and v["SG"] in (8, 16):
            continue  # the layouts differ only in the subgroup reduction: 32 and 64 cover it
        out = step(backend, request, x, state, 16, v["WG"], v["SG"])
        np.testing.assert_allclose(out["state"].reshape(32, 128, 128), want_state, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["out"], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_tokens(backend, request):
    """conv → step for T tokens from a zero state, conv and delta states carried, against the
    model reference (conv, l2norm, deltanet_recurrent, gated rmsnorm) run token by token."""
    rng = np.random.default_rng(9)
    Hk, Hv, D, T = 2, 4, 16, 7
    C = (2 * Hk + Hv) * D
    sg = subgroup_sizes(backend, request)[-1]
    taps = (rng.standard_normal((C, 4)) * 0.7).astype(np.float32)
    x = step_inputs(rng, Hk, Hv, D)
    conv_state, state = np.zeros((3, C), np.float32), np.zeros((Hv, D, D), np.float32)
    ref_hist, ref_S = np.zeros((3, C), np.float32), np.zeros((Hv, D, D), np.float32)
    for _ in range(T):
        mix = rng.standard_normal(C, dtype=np.float32)
        z, b, a = rng.standard_normal(Hv * D, dtype=np.float32), rng.standard_normal(Hv, dtype=np.float32), \
            rng.standard_normal(Hv, dtype=np.float32)
        c = conv(backend, request, mix, taps, conv_state)
        conv_state = c["state"]
        s = step(backend, request, dict(x, conv=c["out"], z=z, b=b, a=a), state, Hk, 64, sg)
        state = s["state"]

        hist = np.concatenate([ref_hist, mix[None]])
        mixed = model.silu((hist * taps.T).sum(axis=0))
        ref_hist = hist[1:]
        q = model.l2norm(mixed[:Hk * D].reshape(Hk, D), EPS)
        k = model.l2norm(mixed[Hk * D:2 * Hk * D].reshape(Hk, D), EPS)
        v = mixed[2 * Hk * D:].reshape(Hv, D)
        g = x["ssm_a"] * model.softplus(a + x["dt_bias"])
        o = model.deltanet_recurrent(np.tile(q, (Hv // Hk, 1))[None], np.tile(k, (Hv // Hk, 1))[None], v[None],
                                     g[None], model.sigmoid(b)[None], ref_S)[0]
        expect = model.rmsnorm(o, x["norm_w"], EPS) * model.silu(z.reshape(Hv, D))
        np.testing.assert_allclose(c["out"], mixed, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state, ref_S, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s["out"].reshape(Hv, D), expect, rtol=1e-4, atol=1e-5)
