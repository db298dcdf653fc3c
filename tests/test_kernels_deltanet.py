"""The fused delta-net decode step (the gate projections β and α, conv + silu + ring update, then
the gated delta rule and the gated norm) against numpy (float64) in the interpreter (every
subgroup size) and on lavapipe (its own): random shapes, thread layouts, gate weight types (every
type with a GPU decoder, dequantized by gguf-py), states and positions (the conv ring before, at
and after its first wrap, and far out), the model's shape, and several tokens in a row from zero
states against the model reference's conv, `deltanet_recurrent` and gated norm. Tolerances: f32 to
~1e-5 relative; the conv ring only moves values, so it must match exactly."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zdsl.kernels import inputs
from zdsl.kernels import deltanet as dn
from zdsl.kernels import dmmv
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values
from zdsl.kernels.quant import FORMATS
from zdsl.models.qwen35 import reference as model
from kernel_testing import BACKENDS, assert_q8_1_of, run

EPS = 1e-6
# before the ring is full (0, 1, 2), its first wrap (3 → slot 3, 5 → slot 1), a long context and
# the last u32 position (the slot arithmetic must not overflow)
POSITIONS = [0, 1, 2, 3, 5, 262_141, 2**32 - 1]


def subgroup_sizes(backend, request):
    return [8, 16, 32, 64] if backend == "interp" else [request.getfixturevalue("device").info.subgroup_size]


def step(backend, request, x, state, pos, n_k_heads, wg, sg):
    """x: the step's inputs (mix, conv_w, conv_state, z, w_ba, x, qtype, ssm_a, dt_bias, norm_w)."""
    Hv, D = state.shape[:2]
    x = dict(x)
    qtype = x.pop("qtype")
    KC = x["conv_state"].shape[0]
    words = np.zeros(8, np.uint32)
    words[0], words[1] = pos, (pos + 1) % 2**32
    args = dict(x, conv_w=x["conv_w"].reshape(-1), conv_state=x["conv_state"].reshape(-1))
    q8 = D % 32 == 0  # the output also as Q8_1 where it is whole blocks
    q8_out = dict(oq=np.zeros(Hv * D // 4, np.uint32), od=np.full(Hv * D // 16, np.nan, np.float32)) if q8 else {}
    out = run(dn.deltanet_step.specialize(D=D, KC=KC, WG=wg, Q8=q8, QTYPE=qtype, SG=sg), backend, request, Hv, **args,
              step=words, state=state, out=np.full(Hv * D, np.nan, np.float32), n_k_heads=n_k_heads,
              k=len(x["x"]), eps=EPS, **q8_out)
    if q8:
        assert_q8_1_of(out["oq"], out["od"], out["out"])
    return out


def step_inputs(rng, Hk, Hv, D, KC=4, mix_scale=1.0, qtype="q8_0", blocks=3):
    """Random inputs; the normed input x has `blocks` blocks of the gate weights' type."""
    C = (2 * Hk + Hv) * D
    hidden = FORMATS[qtype].block * blocks
    x = (rng.standard_normal(hidden) / np.sqrt(hidden)).astype(np.float32)
    return dict(mix=(rng.standard_normal(C) * mix_scale).astype(np.float32),
                conv_w=(rng.standard_normal((C, KC)) * 0.7).astype(np.float32),
                conv_state=(rng.standard_normal((KC, C)) * mix_scale).astype(np.float32),
                z=(rng.standard_normal(Hv * D) * 2).astype(np.float32),
                w_ba=inputs.rows(rng, qtype, 2 * Hv, hidden), qtype=qtype,
                **normed(x),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
                dt_bias=rng.standard_normal(Hv, dtype=np.float32),
                norm_w=rng.standard_normal(D, dtype=np.float32))


def normed(x):
    """The normed input as the step reads it: f32, and Q8_1 (for int8 gate types)."""
    xq, xd = q8_1_buffers(x)
    return dict(x=x, xq=xq, xd=xd)


def check(got, x, state, pos, Hk):
    Hv, D = state.shape[:2]
    want, want_state, want_ring = dn.deltanet_step_ref(**x, pos=pos, state=state, n_k_heads=Hk, eps=EPS)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(Hv, D, D), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["out"], want, rtol=2e-5, atol=2e-5)


# (D, WG) layouts for lavapipe, whose LLVM takes seconds per new pipeline: one and several rows
# per invocation, a row part smaller than a subgroup, a head dim that is no power of two.
LAVAPIPE_LAYOUTS = [(8, 16), (16, 32), (24, 48), (32, 64)]


# gate weight types drawn on lavapipe (a pipeline compile each); the interpreter draws every type
LAVAPIPE_QTYPES = ["q8_0", "q4_k"]


@pytest.mark.parametrize("backend", BACKENDS)
@given(hk=st.integers(1, 3), ratio=st.integers(1, 3), d=st.sampled_from([8, 16, 24, 32, 64]),
       rp_log=st.integers(0, 6), sg_pick=st.integers(0, 3), layout=st.sampled_from(LAVAPIPE_LAYOUTS),
       kc=st.integers(1, 5), pos=st.sampled_from(POSITIONS), qtype=st.sampled_from(list(FORMATS)),
       blocks=st.integers(1, 3), state_scale=st.sampled_from([0.0, 0.1, 3.0]), mix_scale=st.sampled_from([1e-3, 1.0]),
       seed=st.integers(0, 99))
def test_step(backend, request, hk, ratio, d, rp_log, sg_pick, layout, kc, pos, qtype, blocks, state_scale, mix_scale,
              seed):
    """Value head h reads key head h % n_k_heads; any split of the rows over row parts (RP); any
    number of conv taps (lavapipe: the model's 4) at any position; gates of any weight type and
    any number of its blocks."""
    sizes = subgroup_sizes(backend, request)
    sg = sizes[sg_pick % len(sizes)]
    if backend == "interp":
        rp = 2 ** rp_log
        wg = d // 4 * rp
        assume(d % rp == 0 and wg % sg == 0 and wg <= 1024)
    else:
        (d, wg), kc = layout, 4
        qtype = LAVAPIPE_QTYPES[seed % len(LAVAPIPE_QTYPES)]
    assume(wg % FORMATS[qtype].parts == 0)
    rng = np.random.default_rng(seed)
    hv = hk * ratio
    x = step_inputs(rng, hk, hv, d, kc, mix_scale, qtype, blocks)
    state = (rng.standard_normal((hv, d, d)) * state_scale).astype(np.float32)
    check(step(backend, request, x, state, pos, hk, wg, sg), x, state, pos, hk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos", POSITIONS)
def test_positions_odd_heads(backend, request, pos):
    """Every listed position with odd head counts (3 key heads, 9 value heads: three workgroups
    read each key head's q and k, one stores them); the slot being written holds stale values,
    which no tap may read."""
    rng = np.random.default_rng(pos % 1000)
    hk, hv, d, wg = 3, 9, 16, 32
    x = step_inputs(rng, hk, hv, d)
    state = (rng.standard_normal((hv, d, d)) * 0.5).astype(np.float32)
    sg = [s for s in subgroup_sizes(backend, request) if wg % s == 0][-1]
    check(step(backend, request, x, state, pos, hk, wg, sg), x, state, pos, hk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_shape(backend, request):
    """16 key heads, 32 value heads of 128 (64 KiB of state each), through every built layout."""
    rng = np.random.default_rng(4)
    x = step_inputs(rng, 16, 32, 128, blocks=64)  # gates of q8_0 rows of 2048
    state = (rng.standard_normal((32, 128, 128)) * 0.5).astype(np.float32)
    for wg, sg in sorted({(v["WG"], v["SG"]) for v in dn.deltanet_step.space(tuple(subgroup_sizes(backend, request)))}):
        if backend == "interp" and sg in (8, 16):
            continue  # the layouts differ only in the subgroup reduction: 32 and 64 cover it
        check(step(backend, request, x, state, 7, 16, wg, sg), x, state, 7, 16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_tokens(backend, request):
    """The step for T tokens from zero conv and delta states (positions 0 .. T − 1: the ring
    fills, then wraps), both states carried, against the model reference (conv over the last 4
    inputs with zeros before the first, l2norm, deltanet_recurrent, gated rmsnorm) token by token."""
    rng = np.random.default_rng(9)
    Hk, Hv, D, T = 3, 6, 16, 9
    C = (2 * Hk + Hv) * D
    sg = subgroup_sizes(backend, request)[-1]
    x = step_inputs(rng, Hk, Hv, D, qtype="q5_k", blocks=1)
    taps = x["conv_w"]
    gates = dmmv.dequant_rows(x["w_ba"], "q5_k", 2 * Hv, 256)
    ring, state = np.zeros((4, C), np.float32), np.zeros((Hv, D, D), np.float32)
    ref_hist, ref_S = np.zeros((3, C), np.float64), np.zeros((Hv, D, D), np.float64)
    for pos in range(T):
        mix = rng.standard_normal(C, dtype=np.float32)
        z, xn = rng.standard_normal(Hv * D, dtype=np.float32), rng.standard_normal(256, dtype=np.float32) / 16
        s = step(backend, request, dict(x, mix=mix, conv_state=ring, z=z, **normed(xn)), state, pos, Hk, 64, sg)
        b, a = np.split(gates @ q8_1_values(*q8_1_buffers(xn)), 2)  # q5_k: int8 products with Q8_1 x
        ring, state = s["conv_state"].reshape(4, C), s["state"].reshape(Hv, D, D)

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
        np.testing.assert_allclose(state, ref_S, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(s["out"].reshape(Hv, D), expect, rtol=1e-4, atol=1e-5)
