"""The matrix-vector family against numpy, for every weight type: dmmv (COLS, ROWS, ADD),
ffn_gate_up (experts chosen by id, and the dense pair), moe_down (several slots), the embedding
lookup, and the int8 path (quantize_q8_1, then dmmv and ffn_gate_up with Q8). Weights are random bytes with small finite
f16 scale fields, or quant_numpy.quantize of Gaussian values; references dequantize with gguf-py.
Shapes: odd row counts (not multiples of ROWS) and K any number of blocks (not a multiple of
what a workgroup reduces per step). Interpreter at every subgroup size and variant; lavapipe at
its own subgroup size (8) with one variant per weight type, the variants rotating over the types
(each variant is a pipeline compile there).

Error bounds (|W|·|x| is the sum of absolute products of a row, the scale of f32 rounding):
- f32 activations: |y − ref| ≤ 2e-6 · |W|·|x| (ref = dequant(W) @ x in float64).
- embed: the dequantized row to 1e-6 relative (exact for all but IQ4_XS's scale arithmetic).
- Q8_1: q equal to ggml's; d and s equal to its before the f16 rounding ggml stores them with.
- dmmv with Q8: |y − dequant(W) @ x̂| ≤ 2e-6 · |W|·|x̂| for x̂ the kernel's own Q8_1 activations, and
  against the f32 activations |y − dequant(W) @ x| ≤ Σ_j |w_j| · d_j / 2 (+ the f32 term): the
  quantization step bound.
"""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf import GGMLQuantizationType as QuantType
from zdsl.kernels import dmmv as dm
from zdsl.kernels import ffn
from zdsl.kernels import embedding as emb
from zdsl.kernels import quant_numpy
from zdsl.kernels import q8_1 as q8
from zdsl.kernels.quant import FORMATS, INT8_FORMATS, Grid
from kernel_testing import BACKENDS, run, subgroup, tile_sizes
from kernel_testing import pick as variant_pick
from budget import THOROUGH, examples

QTYPES = list(FORMATS)
RTOL = 2e-6

FLOATS = ("f32", "f16", "bf16")
SHAPES = [(1, 1), (1, 2), (3, 1), (1, 4), (2, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1),  # (COLS, ROWS)
          (2, 2), (3, 2), (8, 2)]


def pick(backend, qtype, draw, n, salt=0, size=False):
    """An option index: drawn in the interpreter, fixed per weight type on lavapipe (kernel_testing.pick).
    A `size` (a tile's columns or rows, options smallest first) is the smallest for the IQ grid
    types there: their decoders in a big tile cost lavapipe up to a minute of compiling each, and
    the other types cover every size."""
    if size and backend != "interp" and not THOROUGH and isinstance(FORMATS[qtype], Grid):
        return 0
    return variant_pick(backend, QTYPES.index(qtype), draw, n, salt)


def weights(rng, qtype, rows, k, quantizer):
    """rows × k weights as GGUF bytes (rows, row_bytes)."""
    qt = QuantType[qtype.upper()]
    if qtype in FLOATS or (quantizer and qt in quant_numpy.SUPPORTED_QUANT):
        return quant_numpy.quantize(rng.standard_normal((rows, k)).astype(np.float32), qt)
    f = FORMATS[qtype]
    w = rng.integers(0, 256, (rows, k // f.block, f.nbytes), dtype=np.uint8)
    f.finite_scales(rng, w, 0.05)  # the rest of a block may be anything
    return w.reshape(rows, -1)


def block_count(qtype, draw):
    return draw % 3 + 1 if FORMATS[qtype].block == 256 else draw % 6 + 1


def assert_within(y, ref, bound):
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g} (bound there {bound.reshape(-1)[np.argmax(err)]:.3g})"


def abs_dot(w_bytes, qtype, rows, k, x):
    """|W| @ |x| per row for each vector of x (cols × k): the magnitude f32 rounding scales with."""
    return (np.abs(x.reshape(-1, k)) @ np.abs(dm.dequant_rows(w_bytes, qtype, rows, k)).T).reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=examples(20))
@given(m=st.integers(1, 9), nb=st.integers(0, 5), shape=st.integers(0, len(SHAPES) - 1), add=st.booleans(),
       quantizer=st.booleans(), sg_pick=st.integers(0, 3), nsub=st.sampled_from([1, 2, 4]), seed=st.integers(0, 99))
def test_dmmv(backend, request, qtype, m, nb, shape, add, quantizer, sg_pick, nsub, seed):
    rng = np.random.default_rng(seed)
    cols, rows = SHAPES[pick(backend, qtype, shape, len(SHAPES), size=True)]
    add = bool(pick(backend, qtype, add, 2))
    k = FORMATS[qtype].block * block_count(qtype, nb)
    w = weights(rng, qtype, m, k, quantizer)
    x = rng.standard_normal(cols * k).astype(np.float32)
    y0 = rng.standard_normal(cols * m).astype(np.float32)
    sg = subgroup(backend, request, pick(backend, qtype, sg_pick, 4, 1))
    nsub = [1, 2, 4][pick(backend, qtype, [1, 2, 4].index(nsub), 3, 1)]
    nsub = nsub if sg % FORMATS[qtype].parts == 0 else 1  # rows per subgroup need whole blocks in one
    v = dm.dmmv.specialize(QTYPE=qtype, COLS=cols, ROWS=rows, NSUB=nsub, ADD=add, SG=sg)
    y = run(v, backend, request, v.groups(m=m), w=w, x=x, y=y0, k=k, m=m)["y"]
    assert_within(y, dm.dmmv_ref(w, x, qtype, m, k, y0 if add else None), RTOL * abs_dot(w, qtype, m, k, x) + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=examples(10))
@given(m=st.integers(1, 7), nb=st.integers(0, 5), nexp=st.integers(1, 4), slots=st.integers(1, 3),
       experts=st.booleans(), rows=st.integers(0, 2), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_ffn_gate_up(backend, request, qtype, m, nb, nexp, slots, experts, rows, sg_pick, seed):
    rng = np.random.default_rng(seed)
    rows = [1, 2, 4][pick(backend, qtype, rows, 3, size=True)]
    experts = bool(pick(backend, qtype, experts, 2))
    k = FORMATS[qtype].block * block_count(qtype, nb)
    nexp, slots = (nexp, slots) if experts else (1, 1)
    wg, wu = (weights(rng, qtype, nexp * m, k, quantizer=False) for _ in range(2))
    ids = rng.integers(0, nexp, slots).astype(np.uint32)
    x = rng.standard_normal(k).astype(np.float32)
    v = ffn.ffn_gate_up.specialize(QTYPE=qtype, ROWS=rows, EXPERTS=experts, SG=subgroup(backend, request, sg_pick))
    act = run(v, backend, request, v.groups(m=m, slots=slots), wg=wg, wu=wu, ids=ids, x=x,
              act=np.full(slots * m, np.nan, np.float32), k=k, m=m)["act"]
    g = dm.dmmv_ref(wg, x, qtype, nexp * m, k).reshape(nexp, m)[ids if experts else [0]]
    u = dm.dmmv_ref(wu, x, qtype, nexp * m, k).reshape(nexp, m)[ids if experts else [0]]
    ga = abs_dot(wg, qtype, nexp * m, k, x).reshape(nexp, m)[ids if experts else [0]]
    ua = abs_dot(wu, qtype, nexp * m, k, x).reshape(nexp, m)[ids if experts else [0]]
    ref = ffn.ffn_gate_up_ref(wg, wu, ids, x, qtype, m, k, experts)
    # silu(g)·u moves by at most (|u|·1.1 + |silu(g)|)·(the errors of g and u)
    bound = RTOL * ((np.abs(u) * 1.1 + np.abs(g)) * (ga + ua)).reshape(-1) + 1e-6
    assert_within(act, ref, bound)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=examples(10))
@given(m=st.integers(1, 7), nb=st.integers(0, 5), nexp=st.integers(1, 5), slots=st.integers(1, 4),
       add=st.booleans(), rows=st.integers(0, 2), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_moe_down(backend, request, qtype, m, nb, nexp, slots, add, rows, sg_pick, seed):
    rng = np.random.default_rng(seed)
    rows = [1, 2, 4][pick(backend, qtype, rows, 3, size=True)]
    add = bool(pick(backend, qtype, add, 2))
    k = FORMATS[qtype].block * block_count(qtype, nb)
    w = weights(rng, qtype, nexp * m, k, quantizer=True)
    ids = rng.integers(0, nexp, slots).astype(np.uint32)
    wts = rng.uniform(0, 1, slots).astype(np.float32)
    act = rng.standard_normal(slots * k).astype(np.float32)
    y0 = rng.standard_normal(m).astype(np.float32)
    v = ffn.moe_down.specialize(QTYPE=qtype, ROWS=rows, ADD=add, SG=subgroup(backend, request, sg_pick))
    y = run(v, backend, request, v.groups(m=m), w=w, ids=ids, weights=wts, act=act, y=y0, k=k, m=m, slots=slots)["y"]
    mags = abs_dot(w, qtype, nexp * m, k, act).reshape(slots, nexp, m)
    bound = RTOL * sum(wt * mags[s, e] for s, (e, wt) in enumerate(zip(ids, wts))) + 1e-6
    assert_within(y, ffn.moe_down_ref(w, ids, wts, act, qtype, m, k, y0 if add else None), bound)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=examples(8))
@given(vocab=st.integers(1, 6), nb=st.integers(0, 40), quantizer=st.booleans(), seed=st.integers(0, 99))
def test_embed(backend, request, qtype, vocab, nb, quantizer, seed):
    rng = np.random.default_rng(seed)
    k = FORMATS[qtype].block * (nb % (5 if FORMATS[qtype].block == 256 else 40) + 1)
    table = weights(rng, qtype, vocab, k, quantizer)
    rows = 1 + seed % 3  # one token (decode), or a prompt's chunk
    tokens = rng.integers(0, vocab, rows)
    ids = np.concatenate([[vocab - 1 - tokens[0]], tokens]).astype(np.uint32)
    v = emb.embed.specialize(QTYPE=qtype)
    out = run(v, backend, request, v.groups(k=k, rows=rows), table=table,
              ids=ids, out=np.full(rows * k, np.nan, np.float32), k=k, index=1)["out"]
    ref = np.concatenate([emb.embed_ref(table, int(token), qtype, vocab, k) for token in tokens])
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(15))
@given(nb=st.integers(1, 20), spread=st.floats(1e-3, 1e3), ties=st.booleans(), sg_pick=st.integers(0, 3),
       seed=st.integers(0, 99))
def test_quantize_q8_1(backend, request, nb, spread, ties, sg_pick, seed):
    rng = np.random.default_rng(seed)
    n = 32 * nb
    x = (rng.standard_normal(n) * spread).astype(np.float32)
    x[32 * int(rng.integers(0, nb)):][:32] = 0  # a block of zeros: d = 0, q = 0
    if ties:  # max |x| = 127: x / d lands on halves
        x[:32] = np.arange(32) - 15.5
        x[0] = 127
    out = run(q8.quantize_q8_1.specialize(SG=subgroup(backend, request, sg_pick)), backend, request, -(-n // 256),
              x=x, xq=np.zeros(n // 4, np.uint32), xd=np.full(n // 16, np.nan, np.float32), n=n)
    q, d, s = q8.quantize_q8_1_ref(x)
    qg = out["xq"].view(np.int8).reshape(-1, 32)
    np.testing.assert_array_equal(qg, q)
    dg, sg = out["xd"][0::2], out["xd"][1::2]
    np.testing.assert_array_equal(dg.astype("<f2").astype(np.float32), d.reshape(-1))
    np.testing.assert_allclose(sg, dg * qg.sum(axis=1, dtype=np.int32), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", INT8_FORMATS)
@settings(max_examples=examples(15))
@given(m=st.integers(1, 9), nb=st.integers(0, 5), shape=st.integers(0, len(SHAPES) - 1), add=st.booleans(),
       quantizer=st.booleans(), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_dmmv_q8(backend, request, qtype, m, nb, shape, add, quantizer, sg_pick, seed):
    rng = np.random.default_rng(seed)
    cols, rows = SHAPES[pick(backend, qtype, shape, len(SHAPES), size=True)]
    add = bool(pick(backend, qtype, add, 2))
    k = FORMATS[qtype].block * block_count(qtype, nb)
    sg = subgroup(backend, request, sg_pick)
    w = weights(rng, qtype, m, k, quantizer)
    x = (rng.standard_normal(cols * k) * rng.uniform(0.1, 10, cols * k // 32).repeat(32)).astype(np.float32)
    xq8 = run(q8.quantize_q8_1.specialize(SG=sg), backend, request, -(-cols * k // 256), x=x,
              xq=np.zeros(cols * k // 4, np.uint32), xd=np.zeros(cols * k // 16, np.float32), n=cols * k)
    y0 = rng.standard_normal(cols * m).astype(np.float32)
    v = dm.dmmv.specialize(QTYPE=qtype, Q8=True, COLS=cols, ROWS=rows, ADD=add, SG=sg)
    y = run(v, backend, request, v.groups(m=m), w=w, xq=xq8["xq"], xd=xq8["xd"], y=y0, k=k, m=m)["y"]
    xhat = q8.q8_1_values(xq8["xq"], xq8["xd"])
    base = y0 if add else None
    assert_within(y, dm.dmmv_q8_ref(w, xq8["xq"], xq8["xd"], qtype, m, k, base),
                  RTOL * abs_dot(w, qtype, m, k, xhat) + 1e-6)
    step = np.repeat(xq8["xd"][0::2], 32) / 2  # |x − x̂| ≤ d/2 per element
    quant_bound = abs_dot(w, qtype, m, k, step) + RTOL * abs_dot(w, qtype, m, k, x) + 1e-6
    assert_within(y, dm.dmmv_ref(w, x, qtype, m, k, base), quant_bound)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(12))
@given(types=st.tuples(st.sampled_from(INT8_FORMATS), st.sampled_from(INT8_FORMATS)), m=st.integers(1, 9),
       m2=st.integers(1, 9), nb=st.integers(0, 3), rows=st.sampled_from([1, 2, 4]), nsub=st.sampled_from([1, 2, 4]),
       sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_dmmv_q8_pair(backend, request, types, m, m2, nb, rows, nsub, sg_pick, seed):
    """Two projections of one Q8_1 input in one dispatch, each weight in its own type (lavapipe:
    q5_k and q4_k, the pair the decode graph runs, at varied row layouts): each against the f64
    product on the same x̂, row counts that are not multiples of a workgroup's."""
    qtype, qtype2 = types if backend == "interp" else ("q5_k", "q4_k")
    rng = np.random.default_rng(seed)
    block = max(FORMATS[qtype].block, FORMATS[qtype2].block)
    k = block * (nb + 1)
    sg = subgroup(backend, request, sg_pick)
    parts = max(FORMATS[qtype].iparts, FORMATS[qtype2].iparts)
    nsub = nsub if sg % parts == 0 else 1
    w, w2 = weights(rng, qtype, m, k, True), weights(rng, qtype2, m2, k, True)
    xq, xd = q8.q8_1_buffers(rng.standard_normal(k).astype(np.float32))
    v = dm.dmmv_q8_pair.specialize(QTYPE=qtype, QTYPE2=qtype2, ROWS=rows, NSUB=nsub, SG=sg)
    out = run(v, backend, request, v.groups(m=m, m2=m2), w=w, w2=w2, xq=xq, xd=xd,
              y=np.full(m, np.nan, np.float32), y2=np.full(m2, np.nan, np.float32), k=k, m=m, m2=m2)
    want, want2 = dm.dmmv_q8_pair_ref(w, w2, xq, xd, qtype, qtype2, m, m2, k)
    xhat = q8.q8_1_values(xq, xd)
    assert_within(out["y"], want, RTOL * abs_dot(w, qtype, m, k, xhat) + 1e-6)
    assert_within(out["y2"], want2, RTOL * abs_dot(w2, qtype2, m2, k, xhat) + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", INT8_FORMATS)
@settings(max_examples=examples(10))
@given(m=st.integers(1, 7), nb=st.integers(0, 5), nexp=st.integers(1, 4), slots=st.integers(1, 3),
       experts=st.booleans(), rows=st.integers(0, 2), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_ffn_gate_up_q8(backend, request, qtype, m, nb, nexp, slots, experts, rows, sg_pick, seed):
    """Gate·up by expert id over Q8_1 activations: against the f64 product on the kernel's own x̂."""
    rng = np.random.default_rng(seed)
    rows = [1, 2, 4][pick(backend, qtype, rows, 3, size=True)]
    experts = bool(pick(backend, qtype, experts, 2))
    k = FORMATS[qtype].block * block_count(qtype, nb)
    nexp, slots = (nexp, slots) if experts else (1, 1)
    sg = subgroup(backend, request, sg_pick)
    wg, wu = (weights(rng, qtype, nexp * m, k, quantizer=False) for _ in range(2))
    ids = rng.integers(0, nexp, slots).astype(np.uint32)
    x = rng.standard_normal(k).astype(np.float32)
    xq8 = run(q8.quantize_q8_1.specialize(SG=sg), backend, request, -(-k // 256), x=x,
              xq=np.zeros(k // 4, np.uint32), xd=np.zeros(k // 16, np.float32), n=k)
    v = ffn.ffn_gate_up.specialize(QTYPE=qtype, Q8=True, ROWS=rows, EXPERTS=experts, SG=sg)
    act = run(v, backend, request, v.groups(m=m, slots=slots), wg=wg, wu=wu, ids=ids, xq=xq8["xq"], xd=xq8["xd"],
              act=np.full(slots * m, np.nan, np.float32), k=k, m=m)["act"]
    xhat = q8.q8_1_values(xq8["xq"], xq8["xd"])
    sel = ids if experts else [0]
    g = dm.dmmv_ref(wg, xhat, qtype, nexp * m, k).reshape(nexp, m)[sel]
    u = dm.dmmv_ref(wu, xhat, qtype, nexp * m, k).reshape(nexp, m)[sel]
    ga = abs_dot(wg, qtype, nexp * m, k, xhat).reshape(nexp, m)[sel]
    ua = abs_dot(wu, qtype, nexp * m, k, xhat).reshape(nexp, m)[sel]
    ref = ffn.ffn_gate_up_q8_ref(wg, wu, ids, xq8["xq"], xq8["xd"], qtype, m, k, experts)
    bound = RTOL * ((np.abs(u) * 1.1 + np.abs(g)) * (ga + ua)).reshape(-1) + 1e-6
    assert_within(act, ref, bound)


@pytest.mark.slow
def test_bench_kernels_on_lavapipe():
    """`zdsl bench-kernels` end to end on the tiny preset's step: every tunable use timed with the
    variant the device picks, bytes and rates consistent."""
    from click.testing import CliRunner

    from zdsl.bench_kernels import bench_kernels

    out = CliRunner().invoke(bench_kernels, ["--preset", "tiny", "--device", "lavapipe", "--warmup", "1", "--repeats", "3",
                                             "--warm-ms", "10", "--copy-mb", "4", "--cache-mb", "4", "--json"],
                             catch_exceptions=False)
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["copy_gbps"] > 0 and "llvmpipe" in report["device"]
    kernels = {r["kernel"] for r in report["results"]}
    assert {"dmmv", "ffn_gate_up", "moe_down_all", "moe_router", "deltanet_step", "attn_decode"} <= kernels
    assert sum(r["count"] for r in report["results"] if r["kernel"] == "norm_q8_1") == 5
    for r in report["results"]:
        assert r["us"] > 0 and r["bytes"] > 0 and "SG=8" in r["variant"]
        assert r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"] / report["copy_gbps"])
        assert r["back_to_back_us"] > 0 and r["copy_alone_pct"] > 0
        assert r["back_to_back_gbps"] == pytest.approx(r["bytes"] / r["back_to_back_us"] / 1e3)
        assert r["back_to_back_pct_copy"] == pytest.approx(100 * r["back_to_back_gbps"] / report["copy_gbps"])


@pytest.mark.parametrize("args, words", [(["--kernels", "gemm"], "dispatches no kernel gemm"),
                                         (["--preset", "huge"], "unknown preset 'huge'"),
                                         (["--repeats", "0"], "--repeats")])
def test_bench_kernels_bad_input(args, words, capsys):
    from zdsl.cli import main

    assert main(["bench-kernels", "--preset", "tiny", "--device", "lavapipe", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=examples(6))
@given(m=st.integers(1, 9), nb=st.integers(0, 5), t=st.integers(1, 19), cols=st.sampled_from([4, 8]),
       rows=st.sampled_from([1, 4]), add=st.booleans(), int8=st.booleans(), sg_pick=st.integers(0, 3), seed=st.integers(0, 99))
def test_mul_mm_over_a_chunk_of_tokens(backend, request, qtype, m, nb, t, cols, rows, add, int8, sg_pick, seed):
    """mul_mm: t rows (any count; a last tile of COLS tokens partly past the end) times the
    weights, from f32 rows or from Q8_1 rows (checked against the kernel's own Q8_1 values)."""
    from zdsl.kernels import matmul

    rng = np.random.default_rng(seed)
    cols = [4, 8][pick(backend, qtype, [4, 8].index(cols), 2, size=True)]
    rows = [1, 4][pick(backend, qtype, [1, 4].index(rows), 2, 1, size=True)]
    add, sg_pick = bool(pick(backend, qtype, add, 2, 2)), pick(backend, qtype, sg_pick, 4)
    int8 = bool(pick(backend, qtype, int8, 2, 3)) and qtype in INT8_FORMATS
    k = FORMATS[qtype].block * block_count(qtype, nb)
    w = weights(rng, qtype, m, k, quantizer=False)
    x = rng.standard_normal(t * k).astype(np.float32)
    y0 = rng.standard_normal(t * m).astype(np.float32)
    acts = dict(zip(("xq", "xd"), q8.q8_1_buffers(x))) if int8 else {"x": x}
    xv = q8.q8_1_values(acts["xq"], acts["xd"]).astype(np.float32) if int8 else x
    v = matmul.mul_mm.specialize(QTYPE=qtype, Q8=int8, ADD=add, SG=subgroup(backend, request, sg_pick),
                                 **tile_sizes(matmul.mul_mm, backend, COLS=cols, ROWS=rows))
    y = run(v, backend, request, v.groups(m=m, t=t), w=w, **acts, y=y0, k=k, m=m, t=t)["y"]
    assert_within(y, matmul.mul_mm_ref(w, xv, qtype, m, k, y0 if add else None),
                  RTOL * abs_dot(w, qtype, m, k, xv) + 1e-6)
