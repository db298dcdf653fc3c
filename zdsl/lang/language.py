"""The zdsl language: everything a kernel body may call, in one module.

A kernel is ordinary Python run once at build time with traced values. Python `for` loops and
`if`s over Python values unroll and choose at build time; the GPU's own loops and branches are
written with `zdsl.range` and `with zdsl.if_(...)`. Underneath it is plain SIMT: each
invocation runs the body; workgroups share `shared` arrays; subgroups have collective ops.
"""

from __future__ import annotations

from contextlib import contextmanager

from zdsl.lang import ir
from zdsl.lang.matrices import mat_fill, mat_load, mat_mul_add, mat_store
from zdsl.lang.trace import (BufferParam, LocalArray, SharedArray, TableArray, Tracer, Value, Var, apply, fail,
                             operand, tracer, typed, user_loc)
from zdsl.lang.types import DType, boolean, f16, f32, i32, u32

# ---- parameter annotations -------------------------------------------------------------------


class Buffer:
    """`x: Buffer[f32]`: a storage buffer of f32 (binding order = parameter order)."""

    def __class_getitem__(cls, dtype: DType):
        return BufferAnnotation(dtype)


class Coherent:
    """`x: Coherent[f32]`: a storage buffer whose loads see what other workgroups of the same
    dispatch wrote before a `memory_barrier()` (GLSL `coherent`: no stale cached copy), as the
    workgroup that `last_workgroup()` picks must when it reads the others' results."""

    def __class_getitem__(cls, dtype: DType):
        return BufferAnnotation(dtype, coherent=True)


class BufferAnnotation:
    def __init__(self, dtype: DType, coherent: bool = False):
        self.dtype, self.coherent = dtype, coherent


class Spec:
    """`rows: Spec[u32] = 2`: a specialization constant — set when the pipeline is created,
    without recompiling. Use it for values that do not change the code's shape."""

    def __class_getitem__(cls, dtype: DType):
        return SpecAnnotation(dtype)


class SpecAnnotation:
    def __init__(self, dtype: DType):
        self.dtype = dtype


class Const:
    """`QTYPE: Const = "q4_k"`: a Python value at trace time — each value is its own SPIR-V.
    Use it for what changes the code: types, unroll counts, subgroup size."""


class Derived:
    """`BM: Const = Derived(lambda v: 48 if short(v.QTYPE) else 32)`: a default that depends on
    the compile-time parameters declared before it (v holds their values), for a choice that
    is right for some weight types and does not fit others. A value given still wins."""

    def __init__(self, fn):
        self.fn = fn


# ---- invocation ids -----------------------------------------------------------------------------

def _builtin(name: str, axis: int = 0) -> Value:
    return Value(ir.Builtin(name, axis, u32))


def workgroup_id(axis: int = 0) -> Value:
    """Index of this workgroup in the dispatch (gl_WorkGroupID)."""
    return _builtin("workgroup_id", axis)


def num_workgroups(axis: int = 0) -> Value:
    return _builtin("num_workgroups", axis)


def local_id(axis: int = 0) -> Value:
    """Index of this invocation in its workgroup (gl_LocalInvocationID)."""
    return _builtin("local_id", axis)


def local_index() -> Value:
    """Flattened index of this invocation in its workgroup."""
    return _builtin("local_index")


def global_id(axis: int = 0) -> Value:
    return _builtin("global_id", axis)


def workgroup_size(axis: int = 0) -> int:
    return tracer().workgroup[axis]


def subgroup_size() -> int:
    """The subgroup size this variant is compiled for (a Python int)."""
    sg = tracer().subgroup_size
    if sg is None:
        raise fail("this kernel declares no subgroup size: pass subgroup='PARAM' to @zdsl.kernel")
    return sg


def subgroup_id() -> Value:
    """Which subgroup of the workgroup this invocation is in (local_index // subgroup_size)."""
    subgroup_size()
    tracer().features.add("subgroup")
    return _builtin("subgroup_id")


def lane_id() -> Value:
    """This invocation's lane in its subgroup."""
    subgroup_size()
    tracer().features.add("subgroup")
    return _builtin("lane_id")


# ---- variables, control flow ------------------------------------------------------------------

def var(init, dtype: DType | None = None, name: str = "") -> Var:
    """A mutable variable, for values that loops and branches update (`acc += x`)."""
    init_v = typed(init, dtype or (init.dtype if isinstance(init, Value) else f32))
    if dtype is not None and init_v.dtype != dtype:
        init_v = init_v.to(dtype)
    return tracer().var(init_v, name)


def range(start, stop=None, step=1, *, unroll: bool | int = False):
    """A loop the GPU runs: `for i in zdsl.range(n):`. The body is traced once; values that
    must outlive an iteration live in `zdsl.var`s. `unroll=True` asks the compiler to unroll
    (GLSL's [[unroll]]; it takes no count — unroll N times with a Python loop in the body). For a loop unrolled at build time use Python's own `range` over Python ints."""
    if stop is None:
        start, stop = 0, start
    t = tracer()
    like = next((v.dtype for v in (start, stop, step) if isinstance(v, Value)), u32)
    if not like.is_int:
        raise fail(f"zdsl.range bounds must be integers, not {like!r}")
    lo, hi, st = (operand(v, like) for v in (start, stop, step))
    ref = ir.VarRef(t.nvars, f"i{t.nvars}", like)
    t.nvars += 1
    loop = ir.For(ref, lo, hi, st, [], unroll, user_loc())
    t.emit(loop)
    with t.block(loop.body):
        yield Value(ref)


@contextmanager
def if_(cond):
    """`with zdsl.if_(cond):` — the block runs only where cond holds."""
    c = operand(cond, boolean)
    if c.dtype != boolean:
        raise fail(f"zdsl.if_ needs a bool condition, not {c.dtype!r} (compare it: x != 0)")
    t = tracer()
    t.check_visible(c)
    node = ir.If(c, [], [], user_loc())
    t.emit(node)
    with t.block(node.then):
        yield


@contextmanager
def else_():
    """`with zdsl.else_():` right after a `with zdsl.if_(...)` block."""
    t = tracer()
    block = t.blocks[-1]
    if not block or not isinstance(block[-1], ir.If) or block[-1].orelse:
        raise fail("zdsl.else_() must directly follow a `with zdsl.if_(...)` block")
    with t.block(block[-1].orelse):
        yield


def where(cond, a, b, dtype: DType | None = None) -> Value:
    """cond ? a : b, per invocation (both sides are computed). Two Python literals take
    `dtype` (default f32)."""
    like = dtype or next((v.dtype for v in (a, b) if isinstance(v, Value)), None) or f32
    a, b = typed(a, like), typed(b, like)
    if a.dtype != b.dtype:
        raise fail(f"zdsl.where chooses between {a.dtype!r} and {b.dtype!r}; convert one with .to(...)")
    return apply("select", typed(cond, boolean), a, b, same=False, dtype=a.dtype)


# ---- shared memory, synchronization ------------------------------------------------------------

def shared(dtype: DType, size, over=()) -> SharedArray:
    """A workgroup-shared array; `size` is an int or a compile-time expression of Spec params.

    `over`: arrays declared before, first of all, that this one takes the storage of. Use it
    only while they are dead, a barrier on each side (a product's result tile over its operand
    tiles, once the K loop is done): the workgroup then needs only the larger of the two, and
    more workgroups fit a unit's shared memory. The kernel then needs shared memory blocks
    (VK_KHR_workgroup_memory_explicit_layout; its IR lists "shared_alias" among its features); the
    interpreter keeps the arrays apart, which changes nothing in a program that respects the
    barriers."""
    t = tracer()
    size_ref = size if isinstance(size, int) else operand(size)
    if not isinstance(size_ref, (int, ir.Const, ir.SpecParam, ir.ConstExpr)):
        raise fail("a shared array's size must be known at pipeline creation (ints, Const and Spec params)")
    ids = tuple(a.decl.id for a in over)
    if over:
        sizes = [size] + [a.decl.size for a in over]
        if not all(isinstance(n, int) for n in sizes) or any(i != n for n, i in enumerate(ids)):
            raise fail("zdsl.shared's `over` takes the first arrays declared, of sizes known in Python (ints)")
        if size * dtype.nbytes > sum(a.decl.size * a.decl.dtype.nbytes for a in over):
            raise fail("zdsl.shared's `over`: the array is larger than the arrays whose storage it takes")
        t.features.add("shared_alias")
    decl = ir.Shared(len(t.shared), dtype, size_ref, ids)
    t.shared.append(decl)
    return SharedArray(decl)


def local_array(dtype: DType, size: int) -> LocalArray:
    """A per-invocation array indexed at run time (small: it lives in registers or scratch)."""
    t = tracer()
    if not isinstance(size, int) or size < 1:
        raise fail("a local array's size must be a positive Python int")
    decl = ir.Local(len(t.locals), dtype.compute, size)
    t.locals.append(decl)
    return LocalArray(decl)


def table(dtype: DType, values) -> TableArray:
    """A constant lookup table baked into the kernel (e.g. a non-linear 4-bit codebook)."""
    t = tracer()
    values = tuple(values)
    if not values:
        raise fail("a zdsl.table needs at least one value")
    for decl in t.tables:
        if decl.dtype == dtype.compute and decl.values == values:
            return TableArray(decl)
    decl = ir.Table(len(t.tables), dtype.compute, values)
    t.tables.append(decl)
    return TableArray(decl)


def barrier() -> None:
    """Every invocation of the workgroup waits here; shared-memory writes before it are visible after."""
    tracer().emit(ir.Barrier(user_loc()))


def memory_barrier() -> None:
    """This invocation's buffer writes before it reach device memory before its buffer accesses
    after it (GLSL memoryBarrierBuffer): how one workgroup hands results to another within a
    dispatch. Not a barrier() — nobody waits."""
    tracer().emit(ir.MemoryBarrier(user_loc()))


def last_workgroup(counter: BufferParam, index=0, per_z: bool = False) -> Value:
    """True, in all its invocations, in the one workgroup of the dispatch that gets here last
    (with per_z, of its layer of the grid's z: one row of a batch, counted in its own counter);
    its reads of `Coherent` buffers see every buffer write the others made before getting here.
    counter[index] (u32) counts the arrivals: it must be 0 when the dispatch starts, and the
    last workgroup puts it back to 0 for the next one. Call it in uniform control flow. The
    "last workgroup finishes" reduction: a dependent step without a second dispatch. Every
    workgroup pays a fence and an atomic on one address, so it suits dispatches of a few hundred
    workgroups (the MoE router); with thousands, a second dispatch is cheaper (docs/DESIGN.md)."""
    if not isinstance(counter, BufferParam) or counter.dtype.name != "u32":
        raise fail("zdsl.last_workgroup counts arrivals in a Buffer[u32]")
    groups = num_workgroups(0) * num_workgroups(1) * (1 if per_z else num_workgroups(2))
    memory_barrier()  # release: this invocation's writes before the arrival that announces them
    barrier()         # ... and those of every invocation of the workgroup
    flag = shared(u32, 1)
    with if_(local_index() == 0):
        last = atomic_add(counter, index, 1) == groups - 1
        memory_barrier()  # acquire: the others' writes, before this workgroup's reads
        flag[0] = where(last, 1, 0, u32)
        with if_(last):
            counter[index] = 0
    barrier()
    return flag[0] == 1


# ---- math -------------------------------------------------------------------------------------

def _float_unary(op):
    def fn(x):
        x = typed(x, f32)
        if not x.dtype.is_float:
            raise fail(f"zdsl.{op} needs a float value, not {x.dtype!r}; convert with .to(f32)")
        return apply(op, x)
    fn.__name__ = op
    fn.__doc__ = f"Elementwise {op}."
    return fn


exp, exp2, log, log2 = (_float_unary(n) for n in ("exp", "exp2", "log", "log2"))
sqrt, rsqrt, sin, cos, tanh = (_float_unary(n) for n in ("sqrt", "rsqrt", "sin", "cos", "tanh"))
floor, ceil, round = (_float_unary(n) for n in ("floor", "ceil", "round"))
sigmoid, silu, softplus = (_float_unary(n) for n in ("sigmoid", "silu", "softplus"))


def abs(x) -> Value:
    return apply("abs", x)


def isnan(x) -> Value:
    return apply("isnan", typed(x, f32), dtype=boolean)


def min(a, b) -> Value:
    return apply("min", a, b)


def max(a, b) -> Value:
    return apply("max", a, b)


def pow(a, b) -> Value:
    return apply("pow", a, b)


def clamp(x, lo, hi) -> Value:
    return apply("clamp", x, lo, hi)


def fma(a, b, c) -> Value:
    """a * b + c in one rounding where the hardware has it."""
    return apply("fma", a, b, c)


def bitcast(x, dtype: DType) -> Value:
    """Reinterpret the bits of a 32-bit value (floatBitsToUint and friends)."""
    x = typed(x, u32)
    if x.dtype.bits != 32 or dtype.bits != 32:
        raise fail("zdsl.bitcast works on 32-bit types")
    return tracer().let("bitcast", (x.ref,), dtype.vec(x.dtype.lanes))


def f16_bits(u) -> Value:
    """The f32 value of the IEEE half whose bits are the low 16 bits of u (for packed scales)."""
    return tracer().let("f16_bits", (operand(u, u32),), f32)


def bf16_bits(u) -> Value:
    """The f32 value of the bfloat16 whose bits are the low 16 bits of u."""
    return tracer().let("bf16_bits", (operand(u, u32),), f32)


def unpack_bytes(u) -> Value:
    """The four bytes of a u32 as an f32x4 (byte 0 in lane 0), exact: the cheap way to turn
    packed quantized codes into floats (one conversion per byte, no shifts or masks)."""
    t = tracer()
    t.features.add("int8_arith")
    return t.let("unpack_bytes", (operand(u, u32),), f32.vec(4))


def vec(*parts) -> Value:
    """A 2- or 4-lane vector from scalars of one type."""
    if len(parts) not in (2, 4):
        raise fail("zdsl.vec takes 2 or 4 values")
    like = next((p.dtype for p in parts if isinstance(p, Value)), f32)
    args = tuple(operand(p, like) for p in parts)
    if len({a.dtype for a in args}) > 1:
        raise fail("zdsl.vec parts must all have one type")
    return tracer().let("vec", args, like.vec(len(parts)))


def dot(a: Value, b: Value) -> Value:
    """Σ a_i b_i over the lanes of two float vectors."""
    return tracer().let("dot", (operand(a), operand(b, a.dtype)), a.dtype.scalar)


def dot4_i8(a, b) -> Value:
    """Σ of the products of the four signed bytes packed in a and in b (int8 dot product)."""
    args = (operand(a, u32), operand(b, u32))
    if any(not x.dtype.is_int or x.dtype.bits != 32 or x.dtype.lanes != 1 for x in args):
        raise fail("zdsl.dot4_i8 takes two 32-bit integers, each holding four packed bytes")
    tracer().features.add("int8_dot")
    return tracer().let("dot4_i8", args, i32)


# ---- subgroups ----------------------------------------------------------------------------------

def _subgroup(op: str, x, **attrs) -> Value:
    subgroup_size()
    t = tracer()
    t.features.add("subgroup")
    x = typed(x, f32)
    return t.let(op, (x.ref,), x.dtype, **attrs)


def subgroup_sum(x, cluster: int | None = None) -> Value:
    """Sum over the active lanes of the subgroup (or of each aligned cluster of `cluster` lanes)."""
    return _subgroup("sg_sum", x, cluster=_cluster(cluster))


def subgroup_max(x, cluster: int | None = None) -> Value:
    return _subgroup("sg_max", x, cluster=_cluster(cluster))


def subgroup_min(x, cluster: int | None = None) -> Value:
    return _subgroup("sg_min", x, cluster=_cluster(cluster))


def _cluster(cluster):
    if cluster is None:
        return None
    sg = subgroup_size()
    if not isinstance(cluster, int) or cluster < 1 or cluster & (cluster - 1) or cluster > sg:
        raise fail(f"cluster size must be a power of two ≤ the subgroup size {sg}, not {cluster}")
    return cluster


def subgroup_prefix_sum(x, inclusive: bool = True) -> Value:
    """Running sum over the active lanes up to this one (inclusive) or before it (exclusive)."""
    return _subgroup("sg_prefix", x, inclusive=inclusive)


def subgroup_ballot_count(cond) -> Value:
    """How many active lanes of the subgroup have `cond` true (a u32)."""
    subgroup_size()
    t = tracer()
    t.features.add("subgroup")
    return t.let("sg_count", (operand(cond, boolean),), u32)


def subgroup_broadcast(x, lane: int) -> Value:
    """The value of `x` in lane `lane` (a Python int), for every lane."""
    if not isinstance(lane, int) or not 0 <= lane < subgroup_size():
        raise fail(f"broadcast lane must be a Python int in 0..{subgroup_size() - 1}")
    return _subgroup("sg_broadcast", x, lane=lane)


def subgroup_shuffle(x, lane) -> Value:
    """The value of `x` in lane `lane` (a traced u32)."""
    subgroup_size()
    t = tracer()
    t.features.add("subgroup")
    x = typed(x, f32)
    return t.let("sg_shuffle", (x.ref, operand(lane, u32)), x.dtype)


def subgroup_shuffle_xor(x, mask: int) -> Value:
    """The value of `x` in lane (this lane ^ mask)."""
    subgroup_size()
    t = tracer()
    t.features.add("subgroup")
    x = typed(x, f32)
    return t.let("sg_shuffle_xor", (x.ref, operand(mask, u32)), x.dtype)


# ---- atomics ---------------------------------------------------------------------------------

def _atomic(op: str, buf: BufferParam, index, value) -> Value:
    if buf.dtype.name not in ("u32", "i32"):
        raise fail(f"atomics need a u32 or i32 buffer, not {buf.dtype!r}")
    at = index if buf.base is None else buf.base + index
    return tracer().let(op, (_atomic_view(buf), operand(at, u32), operand(value, buf.dtype)), buf.dtype)


def _atomic_view(buf: BufferParam):
    """The IR view of a buffer that atomics read and write."""
    buf.root.reads = buf.root.writes = True
    return buf.root.view(buf.dtype)._ir()


def atomic_add(buf: BufferParam, index, value) -> Value:
    """buf[index] += value atomically; returns the old value."""
    return _atomic("atomic_add", buf, index, value)


def atomic_max(buf: BufferParam, index, value) -> Value:
    return _atomic("atomic_max", buf, index, value)


def atomic_min(buf: BufferParam, index, value) -> Value:
    return _atomic("atomic_min", buf, index, value)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints (grid sizes)."""
    return -(-a // b)


__all__ = [
    "Derived",
    "Buffer", "Coherent", "Spec", "Const", "workgroup_id", "num_workgroups", "local_id", "local_index", "global_id",
    "workgroup_size", "subgroup_size", "subgroup_id", "lane_id", "var", "range", "if_", "else_", "where",
    "shared", "local_array", "table", "barrier", "memory_barrier", "last_workgroup", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "floor",
    "ceil", "round", "sigmoid", "silu", "softplus", "abs", "isnan", "min", "max", "pow", "clamp", "fma",
    "bitcast", "f16_bits", "bf16_bits", "unpack_bytes", "vec", "dot", "dot4_i8", "subgroup_sum", "subgroup_max",
    "subgroup_min", "subgroup_prefix_sum", "subgroup_ballot_count", "subgroup_broadcast", "subgroup_shuffle", "subgroup_shuffle_xor", "atomic_add",
    "atomic_max", "atomic_min", "cdiv", "mat_fill", "mat_load", "mat_mul_add", "mat_store", "Tracer", "Value", "Var", "f16", "i32",
]
