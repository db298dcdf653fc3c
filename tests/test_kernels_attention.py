"""Decode attention against numpy in the interpreter (every subgroup size) and on lavapipe (its
own): the prep step (q/k norm, partial NEOX RoPE, f16 KV-cache append at the position read from
the step buffer), the split pass (every split count, empty splits included, every GQA group) and
the gated combine; then several tokens in a row against the model reference's own functions.
The chunk kernels (attn_prep_rows, attn_prefill) against numpy and against the decode kernels run
token by token on the same cache; their examples (what the tuner checks) against their references.

Tolerances: f32 results to ~1e-5 relative; RoPE angles are f32 (|error| ≈ position · 1e-7 rad,
so the prep bound grows with the position); cache entries are f16, compared to one f16 step."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zdsl.kernels import attention as att
from zdsl.errors import ZdslError
from zdsl.kernels.kvcache import KV_FORMATS, hadamard, kv_format
from zdsl.models.qwen35.model import reference as model
from kernel_testing import BACKENDS, assert_example_holds, assert_q8_1_of, run, subgroup
from budget import examples

EPS = 1e-6


def step_buffer(pos):
    return np.array([pos, pos + 1, 0, 0], np.uint32)


def rope_atol(pos, values):
    """What f32 angles cost: about 1.5e-7 · pos radians, times the size of the rotated values."""
    return 2e-6 + 2e-7 * pos * float(np.abs(values).max())


def assert_f16_close(got, want, atol=0.0):
    """Equal to within one f16 step (the kernel and numpy round slightly different f32 values)."""
    got, want = got.astype(np.float32), np.asarray(want).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4 + atol)


def prep(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, rope_base=1e7, wg=64, sg=8,
         kt="f16", vt="f16"):
    n_head, n_kv, d = qg.shape[0], k.shape[0], k.shape[1]
    return run(att.attn_prep.specialize(WG=wg, KT=kt, VT=vt, SG=sg), backend, request, n_head + n_kv, qg=qg, k=k, v=v,
               q_norm=q_norm, k_norm=k_norm, step=step_buffer(pos), q=np.full((n_head, d), np.nan, np.float32),
               k_cache=k_cache, v_cache=v_cache, n_head=n_head, n_kv=n_kv, d=d, rope_dims=rope_dims,
               rope_base=rope_base, eps=EPS)


def decode(backend, request, q, k_cache, v_cache, qg, length, nsplit, sg, *, min_chunk=1, nw=1, u=1, wg=64, r=1,
           kt="f16", vt="f16"):
    """attn_decode then attn_combine; returns (partials, o)."""
    n_head, d = q.shape
    n_kv = k_cache.shape[1]
    step = np.array([length - 1, length, 0, 0], np.uint32)
    part = run(att.attn_decode.specialize(G=n_head // n_kv, D=d, NW=nw, U=u, KT=kt, VT=vt, SG=sg), backend, request, (nsplit, n_kv),
               q=q, k_cache=k_cache, v_cache=v_cache, step=step,
               part=np.full(n_head * nsplit * (d + 2), np.nan, np.float32), n_kv=n_kv, min_chunk=min_chunk)["part"]
    q8 = d % 32 == 0  # o also as Q8_1 where it is whole blocks
    q8_out = dict(oq=np.zeros(n_head * d // 4, np.uint32), od=np.full(n_head * d // 16, np.nan, np.float32)) if q8 else {}
    blocks = d // (4 * att._combine_lanes(d))  # a workgroup per head and block of 32 dims
    out = run(att.attn_combine.specialize(D=d, WG=wg, R=r, Q8=q8, VT=vt, SG=sg), backend, request, (n_head, blocks),
              part=part, qg=qg, step=step, o=np.full((n_head, d), np.nan, np.float32), nsplit=nsplit,
              min_chunk=min_chunk, **q8_out)
    if q8:
        assert_q8_1_of(out["oq"], out["od"], out["o"])
    return part.reshape(n_head, nsplit, d + 2), out["o"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_sequences_attend_in_one_launch(backend, request, kv):
    """A batch's sequences, one token each, in one launch a stage (the grid's z): each at its own
    position (its row of the step values), with its own K and V caches and partials (seq_bytes
    apart, as a batch binds each sequence's own as the pieces of one) and its rows of qg, k, v, q
    and o, leaves what launches of that sequence alone leave, bit for bit."""
    rng = np.random.default_rng(11)
    positions, n_kv, group, d, n_ctx, nsplit = (3, 17, 0), 2, 2, 32, 24, 3
    n, n_head, sg = len(positions), n_kv * group, subgroup(backend, request, 0)
    make = (lambda: random_cache(rng, n_ctx, n_kv, d)) if kv == "f16" else \
        (lambda: quantized_cache(rng, n_ctx, n_kv, d, kv))
    caches = [(make(), make()) for _ in positions]
    qg = rng.standard_normal((n, n_head, 2 * d)).astype(np.float32)
    k, v = (rng.standard_normal((n, n_kv, d)).astype(np.float32) for _ in range(2))
    q_norm, k_norm = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    alone = []
    for r, pos in enumerate(positions):
        got = prep(backend, request, qg[r], k[r], v[r], q_norm, k_norm, *caches[r], pos, d, sg=sg, kt=kv, vt=kv)
        kc, vc = got["k_cache"].reshape(caches[r][0].shape), got["v_cache"].reshape(caches[r][1].shape)
        alone.append((got, *decode(backend, request, got["q"].reshape(n_head, d), kc, vc, qg[r], pos + 1, nsplit, sg,
                                   kt=kv, vt=kv)))
    part_bytes = 4 * n_head * nsplit * (d + 2)
    stride = -(-max(caches[0][0].nbytes, part_bytes) // 64) * 64 + 64  # bytes between two sequences'

    def packed(parts, dtype):
        out = np.full(stride * n // np.dtype(dtype).itemsize, np.nan, dtype)
        for r, part in enumerate(parts):
            at = r * stride // out.itemsize
            out[at:at + part.size] = np.asarray(part, dtype).reshape(-1)
        return out

    words = np.zeros((n, 8), np.uint32)
    words[:, 0], words[:, 1] = positions, np.asarray(positions) + 1
    steps = words.reshape(-1)
    got = run(att.attn_prep.specialize(WG=64, KT=kv, VT=kv, SG=sg), backend, request, (n_head + n_kv, 1, n),
              qg=qg, k=k, v=v, q_norm=q_norm, k_norm=k_norm, step=steps,
              q=np.full((n, n_head, d), np.nan, np.float32), k_cache=packed([c[0] for c in caches], np.float16),
              v_cache=packed([c[1] for c in caches], np.float16), n_head=n_head, n_kv=n_kv, d=d, rope_dims=d,
              rope_base=1e7, eps=EPS, seq_bytes=stride)
    q = got["q"].reshape(n, n_head, d)
    part = run(att.attn_decode.specialize(G=group, D=d, NW=1, U=1, KT=kv, VT=kv, SG=sg), backend, request,
               (nsplit, n_kv, n), q=q, k_cache=got["k_cache"], v_cache=got["v_cache"], step=steps,
               part=packed([np.full(part_bytes // 4, np.nan)] * n, np.float32), n_kv=n_kv, min_chunk=1,
               seq_bytes=stride)["part"]
    out = run(att.attn_combine.specialize(D=d, WG=64, R=1, Q8=True, VT=kv, SG=sg), backend, request,
              (n_head, d // (4 * att._combine_lanes(d)), n), part=part, qg=qg, step=steps,
              o=np.full((n, n_head, d), np.nan, np.float32), oq=np.zeros(n * n_head * d // 4, np.uint32),
              od=np.full(n * n_head * d // 16, np.nan, np.float32), nsplit=nsplit, min_chunk=1, seq_bytes=stride)
    halves, floats = stride // 2, stride // 4
    for r, (one, one_part, one_o) in enumerate(alone):
        for name in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(got[name][r * halves:r * halves + one[name].size].view(np.uint16),
                                          one[name].reshape(-1).view(np.uint16))
        np.testing.assert_array_equal(q[r], one["q"].reshape(n_head, d))
        np.testing.assert_array_equal(part[r * floats:r * floats + one_part.size], one_part.reshape(-1))
        np.testing.assert_array_equal(out["o"][r], one_o)


def random_cache(rng, n_ctx, n_kv, d, scale=1.0):
    return (rng.standard_normal((n_ctx, n_kv, d)) * scale).astype(np.float16)


def quantized_cache(rng, n_ctx, n_kv, d, kv_type, scale=1.0):
    """Random rows in a KV format, as the f16 units the kernels declare: (n_ctx, n_kv, row bytes / 2)."""
    rows = (rng.standard_normal((n_ctx, n_kv, d)) * scale).astype(np.float32)
    return KV_FORMATS[kv_type].encode(rows).view(np.float16)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n_kv=st.integers(1, 3), group=st.integers(1, 4), d=st.integers(1, 17).map(lambda n: 4 * n), rope_frac=st.floats(0, 1),
       pos=st.integers(0, 3000), extra=st.integers(0, 2), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       seed=st.integers(0, 99))
def test_prep(backend, request, n_kv, group, d, rope_frac, pos, extra, wg, sg_pick, seed):
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    rope_dims = 2 * int(rope_frac * (d // 2))
    qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
    k, v = rng.standard_normal((n_kv, d), dtype=np.float32), rng.standard_normal((n_kv, d), dtype=np.float32)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    k_cache, v_cache = random_cache(rng, pos + 1 + extra, n_kv, d), random_cache(rng, pos + 1 + extra, n_kv, d)
    out = prep(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, wg=wg,
               sg=subgroup(backend, request, sg_pick))
    q, kc, vc = att.attn_prep_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, 1e7, EPS)
    np.testing.assert_allclose(out["q"], q, rtol=1e-5, atol=rope_atol(pos, q))
    others = np.arange(len(k_cache)) != pos
    np.testing.assert_array_equal(out["k_cache"][others], k_cache[others])  # only row `pos` is written
    np.testing.assert_array_equal(out["v_cache"][others], v_cache[others])
    assert_f16_close(out["k_cache"][pos], kc[pos], rope_atol(pos, kc[pos]))
    np.testing.assert_array_equal(out["v_cache"][pos], vc[pos])


def test_prep_matches_model_reference():
    """Against the model's own rmsnorm and rope_neox (real head sizes, RoPE on 64 of 256 dims)."""
    rng = np.random.default_rng(11)
    n_head, n_kv, d, pos = 16, 2, 256, 777
    qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
    k, v = rng.standard_normal((n_kv, d), dtype=np.float32), rng.standard_normal((n_kv, d), dtype=np.float32)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    cache = np.zeros((pos + 1, n_kv, d), np.float16)
    out = prep("interp", None, qg, k, v, q_norm, k_norm, cache, cache, pos, 64, wg=256, sg=32)
    q = model.rope_neox(model.rmsnorm(qg[None, :, :d], q_norm, EPS), [pos], 64, 1e7)[0]
    kr = model.rope_neox(model.rmsnorm(k[None], k_norm, EPS), [pos], 64, 1e7)[0]
    np.testing.assert_allclose(out["q"], q, rtol=1e-5, atol=rope_atol(pos, q))
    assert_f16_close(out["k_cache"][pos], kr, rope_atol(pos, kr))
    np.testing.assert_array_equal(out["v_cache"][pos], v.astype(np.float16))


@pytest.mark.parametrize("backend", BACKENDS)
@given(n_kv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4, 8]), d=st.sampled_from([4, 8, 16, 32, 64]),
       length=st.integers(1, 80), nsplit=st.integers(1, 12), min_chunk=st.integers(0, 20), extra=st.integers(0, 3),
       scale=st.sampled_from([0.3, 3.0]), nw=st.sampled_from([1, 2, 4]), u=st.integers(1, 3), sg_pick=st.integers(0, 3),
       wg=st.sampled_from([64, 256]), r=st.sampled_from([1, 3]), seed=st.integers(0, 99))
def test_decode_and_combine(backend, request, n_kv, group, d, length, nsplit, min_chunk, extra, scale, nw, u, sg_pick,
                            wg, r, seed):
    """Any length ≥ 1, split count and minimum chunk: splits past the last in use stay empty and are
    skipped; every GQA group, row-cluster and subgroup layout."""
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    q = (rng.standard_normal((n_head, d)) * scale).astype(np.float32)
    qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
    k_cache = random_cache(rng, length + extra, n_kv, d, scale)
    v_cache = random_cache(rng, length + extra, n_kv, d)
    k_cache[length:] = np.float16(np.inf)  # rows past the length must never be read
    part, o = decode(backend, request, q, k_cache, v_cache, qg, length, nsplit, subgroup(backend, request, sg_pick),
                     min_chunk=min_chunk, nw=nw, u=u, wg=wg, r=r)
    used = len(att.split_bounds(length, nsplit, min_chunk))
    np.testing.assert_allclose(part[:, :used], att.attn_decode_ref(q, k_cache, v_cache, length, nsplit, min_chunk)[:, :used],
                               rtol=2e-5, atol=2e-5)
    assert np.isnan(part[:, used:]).all()  # splits not in use write nothing
    np.testing.assert_allclose(o, att.attention_ref(q, k_cache, v_cache, qg, length), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(o, att.attn_combine_ref(part, qg, length, nsplit, min_chunk), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("length,nsplit,min_chunk", [(1, 1, 1), (1, 8, 1), (7, 8, 1), (8, 8, 1), (9, 8, 1), (17, 4, 1),
                                                     (64, 3, 1), (5, 64, 1), (100, 8, 32), (96, 64, 32), (33, 64, 16)])
@pytest.mark.parametrize("d,sg,nw,u", [(16, 8, 1, 1), (16, 64, 2, 3), (64, 8, 4, 2), (64, 64, 1, 4)])
def test_split_edges(length, nsplit, min_chunk, d, sg, nw, u):
    """Fewer rows than splits, exact multiples, one row past a multiple, the minimum chunk deciding;
    several row clusters per subgroup (d = 16 at SG 64: 4 lanes per row) and one."""
    rng = np.random.default_rng(length * 100 + nsplit)
    q, qg = rng.standard_normal((4, d), dtype=np.float32), rng.standard_normal((4, 2 * d), dtype=np.float32)
    k_cache, v_cache = random_cache(rng, length, 2, d), random_cache(rng, length, 2, d)
    part, o = decode("interp", None, q, k_cache, v_cache, qg, length, nsplit, sg, min_chunk=min_chunk, nw=nw, u=u,
                     r=3)
    np.testing.assert_allclose(o, att.attention_ref(q, k_cache, v_cache, qg, length), rtol=2e-5, atol=2e-6)
    assert np.isnan(part[:, len(att.split_bounds(length, nsplit, min_chunk)):]).all()


def test_split_rows_on_the_host():
    """The chunking both kernels share: never more than nsplit chunks, covering every row once;
    every chunk but the last at least min(min_chunk, SHORT_CHUNK) rows, and min_chunk rows once
    the context is long (past SHORT_SPLITS chunks of min_chunk); at short lengths no more than
    SHORT_SPLITS chunks."""
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
    """16 query heads over 2 KV heads of 256 (groups of 8), 8 splits, 300 rows; SG 32 and 64, one
    subgroup with 4 rows in flight and four subgroups with 2."""
    rng = np.random.default_rng(5)
    q, qg = rng.standard_normal((16, 256), dtype=np.float32), rng.standard_normal((16, 512), dtype=np.float32)
    k_cache, v_cache = random_cache(rng, 300, 2, 256), random_cache(rng, 300, 2, 256)
    for sg, nw, u in ((32, 1, 4), (64, 4, 2)):
        _, o = decode("interp", None, q, k_cache, v_cache, qg, 300, 8, sg, min_chunk=16, nw=nw, u=u, wg=256, r=4)
        np.testing.assert_allclose(o, att.attention_ref(q, k_cache, v_cache, qg, 300), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_tokens(backend, request):
    """prep → decode → combine for positions 0..T−1, caches carried, against the model reference's
    rmsnorm / rope_neox / softmax attention run token by token with f32 caches."""
    rng = np.random.default_rng(2)
    n_head, n_kv, d, rope_dims, n_ctx, T, nsplit = 4, 2, 32, 16, 12, 9, 4
    sg = subgroup(backend, request, 0)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    k_cache, v_cache = np.zeros((n_ctx, n_kv, d), np.float16), np.zeros((n_ctx, n_kv, d), np.float16)
    K, V = np.zeros((n_kv, 0, d)), np.zeros((n_kv, 0, d))
    for pos in range(T):
        qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
        k, v = rng.standard_normal((n_kv, d), dtype=np.float32), rng.standard_normal((n_kv, d), dtype=np.float32)
        out = prep(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, rope_dims, sg=sg)
        k_cache, v_cache = out["k_cache"], out["v_cache"]
        _, o = decode(backend, request, out["q"], k_cache, v_cache, qg, pos + 1, nsplit, sg, min_chunk=2, nw=2, u=2)

        q = model.rope_neox(model.rmsnorm(qg[None, :, :d], q_norm, EPS), [pos], rope_dims, 1e7)[0]
        kr = model.rope_neox(model.rmsnorm(k[None], k_norm, EPS), [pos], rope_dims, 1e7)[0]
        K, V = np.concatenate([K, kr[:, None]], 1), np.concatenate([V, v[:, None]], 1)
        Kh, Vh = np.repeat(K, n_head // n_kv, axis=0), np.repeat(V, n_head // n_kv, axis=0)
        scores = np.einsum("hd,htd->ht", q, Kh) / np.sqrt(d)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        expect = np.einsum("ht,htd->hd", p / p.sum(axis=1, keepdims=True), Vh) * model.sigmoid(qg[:, d:])
        np.testing.assert_allclose(o, expect, rtol=2e-3, atol=2e-3)  # f16 cache vs f32 reference


# ---- a chunk of tokens (prefill) -----------------------------------------------------------------

def prep_rows(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, p0, rope_dims, rope_base=1e7, wg=64, sg=8,
              kt="f16", vt="f16"):
    T, n_head, n_kv, d = qg.shape[0], qg.shape[1], k.shape[1], k.shape[2]
    return run(att.attn_prep_rows.specialize(WG=wg, KT=kt, VT=vt, SG=sg), backend, request, (n_head + n_kv, T), qg=qg, k=k, v=v,
               q_norm=q_norm, k_norm=k_norm, step=np.array([p0, p0 + T, 0, 0], np.uint32),
               q=np.full((T, n_head, d), np.nan, np.float32), k_cache=k_cache, v_cache=v_cache, n_head=n_head,
               n_kv=n_kv, d=d, rope_dims=rope_dims, rope_base=rope_base, eps=EPS)


def prefill(backend, request, q, qg, k_cache, v_cache, p0, sg, *, bt=1, nw=1, u=1, q8=False, kt="f16", vt="f16"):
    """attn_prefill of the T queries q (T, n_head, d) at positions p0 ..; returns its outputs, the
    Q8_1 form checked against o."""
    T, n_head, d = q.shape
    n_kv = k_cache.shape[1]
    q8_out = (dict(oq=np.zeros(T * n_head * d // 4, np.uint32), od=np.full(T * n_head * d // 16, np.nan, np.float32))
              if q8 else {})
    out = run(att.attn_prefill.specialize(D=d, G=n_head // n_kv, BT=bt, NW=nw, U=u, Q8=q8, KT=kt, VT=vt, SG=sg),
              backend, request,
              (-(-T // (nw * bt)), n_kv), q=q, qg=qg, k_cache=k_cache, v_cache=v_cache,
              step=np.array([p0, p0 + T, 0, 0], np.uint32), o=np.full((T, n_head, d), np.nan, np.float32),
              n_kv=n_kv, t=T, **q8_out)
    if q8:
        assert_q8_1_of(out["oq"], out["od"], out["o"])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@given(T=st.integers(1, 9), n_kv=st.integers(1, 2), group=st.integers(1, 3), d=st.integers(1, 10).map(lambda n: 4 * n),
       rope_frac=st.floats(0, 1), p0=st.sampled_from([0, 1, 37, 2000]), extra=st.integers(0, 2),
       wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_prep_rows(backend, request, T, n_kv, group, d, rope_frac, p0, extra, wg, sg_pick, seed):
    """T tokens' q rows normed and rotated at p0 + i, cache rows p0 .. p0 + T − 1 written and no other."""
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    rope_dims = 2 * int(rope_frac * (d // 2))
    qg = rng.standard_normal((T, n_head, 2 * d), dtype=np.float32)
    k, v = rng.standard_normal((T, n_kv, d), dtype=np.float32), rng.standard_normal((T, n_kv, d), dtype=np.float32)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    n_ctx = p0 + T + extra
    k_cache, v_cache = random_cache(rng, n_ctx, n_kv, d), random_cache(rng, n_ctx, n_kv, d)
    out = prep_rows(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, p0, rope_dims, wg=wg,
                    sg=subgroup(backend, request, sg_pick))
    q, kc, vc = att.attn_prep_rows_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, p0, rope_dims, 1e7, EPS)
    last = p0 + T - 1
    np.testing.assert_allclose(out["q"], q, rtol=1e-5, atol=rope_atol(last, q))
    mine = (np.arange(n_ctx) >= p0) & (np.arange(n_ctx) <= last)
    np.testing.assert_array_equal(out["k_cache"][~mine], k_cache[~mine])
    np.testing.assert_array_equal(out["v_cache"][~mine], v_cache[~mine])
    assert_f16_close(out["k_cache"][mine], kc[mine], rope_atol(last, kc[mine]))
    np.testing.assert_array_equal(out["v_cache"][mine], vc[mine])


@pytest.mark.parametrize("backend", BACKENDS)
@given(T=st.integers(1, 11), p0=st.sampled_from([0, 0, 1, 5, 40]), n_kv=st.integers(1, 2), extra=st.integers(0, 2),
       scale=st.sampled_from([0.3, 3.0]), bt=st.sampled_from([1, 2]), nw=st.sampled_from([1, 2, 4]),
       u=st.integers(1, 2), q8=st.booleans(), sg_pick=st.integers(0, 3), seed=st.integers(0, 99), data=st.data())
def test_prefill(backend, request, T, p0, n_kv, extra, scale, bt, nw, u, q8, sg_pick, seed, data):
    """Causal, grouped attention of T queries (one or several query blocks, the last cut short)
    against plain masked softmax; rows past p0 + T − 1 hold inf and must never be read. The model's
    head widths and groups in the interpreter; on lavapipe, whose compiler takes seconds to minutes
    for the unrolled code of wide heads at its subgroup of 8, width 32 (one float4 per lane)."""
    interp = backend == "interp"
    d = data.draw(st.sampled_from([32, 64, 128, 256] if interp else [32]), label="d")
    group = data.draw(st.sampled_from([1, 2, 3, 4, 8] if interp else [1, 2, 3, 4]), label="group")
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    q = (rng.standard_normal((T, n_head, d)) * scale).astype(np.float32)
    qg = rng.standard_normal((T, n_head, 2 * d), dtype=np.float32)
    k_cache = random_cache(rng, p0 + T + extra, n_kv, d, scale)
    v_cache = random_cache(rng, p0 + T + extra, n_kv, d)
    k_cache[p0 + T:] = np.float16(np.inf)
    sg = subgroup(backend, request, sg_pick)
    if not att.attn_prefill.constraint(SimpleNamespace(D=d, SG=sg, BT=bt, G=group)):
        bt = 1  # several tokens per subgroup only where their queries fit in registers
    out = prefill(backend, request, q, qg, k_cache, v_cache, p0, sg, bt=bt, nw=nw, u=u, q8=q8)
    np.testing.assert_allclose(out["o"], att.attn_prefill_ref(q, qg, k_cache, v_cache, p0), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,group,p0,T,q8,kt,vt", [(128, 2, 0, 7, True, "f16", "f16"), (256, 2, 13, 5, False, "f16", "f16"),
                                                    (128, 4, 6, 9, True, "f16", "f16"), (128, 8, 21, 4, False, "f16", "f16"),
                                                    (64, 3, 40, 6, True, "q4_0", "q8_0"),
                                                    (128, 2, 9, 5, True, "q3_rot", "q3_rot")])
def test_prefill_matches_decode(backend, request, d, group, p0, T, q8, kt, vt):
    """attn_prep_rows + attn_prefill over a chunk equal T decode steps (attn_prep, attn_decode,
    attn_combine per token) on the same cache, whose rows 0 .. p0 − 1 earlier chunks filled: the
    same q rows, cache rows and o (Q8_1 too)."""
    rng = np.random.default_rng(d + group + p0)
    n_kv, rope_dims, n_ctx = 2, 64, p0 + T + 2
    n_head = n_kv * group
    sg = subgroup(backend, request, 2)
    qg = rng.standard_normal((T, n_head, 2 * d), dtype=np.float32)
    k, v = rng.standard_normal((T, n_kv, d), dtype=np.float32), rng.standard_normal((T, n_kv, d), dtype=np.float32)
    q_norm, k_norm = rng.uniform(0.5, 1.5, d).astype(np.float32), rng.uniform(0.5, 1.5, d).astype(np.float32)
    k_cache, v_cache = quantized_cache(rng, n_ctx, n_kv, d, kt), quantized_cache(rng, n_ctx, n_kv, d, vt)
    k_cache[p0:], v_cache[p0:] = 0, 0
    kv = dict(kt=kt, vt=vt)

    rows = prep_rows(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, p0, rope_dims, sg=sg, **kv)
    chunk = prefill(backend, request, rows["q"], qg, rows["k_cache"], rows["v_cache"], p0, sg, nw=2, q8=q8, **kv)

    kc, vc = k_cache, v_cache
    for i in range(T):
        one = prep(backend, request, qg[i], k[i], v[i], q_norm, k_norm, kc, vc, p0 + i, rope_dims, sg=sg, **kv)
        kc, vc = one["k_cache"], one["v_cache"]
        np.testing.assert_allclose(rows["q"][i], one["q"], rtol=1e-6, atol=1e-6)
        _, o = decode(backend, request, one["q"], kc, vc, qg[i], p0 + i + 1, 4, sg, min_chunk=2, **kv)
        np.testing.assert_allclose(chunk["o"][i], o, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(rows["k_cache"], kc)
    np.testing.assert_array_equal(rows["v_cache"], vc)


def coop_bound(q, k_cache, v_cache, p0):
    """What the units' f16 q and p cost, per output row (T, n_head, 1): a score moves by up to
    2⁻¹¹ · Σ_d |q_d k_d| / √d (q rounded), a weight by that plus 2⁻¹¹ (p rounded), and o, an
    average of V, by the weights' largest relative move times 2 · max |v|; twice that here."""
    T, n_head, d = q.shape
    rows = p0 + T
    K = np.repeat(np.abs(k_cache[:rows].astype(np.float64)), n_head // k_cache.shape[1], axis=1)
    A = np.einsum("thd,shd->ths", np.abs(q.astype(np.float64)), K) / np.sqrt(d)
    A = np.where(np.arange(rows)[None, None, :] <= p0 + np.arange(T)[:, None, None], A, 0).max(axis=2)
    return (2.0 ** -10 * (A + 1) * 2 * np.abs(v_cache[:rows].astype(np.float64)).max())[..., None] + 1e-6


@pytest.mark.parametrize("backend", ["interp", "device"])
@given(T=st.integers(1, 21), p0=st.sampled_from([0, 1, 37, 90]), n_kv=st.integers(1, 2),
       group=st.sampled_from([1, 2, 3, 4, 8]), d=st.sampled_from([32, 64]), nw=st.sampled_from([4, 8]),
       bkv=st.sampled_from([16, 32]), scale=st.sampled_from([0.3, 3.0]),
       rising=st.booleans(), q8=st.booleans(), sg_pick=st.integers(0, 2), seed=st.integers(0, 99),
       kv=st.sampled_from([("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q8_0"), ("f16", "q4_0"), ("q3_rot", "q3_rot")]))
def test_prefill_coop(backend, request, T, p0, n_kv, group, d, nw, bkv, scale, rising, q8, sg_pick, seed, kv):
    """attn_prefill_coop against plain masked softmax within coop_bound, over query blocks cut
    short, odd groups (a token's heads across two workgroups), the cache split between 4 or 8
    subgroups (some with no block to take), every block size and subgroup size, and
    cache rows past p0 + T − 1 read in whole blocks: K and V there huge (weighed 0; finite, as
    the graph's caches are: Vulkan leaves inf and NaN arithmetic undefined). With
    `rising`, keys grow along the cache, so the rows' maxima keep passing TAU and O is rescaled
    (with the rescale left out the outputs are inf and NaN). Caches in each KV format: the
    reference reads them decoded and rounded to f16, as the units take them."""
    if backend == "device" and "coopmat" not in request.getfixturevalue("device").info.features:
        pytest.skip("the device has no cooperative matrices")
    rng = np.random.default_rng(seed)
    n_head, rows = n_kv * group, att.cache_rows(p0 + T)
    q = (rng.standard_normal((T, n_head, d)) * scale).astype(np.float32)
    qg = rng.standard_normal((T, n_head, 2 * d), dtype=np.float32)
    grow = (1 + np.arange(rows) / 8)[:, None, None] if rising else 1.0
    k_cache = (rng.standard_normal((rows, n_kv, d)) * scale * grow).astype(np.float16)
    v_cache = random_cache(rng, rows, n_kv, d)
    huge = 60000 / np.sqrt(32) if kv[0] == "q3_rot" else 60000  # turned, a block's values add up to √32 times
    for cache in (k_cache, v_cache):
        cache[p0 + T:] = np.float16(huge) * np.sign(rng.standard_normal(cache[p0 + T:].shape))
    (k_cache, k_values), (v_cache, v_values) = in_format(k_cache, kv[0], d), in_format(v_cache, kv[1], d, True)
    sg = [16, 32, 64][sg_pick] if backend == "interp" else request.getfixturevalue("device").info.subgroup_size
    assume(att._coop_fits(SimpleNamespace(D=d, SG=sg, BKV=bkv, NW=nw)))  # 8 subgroups of 64-row blocks: too big
    v = att.attn_prefill_coop.specialize(D=d, G=group, NW=nw, BKV=bkv, Q8=q8, KT=kv[0], VT=kv[1], SG=sg)
    q8_out = (dict(oq=np.zeros(T * n_head * d // 4, np.uint32), od=np.full(T * n_head * d // 16, np.nan, np.float32))
              if q8 else {})
    out = run(v, "interp" if backend == "interp" else "lavapipe", request, v.groups(t=T, n_kv=n_kv, ctx=rows), q=q,
              qg=qg, k_cache=k_cache, v_cache=v_cache, step=np.array([p0, p0 + T, 0, 0], np.uint32),
              o=np.full((T, n_head, d), np.nan, np.float32), n_kv=n_kv, t=T, **q8_out)
    want = att.attn_prefill_ref(q, qg, k_values, v_values, p0)
    err = np.abs(out["o"] - want)
    assert np.all(err <= coop_bound(q, k_values, v_values, p0)), err.max()
    if q8:
        assert_q8_1_of(out["oq"], out["od"], out["o"])


def in_format(values, kv_type: str, d: int, turned_back: bool = False):
    """(the cache in `kv_type`, as the f16 units the kernels declare; its values decoded in f16,
    as the units take them, and `turned_back` where the format rotates them: the V o is made of)."""
    fmt = KV_FORMATS[kv_type]
    cache = fmt.encode(values.astype(np.float32)).view(np.float16)
    read = fmt.decode(cache, d).reshape(values.shape).astype(np.float16)
    return cache, fmt.turned(read) if turned_back else read


@pytest.mark.parametrize("backend", ["interp", "device"])
def test_prefill_coop_as_the_graph_runs_it(backend, request):
    """The variant a graph picks for the 35B-A3B's attention (heads of 256 in groups of 8: the
    kernel's defaults, or the device's tuning entry) over a chunk of 37 tokens at depth 100,
    the rows past it huge: the kernel tests draw their own layouts, and an earlier default
    (two subgroups) was wrong on the H100 while every drawn layout they tried passed."""
    from zdsl.autotune.database import choose

    if backend == "device":
        dev = request.getfixturevalue("device")
        if "coopmat" not in dev.info.features:
            pytest.skip("the device has no cooperative matrices")
        v = choose(att.attn_prefill_coop, dev.info, {"t": 37}, D=256, G=8, Q8=True)
    else:
        v = att.attn_prefill_coop.specialize(D=256, G=8, Q8=True)
    rng = np.random.default_rng(5)
    T, p0, n_kv, d = 37, 100, 2, 256
    n_head, rows = 8 * n_kv, att.cache_rows(p0 + T)
    q = rng.standard_normal((T, n_head, d)).astype(np.float32)
    qg = rng.standard_normal((T, n_head, 2 * d)).astype(np.float32)
    k_cache, v_cache = random_cache(rng, rows, n_kv, d), random_cache(rng, rows, n_kv, d)
    for cache in (k_cache, v_cache):
        cache[p0 + T:] = np.float16(60000) * np.sign(rng.standard_normal(cache[p0 + T:].shape))
    out = run(v, "interp" if backend == "interp" else "lavapipe", request, v.groups(t=T, n_kv=n_kv, ctx=rows), q=q,
              qg=qg, k_cache=k_cache, v_cache=v_cache, step=np.array([p0, p0 + T, 0, 0], np.uint32),
              o=np.full((T, n_head, d), np.nan, np.float32), oq=np.zeros(T * n_head * d // 4, np.uint32),
              od=np.full(T * n_head * d // 16, np.nan, np.float32), n_kv=n_kv, t=T)
    err = np.abs(out["o"] - att.attn_prefill_ref(q, qg, k_cache, v_cache, p0))
    assert np.all(err <= coop_bound(q, k_cache, v_cache, p0)), err.max()
    assert_q8_1_of(out["oq"], out["od"], out["o"])


def test_prefill_coop_tiles_fit_shared_memory():
    """The default (D 256: the 35B-A3B's heads, blocks of 32 rows) fits the H100's 48 KiB, and so
    do eight subgroups with blocks of 16; eight with blocks of 32, or blocks of 64, do not, and are
    refused before a device sees them; nor is a workgroup of one or two subgroups offered (wrong
    on the H100), nor heads of other than whole pairs of tiles (the graph asks, and takes
    attn_prefill for those)."""
    fits = lambda **v: att._coop_fits(SimpleNamespace(**{"D": 256, "SG": 32, "NW": 4, "BKV": 32, **v}))
    assert fits() and fits(NW=8, BKV=16) and not fits(NW=8) and not fits(BKV=64) and not fits(NW=2)
    allows = att.attn_prefill_coop.allows  # as the graph asks, for its heads
    assert allows(D=256, G=8) and allows(D=96, G=3) and not allows(D=80, G=8) and not allows(D=256, NW=2)
    with pytest.raises(Exception, match="shared memory"):
        att.attn_prefill_coop.specialize(D=256, G=8, NW=8, BKV=32, SG=32).ir


@pytest.mark.parametrize("kernel,args", [
    (att.attn_prep_rows, dict(q=3 * 16 * 128, qg=3 * 16 * 256, k=3 * 2 * 128, v=3 * 2 * 128, q_norm=128, k_norm=128,
                              step=8, k_cache=40 * 2 * 128 // 2, v_cache=40 * 2 * 128 // 2, n_head=16, n_kv=2, d=128,
                              rope_dims=64, rope_base=1e7, eps=EPS, t=3)),
    (att.attn_prefill, dict(q=6 * 4 * 128, qg=6 * 4 * 256, k_cache=400 * 2 * 128 // 2, v_cache=400 * 2 * 128 // 2,
                            step=8, o=6 * 4 * 128, oq=6 * 4 * 32, od=6 * 4 * 8, n_kv=2, t=6, ctx=400, D=128, G=2,
                            Q8=True)),
    (att.attn_prefill_coop, dict(q=6 * 4 * 128, qg=6 * 4 * 256, k_cache=448 * 2 * 128 // 2, v_cache=448 * 2 * 128 // 2,
                                 step=8, o=6 * 4 * 128, oq=6 * 4 * 32, od=6 * 4 * 8, n_kv=2, t=6, ctx=448, D=128, G=2,
                                 Q8=True, SG=32))])
def test_examples(kernel, args):
    """The inputs the tuner and the benches build for a recorded launch give what its example expects."""
    assert_example_holds(kernel, args)


# ---- quantized KV caches ---------------------------------------------------------------------------

def block_steps(values, kv_type):
    """Each value's quantization step in its format: its block's scale |d| (f16 for f16 values;
    the values as the format stores them, rotated for q3_rot)."""
    fmt = KV_FORMATS[kv_type]
    if fmt.block == 1:
        return np.abs(values) * 2.0 ** -10
    blocks = np.abs(values).reshape(*values.shape[:-1], -1, fmt.block).max(axis=-1, keepdims=True)
    step = blocks / {"q8_0": 127, "q4_0": 8, "q3_rot": 7}[kv_type]
    return np.broadcast_to(step, (*step.shape[:-2], step.shape[-2], fmt.block)).reshape(values.shape)


def assert_rows_written(got, want_values, kv_type, d, atol):
    """Rows as a kernel wrote them, decoded, equal numpy's rows of the same values (gguf's
    rounding) to within one step (the kernel's f32 values and numpy's float64 ones may sit on
    either side of a rounding boundary), and the values to within half a step (a whole one for
    q4_0, whose codes reach 7 steps on the side opposite the block's largest |x|, 8 on its own;
    q3_rot's levels are two steps apart). A rotating format's rows are compared as stored."""
    fmt = KV_FORMATS[kv_type]
    got_values = fmt.decode(got, d).reshape(want_values.shape)
    ours = fmt.decode(fmt.encode(want_values), d).reshape(want_values.shape)
    want_values = fmt.turned(want_values)
    step = block_steps(want_values, kv_type)
    wide = 2.02 if kv_type == "q3_rot" else 1.01  # codes a rounding boundary apart
    assert np.all(np.abs(got_values - ours) <= step * wide + atol)
    error = step * (1.01 if kv_type in ("q4_0", "q3_rot") else 0.51) + atol + 2.0 ** -11 * np.abs(want_values)
    assert np.all(np.abs(got_values - want_values) <= error)


def test_kv_formats_are_gguf_blocks():
    """A quantized row holds GGUF's Q8_0 / Q4_0 blocks (gguf-py's quantize), codes first, scales
    after; sizes per value are the types'."""
    from gguf import GGMLQuantizationType as Q, quants

    x = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)
    for name, qtype, nbytes in (("q8_0", Q.Q8_0, 34), ("q4_0", Q.Q4_0, 18)):
        fmt = KV_FORMATS[name]
        rows = fmt.encode(x)
        assert rows.shape == (5, 3 * nbytes) and fmt.row_bytes(96) == 3 * nbytes
        blocks = quants.quantize(x, qtype).reshape(5, 3, nbytes)
        np.testing.assert_array_equal(rows[:, :3 * (nbytes - 2)], blocks[:, :, 2:].reshape(5, -1))
        np.testing.assert_array_equal(rows[:, 3 * (nbytes - 2):], blocks[:, :, :2].reshape(5, -1))
        np.testing.assert_array_equal(fmt.decode(rows, 96), quants.dequantize(blocks.reshape(5, -1), qtype))


def test_q3_rot_rows():
    """q3_rot against its definition, computed here another way: each block of 32 turned by
    H[i, j] = (−1)^popcount(i & j) / √32 (which undoes itself), rounded to the nearest of the
    levels (2c − 7) · max / 7 under an f16 scale; the codes' low pairs a byte per four values,
    their high bits a nibble per four, the scales last. Heavy-tailed values lose less to it
    than to the same rounding unturned (what the rotation is for)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_t(2, (64, 96)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(32)] for i in range(32)]) / np.sqrt(32)
    y = (x.reshape(64, 3, 32).astype(np.float64) @ h).reshape(64, 96)
    np.testing.assert_allclose(hadamard(x), y, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    np.testing.assert_allclose(hadamard(hadamard(x)), x, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    fmt = KV_FORMATS["q3_rot"]
    rows = fmt.encode(x)
    assert rows.shape == (64, 42) and fmt.row_bytes(96) == 42
    blocks = y.reshape(64, 3, 32)
    top = np.abs(blocks).max(axis=-1, keepdims=True)
    levels = (2 * np.arange(8) - 7) * top[..., None] / 7  # (64, 3, 1, 8)
    codes = np.abs(blocks[..., None] - levels).argmin(axis=-1).reshape(64, 96)
    j = np.arange(96)
    low = (rows[:, j // 4] >> (2 * (j % 4))) & 3
    high = (rows[:, 24 + j // 8] >> (4 * (j // 4 % 2) + j % 4)) & 1
    np.testing.assert_array_equal(low | (high << 2), codes)
    scales = rows[:, 36:].copy().view(np.float16)
    np.testing.assert_array_equal(scales, (top[..., 0] / 7).astype(np.float16))
    want = (2 * codes - 7) * np.repeat(scales.astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(fmt.decode(rows, 96), want)
    np.testing.assert_allclose(fmt.values(rows, 96), hadamard(want), rtol=1e-6, atol=1e-6 * np.abs(want).max())
    unturned = np.abs(x.reshape(64, 3, 32)).max(axis=-1, keepdims=True) / 7
    plain = np.clip(np.floor(x.reshape(64, 3, 32) / (2 * unturned) + 4), 0, 7) * 2 - 7
    assert np.mean((fmt.values(rows, 96) - x) ** 2) < 0.5 * np.mean(((plain * unturned).reshape(64, 96) - x) ** 2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8))
@given(n_kv=st.sampled_from([1, 3]), group=st.sampled_from([1, 2, 8]), d=st.sampled_from([32, 64, 96]),
       kt=st.sampled_from(list(KV_FORMATS)), vt=st.sampled_from(list(KV_FORMATS)), pos=st.integers(0, 300), scale=st.sampled_from([0.01, 30.0]),
       wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_prep_quantized(backend, request, n_kv, group, d, kt, vt, pos, scale, wg, sg_pick, seed):
    """attn_prep writes row `pos` of each KV head in the formats asked (blocks of 32 held by eight
    invocations of any subgroup size, rows of a size only 2-byte aligned at d = 96), no other."""
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
    k, v = rng.standard_normal((n_kv, d), dtype=np.float32), (rng.standard_normal((n_kv, d)) * scale).astype(np.float32)
    q_norm, k_norm = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    k_cache, v_cache = quantized_cache(rng, pos + 2, n_kv, d, kt), quantized_cache(rng, pos + 2, n_kv, d, vt)
    out = prep(backend, request, qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, 32, wg=wg,
               sg=subgroup(backend, request, sg_pick), kt=kt, vt=vt)
    q, _, _ = att.attn_prep_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, 32, 1e7, EPS, kt, vt)
    np.testing.assert_allclose(out["q"], q, rtol=1e-5, atol=rope_atol(pos, q))
    others = np.arange(pos + 2) != pos
    np.testing.assert_array_equal(out["k_cache"][others].view(np.uint8), k_cache[others].view(np.uint8))
    np.testing.assert_array_equal(out["v_cache"][others].view(np.uint8), v_cache[others].view(np.uint8))
    kr = att.rope_ref(att.rmsnorm_ref(k, k_norm, EPS), pos, 32, 1e7)
    assert_rows_written(out["k_cache"][pos], kr, kt, d, rope_atol(pos, kr))
    assert_rows_written(out["v_cache"][pos], v, vt, d, 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8))
@given(n_kv=st.sampled_from([1, 3]), group=st.sampled_from([1, 2, 8]), length=st.integers(1, 90),
       kt=st.sampled_from(list(KV_FORMATS)), vt=st.sampled_from(list(KV_FORMATS)), nsplit=st.integers(1, 6), nw=st.sampled_from([1, 4]),
       u=st.integers(1, 2), scale=st.sampled_from([0.3, 3.0]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99),
       data=st.data())
def test_decode_quantized(backend, request, n_kv, group, length, kt, vt, nsplit, nw, u, scale, sg_pick, seed, data):
    """attn_decode reading K and V in their formats, dequantized in registers, equals softmax
    attention over the decoded caches: any length, every GQA group, lanes reading pieces of a
    block (d = 64 at SG 8: 16 lanes a row, two of them a block) and whole rows of blocks."""
    d = data.draw(st.sampled_from([32, 64, 128] if backend == "interp" else [32]), label="d")
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    q = (rng.standard_normal((n_head, d)) * scale).astype(np.float32)
    qg = rng.standard_normal((n_head, 2 * d), dtype=np.float32)
    k_cache = quantized_cache(rng, length + 1, n_kv, d, kt, scale)
    v_cache = quantized_cache(rng, length + 1, n_kv, d, vt)
    _, o = decode(backend, request, q, k_cache, v_cache, qg, length, nsplit, subgroup(backend, request, sg_pick),
                  min_chunk=4, nw=nw, u=u, kt=kt, vt=vt)
    K = KV_FORMATS[kt].decode(k_cache, d).reshape(length + 1, n_kv, d)  # as read: q is taken as given
    V = KV_FORMATS[vt].values(v_cache, d).reshape(length + 1, n_kv, d)  # o turned back where V is rotated
    np.testing.assert_allclose(o, att.attention_ref(q, K, V, qg, length), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(8))
@given(T=st.integers(1, 9), p0=st.sampled_from([0, 3, 40]), n_kv=st.sampled_from([1, 3]), group=st.sampled_from([1, 2, 8]),
       kt=st.sampled_from(list(KV_FORMATS)), vt=st.sampled_from(list(KV_FORMATS)), nw=st.sampled_from([1, 4]), u=st.integers(1, 2),
       q8=st.booleans(), sg_pick=st.integers(0, 3), seed=st.integers(0, 99), data=st.data())
def test_prefill_quantized(backend, request, T, p0, n_kv, group, kt, vt, nw, u, q8, sg_pick, seed, data):
    """attn_prefill reading quantized caches equals masked softmax over the decoded caches."""
    d = data.draw(st.sampled_from([32, 64] if backend == "interp" else [32]), label="d")
    rng = np.random.default_rng(seed)
    n_head = n_kv * group
    q = rng.standard_normal((T, n_head, d), dtype=np.float32)
    qg = rng.standard_normal((T, n_head, 2 * d), dtype=np.float32)
    k_cache, v_cache = quantized_cache(rng, p0 + T + 1, n_kv, d, kt), quantized_cache(rng, p0 + T + 1, n_kv, d, vt)
    out = prefill(backend, request, q, qg, k_cache, v_cache, p0, subgroup(backend, request, sg_pick), nw=nw, u=u,
                  q8=q8, kt=kt, vt=vt)
    K = KV_FORMATS[kt].decode(k_cache, d).reshape(p0 + T + 1, n_kv, d)
    V = KV_FORMATS[vt].values(v_cache, d).reshape(p0 + T + 1, n_kv, d)
    np.testing.assert_allclose(out["o"], att.attn_prefill_ref(q, qg, K, V, p0), rtol=2e-5, atol=2e-6)


def test_quantized_formats_need_heads_of_whole_blocks():
    with pytest.raises(ZdslError, match="blocks of 32 values.*--kv-type f16"):
        att.attn_decode.specialize(D=16, G=1, NW=1, U=1, KT="q8_0", SG=8).ir
    with pytest.raises(ZdslError, match="unknown KV cache type 'q5_0'"):
        kv_format("q5_0")
