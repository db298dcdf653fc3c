"""Matrix products for a chunk of tokens: Y[i, r] (+)= Σ_k W[r, k] · X[i, k] for the T rows of X.

The prompt's projections. Workgroup (g, j) owns the ROWS rows of row group g (as dmmv's) and the
COLS tokens j·COLS .. j·COLS + COLS − 1: each weight block it loads serves COLS tokens, so the
weights are read ⌈T / COLS⌉ times per chunk instead of T times (and mostly from L2). The block
machinery, int8 (Q8: X as Q8_1 rows, q8_1.py) and f32, is dmmv.py's. Each activation block a
workgroup loads serves its ROWS rows, so ROWS = 4 by default (a 256-token chunk of the 35B-A3B on
the H100: the projections 57 ms with ROWS = 1, 34 with 4, 44 with 8, where the accumulators crowd
the registers). The next step is tiles staged in shared memory (and cooperative matrices).
"""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, boolean, f16, f32, u8, u32
from zdsl.kernels import dmmv, inputs, mma
from zdsl.kernels.dmmv import NSUBS, QTYPES, Rows, input_bytes, row_groups
from zdsl.kernels.quant import INT8_FORMATS
from zdsl.kernels.reduce import SUBGROUPS


def _fits(v) -> bool:
    return not v.Q8 or v.QTYPE in INT8_FORMATS


def _traffic(v, s) -> int:
    """The weights once per token tile, every activation row once, the outputs (read too with ADD)."""
    tiles = -(-s.t // v.COLS)
    return (tiles * s.m * inputs.row_bytes(v.QTYPE, s.k) + s.t * input_bytes(s.k, v.Q8)
            + 4 * s.t * s.m * (2 if v.ADD else 1))


@zdsl.kernel(workgroup=dmmv.workgroup, subgroup="SG",
             variants={"QTYPE": QTYPES, "Q8": [False, True], "COLS": [4, 8], "ROWS": [1, 4], "SG": SUBGROUPS},
             tune={"NSUB": NSUBS}, where=_fits, key=("k", "m"),
             grid=lambda v, s: (row_groups(v, s.m), -(-s.t // v.COLS)), traffic=_traffic, cpu=dict(COLS=4, ROWS=1))
def mul_mm(w: Buffer[u8], x: Buffer[f32], xq: Buffer[u32], xd: Buffer[f32], y: Buffer[f32], k: u32, m: u32,
           t: u32, ADD: Spec[boolean] = False, QTYPE: Const = "q4_k", Q8: Const = False, COLS: Const = 8,
           ROWS: Const = 4, NSUB: Const = 1, SG: Const = 32, WG: Const = 0):
    """y[i·m + r] (+)= Σ_k W[r, k] · x[i·k + k] for the t rows i of x, given in f32 (x) or, with
    Q8, as Q8_1 rows back to back (xq, xd); ADD accumulates into y (a residual connection). A
    tile's tokens past t load row t − 1 and store nothing."""
    first = zdsl.workgroup_id(1) * COLS
    cols = [zdsl.min(first + c, t - 1) for c in range(COLS)]
    live = [first + c < t for c in range(COLS)]
    dmmv.project(w, x, xq, xd, y, k, m, QTYPE, Q8, Rows(ROWS, NSUB, SG), COLS, ADD, cols, live)


def mul_mm_ref(w_bytes, x, qtype, m, k, y=None):
    """Y = X · dequant(W)ᵀ (+ y), rows of X back to back, in float64."""
    return dmmv.dmmv_ref(w_bytes, x, qtype, m, k, y)


@mul_mm.example
def mul_mm_example(use, rng, check):
    q, q8, add = use.fixed["QTYPE"], use.fixed.get("Q8", False), use.fixed.get("ADD", False)
    k, t = use.sizes["k"], use.sizes["t"]
    m = min(use.sizes["m"], inputs.CHECK_ROWS) if check else use.sizes["m"]
    y = inputs.normal(rng, t * m) if add else np.zeros(t * m, np.float32)
    args = dict(w=inputs.rows(rng, q, m, k), **inputs.activations(rng, t * k, q8), y=y, k=k, m=m, t=t)
    y0 = args["y"].copy() if add else None
    return zdsl.Example(args, lambda p: {"y": (dmmv.project_ref(args, q, m, k, y0), 1e-4)},
                        lambda n: {"w": inputs.copies(args["w"], n)})


@zdsl.kernel(workgroup=256, grid=lambda v, s: -(-s.n // 1024), traffic=lambda v, s: 6 * s.n)
def half_rows(x: Buffer[f32], h: Buffer[f16], n: u32):
    """h = x rounded to f16 (n a multiple of 4): the activations mul_mm_coop reads, made once per
    producer rather than by every row tile of every product that reads them."""
    i = zdsl.global_id()
    with zdsl.if_(i < n // 4):
        h.vec4[i] = x.vec4[i].to(f16.vec(4))


def half_rows_ref(x):
    return np.asarray(x, np.float32).astype(np.float16)


@half_rows.example
def half_rows_example(use, rng, check):
    n = use.sizes["n"]
    args = dict(x=inputs.normal(rng, n), h=np.zeros(n, np.float16), n=n)
    return zdsl.Example(args, lambda p: {"h": (half_rows_ref(args["x"]), 0.0)})


def _coop_traffic(v, s) -> int:
    """The weights once per token tile, the activations (f16) once per row tile, the outputs."""
    return (-(-s.t // v.BN) * s.m * inputs.row_bytes(v.QTYPE, s.k) + -(-s.m // v.BM) * 2 * s.t * s.k
            + 4 * s.t * s.m * (2 if v.ADD else 1))


# Tiles of 48 rows × 64 tokens in steps of 128 where the type steps so (the weights decoded 8
# times for a 512-token chunk, not 11), 32 × 48 in whole blocks otherwise: H100,
# zdsl profile --prompt 511 of the 35B-A3B, the projections 22.2 ms against 25.6 (32 × 96 in
# steps of 128: 24.1). Those 48 × 64 take two token tiles per subgroup: each A tile is read from
# shared memory by two subgroups instead of four (timed alone on the H100: Q5_K 8192 rows
# 239 µs against 256, Q4_K 4096 rows 124.5 against 133). The H100's tuned entries take other tiles
# for most Q4_K uses: 32 × 64 or 64 × 32 in steps of 64 (4,096 rows 123 → 110 µs); 96 or
# 128 tokens a tile win nothing there (the same tune: one use at 96, 108 against 110).
@zdsl.kernel(workgroup=mma.workgroup, subgroup="SG", variants={"QTYPE": QTYPES, "BN": [64, 48, 32], "SG": [32]},
             tune={"TN": [1, 2], "BK": mma.STEPS, "BM": [32, 48, 64]}, where=mma.fits, key=("k", "m"),
             grid=lambda v, s: (-(-s.m // v.BM), -(-s.t // v.BN)), traffic=_coop_traffic)
def mul_mm_coop(w: Buffer[u8], x: Buffer[f16], y: Buffer[f32], k: u32, m: u32, t: u32, ADD: Spec[boolean] = False,
                QTYPE: Const = "q4_k", BM: Const = mma.by_steps(48, 32), BN: Const = mma.by_steps(64, 48),
                BK: Const = mma.by_steps(128, 0), TM: Const = 1, TN: Const = mma.by_steps(2, 1), SG: Const = 32):
    """mul_mm on matrix units (mma.py): y[i·m + r] (+)= Σ_k W[r, k] · x[i·k + k] for the t rows i
    of x (in f16: half_rows), k a multiple of BK. Workgroup (g, j) makes rows g·BM … and tokens
    j·BN …"""
    tiles = mma.Tiles(BM, BN, BK, TM, TN, SG, QTYPE)
    f, ctx, r0, rows = mma.weight_rows(QTYPE, k, m, BM)
    n0 = zdsl.workgroup_id(1) * BN
    mma.product(tiles, f, ctx, [(w, rows(0))], x, lambda n: zdsl.min(n0 + n, t - 1) * k, k)

    def store(u):
        n, i = u // BM, u % BM
        with zdsl.if_((n0 + n < t) & (r0 + i < m)):
            at = (n0 + n) * m + r0 + i
            with zdsl.if_(ADD):
                y[at] = y[at] + tiles.c[u]
            with zdsl.else_():
                y[at] = tiles.c[u]
    tiles.spread(BM * BN, store)


def mul_mm_coop_ref(w_bytes, x, qtype, m, k, y=None):
    """mul_mm_ref with W and X rounded to f16, as the matrix units see them (x may be f16 already)."""
    return dmmv.dmmv_ref(w_bytes, x, qtype, m, k, None if y is None else np.asarray(y).reshape(-1), f16=True)


@mul_mm_coop.example
def mul_mm_coop_example(use, rng, check):
    q, add = use.fixed["QTYPE"], use.fixed.get("ADD", False)
    k, t = use.sizes["k"], use.sizes["t"]
    m = min(use.sizes["m"], inputs.CHECK_ROWS) if check else use.sizes["m"]
    y = inputs.normal(rng, t * m) if add else np.zeros(t * m, np.float32)
    args = dict(w=inputs.rows(rng, q, m, k), x=inputs.normal(rng, t * k).astype(np.float16), y=y, k=k, m=m, t=t)
    y0 = args["y"].copy() if add else None
    return zdsl.Example(args, lambda p: {"y": (mul_mm_coop_ref(args["w"], args["x"], q, m, k, y0), 1e-3)},
                        lambda n: {"w": inputs.copies(args["w"], n)})
