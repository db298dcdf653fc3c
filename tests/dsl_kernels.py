"""Kernels only the tests use: elementwise, row reductions, subgroup collectives, a shared-memory
transpose and an int8 dot product, each beside its numpy reference. They exercise the language
(test_dsl.py); the library under kernels/ holds only what the model runs."""

from __future__ import annotations

import numpy as np

import zdsl
from zdsl import Buffer, Const, Spec, f32, i32, u32
from zdsl.kernels.reduce import SUBGROUPS



# ---- elementwise -------------------------------------------------------------------------------

@zdsl.kernel(workgroup="WG", variants={"WG": [64, 256]})
def axpy(x: Buffer[f32], y: Buffer[f32], out: Buffer[f32], n: u32, a: f32, WG: Const = 64):
    """out = a·x + y over n elements."""
    i = zdsl.global_id()
    with zdsl.if_(i < n):
        out[i] = a * x[i] + y[i]


def axpy_ref(x, y, a):
    return np.float32(a) * x + y


@zdsl.kernel(workgroup=64)
def axpy4(x: Buffer[f32], y: Buffer[f32], out: Buffer[f32], n4: u32, a: f32):
    """out = a·x + y with 16-byte vector loads and stores (n4 = n / 4)."""
    i = zdsl.global_id()
    with zdsl.if_(i < n4):
        out.vec4[i] = x.vec4[i] * a + y.vec4[i]


# ---- row reductions: each workgroup reduces one row ---------------------------------------------

@zdsl.kernel(workgroup="WG", subgroup="SG",
             variants={"OP": ["sum", "max"], "WG": [64, 256], "SG": SUBGROUPS})
def row_reduce(x: Buffer[f32], y: Buffer[f32], k: u32, OP: Const = "sum", WG: Const = 64, SG: Const = 32):
    """y[r] = sum or max of x[r, 0:k]: strided partials, a subgroup reduction, then one value per
    subgroup through shared memory."""
    row = zdsl.workgroup_id()
    combine, reduce, identity = {
        "sum": (lambda a, b: a + b, zdsl.subgroup_sum, 0.0),
        "max": (zdsl.max, zdsl.subgroup_max, -np.inf),
    }[OP]
    acc = zdsl.var(identity)
    for j in zdsl.range(zdsl.local_id(), k, WG):
        acc.set(combine(acc, x[row * k + j]))
    partial = zdsl.shared(f32, WG // SG)
    total = reduce(acc)
    with zdsl.if_(zdsl.lane_id() == 0):
        partial[zdsl.subgroup_id()] = total
    zdsl.barrier()
    with zdsl.if_(zdsl.local_id() == 0):
        result = zdsl.var(partial[0])
        for w in range(1, WG // SG):
            result.set(combine(result, partial[w]))
        y[row] = result


def row_reduce_ref(x, OP="sum"):
    return x.sum(axis=1, dtype=np.float32) if OP == "sum" else x.max(axis=1)


# ---- subgroup collectives, lane by lane ---------------------------------------------------------

@zdsl.kernel(workgroup="WG", subgroup="SG", variants={"OP": ["sum", "max", "min", "cluster4_sum",
                                                               "broadcast3", "shuffle_rev", "xor1"],
                                                        "SG": SUBGROUPS, "WG": [64]})
def subgroup_op(x: Buffer[f32], y: Buffer[f32], OP: Const = "sum", WG: Const = 64, SG: Const = 32):
    """y[i] = a subgroup collective of x, as seen by invocation i."""
    i = zdsl.global_id()
    v = x[i]
    y[i] = {
        "sum": lambda: zdsl.subgroup_sum(v),
        "max": lambda: zdsl.subgroup_max(v),
        "min": lambda: zdsl.subgroup_min(v),
        "cluster4_sum": lambda: zdsl.subgroup_sum(v, cluster=4),
        "broadcast3": lambda: zdsl.subgroup_broadcast(v, 3),
        "shuffle_rev": lambda: zdsl.subgroup_shuffle(v, SG - 1 - zdsl.lane_id()),
        "xor1": lambda: zdsl.subgroup_shuffle_xor(v, 1),
    }[OP]()


def subgroup_op_ref(x, OP="sum", SG=32):
    g = x.reshape(-1, SG)
    if OP in ("sum", "max", "min"):
        red = {"sum": g.sum, "max": g.max, "min": g.min}[OP](axis=1, keepdims=True)
        return np.broadcast_to(red, g.shape).reshape(-1)
    if OP == "cluster4_sum":
        c = x.reshape(-1, 4)
        return np.broadcast_to(c.sum(axis=1, keepdims=True), c.shape).reshape(-1)
    if OP == "broadcast3":
        return np.broadcast_to(g[:, 3:4], g.shape).reshape(-1)
    if OP == "shuffle_rev":
        return g[:, ::-1].reshape(-1)
    return g.reshape(-1, 2)[:, ::-1].reshape(-1)


# ---- shared-memory transpose ------------------------------------------------------------------

@zdsl.kernel(workgroup=lambda p: (p.TILE, p.TILE), variants={"TILE": [8, 16]})
def transpose(x: Buffer[f32], y: Buffer[f32], rows: u32, cols: u32, TILE: Const = 16):
    """y = xᵀ for a rows×cols matrix, through a padded shared tile so both the reads and the
    writes walk memory contiguously."""
    tile = zdsl.shared(f32, TILE * (TILE + 1))
    tx, ty = zdsl.local_id(0), zdsl.local_id(1)
    c, r = zdsl.workgroup_id(0) * TILE + tx, zdsl.workgroup_id(1) * TILE + ty
    with zdsl.if_((r < rows) & (c < cols)):
        tile[ty * (TILE + 1) + tx] = x[r * cols + c]
    zdsl.barrier()
    r2, c2 = zdsl.workgroup_id(1) * TILE + tx, zdsl.workgroup_id(0) * TILE + ty
    with zdsl.if_((r2 < rows) & (c2 < cols)):
        y[c2 * rows + r2] = tile[tx * (TILE + 1) + ty]


def transpose_ref(x):
    return np.ascontiguousarray(x.T)


# ---- int8 dot product -------------------------------------------------------------------------

@zdsl.kernel(workgroup="SG", subgroup="SG", variants={"SG": SUBGROUPS})
def dot_i8(a: Buffer[u32], b: Buffer[u32], y: Buffer[i32], k4: u32, SCALE: Spec[i32] = 1, SG: Const = 32):
    """y[r] = SCALE · Σ_k a[r, k] · b[k] over int8 values packed four to a u32 (k4 = k / 4);
    one subgroup per row."""
    row = zdsl.workgroup_id()
    acc = zdsl.var(0, zdsl.i32)
    for j in zdsl.range(zdsl.lane_id(), k4, SG):
        acc += zdsl.dot4_i8(a[row * k4 + j], b[j])
    total = zdsl.subgroup_sum(acc)
    with zdsl.if_(zdsl.lane_id() == 0):
        y[row] = total * SCALE


def dot_i8_ref(a_i8, b_i8, SCALE=1):
    return (a_i8.astype(np.int32) @ b_i8.astype(np.int32)) * SCALE


# ---- one row of a batch: a buffer seen from an offset, a scalar with a default -------------------

@zdsl.kernel(workgroup=64)
def scale_row(x: Buffer[f32], out: Buffer[f32], n4: u32, a: f32, row: u32 = 0):
    """out's row `row` (n4 vec4 values a row) = a · x's row `row`; the other rows untouched."""
    xs, outs = x.at(row * n4 * 4), out.at(row * n4 * 4)
    i = zdsl.global_id()
    with zdsl.if_(i < n4):
        outs.vec4[i] = xs.vec4[i] * a
        with zdsl.if_(i == 0):
            outs[0] = xs.view(u32)[0].to(f32)  # a scalar view from the offset too: the bits as a number
