"""Every value operation of the language, once: its GLSL form and its numpy meaning.

Both backends are driven by this table, so the interpreter is the executable definition of
what the GLSL computes. GLSL templates use {0}, {1}, ... for operands; numpy functions take
numpy arrays (one row per invocation) of the operand types and return the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Op:
    glsl: str
    numpy: Callable
    helper: str = ""  # GLSL function the template needs, emitted once per kernel


def _trunc_div(a, b):
    if np.issubdtype(np.asarray(a).dtype, np.floating):
        return a / b
    if np.issubdtype(np.asarray(a).dtype, np.signedinteger):
        q = np.abs(a) // np.maximum(np.abs(b), 1)
        return (q * np.sign(a) * np.sign(b)).astype(np.asarray(a).dtype)
    return a // np.maximum(b, 1)


def _rem(a, b):
    if np.issubdtype(np.asarray(a).dtype, np.floating):
        return a - b * np.floor(a / b)  # GLSL mod()
    return np.fmod(a, np.maximum(b, 1)).astype(np.asarray(a).dtype)


def _f32(f):
    return lambda *a: f(*a).astype(np.float32) if np.asarray(a[0]).dtype == np.float32 else f(*a)


def _softplus(x):
    return np.maximum(x, 0) + np.log(1 + np.exp(-np.abs(x)))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


BINARY = {
    "add": Op("({0} + {1})", lambda a, b: a + b),
    "sub": Op("({0} - {1})", lambda a, b: a - b),
    "mul": Op("({0} * {1})", lambda a, b: a * b),
    "div": Op("({0} / {1})", _trunc_div),
    "mod": Op("{mod}", _rem),  # spelled per type by the GLSL backend
    "and": Op("({0} & {1})", lambda a, b: a & b),
    "or": Op("({0} | {1})", lambda a, b: a | b),
    "xor": Op("({0} ^ {1})", lambda a, b: a ^ b),
    "shl": Op("({0} << {1})", lambda a, b: a << b.astype(a.dtype)),
    "shr": Op("({0} >> {1})", lambda a, b: a >> b.astype(a.dtype)),
    "lt": Op("({0} < {1})", lambda a, b: a < b),
    "le": Op("({0} <= {1})", lambda a, b: a <= b),
    "gt": Op("({0} > {1})", lambda a, b: a > b),
    "ge": Op("({0} >= {1})", lambda a, b: a >= b),
    "eq": Op("({0} == {1})", lambda a, b: a == b),
    "ne": Op("({0} != {1})", lambda a, b: a != b),
    "land": Op("({0} && {1})", lambda a, b: a & b),
    "lor": Op("({0} || {1})", lambda a, b: a | b),
    "min": Op("min({0}, {1})", np.minimum),
    "max": Op("max({0}, {1})", np.maximum),
    "pow": Op("pow({0}, {1})", _f32(np.power)),
}

UNARY = {
    "neg": Op("(-{0})", lambda a: -a),
    "inv": Op("(~{0})", lambda a: ~a),
    "lnot": Op("(!{0})", lambda a: ~a),
    "abs": Op("abs({0})", np.abs),
    "exp": Op("exp({0})", _f32(np.exp)),
    "exp2": Op("exp2({0})", _f32(np.exp2)),
    "log": Op("log({0})", _f32(np.log)),
    "log2": Op("log2({0})", _f32(np.log2)),
    "sqrt": Op("sqrt({0})", _f32(np.sqrt)),
    "rsqrt": Op("inversesqrt({0})", _f32(lambda a: 1 / np.sqrt(a))),
    "sin": Op("sin({0})", _f32(np.sin)),
    "cos": Op("cos({0})", _f32(np.cos)),
    "tanh": Op("tanh({0})", _f32(np.tanh)),
    "floor": Op("floor({0})", np.floor),
    "ceil": Op("ceil({0})", np.ceil),
    "round": Op("roundEven({0})", np.round),
    "sigmoid": Op("zsigmoid({0})", _f32(_sigmoid),
                  "T zsigmoid(T x) { return T(1) / (T(1) + exp(-x)); }"),
    "silu": Op("zsilu({0})", _f32(lambda x: x * _sigmoid(x)),
               "T zsilu(T x) { return x / (T(1) + exp(-x)); }"),
    "softplus": Op("zsoftplus({0})", _f32(_softplus),
                   "T zsoftplus(T x) { return max(x, T(0)) + log(T(1) + exp(-abs(x))); }"),
    "isnan": Op("isnan({0})", np.isnan),
}

TERNARY = {
    "select": Op("({0} ? {1} : {2})", lambda c, a, b: np.where(c, a, b)),
    "fma": Op("fma({0}, {1}, {2})", lambda a, b, c: a * b + c),
    "clamp": Op("clamp({0}, {1}, {2})", lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi)),
}

HELPER_TYPES = ("float", "vec2", "vec4")  # + the f16 forms when the kernel uses f16


def dot4_i8(a, b):
    """Σ of the four signed bytes of a times those of b (OpSDot, packed 4x8 format)."""
    ab = np.ascontiguousarray(a, dtype=np.uint32).view(np.int8).reshape(-1, 4).astype(np.int32)
    bb = np.ascontiguousarray(b, dtype=np.uint32).view(np.int8).reshape(-1, 4).astype(np.int32)
    return (ab * bb).sum(axis=1).reshape(np.shape(a)).astype(np.int32)


def f16_bits_to_f32(u):
    return np.asarray(u, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def bf16_bits_to_f32(u):
    return (np.asarray(u, dtype=np.uint32) << 16).astype(np.uint32).view(np.float32)
