"""The products on matrix units (kernels/mma.py: mul_mm_coop, moe_gate_up_coop, moe_down_coop;
and the f16 activations half_rows makes for them) against numpy, for the weight types each
claims, odd row and token counts, K of one and several steps, experts that receive no token and
experts with more pairs than a tile. The interpreter
runs them everywhere (it models cooperative matrices: tests/test_dsl_matrices.py); a device with
matrix units (ZDSL_TEST_DEVICE=0 on the GPU machine) runs them too; lavapipe has none.

Bounds (S = Σ_k |w_k · x_k| per output, the scale of rounding):
- against numpy with W and X rounded to f16 as the units see them: |y − ref16| ≤ 2⁻¹³ · S (the
  f32 sums in another order, and a weight whose f32 value the kernel and gguf-py round a bit
  apart landing an f16 step away, rarely);
- against the f32 product: |y − ref| ≤ 2⁻¹⁰ · S (two f16 roundings of 2⁻¹¹ each per product);
- the SwiGLU silu(g)·u of two such products: the bound carried through (silu' ≤ 1.1).
"""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.kernels import dmmv, ffn, inputs, matmul, mma
from zdsl.kernels.dmmv import EXPERT_QTYPES
from zdsl.kernels.quant import FORMATS
from kernel_testing import run
from budget import examples

BACKENDS = ["interp", "device"]


def runner(backend, request):
    if backend == "device":
        dev = request.getfixturevalue("device")
        if "coopmat" not in dev.info.features:
            pytest.skip(f"{dev.info.name} has no cooperative matrices")
    return lambda v, groups, **args: run(v, "interp" if backend == "interp" else "lavapipe", request, groups, **args)


E = 2.0 ** -10
STEPS = mma.STEPS  # K per step: whole blocks, and 128 or 64 (part of a block for the K-quants and IQ3_XXS)


def check(y, ref16, ref, scale):
    assert np.all(np.abs(y - ref16) <= E / 8 * scale + 1e-30), np.max(np.abs(y - ref16) / scale)
    assert np.all(np.abs(y - ref) <= E * scale + 1e-30), np.max(np.abs(y - ref) / scale)


def test_a_weight_types_table_counts_against_shared_memory():
    """48 × 128 tiles in K steps of 128 fit the H100's 48 KiB beside Q4_K's decoder, not beside
    IQ3_XXS's 1 KiB grid (the driver fails the pipeline), so no such variant is registered (in
    steps of 64 they fit); the default tiles fit beside every type's table (IQ2_XS's 1 KiB, IQ1's
    4 KiB), C taking A and B's storage."""
    from zdsl.autotune.database import choose

    tiles = dict(BM=48, BN=128, BK=128, TM=1, TN=1)
    assert mma.fits(SimpleNamespace(QTYPE="q4_k", **tiles)) and not mma.fits(SimpleNamespace(QTYPE="iq3_xxs", **tiles))
    assert mma.fits(SimpleNamespace(QTYPE="iq3_xxs", **{**tiles, "BK": 64}))
    info = SimpleNamespace(subgroup_size=32, device_type="discrete-gpu")
    for qtype, bm in (("q4_k", 64), ("iq1_m", 64)):
        v = choose(ffn.moe_down_coop, info, {}, db=EmptyDatabase(), QTYPE=qtype)
        assert v.params["BM"] == bm and mma.fits(SimpleNamespace(**v.params))
    # projections and the experts' products: larger tiles in steps of 128 where the type steps so,
    # whole blocks and the tiles that fit beside them otherwise
    for kernel, qtype, tiles in ((matmul.mul_mm_coop, "q4_k", (48, 64, 128)), (matmul.mul_mm_coop, "iq3_xxs", (48, 64, 128)),
                                 (matmul.mul_mm_coop, "iq4_xs", (32, 48, 0)), (matmul.mul_mm_coop, "iq2_xs", (32, 48, 0)),
                                 (matmul.mul_mm_coop, "iq1_s", (32, 48, 0)), (ffn.moe_down_coop, "q6_k", (64, 32, 128)),
                                 (ffn.moe_down_coop, "mxfp4", (64, 32, 128)), (ffn.moe_down_coop, "iq4_xs", (64, 16, 0)),
                                 (ffn.moe_gate_up_coop, "q4_k", (128, 16, 128)), (ffn.moe_gate_up_coop, "iq4_xs", (64, 16, 0))):
        v = choose(kernel, info, {}, db=EmptyDatabase(), QTYPE=qtype)
        assert (v.params["BM"], v.params["BN"], v.params["BK"]) == tiles and mma.fits(SimpleNamespace(**v.params))


class EmptyDatabase:
    def lookup(self, *args):
        return None


def products(stack, ids, x, k):
    """Each pair's exact product with its token's row, and the rounding scale S."""
    xs = x.reshape(-1, k).astype(np.float64)
    rows = xs[np.arange(len(ids)) // (len(ids) // len(xs))]
    w = stack[ids]
    return np.einsum("jrk,jk->jr", w, rows).reshape(-1), np.einsum("jrk,jk->jr", np.abs(w), np.abs(rows)).reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", list(FORMATS))  # those built ahead (dmmv.QTYPES) and those made on demand
@settings(max_examples=examples(3), deadline=None)
@given(m=st.integers(1, 70), t=st.integers(1, 70), steps=st.integers(1, 2), add=st.booleans(), seed=st.integers(0, 99),
       data=st.data())
def test_mul_mm_coop(backend, request, qtype, m, t, steps, add, seed, data):
    go = runner(backend, request)
    rng = np.random.default_rng(seed)
    k = 256 * steps
    w, x = inputs.rows(rng, qtype, m, k), inputs.normal(rng, t * k)
    y0 = inputs.normal(rng, t * m) if add else np.zeros(t * m, np.float32)
    (bm, bn, tn), bk = data.draw(st.sampled_from(fitting(qtype, [(32, 48, 1), (48, 64, 1), (48, 32, 1), (48, 32, 2),
                                                                  (32, 32, 2), (16, 64, 2), (64, 32, 2)])))
    v = matmul.mul_mm_coop.specialize(QTYPE=qtype, BM=bm, BN=bn, TN=tn, ADD=add, BK=bk)
    y = go(v, v.groups(m=m, t=t), w=w, x=x.astype(np.float16), y=y0.copy(), k=k, m=m, t=t)["y"]
    wf = dmmv.dequant_rows(w, qtype, m, k).astype(np.float64)
    xf = x.reshape(t, k).astype(np.float64)
    base = y0.astype(np.float64) if add else 0.0
    check(y, matmul.mul_mm_coop_ref(w, x, qtype, m, k, y0 if add else None), (xf @ wf.T).reshape(-1) + base,
          (np.abs(xf) @ np.abs(wf).T).reshape(-1))


PARTIAL_STEPS = [(q, bk) for q, f in FORMATS.items() if f.ispan for bk in (32, 64, 128)
                 if bk % f.ispan == 0 and f.block % bk == 0 and bk < f.block]


def test_k_quants_step_through_part_of_a_block():
    assert {q for q, _ in PARTIAL_STEPS} == {"q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq3_xxs"}
    for q, ok in (("q4_k", True), ("q6_k", False), ("q8_0", True), ("iq4_xs", False)):  # Q6_K's int8 parts pair up
        assert mma.fits(SimpleNamespace(QTYPE=q, BM=32, BN=32, BK=64, TM=1, TN=1)) == ok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype, bk", PARTIAL_STEPS)
@settings(max_examples=examples(2), deadline=None)
@given(m=st.integers(1, 40), t=st.integers(1, 40), steps=st.integers(1, 2), seed=st.integers(0, 99))
def test_steps_within_a_block(backend, request, qtype, bk, m, t, steps, seed):
    """Every K step shorter than a block a type allows (its int8 parts' runs), against numpy."""
    go = runner(backend, request)
    rng = np.random.default_rng(seed)
    k = 256 * steps
    w, x = inputs.rows(rng, qtype, m, k), inputs.normal(rng, t * k)
    v = matmul.mul_mm_coop.specialize(QTYPE=qtype, BM=32, BN=32, BK=bk)
    y = go(v, v.groups(m=m, t=t), w=w, x=x.astype(np.float16), y=np.zeros(t * m, np.float32), k=k, m=m, t=t)["y"]
    wf = dmmv.dequant_rows(w, qtype, m, k).astype(np.float64)
    xf = x.reshape(t, k).astype(np.float64)
    check(y, matmul.mul_mm_coop_ref(w, x, qtype, m, k), (xf @ wf.T).reshape(-1), (np.abs(xf) @ np.abs(wf).T).reshape(-1))


SPLIT_TYPES = [q for q, f in FORMATS.items() if f.ipieces > 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", SPLIT_TYPES)
@pytest.mark.parametrize("tiles, pieces", [((32, 16), 1), ((32, 32), 2), ((16, 64), 4)])
@settings(max_examples=examples(2), deadline=None)
@given(m=st.integers(1, 40), t=st.integers(1, 70), seed=st.integers(0, 99))
def test_int8_parts_split_into_pieces(backend, request, qtype, tiles, pieces, m, t, seed):
    """Where a step's int8 parts are fewer than the invocations, each is split into pieces
    (mma.split, Format.int_groups' pieces): the product of every split against numpy."""
    go = runner(backend, request)
    rng = np.random.default_rng(seed)
    bm, bn = tiles
    v = matmul.mul_mm_coop.specialize(QTYPE=qtype, BM=bm, BN=bn, BK=128, TN=1)
    f = FORMATS[qtype]
    assert mma.split(f, bm * 128 * f.iparts // f.block, mma.workgroup(SimpleNamespace(**v.params))) == pieces
    k = 512
    w, x = inputs.rows(rng, qtype, m, k), inputs.normal(rng, t * k)
    y = go(v, v.groups(m=m, t=t), w=w, x=x.astype(np.float16), y=np.zeros(t * m, np.float32), k=k, m=m, t=t)["y"]
    wf = dmmv.dequant_rows(w, qtype, m, k).astype(np.float64)
    xf = x.reshape(t, k).astype(np.float64)
    check(y, matmul.mul_mm_coop_ref(w, x, qtype, m, k), (xf @ wf.T).reshape(-1), (np.abs(xf) @ np.abs(wf).T).reshape(-1))


@pytest.mark.parametrize("backend", ["interp", "lavapipe"])
@settings(max_examples=examples(5), deadline=None)
@given(n4=st.integers(1, 1500), scale=st.sampled_from([1e-6, 1.0, 3e4]), seed=st.integers(0, 99))
def test_half_rows(backend, request, n4, scale, seed):
    """The f16 activations the matrix units read: every value rounded as numpy rounds to f16
    (subnormals and overflow to inf included), over several workgroups and a partial last one."""
    n = 4 * n4
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    v = matmul.half_rows.specialize()
    h = run(v, backend, request, v.groups(n=n), x=x, h=np.zeros(n, np.float16), n=n)["h"]
    with np.errstate(over="ignore"):  # beyond 65,504 is inf in both
        want = x.astype(np.float16)
    assert np.array_equal(h.view(np.uint16), want.view(np.uint16))


def routing(rng, t, K, n_exp):
    """K distinct experts per token, some experts crowded (more pairs than a tile), some empty."""
    hot = rng.permutation(n_exp)[: max(K, n_exp // 2)]
    ids = np.concatenate([rng.choice(hot, K, replace=False) for _ in range(t)])
    counts = np.bincount(ids, minlength=n_exp)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    return ids, offsets, np.argsort(ids, kind="stable").astype(np.uint32)


@pytest.mark.slow  # every expert type through the interpreter: a minute
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", EXPERT_QTYPES)
@settings(max_examples=examples(3), deadline=None)
@given(m=st.integers(1, 40), t=st.integers(1, 40), K=st.integers(1, 4), n_exp=st.integers(4, 9),
       split=st.sampled_from([1, 2]), seed=st.integers(0, 99), data=st.data())
def test_grouped_coop(backend, request, qtype, m, t, K, n_exp, split, seed, data):
    (bm, bn, _), bk = data.draw(st.sampled_from(fitting(qtype, [(32, 16, 1), (32, 32, 1), (64, 16, 1), (64, 32, 1),
                                                                 (128, 16, 1)])))
    grouped_case(runner(backend, request), qtype, m, t, K, n_exp, bm, bn, split, seed, 256, bk)


def fitting(qtype: str, tiles: list) -> list:
    """The (BM, BN, TN) tiles and K steps of STEPS that fit the type (IQ grids take shared memory; a
    step within a block needs the type's int8 parts to run in it)."""
    return [(tile, bk) for tile in tiles for bk in STEPS
            if mma.fits(SimpleNamespace(BM=tile[0], BN=tile[1], BK=bk, TM=1, TN=tile[2], QTYPE=qtype))]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_coop_model_shapes(backend, request):
    """The tiny MoE model's shapes: 16 experts, 4 per token, 256 wide; chunks of 6 and 63 tokens (some
    experts get more pairs than a tile of 32); two K steps."""
    for t, k in ((6, 256), (63, 256), (63, 512)):
        grouped_case(runner(backend, request), "q4_k", 256, t, 4, 16, 64, 16, 1, 5, k)
    grouped_case(runner(backend, request), "q6_k", 256, 63, 4, 16, 64, 32, 1, 5, 512, 128)  # the down's default
    grouped_case(runner(backend, request), "q4_k", 256, 63, 4, 16, 128, 16, 1, 5, 512, 128)  # the gate·up's


def grouped_case(go, qtype, m, t, K, n_exp, bm, bn, split, seed, k, bk=0):
    """Both grouped products with BM × BN tiles (one 16-row tile per subgroup) in K steps of bk."""
    rng = np.random.default_rng(seed)
    ids, offsets, pairs = routing(rng, t, K, n_exp)
    wg, wu = inputs.rows(rng, qtype, n_exp * m, k), inputs.rows(rng, qtype, n_exp * m, k)
    x = inputs.normal(rng, t * k)
    v = ffn.moe_gate_up_coop.specialize(QTYPE=qtype, BM=bm, TM=1, BN=bn, SPLIT=split, BK=bk)
    act = go(v, v.groups(m=m, n_expert=n_exp, t=t), wg=wg, wu=wu, offsets=offsets, pairs=pairs, x=x,
             act=np.zeros(t * K * m, np.float32), k=k, m=m, topk=K)["act"]
    (g, sg), (u, su) = (products(dmmv.dequant_rows(w, qtype, n_exp * m, k).reshape(n_exp, m, k).astype(np.float64),
                                 ids, x, k) for w in (wg, wu))
    with np.errstate(over="ignore"):  # random Q6_K blocks reach |g| beyond exp's range: silu is 0 or g there
        silu = g / (1 + np.exp(-g))
    bound = 1.1 * E * sg * (np.abs(u) + E * su) + (np.abs(silu) + 1.1 * E * sg) * E * su
    assert np.all(np.abs(act - silu * u) <= bound + 1e-30), np.max(np.abs(act - silu * u) / (bound + 1e-30))
    ref16 = ffn.moe_gate_up_coop_ref(wg, wu, ids, x, qtype, m, k)
    assert np.all(np.abs(act - ref16) <= bound / 8 + 1e-30), np.max(np.abs(act - ref16) / (bound + 1e-30))

    a = inputs.normal(rng, t * K * k)
    v = ffn.moe_down_coop.specialize(QTYPE=qtype, BM=bm, TM=1, BN=bn, SPLIT=split, BK=bk)
    y = go(v, v.groups(m=m, n_expert=n_exp, t=t), w=wg, offsets=offsets, pairs=pairs, act=a,
           y=np.zeros(t * K * m, np.float32), k=k, m=m)["y"]
    stack = dmmv.dequant_rows(wg, qtype, n_exp * m, k).reshape(n_exp, m, k).astype(np.float64)
    check(y, ffn.moe_down_coop_ref(wg, ids, a, qtype, m, k), *products(stack, ids, np.repeat(a.reshape(-1, k), 1, 0), k))


def test_tiles_beyond_shared_memory_are_refused():
    """A tile shape whose A, B and C need more shared memory than mma.SHARED_BYTES stops at trace
    time with one line (a device asked for more can lose itself), not at pipeline creation."""
    from zdsl import ZdslError

    with pytest.raises(ZdslError, match=r"64 × 32 × 256 of q4_k need 50,816 bytes of shared memory"):
        matmul.mul_mm_coop.specialize(QTYPE="q4_k", BM=64, TM=2, BN=32, TN=1, BK=256).ir
    assert matmul.mul_mm_coop.specialize(QTYPE="q4_k").ir is not None


@pytest.mark.parametrize("kernel, sizes", [
    (matmul.mul_mm_coop, dict(k=2048, m=8192, t=511)),
    (ffn.moe_gate_up_coop, dict(k=2048, m=512, t=511, n_expert=256, topk=8)),
    (ffn.moe_down_coop, dict(k=512, m=2048, t=511, n_expert=256, topk=8)),
])
def test_traffic_of_the_default_variant(kernel, sizes):
    """What `zdsl tune` and the benches divide by, for the kernels' own variants (the matrix-unit
    gate·up has no Q8 to ask about): at least the weights of the experts a chunk picks (every
    expert here) and the f32 activations once."""
    v = kernel.specialize(QTYPE="q4_k")
    weights = (sizes.get("n_expert", 1) * sizes["m"] * inputs.row_bytes("q4_k", sizes["k"])
               * (2 if kernel is ffn.moe_gate_up_coop else 1))
    assert weights + 4 * sizes["t"] * sizes["k"] <= kernel.bytes_moved(v.params, sizes)
