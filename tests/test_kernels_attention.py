"""Decode attention (`attn_decode`: the new token's q/k norm, partial NEOX RoPE and f16 cache
append, the split walk over the cache, the merge of the splits and the output gate, in one
dispatch) against numpy, in the interpreter (every subgroup size) and on lavapipe (its own):
every split count, empty splits included, every GQA group, both output forms; then several
tokens in a row against the model reference's own functions.

Tolerances: f32 results to ~1e-5 relative; RoPE angles are f32 (|error| ≈ position · 1e-7 rad,
so the bound grows with the position); cache entries are f16, compared to one f16 step."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.kernels import attention as att
from zdsl.models.qwen35 import reference as model
from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup

EPS = 1e-6


def rope_atol(pos, values):
    """What f32 angles cost: about 1.5e-7 · pos radians, times the size of the rotated values."""
    return 2e-6 + 2e-7 * pos * float(np.abs(values).max())


def assert_f16_close(got, want, atol=0.0):
    """Equal to within one f16 step (the kernel and numpy round slightly different f32 values)."""
    got, want = got.astype(np.float32), np.asarray(want).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 + atol)


def decode(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, nsplit, sg, *,
           min_chunk=1, nw=1, u=1, r=1, rope_base=1e7, length=None):
    """One attn_decode dispatch for the token at `pos` over rows 0 .. length − 1 (pos + 1 by
    default); returns its buffers, partials shaped (n_head, nsplit, d + 4). Checks that the
    arrival counters are back at 0 and, where o is whole Q8_1 blocks, that oq/od quantize o."""
    n_head, n_kv, d = qg.shape[0], k.shape[0], k.shape[1]
    q8 = d % 32 == 0
    step = np.array([pos, pos + 1 if length is None else length, 0, 0], np.uint32)
    out = run(att.attn_decode.specialize(G=n_head // n_kv, D=d, NW=nw, U=u, R=r, Q8=q8, SG=sg), backend, request,
              (nsplit, n_kv), qg=qg, k=k, v=v, q_norm=q_norm, k_norm=k_norm, step=step, k_cache=k_cache,
              v_cache=v_cache, part=np.full(n_head * nsplit * (d + 4), np.nan, np.float32),
              arrivals=np.zeros(n_kv, np.uint32), o=np.full((n_head, d), np.nan, np.float32),
              oq=np.zeros(max(1, n_head * d // 4), np.uint32), od=np.full(max(2, n_head * d // 16), np.nan, np.float32),
              n_kv=n_kv, min_chunk=min_chunk, rope_dims=rope_dims, rope_base=rope_base, eps=EPS)
    np.testing.assert_array_equal(out["arrivals"], 0)
    if q8:
        assert_q8_1_of(out["oq"], out["od"], out["o"])
    out["part"] = out["part"].reshape(n_head, nsplit, d + 4)
    return out


def random_inputs(rng, n_head, n_kv, d, rows, scale=1.0):
    """qg, k, v, q_norm, k_norm and f16 caches of `rows` rows."""
    return (rng.standard_normal((n_head, 2 * d), dtype=np.float32), rng.standard_normal((n_kv, d), dtype=np.float32),
            rng.standard_normal((n_kv, d), dtype=np.float32), (rng.uniform(0.5, 1.5, d) * scale).astype(np.float32),
            (rng.uniform(0.5, 1.5, d) * scale).astype(np.float32),
            (rng.standard_normal((rows, n_kv, d)) * scale).astype(np.float16),
            rng.standard_normal((rows, n_kv, d)).astype(np.float16))


def check(out, inputs, pos, rope_dims, nsplit, min_chunk, rope_base=1e7, length=None):
    """The new cache row (and only it) as attn_decode_ref writes it; o as attention over the
    rows the kernel wrote (its f16 rounding of the new row, not numpy's); untouched partials of
    the splits not in use."""
    qg, k, v, q_norm, k_norm, k_cache, v_cache = inputs
    _, kc, vc = att.attn_decode_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, rope_base, EPS)
    others = np.arange(len(k_cache)) != pos
    np.testing.assert_array_equal(out["k_cache"][others], k_cache[others])
    np.testing.assert_array_equal(out["v_cache"][others], v_cache[others])
    assert_f16_close(out["k_cache"][pos], kc[pos], rope_atol(pos, kc[pos]))
    np.testing.assert_array_equal(out["v_cache"][pos], vc[pos])
    length = pos + 1 if length is None else length
    q = att.rope_ref(att.rms_norm_ref(qg[:, :k.shape[1]], q_norm, EPS), pos, rope_dims, rope_base)
    o = att.attention_ref(q, out["k_cache"], out["v_cache"], qg, length)
    np.testing.assert_allclose(out["o"], o, rtol=2e-5, atol=2e-6 + rope_atol(pos, o))
    assert np.isnan(out["part"][:, len(att.split_bounds(length, nsplit, min_chunk)):]).all()  # splits not in use


@pytest.mark.parametrize("backend", BACKENDS)
@given(n_kv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 8]), d=st.sampled_from([4, 8, 16, 32, 64]),
       rope_frac=st.floats(0, 1), pos=st.integers(0, 90), nsplit=st.integers(1, 12), min_chunk=st.integers(0, 20),
       extra=st.integers(0, 3), scale=st.sampled_from([0.3, 3.0]), nw=st.sampled_from([1, 2, 4]), u=st.integers(1, 3),
       r=st.sampled_from([1, 3, 4]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_decode(backend, request, n_kv, group, d, rope_frac, pos, nsplit, min_chunk, extra, scale, nw, u, r, sg_pick,
                seed):
    """Any position, split count and minimum chunk: the split holding the new row writes it and
    reads it back; splits past the last in use stay empty; every GQA group, row-cluster and
    subgroup layout; rows past the length (∞ in K) are never read."""
    rng = np.random.default_rng(seed)
    rope_dims = 2 * int(rope_frac * (d // 2))
    inputs = random_inputs(rng, n_kv * group, n_kv, d, pos + 1 + extra, scale)
    inputs[5][pos + 1:] = np.float16(np.inf)
    out = decode(backend, request, *inputs, pos, rope_dims, nsplit, subgroup(backend, request, sg_pick),
                 min_chunk=min_chunk, nw=nw, u=u, r=r)
    check(out, inputs, pos, rope_dims, nsplit, min_chunk)


@pytest.mark.parametrize("pos,nsplit,min_chunk", [(0, 1, 1), (0, 8, 1), (6, 8, 1), (7, 8, 1), (8, 8, 1), (16, 4, 1),
                                                  (63, 3, 1), (4, 64, 1), (99, 8, 32), (95, 64, 32), (32, 64, 16)])
@pytest.mark.parametrize("d,sg,nw,u", [(16, 8, 1, 1), (16, 64, 2, 3), (64, 8, 4, 2), (64, 64, 1, 4)])
def test_split_edges(pos, nsplit, min_chunk, d, sg, nw, u):
    """Fewer rows than splits, exact multiples, one row past a multiple, the minimum chunk deciding;
    several row clusters per subgroup (d = 16 at SG 64: 4 lanes per row) and one."""
    rng = np.random.default_rng(pos * 100 + nsplit)
    inputs = random_inputs(rng, 4, 2, d, pos + 1)
    out = decode("interp", None, *inputs, pos, d // 2, nsplit, sg, min_chunk=min_chunk, nw=nw, u=u, r=3)
    check(out, inputs, pos, d // 2, nsplit, min_chunk)


def test_new_row_inside_the_context():
    """The new token's row need not be the last (step[0] < step[1] − 1): the split holding it
    writes it, and every row up to the length counts."""
    rng = np.random.default_rng(3)
    inputs = random_inputs(rng, 4, 2, 32, 40)
    pos, length = 17, 40
    out = decode("interp", None, *inputs, pos, 16, 5, 8, nw=2, u=2, r=4, length=length)
    check(out, inputs, pos, 16, 5, 1, length=length)


def test_split_rows_on_the_host():
    """The chunking the kernel uses, on the host: never more than nsplit chunks, covering every
    row once; every chunk but the last at least min(min_chunk, SHORT_CHUNK) rows, and min_chunk
    rows once the context is long (past SHORT_SPLITS chunks of min_chunk); at short lengths no
    more than SHORT_SPLITS chunks."""
    for length in range(1, 3000, 7):
        for nsplit in (1, 3, 8, 64, 512):
            for min_chunk in (0, 1, 16, 32, 64):
                bounds = att.split_bounds(length, nsplit, min_chunk)
                assert len(bounds) <= nsplit and bounds[0][0] == 0 and bounds[-1][1] == length
                assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:]))
                sizes = [b - a for a, b in bounds[:-1]]
                assert all(n >= min(min_chunk, att.SHORT_CHUNK) for n in sizes)
                if length >= min_chunk * att.SHORT_SPLITS:
                    assert all(n >= min_chunk for n in sizes)
                elif min_chunk >= att.SHORT_CHUNK:
                    assert len(bounds) <= att.SHORT_SPLITS


def test_split_count_covers_every_length():
    """The grid recorded for a context leaves room for the short-context chunks: a length of L ≤
    512 rows uses ceil(L / 16) splits of 16 whatever the context allocated, and a long one
    chunks of 64 rows, up to 256 of them."""
    for n_ctx in (1, 15, 16, 100, 511, 512, 513, 2048, 4096, 20000):
        grid = att.split_count(n_ctx, 64, 256)
        assert 1 <= grid <= 256
        for length in sorted({1, n_ctx // 3 + 1, n_ctx // 2 + 1, n_ctx}):
            bounds = att.split_bounds(length, grid, 64)
            if length <= 512:
                assert len(bounds) == -(-length // 16)
            elif length >= 2048:  # chunks of 64 rows, or as many as the grid holds
                assert bounds[0][1] == max(64, -(-length // 256))


def test_decode_model_shape():
    """The model's shapes against the model reference's own rmsnorm and rope_neox: 16 query heads
    over 2 KV heads of 256 (groups of 8), RoPE on 64 dims, position 777, 8 splits; SG 32 and 64,
    one subgroup with 4 rows in flight and four subgroups with 2."""
    rng = np.random.default_rng(5)
    pos = 777
    qg, k, v, q_norm, k_norm, k_cache, v_cache = random_inputs(rng, 16, 2, 256, pos + 1)
    q = model.rope_neox(model.rmsnorm(qg[None, :, :256], q_norm, EPS), [pos], 64, 1e7)[0]
    kr = model.rope_neox(model.rmsnorm(k[None], k_norm, EPS), [pos], 64, 1e7)[0]
    for sg, nw, u, r in ((32, 1, 4, 4), (64, 4, 2, 8)):
        out = decode("interp", None, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, 64, 8, sg, min_chunk=16,
                     nw=nw, u=u, r=r)
        assert_f16_close(out["k_cache"][pos], kr, rope_atol(pos, kr))
        np.testing.assert_array_equal(out["v_cache"][pos], v.astype(np.float16))
        np.testing.assert_allclose(out["o"], att.attention_ref(q, out["k_cache"], out["v_cache"], qg, pos + 1),
                                   rtol=2e-5, atol=rope_atol(pos, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_tokens(backend, request):
    """Positions 0..T−1, caches carried, against the model reference's rmsnorm / rope_neox /
    softmax attention run token by token with f32 caches."""
    rng = np.random.default_rng(2)
    n_head, n_kv, d, rope_dims, n_ctx, T, nsplit = 4, 2, 32, 16, 12, 9, 4
    sg = subgroup(backend, request, 0)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    k_cache, v_cache = np.zeros((n_ctx, n_kv, d), np.float16), np.zeros((n_ctx, n_kv, d), np.float16)
    K, V = np.zeros((n_kv, 0, d)), np.zeros((n_kv, 0, d))
    for pos in range(T):
        qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
        k, v = rng.standard_normal((n_kv, d), dtype=np.float32), rng.standard_normal((n_kv, d), dtype=np.float32)
        out = decode(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, nsplit, sg,
                     min_chunk=2, nw=2, u=2, r=2)
        k_cache, v_cache = out["k_cache"], out["v_cache"]

        q = model.rope_neox(model.rmsnorm(qg[None, :, :d], q_norm, EPS), [pos], rope_dims, 1e7)[0]
        kr = model.rope_neox(model.rmsnorm(k[None], k_norm, EPS), [pos], rope_dims, 1e7)[0]
        K, V = np.concatenate([K, kr[:, None]], 1), np.concatenate([V, v[:, None]], 1)
        Kh, Vh = np.repeat(K, n_head // n_kv, axis=0), np.repeat(V, n_head // n_kv, axis=0)
        scores = np.einsum("hd,htd->ht", q, Kh) / np.sqrt(d)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        expect = np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), Vh) * model.sigmoid(qg[:, d:])
        np.testing.assert_allclose(out["o"], expect, rtol=2e-3, atol=2e-3)  # f16 cache vs f32 reference
