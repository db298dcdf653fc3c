"""Tracing: running a kernel's Python body once with traced values to record its IR.

Operators on `Value`s append `Let` statements to the block being traced; Python control flow
over Python values runs at trace time (so a Python `for` unrolls), and the language's own
`range` / `if_` open IR blocks. Every node records the kernel-source line that made it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from contextlib import contextmanager

import numpy as np

from zdsl.errors import KernelError
from zdsl.lang import ir
from zdsl.lang.types import DType, boolean, f16, f32, i32, of_python, u32

_LANG_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP = {os.path.abspath(contextlib.__file__)}


def user_loc() -> ir.Loc:
    """The innermost stack frame outside the language implementation: the kernel author's line."""
    frame = sys._getframe(1)
    while frame is not None:
        path = _author_path(frame.f_code.co_filename)
        if path is not None:
            return path, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


@functools.lru_cache(maxsize=None)
def _author_path(file: str) -> str | None:
    """A frame's file as user_loc names it, or None for the language's own (every traced
    operation asks: a kernel's trace makes tens of thousands)."""
    path = os.path.abspath(file)
    return None if os.path.dirname(path) == _LANG_DIR or path in _SKIP else path


def fail(message: str, loc: ir.Loc | None = None) -> KernelError:
    file, line = loc or user_loc()
    return KernelError(f"{file}:{line}: {message}")


_ACTIVE = threading.local()  # the trace under way on each thread: a Recorder's thread traces kernels too


class Tracer:
    """The state of one trace: the stack of open blocks and the kernel's declarations."""

    def __init__(self, subgroup_size: int | None, workgroup: tuple[int, int, int]):
        self.blocks: list[list] = [[]]
        self.open_ids: list[int] = [0]  # ids of the open blocks, outermost first
        self.block_of: dict[int, int] = {}  # temp id -> id of the block that defined it
        self.next_block = 1
        self.ntemps = 0
        self.nvars = 0
        self.shared: list[ir.Shared] = []
        self.locals: list[ir.Local] = []
        self.tables: list[ir.Table] = []
        self.features: set[str] = set()
        self.subgroup_size = subgroup_size
        self.workgroup = workgroup

    # -- blocks
    def emit(self, stmt) -> None:
        self.blocks[-1].append(stmt)

    @contextmanager
    def block(self, into: list):
        self.blocks.append(into)
        self.open_ids.append(self.next_block)
        self.next_block += 1
        try:
            yield
        finally:
            self.blocks.pop()
            self.open_ids.pop()

    def let(self, op: str, args: tuple, dtype: DType, **attrs) -> Value:
        for a in args:
            self.check_visible(a)
        temp = ir.Temp(self.ntemps, dtype)
        self.ntemps += 1
        self.block_of[temp.id] = self.open_ids[-1]
        self.emit(ir.Let(temp, op, args, user_loc(), attrs))
        return Value(temp)

    def check_visible(self, operand) -> None:
        if isinstance(operand, ir.Temp) and self.block_of.get(operand.id, 0) not in self.open_ids:
            raise fail("this value was computed inside a zdsl.range / zdsl.if_ block and used after it "
                       "ended; declare it before the block with zdsl.var(...) and update it with "
                       ".set(...) or +=")

    def var(self, init: Value, name: str) -> Var:
        if name and not name.isidentifier():
            raise fail(f"variable name {name!r} is not an identifier")
        ref = ir.VarRef(self.nvars, f"{name}_{self.nvars}" if name else f"v{self.nvars}", init.dtype)
        self.nvars += 1
        self.emit(ir.DeclareVar(ref, init.ref, user_loc()))
        return Var(ref)


def tracer() -> Tracer:
    current = getattr(_ACTIVE, "tracer", None)
    if current is None:
        raise fail("zdsl language functions can only be called inside a @zdsl.kernel body")
    return current


@contextmanager
def tracing(t: Tracer):
    """The language functions called inside (on this thread) record into trace t."""
    _ACTIVE.tracer = t
    try:
        yield t
    finally:
        _ACTIVE.tracer = None


# ---- values -------------------------------------------------------------------------------------

def operand(x, like: DType | None = None) -> ir.Operand:
    """A Value or a Python literal as an IR operand; a literal adopts the type `like`."""
    if isinstance(x, Value):
        return x.ref
    if isinstance(x, (bool, int, float, np.number, np.bool_)):
        t = of_python(x) if like is None else like.scalar
        if t.is_int and isinstance(x, (float, np.floating)):
            raise fail(f"the float literal {x} meets a {t} value; write an integer or convert with .to(f32)")
        if t.kind == "u" and x < 0:
            raise fail(f"the negative literal {x} meets a u32 value; convert with .to(i32) first")
        if t.is_int and isinstance(x, bool):
            raise fail("a bool literal meets an integer value")
        return ir.Const(t.numpy.type(x) if t.kind != "b" else bool(x), t)
    raise fail(f"a {type(x).__name__} is not a kernel value (expected a traced value or a number)")


def _is_constexpr(o) -> bool:
    return isinstance(o, (ir.Const, ir.SpecParam, ir.ConstExpr))


def apply(op: str, *xs, dtype: DType | None = None, same: bool = True, **attrs) -> Value:
    """Record op(xs): unify operand types (literals adopt the typed operand's type), check them,
    and fold constant-only arithmetic into a compile-time expression."""
    typed = [x.dtype for x in xs if isinstance(x, Value)]
    like = typed[0] if typed else None
    args = tuple(operand(x, like) for x in xs)
    if same and len({a.dtype.scalar for a in args}) > 1:
        names = " and ".join(sorted({repr(a.dtype) for a in args}))
        raise fail(f"'{op}' mixes {names}; convert one side with .to(...)")
    out = dtype or max((a.dtype for a in args), key=lambda t: t.lanes)
    if all(_is_constexpr(a) for a in args) and op in _CONSTEXPR_OPS:
        return Value(ir.ConstExpr(op, args, out))
    return tracer().let(op, args, out, **attrs)


_CONSTEXPR_OPS = {"add", "sub", "mul", "div", "mod", "min", "max", "shl", "shr", "and", "or"}


class Value:
    """A traced value: an IR operand with its type. Arithmetic records IR."""

    __slots__ = ("ref",)
    __array_priority__ = 1000  # numpy scalars on the left defer to us

    def __init__(self, ref: ir.Operand):
        self.ref = ref

    @property
    def dtype(self) -> DType:
        return self.ref.dtype

    def __repr__(self) -> str:
        return f"<traced {self.dtype!r}>"

    def __bool__(self):
        raise fail("a traced value has no Python truth value: use zdsl.if_(...) for control flow, "
                   "zdsl.where(...) to choose values, & and | instead of 'and' and 'or'")

    def __index__(self):
        raise fail("a traced value cannot be used as a Python index or range bound; "
                   "use zdsl.range(...) for a loop the GPU runs, or make the parameter a Const")

    __hash__ = object.__hash__

    # arithmetic
    def _num(self, op, other, reverse=False):
        a, b = (other, self) if reverse else (self, other)
        if op in ("and", "or", "xor", "shl", "shr", "mod") and self.dtype.is_float and op != "mod":
            raise fail(f"bitwise '{op}' on a float value; bitcast it with zdsl.bitcast(x, u32) first")
        if op in ("shl", "shr"):
            return apply(op, a, b, same=False, dtype=(a if isinstance(a, Value) else self).dtype)
        if op in ("land", "lor") or (op in ("and", "or", "xor") and self.dtype.kind == "b"):
            op = {"and": "land", "or": "lor", "xor": "ne"}.get(op, op)
            return apply(op, a, b, dtype=boolean.vec(self.dtype.lanes))
        return apply(op, a, b)

    def __add__(self, o): return self._num("add", o)
    def __radd__(self, o): return self._num("add", o, True)
    def __sub__(self, o): return self._num("sub", o)
    def __rsub__(self, o): return self._num("sub", o, True)
    def __mul__(self, o): return self._num("mul", o)
    def __rmul__(self, o): return self._num("mul", o, True)
    def __truediv__(self, o): return self._num("div", o)
    def __rtruediv__(self, o): return self._num("div", o, True)

    def __floordiv__(self, o):
        if self.dtype.is_float:
            raise fail("// on a float value; use / and zdsl.floor(...)")
        return self._num("div", o)

    def __rfloordiv__(self, o): return self._num("div", o, True)
    def __mod__(self, o): return self._num("mod", o)
    def __rmod__(self, o): return self._num("mod", o, True)
    def __and__(self, o): return self._num("and", o)
    def __rand__(self, o): return self._num("and", o, True)
    def __or__(self, o): return self._num("or", o)
    def __ror__(self, o): return self._num("or", o, True)
    def __xor__(self, o): return self._num("xor", o)
    def __rxor__(self, o): return self._num("xor", o, True)
    def __lshift__(self, o): return self._num("shl", o)
    def __rlshift__(self, o): return self._num("shl", o, True)
    def __rshift__(self, o): return self._num("shr", o)
    def __rrshift__(self, o): return self._num("shr", o, True)

    def __neg__(self):
        if self.dtype.kind == "u":
            raise fail("negating an unsigned value; convert with .to(i32) first")
        return apply("neg", self)

    def __invert__(self):
        return apply("lnot" if self.dtype.kind == "b" else "inv", self)

    def _cmp(self, op, o):
        return apply(op, self, o, dtype=boolean.vec(self.dtype.lanes))

    def __lt__(self, o): return self._cmp("lt", o)
    def __le__(self, o): return self._cmp("le", o)
    def __gt__(self, o): return self._cmp("gt", o)
    def __ge__(self, o): return self._cmp("ge", o)
    def __eq__(self, o): return self._cmp("eq", o)
    def __ne__(self, o): return self._cmp("ne", o)

    # conversions and lanes
    def to(self, dtype: DType) -> Value:
        """Numeric conversion (f32 → u32 truncates, u32 → f32 rounds, f32 → f16 rounds); a
        scalar converted to a vector type is repeated in every lane."""
        if dtype.lanes > 1 and self.dtype.lanes == 1:
            return tracer().let("splat", (self.ref,), dtype.compute.vec(dtype.lanes)).to(dtype)
        dtype = dtype.compute.vec(self.dtype.lanes)
        if dtype == self.dtype:
            return self
        if _is_constexpr(self.ref):
            return Value(ir.ConstExpr("cast", (self.ref,), dtype))
        if dtype.name == "f16" or self.dtype.name == "f16":
            tracer().features.add("f16")
        return tracer().let("cast", (self.ref,), dtype)

    def __getitem__(self, lane: int) -> Value:
        if self.dtype.lanes == 1:
            raise fail(f"indexing a scalar {self.dtype!r} value")
        if not isinstance(lane, int) or not 0 <= lane < self.dtype.lanes:
            raise fail(f"lane index must be a Python int in 0..{self.dtype.lanes - 1}")
        return tracer().let("lane", (self.ref,), self.dtype.scalar, lane=lane)

    x = property(lambda self: self[0])
    y = property(lambda self: self[1])
    z = property(lambda self: self[2])
    w = property(lambda self: self[3])


class Var(Value):
    """A mutable kernel variable (a GLSL local): the way values flow out of loops and branches."""

    __slots__ = ()

    def set(self, value) -> None:
        v = operand(value, self.dtype)
        if v.dtype != self.dtype:
            raise fail(f"assigning a {v.dtype!r} value to a {self.dtype!r} variable; convert with .to(...)")
        tracer().check_visible(v)
        tracer().emit(ir.Assign(self.ref, v, user_loc()))

    def _update(self, op, other):
        self.set(self._num(op, other))
        return self

    def __iadd__(self, o): return self._update("add", o)
    def __isub__(self, o): return self._update("sub", o)
    def __imul__(self, o): return self._update("mul", o)
    def __itruediv__(self, o): return self._update("div", o)
    def __iand__(self, o): return self._update("and", o)
    def __ior__(self, o): return self._update("or", o)
    def __ixor__(self, o): return self._update("xor", o)
    def __ilshift__(self, o): return self._update("shl", o)
    def __irshift__(self, o): return self._update("shr", o)


# ---- memory -------------------------------------------------------------------------------------

class BufferParam:
    """A storage-buffer parameter. `x[i]` loads, `x[i] = v` stores; `x.view(u32)` and `x.vec4`
    see the same memory as other element types (for packed quantized blocks, wide loads);
    `x.at(n)` sees it from element n on."""

    base = None  # elements of dtype before what index 0 reads (at())

    def __init__(self, name: str, binding: int, dtype: DType):
        self.name, self.binding, self.dtype = name, binding, dtype
        self.reads = self.writes = False
        self.views: dict[DType, ir.View] = {}

    @property
    def root(self) -> BufferParam:
        return self

    def at(self, offset) -> BufferParam:
        """The buffer from element `offset` on: x.at(n)[i] is x[n + i]. One sequence's row of a
        batch, read by a kernel written for one row; through a wider view (vec4, view(u32))
        `offset` must be a whole number of its elements."""
        return _Shifted(self, offset)

    def view(self, dtype: DType) -> BufferView:
        return BufferView(self, dtype)

    @property
    def vec2(self) -> BufferView:
        return BufferView(self, self.dtype.vec(2))

    @property
    def vec4(self) -> BufferView:
        return BufferView(self, self.dtype.vec(4))

    def __getitem__(self, index):
        return BufferView(self, self.dtype)[index]

    def __setitem__(self, index, value):
        BufferView(self, self.dtype)[index] = value

    def load(self, index, mask=None, other=0):
        return BufferView(self, self.dtype).load(index, mask, other)

    def __repr__(self):
        return f"<buffer {self.name}: {self.dtype!r}>"


class _Shifted(BufferParam):
    """A buffer parameter seen from an offset (BufferParam.at): the parameter's binding, flags and
    views, indices moved by `base` elements."""

    def __init__(self, buf: BufferParam, offset):
        self._root = buf.root
        self.name, self.binding, self.dtype = buf.name, buf.binding, buf.dtype
        self.base = offset if buf.base is None else buf.base + offset

    @property
    def root(self) -> BufferParam:
        return self._root


def _index(index) -> ir.Operand:
    ref = operand(index, u32)
    if not ref.dtype.is_int or ref.dtype.lanes != 1:
        raise fail(f"an index must be a scalar integer, not {ref.dtype!r}")
    return ref


def _storage_feature(t: Tracer, dtype: DType) -> None:
    if dtype.bits == 8:
        t.features.add("int8_storage")
    elif dtype.bits == 16:
        t.features.add("int16_storage" if dtype.name != "f16" else "f16")


class BufferView:
    def __init__(self, buf: BufferParam, dtype: DType):
        self.buf, self.dtype = buf.root, dtype
        self.base = None
        if buf.base is not None:  # the offset in this view's elements
            ratio = buf.dtype.bits * buf.dtype.lanes, dtype.bits * dtype.lanes
            self.base = buf.base * (ratio[0] // ratio[1]) if ratio[0] >= ratio[1] else buf.base // (ratio[1] // ratio[0])

    def _index(self, index) -> ir.Operand:
        return _index(index if self.base is None else self.base + index)

    def _ir(self) -> ir.View:
        t = tracer()
        _storage_feature(t, self.dtype)
        if self.dtype not in self.buf.views:
            self.buf.views[self.dtype] = ir.View(self.buf.name, self.buf.binding, self.dtype)
        return self.buf.views[self.dtype]

    def load(self, index, mask=None, other=0) -> Value:
        """x[index], or `other` where `mask` is false (the load does not happen there)."""
        self.buf.reads = True
        view = self._ir()
        out = self.dtype.compute
        if mask is None:
            return tracer().let("load", (view, self._index(index)), out)
        return tracer().let("load", (view, self._index(index), operand(mask, boolean), operand(other, out)), out)

    __getitem__ = load

    def __setitem__(self, index, value) -> None:
        self.buf.writes = True
        view = self._ir()
        v = operand(value, self.dtype.compute)
        if v.dtype.lanes != self.dtype.lanes or v.dtype.kind != self.dtype.compute.kind:
            raise fail(f"storing a {v.dtype!r} value into {self.buf.name} of {self.dtype!r}; convert with .to(...)")
        if v.dtype.scalar != self.dtype.compute.scalar and self.dtype.name == "f16":
            tracer().features.add("f16")
        tracer().check_visible(v)
        tracer().emit(ir.Store(view, self._index(index), v, user_loc()))


class ArrayRef:
    """An array declared by the kernel: `a[i]` loads, `a[i] = v` stores (if writable)."""

    load_op = "shared_load"
    what = "a shared array"

    def __init__(self, decl):
        self.decl = decl

    @property
    def dtype(self) -> DType:
        return self.decl.dtype

    def __getitem__(self, index) -> Value:
        return tracer().let(self.load_op, (self.decl, _index(index)), self.dtype.compute)

    def __setitem__(self, index, value) -> None:
        v = operand(value, self.dtype.compute)
        if v.dtype != self.dtype.compute:
            raise fail(f"storing a {v.dtype!r} value into {self.what} of {self.dtype!r}")
        tracer().check_visible(v)
        tracer().emit(ir.Store(self.decl, _index(index), v, user_loc()))


class SharedArray(ArrayRef):
    """Workgroup-shared memory: `s[i]`, `s[i] = v`; synchronize with zdsl.barrier()."""


class LocalArray(ArrayRef):
    """A per-invocation array: `a[i]` with i known only at run time."""

    load_op, what = "local_load", "a local array"


class TableArray(ArrayRef):
    """A constant table: read-only."""

    load_op, what = "table_load", "a constant table"

    def __setitem__(self, index, value):
        raise fail("a zdsl.table is constant; use zdsl.local_array for values that change")


def typed(x, dtype: DType) -> Value:
    return x if isinstance(x, Value) else Value(operand(x, dtype))


__all__ = ["Tracer", "Value", "Var", "BufferParam", "BufferView", "SharedArray", "apply", "operand",
           "tracer", "fail", "user_loc", "typed", "f32", "f16", "i32", "u32"]
