"""The numpy reference forward: chunked delta-net = recurrent, decode = prefill, and the blocks
against direct textbook formulas. (tests/test_llamacpp.py checks it against llama.cpp.)"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.model.reference import (ReferenceModel, deltanet_chunked, deltanet_recurrent, l2norm,
                                          rmsnorm, rope_neox)

from budget import examples


@pytest.fixture(scope="module", params=["tiny", "tiny-dense"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / f"{request.param}.gguf"
    synth.write(path, request.param, quant="q8_0", seed=3)
    return ReferenceModel(path)


def _inputs(rng, T, H, dk, dv):
    q = l2norm(rng.standard_normal((T, H, dk)), 1e-6)
    k = l2norm(rng.standard_normal((T, H, dk)), 1e-6)
    v = rng.standard_normal((T, H, dv))
    g = -rng.exponential(0.3, (T, H))          # log-decay <= 0
    beta = rng.uniform(0, 1, (T, H))
    S = rng.standard_normal((H, dk, dv)) * 0.1
    return q, k, v, g, beta, S


@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 150), H=st.integers(1, 3), dk=st.sampled_from([4, 16, 32]), dv=st.sampled_from([4, 8, 32]),
       chunk=st.sampled_from([1, 7, 16, 64]), seed=st.integers(0, 2**31))
def test_chunked_deltanet_equals_recurrent(T, H, dk, dv, chunk, seed):
    q, k, v, g, beta, S = _inputs(np.random.default_rng(seed), T, H, dk, dv)
    S1, S2 = S.copy(), S.copy()
    o1 = deltanet_recurrent(q, k, v, g, beta, S1)
    o2 = deltanet_chunked(q, k, v, g, beta, S2, chunk=chunk)
    np.testing.assert_allclose(o2, o1, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(S2, S1, rtol=1e-9, atol=1e-9)


def test_deltanet_recurrent_is_the_delta_rule():
    """One head, written with explicit loops over the matrix entries."""
    rng = np.random.default_rng(0)
    q, k, v, g, beta, S = _inputs(rng, 5, 1, 3, 2)
    S0 = S[0].copy()
    o = deltanet_recurrent(q, k, v, g, beta, S)
    for t in range(5):
        S0 = np.exp(g[t, 0]) * S0
        u = [sum(S0[i, j] * k[t, 0, i] for i in range(3)) for j in range(2)]
        for i in range(3):
            for j in range(2):
                S0[i, j] += k[t, 0, i] * beta[t, 0] * (v[t, 0, j] - u[j])
        expect = [sum(S0[i, j] * q[t, 0, i] for i in range(3)) / np.sqrt(3) for j in range(2)]
        np.testing.assert_allclose(o[t, 0], expect, rtol=1e-12)
    np.testing.assert_allclose(S[0], S0, rtol=1e-12)


def test_rope_neox_rotates_pairs_i_and_i_plus_half():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 16))
    y = rope_neox(x, [0, 5, 9], 8, 100.0)
    np.testing.assert_array_equal(y[0], x[0])                  # position 0: identity
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])      # dims past rope_dims untouched
    p, i = 9, 2
    th = p * 100.0 ** (-2 * i / 8)
    a, b = x[2, 1, i], x[2, 1, i + 4]
    np.testing.assert_allclose([y[2, 1, i], y[2, 1, i + 4]],
                               [a * np.cos(th) - b * np.sin(th), a * np.sin(th) + b * np.cos(th)])
    # relative: <rope(q, m), rope(k, n)> depends only on m - n
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    d1 = (rope_neox(q, [7], 8, 100.0) * rope_neox(k, [3], 8, 100.0)).sum()
    d2 = (rope_neox(q, [14], 8, 100.0) * rope_neox(k, [10], 8, 100.0)).sum()
    np.testing.assert_allclose(d1, d2)


def test_logits_are_finite_and_not_flat(model):
    logits = model.forward(np.arange(0, 1000, 13))
    assert np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 1.0
    assert len(set(logits.argmax(1).tolist())) > 20


def test_decode_after_prompt_equals_one_forward(model):
    toks = np.random.default_rng(5).integers(0, model.hp.vocab, 90)
    full = model.forward(toks)
    state = model.new_state()
    parts = [model.forward(toks[:70], state)]
    parts += [model.forward(toks[t:t + 1], state) for t in range(70, 85)]
    parts.append(model.forward(toks[85:], state))
    assert state.pos == 90
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=2e-4 * np.abs(full).max())


def test_state_copy_branches(model):
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    s = model.new_state()
    model.forward(toks[:5], s)
    fork = s.copy()
    a = model.forward(toks[5:], s)
    b = model.forward(toks[5:], fork)
    np.testing.assert_array_equal(a, b)


def test_trace_and_float64(model, tmp_path):
    trace = {}
    toks = [10, 20, 30, 40]
    l32 = model.forward(toks, trace=trace)
    assert list(trace) == ["embed"] + [f"layer{i}" for i in range(model.hp.n_layers)] + ["h"]
    assert all(v.shape == (4, model.hp.hidden) for v in trace.values())
    last = trace[f"layer{model.hp.n_layers - 1}"]  # h: the last layer's output normed, what the head reads
    np.testing.assert_allclose(trace["h"], rmsnorm(last, model.w("output_norm.weight"), model.hp.eps), rtol=1e-6)
    np.testing.assert_allclose(model.proj(trace["h"], model.file.output_name), l32, rtol=1e-6)
    l64 = ReferenceModel(model.file, dtype=np.float64).forward(toks)
    assert l64.dtype == np.float64
    np.testing.assert_allclose(l32, l64, rtol=0, atol=1e-3)


def test_bad_tokens(model):
    with pytest.raises(ValueError, match="token ids"):
        model.forward([model.hp.vocab])
    assert model.forward([]).shape == (0, model.hp.vocab)


@settings(max_examples=examples(6), deadline=None)
@given(splits=st.lists(st.integers(1, 70), min_size=1, max_size=3), seed=st.integers(0, 2**31))
def test_any_split_into_calls_matches(model, splits, seed):
    toks = np.random.default_rng(seed).integers(0, model.hp.vocab, sum(splits))
    full = model.forward(toks)
    state, parts, at = model.new_state(), [], 0
    for n in splits:
        parts.append(model.forward(toks[at:at + n], state))
        at += n
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=2e-4 * np.abs(full).max())
