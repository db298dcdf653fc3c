"""The fused delta-net decode step (the gate projections β and α, conv + silu + ring update, then
the gated delta rule and the gated norm) against numpy (float64) in the interpreter (every
subgroup size) and on lavapipe (its own): random shapes, thread layouts, gate weight types (every
type with a GPU decoder, dequantized by gguf-py), states and positions (the conv ring before, at
and after its first wrap, and far out), the model's shape, and several tokens in a row from zero
states against the model reference's conv, `deltanet_recurrent` and gated norm. The prefill
kernel (a chunk of tokens in one dispatch) against its float64 reference and against as many
decode steps, and a prompt in chunks then decode steps against the model reference. Tolerances:
f32 to ~1e-5 relative; the conv ring only moves values, so it must match exactly."""

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
from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup

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


# ---- deltanet_prefill: a chunk of tokens in one dispatch ----------------------------------------

def prefill(backend, request, x, state, pos, n_k_heads, wg, sg, q8, t=None):
    """x: the chunk's inputs (mix (rows, C), conv_w (C, KC), conv_state (KC, C), z (rows, Hv·D),
    ba (rows, 2·Hv), ssm_a, dt_bias, norm_w); deltanet_conv_rows then deltanet_prefill run the
    first t rows (all by default)."""
    Hv, D = state.shape[:2]
    rows = x["mix"].shape[0]
    t = rows if t is None else t
    KC = x["conv_state"].shape[0]
    args = {n: np.ascontiguousarray(a).reshape(-1) for n, a in x.items()}
    C = x["mix"].shape[1]
    conv = dn.deltanet_conv_rows.specialize(KC=KC, WG=64)  # the chunk's conv first, as the graph runs it
    args["conv"] = run(conv, backend, request, conv.groups(channels=C, t=t), mix=args["mix"], conv_w=args.pop("conv_w"),
                       conv_state=args["conv_state"], step=inputs.step_words(pos, pos + t),
                       conv=np.full(rows * C, np.nan, np.float32), channels=C)["conv"]
    n = rows * Hv * D
    q8_out = dict(oq=np.zeros(n // 4, np.uint32), od=np.full(n // 16, np.nan, np.float32)) if q8 else {}
    out = run(dn.deltanet_prefill.specialize(D=D, KC=KC, WG=wg, Q8=q8, SG=sg), backend, request, Hv, **args,
              step=inputs.step_words(pos, pos + t), state=state.reshape(-1),
              out=np.full(n, np.nan, np.float32), arrivals=np.zeros(1, np.uint32), t=t,
              n_k_heads=n_k_heads, eps=EPS, **q8_out)
    assert out["arrivals"][0] == 0
    if q8:
        used = t * Hv * D
        assert_q8_1_of(out["oq"][:used // 4], out["od"][:used // 16], out["out"][:used])
    return out


def prefill_inputs(rng, Hk, Hv, D, T, KC=4, extra=0):
    """Random chunk inputs; `extra` rows past the chunk are NaN (the kernel must not read them)."""
    C = (2 * Hk + Hv) * D

    def rows(n, scale=1.0):
        a = (rng.standard_normal((T + extra, n)) * scale).astype(np.float32)
        a[T:] = np.nan
        return a
    return dict(mix=rows(C), conv_w=(rng.standard_normal((C, KC)) * 0.7).astype(np.float32),
                conv_state=rng.standard_normal((KC, C), dtype=np.float32), z=rows(Hv * D, 2.0), ba=rows(2 * Hv),
                ssm_a=-np.exp(rng.standard_normal(Hv)).astype(np.float32),
                dt_bias=rng.standard_normal(Hv, dtype=np.float32), norm_w=rng.standard_normal(D, dtype=np.float32))


def check_prefill(got, x, state, pos, Hk, T):
    Hv, D = state.shape[:2]
    chunk = dict(x, mix=x["mix"][:T], z=x["z"][:T], ba=x["ba"][:T])
    want, want_state, want_ring = dn.deltanet_prefill_ref(**chunk, pos=pos, state=state, n_k_heads=Hk, eps=EPS)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(Hv, D, D), want_state, rtol=1e-5, atol=1e-5)
    out = got["out"].reshape(-1, Hv * D)
    np.testing.assert_allclose(out[:T], want, rtol=2e-5, atol=2e-5)
    assert np.isnan(out[T:]).all()  # rows past t untouched


def steps(backend, request, x, state, pos, Hk, wg, sg, T):
    """The same chunk as T deltanet_step dispatches, states carried: the gates come from f32
    rows that pick ba's entries exactly (identity weights, input = the token's ba row, zero-padded
    to one 32-value block)."""
    Hv, D = state.shape[:2]
    w_ba = np.eye(2 * Hv, 32, dtype=np.float32).reshape(-1).view(np.uint8)
    ring, outs = x["conv_state"], []
    for i in range(T):
        xn = np.zeros(32, np.float32)
        xn[:2 * Hv] = x["ba"][i]
        given = dict(mix=x["mix"][i], conv_w=x["conv_w"], conv_state=ring, z=x["z"][i], w_ba=w_ba, qtype="f32",
                     **normed(xn), ssm_a=x["ssm_a"], dt_bias=x["dt_bias"], norm_w=x["norm_w"])
        s = step(backend, request, given, state, pos + i, Hk, wg, sg)
        ring, state = s["conv_state"].reshape(ring.shape), s["state"].reshape(state.shape)
        outs.append(s["out"])
    return np.stack(outs), state, ring


PREFILL_POSITIONS = [0, 1, 3, 5, 1001, 2**32 - 16]  # an empty ring, one filling, wrapped, far out, near the u32 end
LAVAPIPE_PREFILL_LAYOUTS = [(16, 32), (32, 64)]  # (D, WG): several rows per invocation; whole Q8_1 blocks


@pytest.mark.parametrize("backend", BACKENDS)
@given(hk=st.integers(1, 2), T=st.integers(1, 11), d=st.sampled_from([8, 16, 24, 32]), rp_log=st.integers(0, 4),
       sg_pick=st.integers(0, 3), layout=st.sampled_from(LAVAPIPE_PREFILL_LAYOUTS), kc=st.integers(1, 5),
       pos=st.sampled_from(PREFILL_POSITIONS), q8=st.booleans(), extra=st.integers(0, 2),
       state_scale=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 99))
def test_prefill(backend, request, hk, T, d, rp_log, sg_pick, layout, kc, pos, q8, extra, state_scale, seed):
    """A chunk of T tokens (1, odd, more than the conv's taps) against the float64 reference and
    against T deltanet_step dispatches (out rows, state, ring): 2·n_k_heads value heads, so two
    workgroups read each key head's q and k; rows past t (NaN) neither read nor written."""
    sg = subgroup(backend, request, sg_pick)
    if backend == "interp":
        rp = 2 ** rp_log
        wg = d // 4 * rp
        assume(d % rp == 0 and wg % sg == 0 and wg % 8 == 0)
    else:
        (d, wg), kc = layout, 4
    q8 = q8 and d % 32 == 0
    rng = np.random.default_rng(seed)
    hv = 2 * hk
    x = prefill_inputs(rng, hk, hv, d, T, kc, extra)
    state = (rng.standard_normal((hv, d, d)) * state_scale).astype(np.float32)
    got = prefill(backend, request, x, state, pos, hk, wg, sg, q8, T)
    check_prefill(got, x, state, pos, hk, T)
    out, want_state, want_ring = steps(backend, request, x, state, pos, hk, wg, sg, T)
    np.testing.assert_array_equal(got["conv_state"].reshape(want_ring.shape), want_ring)
    np.testing.assert_allclose(got["state"].reshape(want_state.shape), want_state, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["out"].reshape(-1, hv * d)[:T], out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_chunks_then_decode(backend, request):
    """A prompt from zero states in chunks of 1 (at p0 = 0), 5 and 2 (starting on rings the earlier
    chunks filled), then decode steps: every output row, the final delta state and ring against
    the model reference (conv over the last 4 inputs with zeros before the first, l2norm,
    deltanet_recurrent, gated rmsnorm) run over the whole sequence."""
    rng = np.random.default_rng(11)
    Hk, Hv, D, KC, wg = 2, 4, 32, 4, 64
    C = (2 * Hk + Hv) * D
    sg = subgroup(backend, request, 2)
    x = prefill_inputs(rng, Hk, Hv, D, 10)
    ring, state = np.zeros((KC, C), np.float32), np.zeros((Hv, D, D), np.float32)
    outs, pos = [], 0
    for T in (1, 5, 2):
        chunk = dict(x, mix=x["mix"][pos:pos + T], z=x["z"][pos:pos + T], ba=x["ba"][pos:pos + T], conv_state=ring)
        got = prefill(backend, request, chunk, state, pos, Hk, wg, sg, True)
        ring, state = got["conv_state"].reshape(KC, C), got["state"].reshape(Hv, D, D)
        outs.append(got["out"].reshape(T, -1))
        pos += T
    tail = dict(x, mix=x["mix"][pos:], z=x["z"][pos:], ba=x["ba"][pos:], conv_state=ring)
    out, state, ring = steps(backend, request, tail, state, pos, Hk, wg, sg, 10 - pos)
    outs.append(out)

    taps = x["conv_w"].astype(np.float64)
    hist = np.concatenate([np.zeros((KC - 1, C)), x["mix"]])
    mixed = model.silu(sum(hist[j:j + 10] * taps[:, j] for j in range(KC)))
    heads = np.arange(Hv) % Hk
    q = model.l2norm(mixed[:, :Hk * D].reshape(10, Hk, D), EPS)[:, heads]
    k = model.l2norm(mixed[:, Hk * D:2 * Hk * D].reshape(10, Hk, D), EPS)[:, heads]
    v = mixed[:, 2 * Hk * D:].reshape(10, Hv, D)
    b, a = x["ba"][:, :Hv].astype(np.float64), x["ba"][:, Hv:].astype(np.float64)
    ref_S = np.zeros((Hv, D, D))
    o = model.deltanet_recurrent(q, k, v, x["ssm_a"] * model.softplus(a + x["dt_bias"]), model.sigmoid(b), ref_S)
    expect = model.rmsnorm(o, x["norm_w"], EPS) * model.silu(x["z"].reshape(10, Hv, D))
    np.testing.assert_allclose(np.concatenate(outs).reshape(10, Hv, D), expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state, ref_S, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ring, x["mix"][[8, 9, 6, 7]])  # slot p % 4 holds position p's input


def test_prefill_example():
    """The example the tuner and the benches use (a wrapped ring, D = 128) agrees with its reference
    in the interpreter, Q8 on and off."""
    from types import SimpleNamespace

    for q8 in (False, True):
        use = SimpleNamespace(fixed=dict(D=128, KC=4, Q8=q8), sizes=dict(n_k_heads=1, v_heads=2, t=3, eps=EPS))
        ex = dn.deltanet_prefill.make_example(use, np.random.default_rng(0), True)
        variant = dn.deltanet_prefill.specialize(D=128, KC=4, WG=256, Q8=q8, SG=32)
        args = {n: v for n, v in ex.args.items() if n != "v_heads"}
        got = variant.interpret(ex.args["v_heads"], **args)
        for name, (want, tol) in ex.expect(variant.params).items():
            if name == "od":  # the scales only; s is NaN in the reference
                np.testing.assert_allclose(got[name][::2], want[::2], rtol=tol)
            else:
                np.testing.assert_allclose(got[name], want, rtol=tol, atol=tol)
