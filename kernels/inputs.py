"""Random inputs for kernel examples (`@kernel.example`): valid quantized rows, activations, the
step buffer, KV caches, and the sizes of the small check versions whose references are cheap.
The tuner checks and times candidates on them, the benches time them, the tests check them."""

from __future__ import annotations

import numpy as np

from zdsl.kernels.kvcache import KV_FORMATS
from zdsl.kernels.q8_1 import q8_1_buffers, q8_1_ref
from zdsl.kernels.quant import FORMATS
from zdsl.kernels.steps import STEP_WORDS

CHECK_ROWS = 45      # output rows of a check case: not a multiple of any ROWS, so tails are covered
CHECK_CTX = 300      # context of an attention check case (a few splits of 64 rows)
CHECK_VOCAB = 5000   # vocabulary of a sampling check case (two or more candidate groups)


def rows(rng, qtype: str, n: int, k: int) -> np.ndarray:
    """n random rows of k values in a weight type, as bytes, with finite f16 scales and E8M0
    exponents of 2⁻¹⁰ … 2⁻¹ (speed does not depend on the values; references dequantize them)."""
    f = FORMATS[qtype]
    if qtype in ("f32", "f16", "bf16"):
        x = rng.standard_normal((n, k), dtype=np.float32)
        return (x if qtype == "f32" else x.astype(np.float16) if qtype == "f16"
                else (x.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8).reshape(-1)
    w = rng.integers(0, 256, (n, k // f.block, f.nbytes), dtype=np.uint8)
    f.finite_scales(rng, w, 0.01)
    return w.reshape(-1)


def row_bytes(qtype: str, k: int) -> int:
    f = FORMATS[qtype]
    return k // f.block * f.nbytes


def normal(rng, n: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(n) * scale).astype(np.float32)


def activations(rng, k: int, q8: bool) -> dict:
    """An input vector as the graph writes it: f32 `x`, or its Q8_1 buffers `xq`, `xd`."""
    x = normal(rng, k)
    return dict(zip(("xq", "xd"), q8_1_buffers(x))) if q8 else {"x": x}


def q8_1_scales(x) -> np.ndarray:
    """The Q8_1 scale pairs a kernel writes for x, to check against: d as the kernels compute it,
    s unchecked (NaN). The quants themselves may differ from numpy's by a step where a value
    sits on a rounding half; the scales may not."""
    d = q8_1_ref(x)[1].reshape(-1)
    return np.stack([d, np.full(d.size, np.nan, np.float32)], axis=1).reshape(-1)


def step_words(pos: int, length: int, counter: int = 0) -> np.ndarray:
    s = np.zeros(STEP_WORDS, np.uint32)
    s[0], s[1], s[3] = pos, length, counter
    return s


def kv_cache(rng, ctx: int, n_kv: int, d: int, kv_type: str = "f16") -> np.ndarray:
    """A cache of random rows in a KV format (kvcache.py), as the f16 units kernels declare."""
    rows = rng.standard_normal((ctx * n_kv, d)).astype(np.float32)
    return KV_FORMATS[kv_type].encode(rows).view(np.float16).reshape(-1)


def copies(array, n: int) -> list:
    """The same bytes n − 1 more times (each upload lands at its own address)."""
    return [array] * (n - 1)


def experts(rng, n: int, slots: int, rows: int = 1) -> np.ndarray:
    """`slots` distinct experts of n, in random order, for each of `rows` rows one after another."""
    return np.concatenate([rng.permutation(n)[:slots] for _ in range(rows)]).astype(np.uint32)
