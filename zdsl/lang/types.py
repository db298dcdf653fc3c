"""Element types of the DSL.

Compute types are what values in a kernel have: f32, f16, i32, u32, bool, and their 2- and
4-lane vectors. Storage-only types (u8, i8, u16, i16, bf16) exist in buffers; loading widens
them to a compute type (u8 → u32, bf16 → f32, ...) and storing narrows back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    kind: str  # "f" float, "i" signed, "u" unsigned, "b" bool
    bits: int
    lanes: int = 1

    def __repr__(self) -> str:
        return self.name if self.lanes == 1 else f"{self.name}x{self.lanes}"

    def vec(self, lanes: int) -> DType:
        return DType(self.name, self.kind, self.bits, lanes)

    @functools.cached_property
    def scalar(self) -> DType:
        return DType(self.name, self.kind, self.bits)

    @property
    def nbytes(self) -> int:
        return max(1, self.bits // 8) * self.lanes

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @functools.cached_property
    def compute(self) -> DType:
        """The type a loaded element has in registers."""
        return _WIDEN.get(self.name, self.scalar).vec(self.lanes)

    @functools.cached_property
    def numpy(self) -> np.dtype:  # cached: the interpreter asks for it at every operation
        return np.dtype(_NUMPY[self.name])

    @functools.cached_property
    def glsl(self) -> str:
        base, vec = _GLSL[self.name]
        return base if self.lanes == 1 else f"{vec}{self.lanes}"

    # Annotation `Buffer[f32]` is the usual form, but `f32[:]` would be a natural slip: say so.
    def __getitem__(self, _):
        raise TypeError(f"write Buffer[{self.name}] for a buffer parameter")


f32 = DType("f32", "f", 32)
f16 = DType("f16", "f", 16)
bf16 = DType("bf16", "f", 16)
i32 = DType("i32", "i", 32)
u32 = DType("u32", "u", 32)
i16 = DType("i16", "i", 16)
u16 = DType("u16", "u", 16)
i8 = DType("i8", "i", 8)
u8 = DType("u8", "u", 8)
boolean = DType("bool", "b", 1)

ALL = {t.name: t for t in (f32, f16, bf16, i32, u32, i16, u16, i8, u8, boolean)}

_WIDEN = {"u8": u32, "u16": u32, "i8": i32, "i16": i32, "bf16": f32}
_NUMPY = {"f32": "float32", "f16": "float16", "bf16": "uint16", "i32": "int32", "u32": "uint32",
          "i16": "int16", "u16": "uint16", "i8": "int8", "u8": "uint8", "bool": "bool"}
_GLSL = {"f32": ("float", "vec"), "f16": ("float16_t", "f16vec"), "bf16": ("uint16_t", "u16vec"),
         "i32": ("int", "ivec"), "u32": ("uint", "uvec"), "i16": ("int16_t", "i16vec"),
         "u16": ("uint16_t", "u16vec"), "i8": ("int8_t", "i8vec"), "u8": ("uint8_t", "u8vec"),
         "bool": ("bool", "bvec")}


def of_python(value) -> DType:
    """The type a bare Python literal takes when it meets no other typed operand."""
    if isinstance(value, (bool, np.bool_)):
        return boolean
    if isinstance(value, (int, np.integer)):
        return i32 if value < 0 else u32
    if isinstance(value, (float, np.floating)):
        return f32
    raise TypeError(f"{type(value).__name__} is not a kernel value")
