"""The MoE router (the residual stream normed, in f32 and Q8_1; router logits of it, then the
top-k experts and their weights picked by the workgroup that finishes last, and the shared
expert's gate, its last logit) against numpy, in the interpreter (every subgroup size) and on
lavapipe (its own): normed input and logits to rounding; expert ids exactly (ties to the lower
expert) and weights to rounding, from the logits the kernel wrote; the arrival count back at 0.
A chunk of T tokens: routing rows and grouping the pairs by expert exactly, the grouped gate·up
and down products per pair, the combine into the residual, and the whole chain against the
routed block in numpy (moe.moe_block_ref), with experts that get no token."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zdsl
from zdsl.kernels import moe
from zdsl.kernels import quant_numpy as F
from zdsl.kernels.norm import rms_norm_ref
from kernel_testing import BACKENDS, assert_q8_1_of, run, subgroup, tile_sizes
from budget import examples

EPS = 1e-6


def router_weights(rng, n, k, qtype, ties):
    """n router rows, then the shared expert's gate as row n (weights.py); with ties, copies of a
    few distinct rows: equal logits, also across the top-k boundary."""
    rows = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    if ties:
        rows = rows[rng.integers(0, max(2, n // 4), n)]
    gate = rng.standard_normal((1, k)).astype(np.float32) * 0.1
    return F.quantize(np.concatenate([rows, gate]), F.QuantType[qtype.upper()]).reshape(-1)


def route(variant, backend, request, w, x, norm_w, n, k, K):
    """Route x; check the normed input the router writes (f32 and Q8_1) against numpy."""
    out = run(variant, backend, request, variant.groups(n_expert=n), w=w, x=x,
              norm_w=norm_w, hn=np.full(k, np.nan, np.float32), xq=np.zeros(k // 4, np.uint32),
              xd=np.full(k // 16, np.nan, np.float32), logits=np.full(n + 1, np.nan, np.float32),
              arrivals=np.zeros(1, np.uint32), ids=np.full(K + 1, 7777, np.uint32), weights=np.full(K + 1, np.nan, np.float32),
              k=k, n_expert=n, eps=EPS)
    hn = rms_norm_ref(x, norm_w, EPS)
    np.testing.assert_allclose(out["hn"], hn, rtol=2e-5, atol=2e-5 * np.abs(hn).max())
    assert_q8_1_of(out["xq"], out["xd"], out["hn"])
    return out


def inputs(rng, k):
    """(x, norm_w): a residual stream far from unit scale, its norm weight."""
    return rng.standard_normal(k).astype(np.float32) * 7, rng.standard_normal(k).astype(np.float32) * 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(20))
@given(K=st.sampled_from([4, 8, 10]), extra=st.integers(0, 70), kb=st.integers(1, 4), qtype=st.sampled_from(["f32", "q8_0"]),
       ties=st.booleans(), rows=st.sampled_from([1, 2, 4]), nsub=st.sampled_from([1, 2, 4]),
       wg=st.sampled_from([0, 0, 128, 256]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_router(backend, request, K, extra, kb, qtype, ties, rows, nsub, wg, sg_pick, seed):
    rng = np.random.default_rng(seed)
    n, k = K + extra, 32 * kb
    w = router_weights(rng, n, k, qtype, ties)
    x, norm_w = inputs(rng, k)
    v = moe.moe_router.specialize(QTYPE=qtype, K=K, ROWS=rows, NSUB=nsub if wg == 0 else 1, WG=wg,
                                  SG=subgroup(backend, request, sg_pick))
    out = route(v, backend, request, w, x, norm_w, n, k, K)
    _, logits, _, want = moe.moe_router_ref(w, x, norm_w, EPS, qtype, n, k, K)
    np.testing.assert_allclose(out["logits"], logits, rtol=2e-5, atol=2e-5 * np.abs(logits).max())
    ids, weights = moe.route_ref(out["logits"][:n], K)
    np.testing.assert_array_equal(out["ids"], np.append(ids[0], n))  # [K]: the shared expert, appended to the stacks
    np.testing.assert_allclose(out["weights"][:K], weights[0], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(out["weights"][:K].sum(), 1, rtol=1e-5)
    np.testing.assert_allclose(out["weights"][K], 1 / (1 + np.exp(-np.float64(out["logits"][n]))), rtol=1e-6)
    np.testing.assert_allclose(out["weights"][K], want[K], rtol=1e-5)  # the shared expert's gate
    assert out["arrivals"][0] == 0


def test_router_twice_in_one_sequence(device):
    """Two tokens routed back to back in one command buffer: the second dispatch finds the count
    the first left at 0 and picks its own experts."""
    rng = np.random.default_rng(3)
    n, k, K = 61, 256, 8
    w = router_weights(rng, n, k, "f32", ties=False)
    _, norm_w = inputs(rng, k)
    xs = [inputs(rng, k)[0] for _ in range(2)]
    v = moe.moe_router.specialize(K=K, ROWS=2, SG=device.info.subgroup_size)
    up = lambda a, name: device.upload(np.ascontiguousarray(a), name=name)  # noqa: E731
    shared = dict(w=up(w, "w"), norm_w=up(norm_w, "norm_w"),
                  arrivals=up(np.zeros(1, np.uint32), "arrivals"), hn=up(np.zeros(k, np.float32), "hn"),
                  xq=up(np.zeros(k // 4, np.uint32), "xq"), xd=up(np.zeros(k // 16, np.float32), "xd"))
    own = [dict(x=up(x, "x"), logits=up(np.zeros(n + 1, np.float32), "logits"), ids=up(np.zeros(K + 1, np.uint32), "ids"),
                weights=up(np.zeros(K + 1, np.float32), "weights")) for x in xs]
    try:
        seq = device.sequence()
        for bufs in own:
            v.dispatch(seq, v.groups(n_expert=n), k=k, n_expert=n, eps=EPS, **shared, **bufs)
        seq.run()
        seq.free()
        for x, bufs in zip(xs, own):
            _, want_logits, want_ids, want_weights = moe.moe_router_ref(w, x, norm_w, EPS, "f32", n, k, K)
            np.testing.assert_allclose(bufs["logits"].read(np.float32, (n + 1,)), want_logits, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(bufs["ids"].read(np.uint32, (K + 1,)), want_ids)
            np.testing.assert_allclose(bufs["weights"].read(np.float32, (K + 1,)), want_weights, rtol=1e-5)
        assert shared["arrivals"].read(np.uint32, (1,))[0] == 0
    finally:
        for b in list(shared.values()) + [b for bufs in own for b in bufs.values()]:
            b.free()


def test_router_the_model_shape():
    """256 experts of 2048 f32 weights, 8 used, as Qwen3.5-35B-A3B, with the picks' order
    independent of the reference's: the k largest logits, largest first; the shared expert's
    gate from its row (the last) in float64."""
    rng = np.random.default_rng(7)
    n, k = 256, 2048
    w = rng.standard_normal((n + 1, k), dtype=np.float32) * 0.02
    x, norm_w = inputs(rng, k)
    out = route(moe.moe_router.specialize(K=8, SG=32), "interp", None, w.reshape(-1).view(np.uint8), x, norm_w, n, k, 8)
    hn = rms_norm_ref(x, norm_w, EPS)
    logits = out["logits"][:n]
    np.testing.assert_array_equal(out["ids"], np.append(np.argsort(-logits)[:8], n))
    p = np.exp(logits[out["ids"][:8]] - logits.max())
    np.testing.assert_allclose(out["weights"][:8], p / p.sum(), rtol=1e-5)
    np.testing.assert_allclose(out["weights"][8], 1 / (1 + np.exp(-(w[n].astype(np.float64) @ hn))), rtol=1e-5)


# ---- a chunk of T tokens: route, group by expert, gate·up and down per expert, combine ----

from types import SimpleNamespace  # noqa: E402

from zdsl.autotune.tuner import close  # noqa: E402
from zdsl.kernels import ffn  # noqa: E402
from zdsl.kernels import inputs as kernel_inputs  # noqa: E402
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_values  # noqa: E402
from zdsl.kernels.quant import FORMATS, INT8_FORMATS  # noqa: E402


def chunk_logits(rng, t, n, stride, ties, few):
    """t rows of router logits (stride ≥ n wide); with ties, drawn from a few values (equal
    logits, also across the top-k boundary); with few, experts past the first `few` well
    below the rest (they get no token)."""
    if ties:
        logits = rng.integers(0, 4, (t, stride)).astype(np.float32)
    else:
        logits = rng.standard_normal((t, stride)).astype(np.float32) * 2
    if few:
        logits[:, few:n] -= 100
    return logits


def route_chunk(backend, request, logits, n, K, wg, sg_pick):
    """moe_route_rows then moe_group on `backend`; their outputs checked against numpy."""
    t, stride = logits.shape
    v = moe.moe_route_rows.specialize(K=K, WG=wg, SG=subgroup(backend, request, sg_pick))
    out = run(v, backend, request, v.groups(t=t, n_expert=n), logits=logits.reshape(-1), ids=np.full(t * K, 7777, np.uint32),
              weights=np.full(t * K, np.nan, np.float32), counts=np.zeros(n, np.int32), n_expert=n, stride=stride)
    ids, weights, counts = moe.moe_route_rows_ref(logits, n, K)
    np.testing.assert_array_equal(out["ids"], ids)
    np.testing.assert_allclose(out["weights"], weights, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(out["counts"], counts)
    g = moe.moe_group.specialize(K=K, SG=subgroup(backend, request, sg_pick))
    grouped = run(g, backend, request, g.groups(n_expert=n), ids=out["ids"], counts=out["counts"],
                  offsets=np.full(n + 1, 7777, np.uint32), pairs=np.full(t * K, 7777, np.uint32), t=t, n_expert=n)
    offsets, pairs = moe.moe_group_ref(ids, n)
    np.testing.assert_array_equal(grouped["offsets"], offsets)
    np.testing.assert_array_equal(moe.sorted_within_experts(grouped["offsets"], grouped["pairs"]), pairs)
    assert not grouped["counts"].any()  # back at 0 for the next chunk
    return out["ids"], out["weights"], grouped["offsets"], grouped["pairs"]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(12), deadline=None)
@given(t=st.sampled_from([1, 3, 7, 20]), n=st.integers(8, 16), K=st.integers(2, 4), extra=st.integers(0, 1),
       ties=st.booleans(), few=st.sampled_from([0, 0, 5]), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3),
       seed=st.integers(0, 99))
def test_route_and_group_rows(backend, request, t, n, K, extra, ties, few, wg, sg_pick, seed):
    """Each token's K experts (ties to the lower expert) and weights, the tally, then the pairs
    grouped by expert (offsets exact, each expert's pairs as a set), the tally back at 0."""
    logits = chunk_logits(np.random.default_rng(seed), t, n, n + extra, ties, few)
    route_chunk(backend, request, logits, n, K, wg, sg_pick)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(6), deadline=None)
@given(t=st.sampled_from([1, 6, 40]), n=st.sampled_from([70, 300, 512]), K=st.sampled_from([2, 8]),
       few=st.sampled_from([0, 0, 40]), wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_route_and_group_many_experts(backend, request, t, n, K, few, wg, sg_pick, seed):
    """More experts than a workgroup has invocations (the prefix sum in rounds), up to MAX_EXPERTS."""
    logits = chunk_logits(np.random.default_rng(seed), t, n, n + 1, False, few)
    ids, _, _, _ = route_chunk(backend, request, logits, n, K, wg, sg_pick)
    g = moe.moe_group.specialize(K=K, WG=wg, SG=subgroup(backend, request, sg_pick))
    counts = np.bincount(ids, minlength=n).astype(np.int32)
    out = run(g, backend, request, g.groups(n_expert=n), ids=ids, counts=counts, offsets=np.zeros(n + 1, np.uint32),
              pairs=np.zeros(t * K, np.uint32), t=t, n_expert=n)
    offsets, pairs = moe.moe_group_ref(ids, n)
    np.testing.assert_array_equal(out["offsets"], offsets)
    np.testing.assert_array_equal(moe.sorted_within_experts(out["offsets"], out["pairs"]), pairs)


def grouped_case(rng, t, n, K, few):
    """ids of t tokens routed to K distinct experts each (from the first `few` only, if few),
    and the grouping moe_group makes of them."""
    pool = few or n
    ids = np.concatenate([rng.permutation(pool)[:K] for _ in range(t)]).astype(np.uint32)
    offsets, pairs = moe.moe_group_ref(ids, n)
    return ids, offsets, pairs


PRODUCT_TYPES = ["q4_k", "q8_0", "q6_k", "q5_k", "iq4_xs"]


def own_rows(nsub, sg, qtype, q8):
    """NSUB subgroups with rows of their own where a subgroup is whole blocks, else 1."""
    parts = FORMATS[qtype].iparts if q8 else FORMATS[qtype].parts
    return nsub if sg % parts == 0 else 1


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(6), deadline=None)
@given(qtype=st.sampled_from(PRODUCT_TYPES), q8=st.booleans(), t=st.sampled_from([1, 3, 13]), n=st.integers(8, 12),
       K=st.integers(2, 4), few=st.sampled_from([0, 5]), kb=st.integers(1, 2), m=st.sampled_from([13, 32, 45]),
       rows=st.sampled_from([1, 2]), cols=st.sampled_from([4, 8]), split=st.sampled_from([1, 2]),
       nsub=st.sampled_from([1, 2]), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_gate_up_grouped(backend, request, qtype, q8, t, n, K, few, kb, m, rows, cols, split, nsub, sg_pick, seed):
    """act of every pair: its expert's silu(gate·x) ⊙ (up·x) on its token's row, f32 or Q8_1
    rows; experts without a pair leave nothing behind (act NaN-filled: every pair written once)."""
    rng = np.random.default_rng(seed)
    q8 = q8 and qtype in INT8_FORMATS
    k = 256 * kb
    ids, offsets, pairs = grouped_case(rng, t, n, K, few)
    x = rng.standard_normal(t * k).astype(np.float32)
    xq, xd = q8_1_buffers(x)
    wg, wu = (kernel_inputs.rows(rng, qtype, n * m, k) for _ in range(2))
    sg = subgroup(backend, request, sg_pick)
    v = ffn.moe_gate_up_grouped.specialize(QTYPE=qtype, Q8=q8, SPLIT=split, NSUB=own_rows(nsub, sg, qtype, q8), SG=sg,
                                           **tile_sizes(ffn.moe_gate_up_grouped, backend, ROWS=rows, COLS=cols))
    out = run(v, backend, request, v.groups(m=m, n_expert=n, t=t), wg=wg, wu=wu, offsets=offsets, pairs=pairs, x=x,
              xq=xq, xd=xd, act=np.full(t * K * m, np.nan, np.float32), k=k, m=m, topk=K)
    want = ffn.moe_gate_up_grouped_ref(wg, wu, ids, q8_1_values(xq, xd) if q8 else x, qtype, m, k)
    np.testing.assert_allclose(out["act"], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


GRID_TYPES = ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m"]  # the IQ grid formats (quant.Grid)


# gate and up of different types, as per-tensor mixes may have them: K-quants, IQ grid + IQ4,
# block 32 + 256
MIXED_PAIRS = [("q4_k", "q6_k"), ("iq3_xxs", "iq4_xs"), ("q8_0", "q5_k")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", MIXED_PAIRS)
@pytest.mark.parametrize("q8", [False, True])
def test_gate_up_of_two_types(backend, request, pair, q8):
    """Wg in one type, Wu in another: the decode step's ffn_gate_up (experts by id, the shared
    one among them, and a dense pair) and the prompt's grouped product, each against numpy with
    each matrix dequantized by its own type; Q8_1 rows where both types have an int8 decoder."""
    qg, qu = pair
    if q8 and not (qg in INT8_FORMATS and qu in INT8_FORMATS):
        pytest.skip(f"{qg} or {qu} has no int8 decoder")
    if backend == "lavapipe" and qg in GRID_TYPES:
        pytest.skip("lavapipe's LLVM takes minutes over an IQ grid beside another decoder (the interpreter runs it)")
    rng = np.random.default_rng(MIXED_PAIRS.index(pair))
    t, n, K, m, k = 5, 7, 3, 37, 512
    sg = subgroup(backend, request, MIXED_PAIRS.index(pair))
    wg, wu = kernel_inputs.rows(rng, qg, n * m, k), kernel_inputs.rows(rng, qu, n * m, k)
    x = rng.standard_normal(t * k).astype(np.float32)
    xq, xd = q8_1_buffers(x)
    rows_x = q8_1_values(xq, xd) if q8 else x
    for experts in (True, False):
        ids = rng.integers(0, n, K + 1).astype(np.uint32)
        slots = K + 1 if experts else 1
        v = ffn.ffn_gate_up.specialize(QTYPE=qg, QTYPE_UP=qu, Q8=q8, ROWS=2, EXPERTS=experts, SG=sg)
        got = run(v, backend, request, v.groups(m=m, slots=slots), wg=wg, wu=wu, ids=ids, x=x[:k], xq=xq[:k // 4],
                  xd=xd[:k // 16], act=np.full(slots * m, np.nan, np.float32), k=k, m=m)["act"]
        want = ffn.ffn_gate_up_ref(wg, wu, ids, rows_x[:k], qg, m, k, experts, qu)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    ids, offsets, pairs = grouped_case(rng, t, n, K, 0)
    v = ffn.moe_gate_up_grouped.specialize(QTYPE=qg, QTYPE_UP=qu, Q8=q8, SPLIT=2, NSUB=1, SG=sg,
                                           **tile_sizes(ffn.moe_gate_up_grouped, backend, ROWS=2, COLS=4))
    got = run(v, backend, request, v.groups(m=m, n_expert=n, t=t), wg=wg, wu=wu, offsets=offsets, pairs=pairs, x=x,
              xq=xq, xd=xd, act=np.full(t * K * m, np.nan, np.float32), k=k, m=m, topk=K)["act"]
    want = ffn.moe_gate_up_grouped_ref(wg, wu, ids, rows_x, qg, m, k, qtype_up=qu)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", GRID_TYPES)
def test_grouped_products_of_grid_types(backend, request, qtype):
    """The grouped gate·up and down products in each IQ grid type (their grids in shared memory),
    13 tokens over 9 experts, 45 rows (odd) and COLS 4; on lavapipe one of the two kernels per
    type, alternating (each is a pipeline compile there)."""
    rng = np.random.default_rng(GRID_TYPES.index(qtype))
    t, n, K, m, k = 13, 9, 3, 45, 512
    ids, offsets, pairs = grouped_case(rng, t, n, K, 0)
    sg = subgroup(backend, request, GRID_TYPES.index(qtype))
    kernels = ["gate_up", "down"] if backend == "interp" else [["gate_up", "down"][GRID_TYPES.index(qtype) % 2]]
    if "gate_up" in kernels:
        x = rng.standard_normal(t * k).astype(np.float32)
        wg, wu = (kernel_inputs.rows(rng, qtype, n * m, k) for _ in range(2))
        v = ffn.moe_gate_up_grouped.specialize(QTYPE=qtype, Q8=False, SPLIT=2, NSUB=1, SG=sg,
                                               **tile_sizes(ffn.moe_gate_up_grouped, backend, ROWS=2, COLS=4))
        out = run(v, backend, request, v.groups(m=m, n_expert=n, t=t), wg=wg, wu=wu, offsets=offsets, pairs=pairs,
                  x=x, xq=np.zeros(1, np.uint32), xd=np.zeros(1, np.float32),
                  act=np.full(t * K * m, np.nan, np.float32), k=k, m=m, topk=K)
        want = ffn.moe_gate_up_grouped_ref(wg, wu, ids, x, qtype, m, k)
        np.testing.assert_allclose(out["act"], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    if "down" in kernels:
        act = rng.standard_normal(t * K * k).astype(np.float32)
        w = kernel_inputs.rows(rng, qtype, n * m, k)
        v = ffn.moe_down_grouped.specialize(QTYPE=qtype, SPLIT=1, NSUB=1, SG=sg,
                                            **tile_sizes(ffn.moe_down_grouped, backend, ROWS=1, COLS=4))
        out = run(v, backend, request, v.groups(m=m, n_expert=n, t=t), w=w, offsets=offsets, pairs=pairs, act=act,
                  y=np.full(t * K * m, np.nan, np.float32), k=k, m=m)
        want = ffn.moe_down_grouped_ref(w, ids, act, qtype, m, k)
        np.testing.assert_allclose(out["y"], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(6), deadline=None)
@given(qtype=st.sampled_from(PRODUCT_TYPES), t=st.sampled_from([1, 3, 13]), n=st.integers(8, 12), K=st.integers(2, 4),
       few=st.sampled_from([0, 5]), kb=st.integers(1, 2), m=st.sampled_from([13, 32, 45]), rows=st.sampled_from([1, 2]),
       cols=st.sampled_from([4, 8]), split=st.sampled_from([1, 2]), nsub=st.sampled_from([1, 2]),
       sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_down_grouped(backend, request, qtype, t, n, K, few, kb, m, rows, cols, split, nsub, sg_pick, seed):
    """y of every pair: its expert's down rows times the pair's act row."""
    rng = np.random.default_rng(seed)
    k = 256 * kb
    ids, offsets, pairs = grouped_case(rng, t, n, K, few)
    act = rng.standard_normal(t * K * k).astype(np.float32)
    w = kernel_inputs.rows(rng, qtype, n * m, k)
    sg = subgroup(backend, request, sg_pick)
    v = ffn.moe_down_grouped.specialize(QTYPE=qtype, SPLIT=split, NSUB=own_rows(nsub, sg, qtype, False), SG=sg,
                                        **tile_sizes(ffn.moe_down_grouped, backend, ROWS=rows, COLS=cols))
    out = run(v, backend, request, v.groups(m=m, n_expert=n, t=t), w=w, offsets=offsets, pairs=pairs, act=act,
              y=np.full(t * K * m, np.nan, np.float32), k=k, m=m)
    want = ffn.moe_down_grouped_ref(w, ids, act, qtype, m, k)
    np.testing.assert_allclose(out["y"], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10), deadline=None)
@given(t=st.sampled_from([1, 2, 5]), K=st.integers(2, 4), k4=st.integers(1, 80), shared=st.booleans(),
       wg=st.sampled_from([64, 256]), seed=st.integers(0, 99))
def test_combine_rows(backend, request, t, K, k4, shared, wg, seed):
    """x += the weighted pairs of each token (and the shared expert times its gate)."""
    rng = np.random.default_rng(seed)
    k, n = 4 * k4, 9
    x, y = rng.standard_normal(t * k).astype(np.float32), rng.standard_normal(t * K * k).astype(np.float32)
    weights = rng.uniform(0, 1, t * K).astype(np.float32)
    sh, logits = rng.standard_normal(t * k).astype(np.float32), rng.standard_normal(t * (n + 1)).astype(np.float32)
    v = moe.moe_combine_rows.specialize(SHARED=shared, WG=wg)
    out = run(v, backend, request, v.groups(k=k, t=t), x=x, weights=weights, y=y, shared=sh, logits=logits, k=k,
              topk=K, n_expert=n, stride=n + 1)
    want = moe.moe_combine_rows_ref(x, weights, y, K, sh if shared else None, logits.reshape(t, n + 1)[:, n])
    np.testing.assert_allclose(out["x"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(4), deadline=None)
@given(t=st.sampled_from([1, 5, 13]), n=st.integers(8, 16), K=st.integers(2, 4), few=st.sampled_from([0, 6]),
       types=st.sampled_from([("q4_k", "q6_k", True), ("q8_0", "q8_0", False), ("q6_k", "q4_k", True),
                              ("iq4_xs", "q5_k", False)]),
       shared=st.booleans(), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_moe_chunk_chain(backend, request, t, n, K, few, types, shared, sg_pick, seed):
    """route → group → gate·up → down → combine over a chunk of t tokens equals the whole
    routed block in numpy (moe_block_ref), the shared expert folded in or not."""
    qtype, qdown, q8 = types
    q8 = q8 and qtype in INT8_FORMATS
    rng = np.random.default_rng(seed)
    k, m = 256, 256  # residual width, expert width (the down rows: whole 256-blocks)
    logits = chunk_logits(rng, t, n, n + 1, False, few)
    ids, weights, offsets, pairs = route_chunk(backend, request, logits, n, K, 64, sg_pick)
    h = rng.standard_normal(t * k).astype(np.float32)
    hq, hd = q8_1_buffers(h)
    wg, wu = (kernel_inputs.rows(rng, qtype, n * m, k) for _ in range(2))
    wd = kernel_inputs.rows(rng, qdown, n * k, m)
    sg = subgroup(backend, request, sg_pick)
    gu = ffn.moe_gate_up_grouped.specialize(QTYPE=qtype, Q8=q8, SG=sg,
                                            **tile_sizes(ffn.moe_gate_up_grouped, backend, ROWS=2, COLS=4))
    act = run(gu, backend, request, gu.groups(m=m, n_expert=n, t=t), wg=wg, wu=wu, offsets=offsets, pairs=pairs, x=h,
              xq=hq, xd=hd, act=np.full(t * K * m, np.nan, np.float32), k=k, m=m, topk=K)["act"]
    dn = ffn.moe_down_grouped.specialize(QTYPE=qdown, SG=sg, **tile_sizes(ffn.moe_down_grouped, backend, ROWS=1, COLS=8))
    y = run(dn, backend, request, dn.groups(m=k, n_expert=n, t=t), w=wd, offsets=offsets, pairs=pairs, act=act,
            y=np.full(t * K * k, np.nan, np.float32), k=m, m=k)["y"]
    x = rng.standard_normal(t * k).astype(np.float32)
    sh = rng.standard_normal(t * k).astype(np.float32)
    cb = moe.moe_combine_rows.specialize(SHARED=shared)
    out = run(cb, backend, request, cb.groups(k=k, t=t), x=x, weights=weights, y=y, shared=sh,
              logits=logits.reshape(-1), k=k, topk=K, n_expert=n, stride=n + 1)["x"]
    want = moe.moe_block_ref(logits, q8_1_values(hq, hd) if q8 else h, x, wg, wu, wd, qtype, qdown, n, m, K,
                             sh if shared else None)
    np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3 * np.abs(want - x).max())


def interpret_example(kernel, fixed, sizes, buffers=None):
    """A kernel's check example (what the tuner and benches run) in the interpreter: its grid, its
    outputs and what its reference expects of them."""
    use = SimpleNamespace(fixed=fixed, sizes=sizes, buffers=buffers or {})
    ex = kernel.make_example(use, np.random.default_rng(0), True)
    v = kernel.specialize(**fixed)
    groups = v.groups(**{name: value for name, value in ex.args.items() if np.isscalar(value)})
    params = {p.name for p in kernel.params}
    return groups, v.interpret(groups, **{n: a for n, a in ex.args.items() if n in params}), ex.expect(fixed)


@pytest.mark.parametrize("kernel, fixed, sizes", [
    (moe.moe_route_rows, dict(K=8), dict(n_expert=20, t=7, stride=21)),
    (moe.moe_group, dict(K=8), dict(n_expert=20, t=7)),
    (moe.moe_combine_rows, dict(SHARED=True), dict(k=64, t=4, topk=8, n_expert=20, stride=21)),
    (ffn.moe_gate_up_grouped, dict(QTYPE="q4_k", Q8=True), dict(k=256, m=64, n_expert=20, t=7, topk=8)),
    (ffn.moe_down_grouped, dict(QTYPE="q6_k"), dict(k=256, m=64, n_expert=20, t=7, topk=8)),
])
def test_chunk_examples_check(kernel, fixed, sizes):
    """Each chunk kernel's example (what the tuner and benches run) agrees with its reference in
    the interpreter, on its check case."""
    _, out, expected = interpret_example(kernel, fixed, sizes)
    for name, (want, tol) in expected.items():
        np.testing.assert_allclose(out[name], want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("kernel, fixed, sizes, buffers", [
    (moe.moe_router, dict(QTYPE="f32", K=8), dict(k=256, n_expert=20, eps=EPS), {}),
    (ffn.ffn_gate_up, dict(QTYPE="q4_k", Q8=True, EXPERTS=True), dict(k=256, m=64, slots=9),
     dict(wg=20 * 64 * kernel_inputs.row_bytes("q4_k", 256))),
    (ffn.ffn_gate_up, dict(QTYPE="q5_k", Q8=False, EXPERTS=False), dict(k=256, m=64, slots=1),
     dict(wg=64 * kernel_inputs.row_bytes("q5_k", 256))),
    (ffn.moe_down, dict(QTYPE="q6_k"), dict(k=256, m=64, slots=8),
     dict(w=20 * 64 * kernel_inputs.row_bytes("q6_k", 256))),
    (ffn.moe_down_all, dict(QTYPE="q4_k", QTYPE_SH="", K=8), dict(k=256, m=64),
     dict(w=20 * 64 * kernel_inputs.row_bytes("q4_k", 256))),
    (ffn.moe_down_all, dict(QTYPE="q4_k", QTYPE_SH="q6_k", K=8), dict(k=256, m=64),
     dict(w=20 * 64 * kernel_inputs.row_bytes("q4_k", 256))),
])
def test_step_examples_check_every_row(kernel, fixed, sizes, buffers, rows):
    """The experts' kernels of a step (what `zdsl tune` times and checks) give each of a launch's
    rows (several tokens or streams: the grid's z) its inputs and outputs, and every row agrees
    with the reference in the interpreter: a check of one row would pass a variant that gets the
    others wrong."""
    groups, out, expected = interpret_example(kernel, fixed, {**sizes, "rows": rows}, buffers)
    assert groups[2] == rows
    for name, (want, tol) in expected.items():
        assert len(out[name]) == len(want) and close(out[name], want, tol) is None, name  # NaN: not checked


def test_chunk_routing_sizes_it_cannot_take():
    """Fewer experts than picks, or more experts than moe_group's table: a one-line error at launch."""
    with pytest.raises(zdsl.ZdslError, match="only 3"):
        moe.moe_route_rows.specialize(K=4, SG=8).groups(t=2, n_expert=3)
    with pytest.raises(zdsl.ZdslError, match="at most"):
        moe.moe_group.specialize(K=8, SG=8).groups(t=2, n_expert=moe.MAX_EXPERTS + 1)
