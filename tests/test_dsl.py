"""The DSL against numpy: every sample kernel in the interpreter (subgroup sizes 8/32/64) and on
lavapipe (its own subgroup size), over random shapes and variant values."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dsl_kernels as k
from kernel_testing import BACKENDS, run


def sizes_for(backend, request):
    if backend == "interp":
        return [8, 32, 64]
    return [request.getfixturevalue("device").info.subgroup_size]


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 3000), wg=st.sampled_from([64, 256]), a=st.floats(-4, 4, width=32), seed=st.integers(0, 99))
def test_axpy(backend, request, n, wg, a, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    out = run(k.axpy.specialize(WG=wg), backend, request, -(-n // wg), x=x, y=y,
              out=np.full(n, np.nan, np.float32), n=n, a=a)["out"]
    np.testing.assert_allclose(out, k.axpy_ref(x, y, a), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n4=st.integers(1, 700), seed=st.integers(0, 99))
def test_vec4_loads(backend, request, n4, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(4 * n4, dtype=np.float32), rng.standard_normal(4 * n4, dtype=np.float32)
    out = run(k.axpy4.specialize(), backend, request, -(-n4 // 64), x=x, y=y,
              out=np.full(4 * n4, np.nan, np.float32), n4=n4, a=0.5)["out"]
    np.testing.assert_allclose(out, k.axpy_ref(x, y, 0.5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 6), cols=st.integers(1, 700), op=st.sampled_from(["sum", "max"]),
       wg=st.sampled_from([64, 256]), sg_pick=st.integers(0, 2), seed=st.integers(0, 99))
def test_row_reduce(backend, request, rows, cols, op, wg, sg_pick, seed):
    sizes = sizes_for(backend, request)
    sg = sizes[sg_pick % len(sizes)]
    x = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    y = run(k.row_reduce.specialize(OP=op, WG=wg, SG=sg), backend, request, rows,
            x=x, y=np.full(rows, np.nan, np.float32), k=cols)["y"]
    np.testing.assert_allclose(y, k.row_reduce_ref(x, op), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", k.subgroup_op.variant_space["OP"])
def test_subgroup_collectives(backend, request, op):
    for sg in sizes_for(backend, request):
        x = np.random.default_rng(sg).standard_normal(128, dtype=np.float32)
        y = run(k.subgroup_op.specialize(OP=op, SG=sg), backend, request, 2,
                x=x, y=np.full(128, np.nan, np.float32))["y"]
        np.testing.assert_allclose(y, k.subgroup_op_ref(x, op, sg), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 70), cols=st.integers(1, 70), tile=st.sampled_from([8, 16]), seed=st.integers(0, 99))
def test_shared_transpose(backend, request, rows, cols, tile, seed):
    x = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    y = run(k.transpose.specialize(TILE=tile), backend, request, (-(-cols // tile), -(-rows // tile)),
            x=x, y=np.full(rows * cols, np.nan, np.float32), rows=rows, cols=cols)["y"]
    np.testing.assert_array_equal(y.reshape(cols, rows), k.transpose_ref(x))


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 9), k4=st.integers(1, 80), scale=st.integers(-3, 3), seed=st.integers(0, 99))
def test_int8_dot_and_spec_constant(backend, request, rows, k4, scale, seed):
    rng = np.random.default_rng(seed)
    a = rng.integers(-128, 128, (rows, 4 * k4), dtype=np.int8)
    b = rng.integers(-128, 128, 4 * k4, dtype=np.int8)
    sg = sizes_for(backend, request)[0]
    y = run(k.dot_i8.specialize(SG=sg, SCALE=scale), backend, request, rows,
            a=a.view(np.uint32), b=b.view(np.uint32), y=np.zeros(rows, np.int32), k4=k4)["y"]
    np.testing.assert_array_equal(y, k.dot_i8_ref(a, b, scale))


def test_spec_constant_does_not_recompile():
    """Spec values live in the pipeline, not the code: two values, one SPIR-V."""
    a, b = k.dot_i8.specialize(SG=8, SCALE=1), k.dot_i8.specialize(SG=8, SCALE=5)
    assert a is not b and a.glsl == b.glsl and a.spirv == b.spirv
    assert a.spec_constants() != b.spec_constants()


def test_a_derived_default_follows_the_parameters_before_it():
    """A Const default may depend on the Consts declared before it (zdsl.Derived); a value given
    wins, and the derived value is the variant's (its label, its code)."""
    @zdsl.kernel(workgroup="WG", register=False)
    def scaled(x: Buffer[f32], y: Buffer[f32], WIDE: Const = False, WG: Const = zdsl.Derived(lambda v: 256 if v.WIDE else 64)):
        i = zdsl.global_id()
        y[i] = x[i] * float(WG)

    assert [scaled.specialize(**given).params["WG"] for given in ({}, {"WIDE": True}, {"WIDE": True, "WG": 32})] == [64, 256, 32]
    x = np.arange(256, dtype=np.float32)
    y = scaled.specialize(WIDE=True).interpret(1, x=x, y=np.zeros_like(x))["y"]
    assert np.array_equal(y, x * 256)


# ---- language features beyond the sample kernels -------------------------------------------------

import zdsl  # noqa: E402
from zdsl import Buffer, Const, f32, u8, u32  # noqa: E402


@zdsl.kernel(workgroup=64, subgroup="SG", register=False)
def _features(x: Buffer[f32], idx: Buffer[u32], y: Buffer[f32], counts: Buffer[u32], SG: Const = 8):
    i = zdsl.global_id()
    v = x[i]
    scratch = zdsl.local_array(f32, 4)
    for j in range(4):
        scratch[j] = v * (j + 1)
    codebook = zdsl.table(f32, [-1.0, -0.5, 0.25, 2.0])
    picked = scratch[idx[i] & 3] + codebook[(idx[i] >> 2) & 3]
    y[2 * i] = picked + zdsl.subgroup_prefix_sum(v)
    y[2 * i + 1] = zdsl.subgroup_prefix_sum(v, inclusive=False)
    counts[i] = zdsl.subgroup_ballot_count(v > 0.0)


def _features_ref(x, idx, sg):
    codebook = np.array([-1.0, -0.5, 0.25, 2.0], np.float32)
    g = x.reshape(-1, sg)
    inc = np.cumsum(g, axis=1).reshape(-1)
    y = np.empty(2 * len(x), np.float32)
    y[0::2] = x * ((idx & 3) + 1) + codebook[(idx >> 2) & 3] + inc
    y[1::2] = inc - x
    counts = np.repeat((g > 0).sum(axis=1), sg).astype(np.uint32)
    return y, counts


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_arrays_tables_prefix_sums_ballots(backend, request):
    for sg in sizes_for(backend, request):
        rng = np.random.default_rng(sg)
        x = rng.standard_normal(128, dtype=np.float32)
        idx = rng.integers(0, 16, 128, dtype=np.uint32)
        out = run(_features.specialize(SG=sg), backend, request, 2, x=x, idx=idx,
                  y=np.full(256, np.nan, np.float32), counts=np.zeros(128, np.uint32))
        y_ref, c_ref = _features_ref(x, idx, sg)
        np.testing.assert_allclose(out["y"], y_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["counts"], c_ref)


def test_argument_dtype_is_checked():
    with pytest.raises(zdsl.ZdslError, match="float64 but the kernel declares Buffer\\[f32\\]"):
        k.axpy.specialize().interpret(1, x=np.zeros(4), y=np.zeros(4, np.float32), out=np.zeros(4, np.float32),
                                      n=4, a=1.0)


@zdsl.kernel(workgroup=64, register=False)
def _unpack(x: Buffer[u32], y: Buffer[f32]):
    i = zdsl.global_id()
    y[i] = zdsl.dot(zdsl.unpack_bytes(x[i]), zdsl.vec(1.0, 10.0, 100.0, 1000.0))


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 99))
def test_unpack_bytes(backend, request, seed):
    x = np.random.default_rng(seed).integers(0, 2**32, 128, dtype=np.uint32)
    y = run(_unpack.specialize(), backend, request, 2, x=x, y=np.zeros(128, np.float32))["y"]
    expected = (x.view(np.uint8).reshape(-1, 4).astype(np.float64) @ [1, 10, 100, 1000]).astype(np.float32)
    np.testing.assert_array_equal(y, expected)


@zdsl.kernel(workgroup=64, register=False)
def _vectors(x: Buffer[f32], h: Buffer[zdsl.f16], y: Buffer[f32], n4: u32):
    i = zdsl.global_id()
    acc = zdsl.var(0.5, f32.vec(4))
    v = x.vec4.load(i, mask=i < n4, other=0.0)
    acc.set(acc + zdsl.sigmoid(v) + zdsl.silu(v) + zdsl.softplus(v))
    h[i] = acc.x  # f32 into an f16 buffer: narrowed on store
    y.vec4[i] = acc


@pytest.mark.parametrize("backend", BACKENDS)
def test_vector_math_masked_vector_loads_and_f16_stores(backend, request):
    x = np.random.default_rng(1).standard_normal(4 * 64, dtype=np.float32) * 4
    out = run(_vectors.specialize(), backend, request, 1, x=x, h=np.zeros(64, np.float16),
              y=np.zeros(4 * 64, np.float32), n4=60)
    xv = np.where(np.arange(4 * 64) < 240, x, 0).astype(np.float64)
    sig = 1 / (1 + np.exp(-xv))
    expected = 0.5 + sig + xv * sig + np.logaddexp(0, xv)
    np.testing.assert_allclose(out["y"], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["h"], expected[0::4].astype(np.float16), rtol=1e-3)


@zdsl.kernel(workgroup=64, register=False)
def _reverse_quads(x: Buffer[f32], y: Buffer[f32]):
    """y's quads = x's quads in reverse order within each workgroup, through a vec4 shared array."""
    t = zdsl.local_index()
    quads = zdsl.shared(f32.vec(4), 64)
    quads[t] = x.vec4[zdsl.global_id()]
    zdsl.barrier()
    y.vec4[zdsl.global_id()] = quads[63 - t] * 2.0


@pytest.mark.parametrize("backend", BACKENDS)
@given(groups=st.integers(1, 3), seed=st.integers(0, 99))
def test_vector_shared_arrays(backend, request, groups, seed):
    x = np.random.default_rng(seed).standard_normal(256 * groups, dtype=np.float32)
    y = run(_reverse_quads.specialize(), backend, request, groups, x=x, y=np.full_like(x, np.nan))["y"]
    np.testing.assert_array_equal(y.reshape(groups, 64, 4), 2 * x.reshape(groups, 64, 4)[:, ::-1])


@zdsl.kernel(workgroup=64, register=False)
def _double_then_sum(x: Buffer[f32], doubled: zdsl.Coherent[f32], arrivals: Buffer[u32], out: Buffer[f32], n: u32):
    """doubled = 2·x by every workgroup; then out[0] += Σ doubled by the workgroup that finishes last."""
    i = (zdsl.workgroup_id(1) * zdsl.num_workgroups(0) + zdsl.workgroup_id(0)) * 64 + zdsl.local_index()
    with zdsl.if_(i < n):
        doubled[i] = 2.0 * x[i]
    with zdsl.if_(zdsl.last_workgroup(arrivals)):
        with zdsl.if_(zdsl.local_index() == 0):
            total = zdsl.var(0.0)
            for j in zdsl.range(n):
                total += doubled[j]
            out[0] = out[0] + total


@pytest.mark.parametrize("backend", BACKENDS)
@given(gx=st.integers(1, 5), gy=st.integers(1, 3), tail=st.integers(0, 63), seed=st.integers(0, 99))
def test_last_workgroup_sees_every_workgroups_writes_and_resets_its_count(backend, request, monkeypatch, gx, gy,
                                                                           tail, seed):
    """The last workgroup of a 2-D grid adds up what all wrote, and leaves the count at 0, so a
    second dispatch in the same sequence does it again. The interpreter runs in chunks of two
    workgroups here: the last one must still come after all of them."""
    from zdsl.lang import interp

    monkeypatch.setattr(interp, "MAX_LANES", 128)
    n = 64 * gx * gy - tail
    x = np.random.default_rng(seed).integers(-50, 50, n).astype(np.float32)  # exact sums in any order
    args = dict(x=x, doubled=np.full(n, np.nan, np.float32), arrivals=np.zeros(1, np.uint32),
                out=np.ones(1, np.float32), n=n)
    v = _double_then_sum.specialize()
    if backend == "interp":
        first = v.interpret((gx, gy), **args)
        second = v.interpret((gx, gy), **{**args, **first})
    else:
        device = request.getfixturevalue("device")
        bufs = {name: device.upload(a, name=name) for name, a in args.items() if name != "n"}
        try:
            seq = device.sequence()
            v.dispatch(seq, (gx, gy), n=n, **bufs)
            v.dispatch(seq, (gx, gy), n=n, **bufs)
            seq.run()
            seq.free()
            second = {name: bufs[name].read(args[name].dtype, args[name].shape) for name in ("doubled", "arrivals", "out")}
        finally:
            for b in bufs.values():
                b.free()
    np.testing.assert_array_equal(second["doubled"], 2 * x)
    assert second["arrivals"][0] == 0
    assert second["out"][0] == 1 + 2 * 2 * x.astype(np.float64).sum()


def test_coherent_buffers_and_memory_barriers_in_glsl():
    glsl = _double_then_sum.specialize().glsl
    assert "coherent buffer B_doubled" in glsl and "coherent buffer B_x" not in glsl
    assert glsl.count("memoryBarrierBuffer();") == 2


@zdsl.kernel(workgroup=64, register=False)
def _scaled_copy(x: Buffer[f32], scale_buf: Buffer[f32], bias: Buffer[u8], y: Buffer[f32], n: u32, s: f32,
                 SCALED: Const = False):
    """y = x, times scale_buf[0] · s when SCALED: without it, scale_buf, bias and s go unused."""
    i = zdsl.global_id()
    with zdsl.if_(i < n):
        y[i] = x[i] * scale_buf[0] * s if SCALED else x[i]


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_and_scalars_a_variant_never_touches_may_be_left_out(backend, request):
    """A Const that turns a buffer's use off: the variant binds a placeholder there (declared as
    words: its own type could need an extension), the Sequence sees no access to it, and an
    unread scalar packs as 0. Leaving out one that is used is still an error."""
    x = np.arange(100, dtype=np.float32)
    plain = _scaled_copy.specialize()
    assert [acc for _, _, acc in plain.ir.buffers] == ["r", "-", "-", "w"]
    assert "uint bias_u32[]" in plain.glsl and "uint8_t" not in plain.glsl
    out = run(plain, backend, request, 2, x=x, y=np.zeros(100, np.float32), n=100)
    np.testing.assert_array_equal(out["y"], x)
    scaled = _scaled_copy.specialize(SCALED=True)
    out = run(scaled, backend, request, 2, x=x, scale_buf=np.float32([2.0]), y=np.zeros(100, np.float32), n=100, s=1.5)
    np.testing.assert_array_equal(out["y"], 3 * x)
    with pytest.raises(zdsl.ZdslError, match="missing buffer argument.*scale_buf"):
        run(scaled, backend, request, 2, x=x, y=np.zeros(100, np.float32), n=100, s=1.5)
    with pytest.raises(zdsl.ZdslError, match="missing scalar argument.*s"):
        run(scaled, backend, request, 2, x=x, scale_buf=np.float32([2.0]), y=np.zeros(100, np.float32), n=100)


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=st.integers(1, 5), n4=st.integers(1, 200), pick=st.integers(0, 4), seed=st.integers(0, 99))
def test_a_buffer_from_an_offset_reads_and_writes_one_row(backend, request, rows, n4, pick, seed):
    """x.at(n) moves every index of x by n elements, through wider and narrower views too; a
    scalar with a default in the signature may be left out of the launch."""
    rng = np.random.default_rng(seed)
    row = pick % rows
    x = rng.standard_normal((rows, 4 * n4), dtype=np.float32)
    given_row = dict(row=row) if row else {}  # row 0: the default
    out = run(k.scale_row.specialize(), backend, request, -(-n4 // 64), x=x.reshape(-1),
              out=np.full(rows * 4 * n4, np.nan, np.float32), n4=n4, a=2.0, **given_row)["out"].reshape(rows, -1)
    want = 2 * x[row]
    want[0] = np.float32(x[row, :1].view(np.uint32)[0])
    np.testing.assert_array_equal(out[row], want)
    assert np.isnan(np.delete(out, row, axis=0)).all()


def test_kernels_trace_on_two_threads_at_once():
    """Each thread traces into its own trace (a Recorder's thread makes variants while another
    thread makes others): traces made side by side, the threads switching every few
    microseconds, give the GLSL that each gives alone."""
    import sys
    import threading

    from zdsl.kernels.dmmv import dmmv
    from zdsl.kernels.sampling import sample_draw
    from zdsl.lang import glsl

    jobs = [(dmmv, dmmv.specialize(QTYPE="q4_k", Q8=True, COLS=3).consts),
            (sample_draw, sample_draw.specialize(CAP=64).consts)]
    alone = [glsl.emit(kernel._trace(consts)) for kernel, consts in jobs]
    got, errors = [[] for _ in jobs], []

    def trace(i):
        try:
            kernel, consts = jobs[i]
            for _ in range(4):
                got[i].append(glsl.emit(kernel._trace(consts)))
        except Exception as e:  # noqa: BLE001 (reported below, on the test's thread)
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=trace, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert all(out == [want] * 4 for out, want in zip(got, alone))
