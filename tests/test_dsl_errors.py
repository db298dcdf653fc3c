"""Mistakes in kernels are reported at the Python line that made them."""

import inspect

import numpy as np
import pytest

import zdsl
from zdsl import Buffer, Const, f32, u32
from zdsl.errors import KernelError, ZdslError


def line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, l in enumerate(src) if text in l)


def expect_error_at(kdef, marker, match, **kw):
    with pytest.raises(KernelError, match=match) as e:
        v = kdef.specialize(**kw)
        v.interpret(1, **{p.name: np.zeros(64, p.dtype.numpy) for p in kdef.params if p.kind == "buffer"},
                    **{p.name: 64 for p in kdef.params if p.kind == "scalar"})
    assert f"test_dsl_errors.py:{line_of(kdef.fn, marker)}:" in str(e.value)


def test_mixed_types():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        x[0] = x[0] + n  # MARK
    expect_error_at(bad, "# MARK", "mixes f32 and u32")


def test_python_truth_of_traced_value():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        if zdsl.global_id() < n:  # MARK
            x[0] = 1.0
    expect_error_at(bad, "# MARK", "no Python truth value")


def test_value_escaping_a_loop():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        for i in zdsl.range(n):
            t = x[i] * 2.0
        x[0] = t  # MARK
    expect_error_at(bad, "# MARK", "declare it before the block")


def test_out_of_bounds_read_in_interpreter():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        x[zdsl.global_id()] = x[zdsl.global_id() + 1]  # MARK
    expect_error_at(bad, "# MARK", "out-of-bounds read of x")


def test_divergent_barrier():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        with zdsl.if_(zdsl.local_id() < 3):
            zdsl.barrier()  # MARK
    expect_error_at(bad, "# MARK", "uniform control flow")


def test_shared_memory_race():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        s = zdsl.shared(f32, 64)
        s[zdsl.local_id()] = 1.0
        x[zdsl.local_id()] = s[(zdsl.local_id() + 1) % 64]  # MARK
    expect_error_at(bad, "# MARK", "shared-memory race")


def test_plain_python_error_in_body():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32, MODE: Const = "a"):
        x[0] = {"b": 1.0}[MODE]  # MARK
    expect_error_at(bad, "# MARK", "KeyError")


def test_float_literal_into_integer():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        x[0] = (n * 1.5).to(f32)  # MARK
    expect_error_at(bad, "# MARK", "float literal")


def test_missing_annotation_and_unknown_variant_param():
    with pytest.raises(KernelError, match="needs an annotation"):
        @zdsl.kernel(register=False)
        def bad(x, n: u32):
            pass
    with pytest.raises(KernelError, match="not a Const or Spec"):
        @zdsl.kernel(register=False, variants={"NOPE": [1]})
        def bad2(x: Buffer[f32]):
            pass


def test_direct_call_is_refused():
    @zdsl.kernel(register=False)
    def k(x: Buffer[f32]):
        x[0] = 1.0
    with pytest.raises(ZdslError, match="specialize"):
        k(None)


def test_shared_memory_overwrite_before_barrier():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        s = zdsl.shared(f32, 64)
        s[zdsl.local_id()] = 1.0
        zdsl.barrier()
        t = s[(zdsl.local_id() + 1) % 64]
        s[zdsl.local_id()] = t  # MARK
        x[zdsl.local_id()] = t
    expect_error_at(bad, "# MARK", "overwrites element")


def test_last_workgroup_needs_a_u32_counter():
    @zdsl.kernel(register=False)
    def bad(x: Buffer[f32], n: u32):
        with zdsl.if_(zdsl.last_workgroup(x)):  # MARK
            x[0] = 1.0
    expect_error_at(bad, "# MARK", "counts arrivals in a Buffer\\[u32\\]")


def test_shared_over_takes_only_the_first_arrays_and_no_more_than_their_storage():
    @zdsl.kernel(register=False)
    def late(x: Buffer[f32], n: u32):
        a = zdsl.shared(f32, 64)
        b = zdsl.shared(f32, 64)
        c = zdsl.shared(f32, 64, over=(b,))  # MARK
        c[0] = a[0]
    expect_error_at(late, "# MARK", "takes the first arrays declared")

    @zdsl.kernel(register=False)
    def large(x: Buffer[f32], n: u32):
        a = zdsl.shared(f32, 64)
        c = zdsl.shared(f32, 65, over=(a,))  # MARK
        c[0] = a[0]
    expect_error_at(large, "# MARK", "larger than the arrays")


def test_shared_over_shares_storage_in_the_shader_and_not_in_the_interpreter():
    """A result array in its operands' storage, each used only between barriers: the interpreter
    gives the same answer as without `over`, and the shader declares shared memory blocks (all of
    them starting at one address) that glslang and spirv-val accept."""
    from zdsl import toolchain

    def body(x, over):
        t = zdsl.local_index()
        a = zdsl.shared(f32, 64)
        b = zdsl.shared(f32, 64)
        c = zdsl.shared(f32, 128, over=(a, b) if over else ())
        a[t] = x[t]
        b[t] = x[t + 64]
        zdsl.barrier()
        s = a[63 - t] + b[t]
        zdsl.barrier()
        c[t], c[t + 64] = s, 2.0 * s
        zdsl.barrier()
        x[t + 128] = c[(t * 7) % 128]

    @zdsl.kernel(workgroup=64, register=False)
    def apart(x: Buffer[f32]):
        body(x, False)

    @zdsl.kernel(workgroup=64, register=False)
    def aliased(x: Buffer[f32]):
        body(x, True)

    x = np.random.default_rng(0).normal(size=192).astype(np.float32)
    want = apart.specialize().interpret(1, x=x.copy())["x"]
    assert np.array_equal(aliased.specialize().interpret(1, x=x.copy())["x"], want)
    v = aliased.specialize()
    assert "shared_alias" in v.ir.features and "shared_alias" not in apart.specialize().ir.features
    blocks = [line for line in v.glsl.splitlines() if line.startswith("shared ")]
    assert blocks == ["shared ZdslShared { float sh0[64]; float sh1[64]; };", "shared ZdslShared2 { float sh2[128]; };"]
    toolchain.validate(toolchain.compile_glsl(v.glsl, name="aliased"), name="aliased")
