"""Cooperative matrices: a subgroup's tile of a matrix product, held across its invocations.

A GPU with matrix units (VK_KHR_cooperative_matrix: NVIDIA's tensor cores, RDNA's WMMA)
multiplies small tiles in one instruction when the whole subgroup holds them together. The
language has one type and four operations for it:

- `mat_fill(value, rows, cols)`: an accumulator tile with every element `value`;
- `mat_load(src, offset, stride, rows, cols, use)`: a tile of a shared array or a buffer,
  element (r, c) at src[offset + r·stride + c] (row-major) or src[offset + c·stride + r]
  (`column_major=True`); `use` says which operand it will be: "a" (left, rows × k), "b"
  (right, k × cols) or "acc". In a shared array of vectors (f16 × 4: one 8-byte store fills
  four elements) offset and stride count vectors, and a row's elements run on through the lanes;
- `mat_mul_add(a, b, c)`: c + a·b, the product's elements summed in f32;
- `mat_store(m, dst, offset, stride)`: the tile back, laid out as mat_load reads it.

Which invocation holds which element is the device's business, so a tile is only loaded, multiplied
and stored whole: every invocation of the subgroup takes part with the same offsets (the
interpreter checks both). A tile stored to shared memory is visible to the workgroup after a
barrier(). The shapes are the ones every device with matrix units offers: 16 × 16, f16 operands
and an f32 (or f16) accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from zdsl.lang import ir
from zdsl.lang.trace import BufferParam, SharedArray, Value, fail, operand, tracer, user_loc
from zdsl.lang.types import DType, f32, u32

SIZE = 16
USES = {"a": "gl_MatrixUseA", "b": "gl_MatrixUseB", "acc": "gl_MatrixUseAccumulator"}


@dataclass(frozen=True)
class MatrixType:
    """A subgroup's rows × cols tile of `element`, for `use` "a", "b" or "acc"."""
    element: DType
    rows: int
    cols: int
    use: str
    lanes = 1  # one value per invocation, as far as the IR's type rules go
    kind = "m"
    name = "matrix"

    @property
    def scalar(self) -> MatrixType:
        return self

    compute = scalar

    @property
    def is_float(self) -> bool:
        return False

    is_int = is_float

    @property
    def glsl(self) -> str:
        return f"coopmat<{self.element.glsl}, gl_ScopeSubgroup, {self.rows}, {self.cols}, {USES[self.use]}>"

    def __repr__(self) -> str:
        return f"matrix<{self.element!r}, {self.rows}x{self.cols}, {self.use}>"


def _shape(rows: int, cols: int) -> None:
    if (rows, cols) != (SIZE, SIZE):
        raise fail(f"a cooperative matrix is {SIZE} x {SIZE} here, not {rows} x {cols}")


def _matrix(x, what: str, use: str | None = None) -> MatrixType:
    if not isinstance(x, Value) or not isinstance(x.dtype, MatrixType):
        raise fail(f"{what} must be a cooperative matrix (zdsl.mat_load / mat_fill)")
    if use and x.dtype.use != use:
        raise fail(f"{what} is a {x.dtype!r}; it must be loaded with use={use!r}")
    return x.dtype


def _memory(src, what: str):
    """The IR array of a shared array or a buffer, and its element type (a vector's lane type)."""
    if isinstance(src, SharedArray):
        return src.decl, src.dtype.scalar
    if isinstance(src, BufferParam):
        if src.base is not None:
            raise fail(f"{what} is a whole buffer, not one seen from an offset (at()): add it to the tile's offset")
        view = src.view(src.dtype)._ir()
        return view, src.dtype
    raise fail(f"{what} is a zdsl.shared array or a Buffer parameter, not {type(src).__name__}")


def _uses_matrices() -> None:
    t = tracer()
    t.features.update({"coopmat", "f16", "subgroup"})


def mat_fill(value, rows: int = SIZE, cols: int = SIZE, dtype: DType = f32) -> Value:
    """An accumulator tile whose elements are all `value`."""
    _shape(rows, cols)
    _uses_matrices()
    v = operand(value, dtype)
    if v.dtype != dtype:
        v = Value(v).to(dtype).ref
    return tracer().let("mat_fill", (v,), MatrixType(dtype, rows, cols, "acc"))


def mat_load(src, offset, stride, rows: int = SIZE, cols: int = SIZE, use: str = "a",
             column_major: bool = False) -> Value:
    """The rows × cols tile of `src` at `offset`, `stride` elements between rows (columns with
    column_major), for use "a", "b" or "acc"."""
    _shape(rows, cols)
    if use not in USES:
        raise fail(f"use is one of {', '.join(USES)}, not {use!r}")
    _uses_matrices()
    array, element = _memory(src, "mat_load's source")
    if isinstance(src, BufferParam):
        src.reads = True
    if element.name not in ("f16", "f32") or (use != "acc" and element.name != "f16"):
        raise fail(f"a matrix for use {use!r} is loaded from f16{' or f32' if use == 'acc' else ''} "
                   f"memory, not {element!r}")
    return tracer().let("mat_load", (array, operand(offset, u32), operand(stride, u32)),
                        MatrixType(element, rows, cols, use), column_major=column_major)


def mat_mul_add(a, b, c) -> Value:
    """c + a·b for an "a" tile (m × k), a "b" tile (k × n) and an accumulator (m × n)."""
    ta, tb, tc = _matrix(a, "mat_mul_add's a", "a"), _matrix(b, "mat_mul_add's b", "b"), _matrix(c, "mat_mul_add's c", "acc")
    if ta.element != tb.element:
        raise fail(f"mat_mul_add multiplies tiles of one element type, not {ta!r} and {tb!r}")
    return tracer().let("mat_mul_add", (a.ref, b.ref, c.ref), tc)


def mat_store(m, dst, offset, stride, column_major: bool = False) -> None:
    """Tile m into `dst` (a shared array or a buffer of its element type) as mat_load reads it."""
    tm = _matrix(m, "mat_store's tile")
    array, element = _memory(dst, "mat_store's destination")
    if isinstance(dst, BufferParam):
        dst.writes = True
    if element != tm.element:
        raise fail(f"mat_store writes a {tm!r} into {element!r} memory; the types must match")
    t = tracer()
    off, st = operand(offset, u32), operand(stride, u32)
    for o in (m.ref, off, st):
        t.check_visible(o)
    t.emit(ir.MatrixStore(m.ref, array, off, st, column_major, user_loc()))


__all__ = ["MatrixType", "mat_fill", "mat_load", "mat_mul_add", "mat_store"]
