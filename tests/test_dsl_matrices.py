"""Cooperative matrices in the DSL (zdsl/lang/matrices.py): the interpreter's tiles against numpy
over hypothesis-drawn tiles, layouts and strides; the rules it enforces (whole subgroups, one
offset per subgroup, no shared-memory race with a tile load); and GLSL that glslang compiles."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zdsl
from zdsl import Buffer, Const, f16, f32, u32
from zdsl.errors import KernelError
from budget import examples


@zdsl.kernel(workgroup=lambda v: 2 * v.SG, subgroup="SG")
def tile_product(a: Buffer[f16], b: Buffer[f16], c: Buffer[f32], out: Buffer[f32], stride: u32,
                 A_COLUMNS: Const = False, B_COLUMNS: Const = False, STAGE: Const = False, FOURS: Const = False,
                 ROOM: Const = 40, SG: Const = 32):
    """out = c + a·b for two subgroups, each its own 16 × 16 tiles at offset 256·subgroup (a and b
    read with `stride` ≤ ROOM, from shared memory when STAGE; with FOURS, shared arrays of f16 × 4,
    whose offset and stride count fours: stride a multiple of 4)."""
    sub = zdsl.subgroup_id()
    at = sub * 256
    if FOURS:
        n4 = (256 + 16 * ROOM) // 4
        sa, sb = zdsl.shared(f16.vec(4), n4), zdsl.shared(f16.vec(4), n4)
        for i in zdsl.range(zdsl.local_index(), (256 + 16 * stride) // 4, 2 * SG):
            sa[i] = a.vec4[i]
            sb[i] = b.vec4[i]
        zdsl.barrier()
        acc = zdsl.var(zdsl.mat_load(c, at, 16, use="acc"))
        ta = zdsl.mat_load(sa, at // 4, stride // 4, use="a", column_major=A_COLUMNS)
        tb = zdsl.mat_load(sb, at // 4, stride // 4, use="b", column_major=B_COLUMNS)
        acc.set(zdsl.mat_mul_add(ta, tb, acc))
        zdsl.mat_store(acc, out, at, 16)
        return
    if STAGE:
        sa, sb = zdsl.shared(f16, 256 + 16 * ROOM), zdsl.shared(f16, 256 + 16 * ROOM)
        for i in zdsl.range(zdsl.local_index(), 256 + 16 * stride, 2 * SG):
            sa[i] = a[i]
            sb[i] = b[i]
        zdsl.barrier()
        src_a, src_b = sa, sb
    else:
        src_a, src_b = a, b
    acc = zdsl.var(zdsl.mat_load(c, at, 16, use="acc"))
    ta = zdsl.mat_load(src_a, at, stride, use="a", column_major=A_COLUMNS)
    tb = zdsl.mat_load(src_b, at, stride, use="b", column_major=B_COLUMNS)
    acc.set(zdsl.mat_mul_add(ta, tb, acc))
    zdsl.mat_store(acc, out, at, 16)


def tile(arr, offset, stride, columns):
    r, c = np.arange(16)[:, None], np.arange(16)[None, :]
    return arr[offset + (c * stride + r if columns else r * stride + c)]


@settings(max_examples=examples(20), deadline=None)
@given(stride=st.integers(16, 40), a_cols=st.booleans(), b_cols=st.booleans(),
       stage=st.sampled_from(["no", "scalars", "fours"]), sg=st.sampled_from([8, 32]), seed=st.integers(0, 99))
def test_tile_product_against_numpy(stride, a_cols, b_cols, stage, sg, seed):
    """Tiles from buffers, shared f16 arrays and shared f16 × 4 arrays (there a row runs on
    through a four's lanes: the same tiles)."""
    rng = np.random.default_rng(seed)
    stride = stride // 4 * 4 if stage == "fours" else stride
    n = 256 + 16 * stride
    a, b = (rng.standard_normal(n).astype(np.float16) for _ in range(2))
    c = rng.standard_normal(512).astype(np.float32)
    v = tile_product.specialize(A_COLUMNS=a_cols, B_COLUMNS=b_cols, STAGE=stage == "scalars", FOURS=stage == "fours",
                                SG=sg)
    out = v.interpret(1, a=a, b=b, c=c, out=np.zeros(512, np.float32), stride=stride)["out"]
    for s in range(2):
        want = (c[256 * s:256 * s + 256].reshape(16, 16).astype(np.float64)
                + tile(a.astype(np.float64), 256 * s, stride, a_cols) @ tile(b.astype(np.float64), 256 * s, stride, b_cols))
        np.testing.assert_allclose(out[256 * s:256 * s + 256].reshape(16, 16), want, rtol=1e-5, atol=1e-5)


def test_tile_product_compiles():
    for staged in (dict(STAGE=True), dict(FOURS=True)):
        text = tile_product.specialize(**staged).glsl
        assert "coopMatMulAdd" in text and "GL_KHR_cooperative_matrix" in text
        assert len(tile_product.specialize(**staged).spirv) > 0
    assert "shared f16vec4" in tile_product.specialize(FOURS=True).glsl


@zdsl.kernel(workgroup=lambda v: v.SG, subgroup="SG")
def racy(a: Buffer[f16], out: Buffer[f32], BARRIER: Const = False, DIVERGE: Const = False, SG: Const = 8):
    s = zdsl.shared(f16, 256)
    for i in zdsl.range(zdsl.local_index(), 256, SG):
        s[i] = a[i]
    if BARRIER:
        zdsl.barrier()
    offset = zdsl.where(zdsl.lane_id() == 0, 16, 0, u32) if DIVERGE else 0
    m = zdsl.mat_load(s, offset, 16, use="a")
    acc = zdsl.mat_mul_add(m, zdsl.mat_load(a, 0, 16, use="b"), zdsl.mat_fill(0.0))
    zdsl.mat_store(acc, out, 0, 16)


def test_interpreter_refuses_what_hardware_gets_wrong():
    args = dict(a=np.ones(512, np.float16), out=np.zeros(256, np.float32))
    with pytest.raises(KernelError, match="race"):
        racy.specialize().interpret(1, **args)
    with pytest.raises(KernelError, match="differs between invocations"):
        racy.specialize(BARRIER=True, DIVERGE=True).interpret(1, **args)
    out = racy.specialize(BARRIER=True).interpret(1, **args)["out"]
    np.testing.assert_array_equal(out, np.full(256, 16.0, np.float32))


def test_tiles_are_16_by_16_and_typed():
    @zdsl.kernel(workgroup=lambda v: 32, subgroup="SG")
    def wrong(a: Buffer[f32], out: Buffer[f32], SG: Const = 32):
        zdsl.mat_store(zdsl.mat_load(a, 0, 16, use="a"), out, 0, 16)
    with pytest.raises(KernelError, match="f16"):
        wrong.specialize().glsl
