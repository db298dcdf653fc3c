"""GGUF block formats against gguf-py (and, opt-in, against ggml's own C reference).

Decoding: random blocks of every type decode bit for bit as `gguf.quants.dequantize` does
(NaN-aware: a block with an inf or NaN scale gives NaN in the same places).

Encoding, bounds per block of 256 (32 for Q8_0/Q8_1) relative to the block's max |x|:
- Q8_0 / Q8_1: |x − d·q| ≤ d₃₂/2 + 127·|d − d₃₂|, d₃₂ = max|x| / 127 before its f16 rounding
  (relative 2⁻¹¹, or 2⁻²⁵ absolute where d is subnormal);
  Q8_0 bytes equal `gguf.quants.quantize` exactly (both round halves away from zero, as C roundf).
- RMS error ≤ 0.035 (Q4_K), 0.018 (Q5_K), 0.009 (Q6_K) × max|x|; the worst measured over 4096
  blocks each of Gaussian, t(2), one-sided uniform, outlier, mixed-scale and sparse data:
  0.0296, 0.0151, 0.0081. Blocks with max|x| below ~0.06 (Q4_K) have subnormal f16 scales, whose
  rounding adds up to 2⁻²⁵·max(sc·q) absolute.
- N(0, 1) values: RMS error / σ ≤ 0.0716 / 0.0360 / 0.0175 / 0.0054 for Q4_K / Q5_K / Q6_K / Q8_0;
  measured 0.0711 / 0.0356 / 0.0173 / 0.00535 (llama.cpp's reference quantizer: 0.0713 / 0.0361 /
  0.0177 / 0.00536). Opt-in: no more RMS error than llama.cpp's on N(0, 1) and t(4) data, and
  Q8_1 bytes equal to its quantize_row_q8_1_ref.
"""

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from zdsl.errors import ZdslError
from zdsl.kernels import quant_numpy as F
from zdsl.kernels.quant_numpy import QuantType as Q
from budget import examples

BLOCK_TYPES = sorted(F.SUPPORTED_DEQUANT - {Q.F32, Q.F16, Q.BF16, Q.Q8_1})
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
# Byte offsets of the f16 factors inside each block (the rest of a block is codes and sub-scales).
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
    Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ3_XXS: (0,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,),
}
RMS_BOUND = {Q.Q4_K: 0.035, Q.Q5_K: 0.018, Q.Q6_K: 0.009}
# Small blocks have subnormal f16 scales, rounded to 2⁻²⁴ absolute: adds 2⁻²⁵ · (max sc·q + 63 for dmin).
SUBNORMAL = {Q.Q4_K: 2.0**-25 * (63 * 15 + 63), Q.Q5_K: 2.0**-25 * (63 * 31 + 63), Q.Q6_K: 2.0**-25 * 128 * 32}
GAUSS_BOUND = {Q.Q4_K: 0.0716, Q.Q5_K: 0.0360, Q.Q6_K: 0.0175, Q.Q8_0: 0.0054}


def gguf_dequant(raw: np.ndarray, qtype, shape) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(quants.dequantize(raw.reshape(-1, raw.shape[-1]), qtype), np.float32).reshape(shape)


def assert_same_bits(ours: np.ndarray, ref: np.ndarray):
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def random_blocks(rng, qtype, rows: int, k: int, finite: bool) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, F.row_bytes(qtype, k)), dtype=np.uint8)
    if finite:
        blocks = raw.reshape(rows, -1, F.block_shape(qtype)[1])
        for at in F16_FIELDS.get(qtype, ()):
            h = np.ascontiguousarray(blocks[..., at:at + 2]).view(np.uint16)
            h = np.where((h & 0x7C00) == 0x7C00, h ^ 0x4000, h)  # exponent 31 (inf/NaN) -> 15
            blocks[..., at:at + 2] = h.view(np.uint8)
        if qtype == Q.IQ1_M:  # its d sits in the top nibbles of four u16
            h = F.iq1_m_d_bits(blocks)
            F.set_iq1_m_d_bits(blocks, np.where((h & 0x7C00) == 0x7C00, h ^ 0x4000, h))
        if qtype == Q.MXFP4:  # 2^(e − 128) · 12 stays finite for e ≤ 252
            blocks[..., 0] = np.minimum(blocks[..., 0], 252)
    return raw


# ---- layout and errors --------------------------------------------------------------------------

def test_block_shapes_match_gguf_and_q8_1_is_ggmls_36_byte_block():
    for t in F.SUPPORTED_DEQUANT - {Q.Q8_1}:
        assert F.block_shape(t) == GGML_QUANT_SIZES[t], t.name
    assert F.block_shape(Q.Q8_1) == (32, 36)
    assert F.row_bytes(Q.Q4_K, 2048) == 8 * 144 and F.row_bytes(Q.BF16, 7) == 14
    assert F.SUPPORTED_QUANT == {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q8_0, Q.Q8_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4}


def test_user_errors_are_one_line_zdsl_errors():
    cases = [
        (lambda: F.row_bytes(Q.Q4_K, 300), "multiple of 256"),
        (lambda: F.dequantize(b"\0" * 143, Q.Q4_K, (256,)), "takes 144 bytes, got 143"),
        (lambda: F.dequantize(b"", Q.Q8_0, ()), "shape"),
        (lambda: F.dequantize(b"\0" * 66, Q.TQ2_0, (256,)), "TQ2_0 is not supported by dequantize"),
        (lambda: F.quantize(np.zeros(32), Q.Q4_1), "Q4_1 is not supported by quantize; supported: F32"),
        (lambda: F.block_shape(12345), "12345 is not supported"),
        (lambda: F.quantize(np.float32(1), Q.Q8_0), "scalar"),
        (lambda: F.quantize(np.full(256, np.nan), Q.Q4_K), "NaN"),
        (lambda: F.quantize(np.full(32, 1e7), Q.Q8_0), "too large"),
        (lambda: F.quantize(np.linspace(-1e9, 1e9, 256), Q.Q4_K), "too large"),
        (lambda: F.k_scales(b"\0" * 34, Q.Q8_0, (32,)), "Q8_0 is not supported by k_scales"),
        (lambda: F.unpack(b"\0" * 4, Q.F32, (1,)), "F32 is not supported by unpack"),
    ]
    for call, text in cases:
        with pytest.raises(ZdslError, match=text) as e:
            call()
        assert "\n" not in str(e.value)
    assert "Q6_K" in str(pytest.raises(ZdslError, F.quantize, np.zeros(32), Q.Q4_1).value)


# ---- decoding ------------------------------------------------------------------------------------

@settings(max_examples=examples(300))
@given(qtype=st.sampled_from(BLOCK_TYPES + FLOAT_TYPES), lead=st.lists(st.integers(1, 3), max_size=2),
       nblocks=st.integers(1, 5), finite=st.booleans(), as_bytes=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_dequantize_equals_gguf_bit_for_bit(qtype, lead, nblocks, finite, as_bytes, seed):
    rng = np.random.default_rng(seed)
    k = F.block_shape(qtype)[0] * nblocks if qtype not in FLOAT_TYPES else nblocks * 13
    rows = int(np.prod(lead, dtype=np.int64))
    raw = random_blocks(rng, qtype, rows, k, finite)
    shape = (*lead, k)
    ours = F.dequantize(raw.tobytes() if as_bytes else raw.reshape(*lead, -1), qtype, shape)
    assert_same_bits(ours, gguf_dequant(raw, qtype, shape))
    if finite and qtype not in FLOAT_TYPES:
        assert np.isfinite(ours).all()


def test_dequantize_reads_memmaps_and_typed_arrays(tmp_path):
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, Q.Q5_K, 6, 512, finite=True)
    path = tmp_path / "t.bin"
    path.write_bytes(b"xyz" + raw.tobytes())  # an odd offset: views must not need alignment
    mm = np.memmap(path, np.uint8, "r", offset=3, shape=raw.shape)
    assert_same_bits(F.dequantize(mm, Q.Q5_K, (2, 3, 512)), gguf_dequant(raw, Q.Q5_K, (2, 3, 512)))
    x = rng.standard_normal((4, 5)).astype(np.float32)
    assert np.array_equal(F.dequantize(x, Q.F32, (4, 5)), x)  # any dtype is taken as its bytes
    assert F.dequantize(b"", Q.Q4_K, (0, 256)).shape == (0, 256)


@settings(max_examples=examples(60))
@given(qtype=st.sampled_from(BLOCK_TYPES), rows=st.integers(1, 3), nblocks=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_unpack_codes_rebuild_the_values(qtype, rows, nblocks, seed):
    rng = np.random.default_rng(seed)
    k = F.block_shape(qtype)[0] * nblocks
    raw = random_blocks(rng, qtype, rows, k, finite=True)
    c = F.unpack(raw, qtype, (rows, k))
    group = {Q.Q2_K: 16, Q.Q3_K: 16, Q.Q6_K: 16, Q.Q4_K: 32, Q.Q5_K: 32, Q.IQ4_XS: 32, Q.IQ2_XS: 16, Q.IQ2_S: 16,
             Q.IQ1_M: 16}.get(qtype, 32)
    assert c.q.dtype == np.int8 and c.q.shape == (rows, k) and c.group == group
    assert c.scale.shape == (rows, k // group)
    assert (c.bias is None) == (qtype not in {Q.Q4_1, Q.Q5_1, Q.Q2_K, Q.Q4_K, Q.Q5_K})
    lo, hi = {Q.Q4_0: (-8, 7), Q.Q4_1: (0, 15), Q.Q5_0: (-16, 15), Q.Q5_1: (0, 31), Q.Q8_0: (-128, 127),
              Q.Q2_K: (0, 3), Q.Q3_K: (-4, 3), Q.Q4_K: (0, 15), Q.Q5_K: (0, 31), Q.Q6_K: (-32, 31),
              Q.IQ4_NL: (-127, 113), Q.IQ4_XS: (-127, 113), Q.MXFP4: (-12, 12), Q.IQ3_XXS: (-62, 62),
              Q.IQ2_XXS: (-43, 43), Q.IQ2_XS: (-43, 43), Q.IQ2_S: (-43, 43), Q.IQ3_S: (-15, 15),
              Q.IQ1_S: (-9, 9), Q.IQ1_M: (-9, 9)}[qtype]
    assert lo <= c.q.min() and c.q.max() <= hi
    assert_same_bits(c.values(), gguf_dequant(raw, qtype, (rows, k)))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M])
def test_iq_grid_blocks_equal_gguf_bit_for_bit(qtype):
    """Many blocks of each grid type at once (every grid index and sign pattern is likely met),
    finite and not."""
    rng = np.random.default_rng(int(qtype))
    for finite in (True, False):
        raw = random_blocks(rng, qtype, 32, 256 * 16, finite)
        assert_same_bits(F.dequantize(raw, qtype, (32, 4096)), gguf_dequant(raw, qtype, (32, 4096)))


def test_iq_sign_patterns_are_ggmls():
    """The 128 sign bytes IQ2/IQ3 blocks index, computed from parity, equal ggml's ksigns table."""
    assert np.array_equal(F.sign_byte(np.arange(128)), np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8))
    assert F.iq3_grid().shape == (256, 4) and F.iq3_grid().min() == 4 and F.iq3_grid().max() == 62


def test_k4_scale_packing_matches_gguf_and_round_trips():
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (500, 12), dtype=np.uint8)
    sc, m = F.unpack_scale_min_k4(packed)
    ref_sc, ref_m = quants.Q4_K.get_scale_min(packed)
    assert np.array_equal(sc, ref_sc) and np.array_equal(m, ref_m)
    assert np.array_equal(F.pack_scale_min_k4(sc, m), packed)
    sc, m = rng.integers(0, 64, (2, 7, 8), dtype=np.uint8)
    assert all(np.array_equal(a, b) for a, b in zip(F.unpack_scale_min_k4(F.pack_scale_min_k4(sc, m)), (sc, m)))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_scales_factor_the_group_scales(qtype):
    raw = random_blocks(np.random.default_rng(5), qtype, 3, 512, finite=True)
    ks, c = F.k_scales(raw, qtype, (3, 512)), F.unpack(raw, qtype, (3, 512))
    n_sub = 16 if qtype == Q.Q6_K else 8
    assert ks.d.shape == (3, 2) and ks.sc.shape == (3, 2, n_sub)
    assert np.array_equal(ks.d[..., None] * ks.sc.astype(np.float32), c.scale.reshape(3, 2, n_sub))
    if qtype == Q.Q6_K:
        assert ks.dmin is None and ks.m is None and ks.sc.dtype == np.int8
    else:
        assert ks.sc.max() < 64 and ks.m.max() < 64
        assert np.array_equal(-(ks.dmin[..., None] * ks.m.astype(np.float32)), c.bias.reshape(3, 2, 8))


# ---- encoding ------------------------------------------------------------------------------------

def sample(kind: str, rng, shape) -> np.ndarray:
    n = shape[-1]
    if kind == "gauss":
        return rng.standard_normal(shape)
    if kind == "t2":
        return rng.standard_t(2, shape)
    if kind == "positive":
        return rng.uniform(0.5, 1.0, shape)
    if kind == "negative":
        return rng.uniform(-1.0, -0.5, shape)
    if kind == "outliers":
        return rng.standard_normal(shape) * np.where(rng.random(shape) < 0.01, 100.0, 1.0)
    if kind == "mixed":  # sub-blocks of very different size in one block
        size = 10.0 ** rng.integers(-2, 1, (*shape[:-1], n // 32, 1))
        return rng.standard_normal(shape) * size.repeat(32, -1).reshape(shape)
    return rng.standard_normal(shape) * (rng.random(shape) < 0.05)  # sparse


KINDS = ["gauss", "t2", "positive", "negative", "outliers", "mixed", "sparse"]


@settings(max_examples=examples(150))
@given(qtype=st.sampled_from([Q.Q8_0, Q.Q8_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]), kind=st.sampled_from(KINDS),
       rows=st.integers(1, 3), nblocks=st.integers(1, 3), log_scale=st.floats(-1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_round_trip_within_bounds_as_valid_gguf_blocks(qtype, kind, rows, nblocks, log_scale, seed):
    rng = np.random.default_rng(seed)
    block = 32 if qtype in (Q.Q8_0, Q.Q8_1) else 256
    x = (sample(kind, rng, (rows, nblocks * 256)) * 10.0 ** log_scale).astype(np.float32)
    b = F.quantize(x, qtype)
    assert b.dtype == np.uint8 and b.shape == (rows, F.row_bytes(qtype, x.shape[1]))
    y = F.dequantize(b, qtype, x.shape)
    if qtype != Q.Q8_1:  # gguf-py has no Q8_1
        assert_same_bits(y, gguf_dequant(b, qtype, x.shape))
    err, amax = (y - x).reshape(-1, block), np.abs(x).reshape(-1, block).max(axis=1)
    if block == 32:
        d = amax / 127
        assert (np.abs(err).max(axis=1) <= d / 2 + 127 * np.maximum(d * 2.0**-11, 2.0**-25)).all()
    else:
        assert (np.sqrt((err**2).mean(axis=1)) <= RMS_BOUND[qtype] * amax + SUBNORMAL[qtype]).all()


def test_gaussian_round_trip_error_is_llama_cpp_class():
    x = np.random.default_rng(6).standard_normal((128, 4096)).astype(np.float32)
    for qtype, bound in GAUSS_BOUND.items():
        y = F.dequantize(F.quantize(x, qtype), qtype, x.shape)
        assert np.sqrt(np.mean((y - x) ** 2)) <= bound, qtype.name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q8_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_zero_and_constant_rows(qtype):
    x = np.zeros((1, 512), np.float32)
    assert np.array_equal(F.dequantize(F.quantize(x, qtype), qtype, x.shape), x)
    for c in (1.0, -1.0, 0.25, -250.0):  # (f16 block scales in their normal range)
        x = np.full((2, 512), c, np.float32)
        x[1, 256:] = -c  # one block of each sign
        y = F.dequantize(F.quantize(x, qtype), qtype, x.shape)
        assert np.abs(y - x).max() <= abs(c) * 2.0**-10, (qtype.name, c)


@settings(max_examples=examples(100))
@given(qtype=st.sampled_from([Q.Q8_0, Q.Q4_0]), rows=st.integers(1, 4), nblocks=st.integers(1, 4),
       log_scale=st.floats(-4, 4), ties=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_q8_0_and_q4_0_bytes_equal_gguf(qtype, rows, nblocks, log_scale, ties, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 32 * nblocks)) * 10.0 ** log_scale
    if ties:  # x / d lands on halves: roundf's ties away from zero, not to even
        x = rng.integers(-254, 255, x.shape) / 2.0
        x[:, ::32] = 127.0
    x = x.astype(np.float32)
    assert np.array_equal(F.quantize(x, qtype), quants.quantize(x, qtype))


@settings(max_examples=examples(100))
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 4), nblocks=st.integers(1, 4), log_scale=st.floats(-30, 30),
       seed=st.integers(0, 2**32 - 1))
def test_mxfp4_bytes_equal_gguf(kind, rows, nblocks, log_scale, seed):
    """The shared exponent and each element's nearest FP4 level (the first of a tie) as gguf-py
    picks them, over 60 binary orders of magnitude; zero blocks included."""
    rng = np.random.default_rng(seed)
    x = (sample(kind, rng, (rows, 32 * nblocks)) * 2.0 ** log_scale).astype(np.float32)
    x[:, :32] *= rng.integers(0, 2)  # a zero block, sometimes
    assert np.array_equal(F.quantize(x, Q.MXFP4), quants.quantize(x, Q.MXFP4))


@settings(max_examples=examples(100))
@given(lead=st.lists(st.integers(1, 3), max_size=2), nblocks=st.integers(1, 4),
       log_scale=st.floats(-3, 3), seed=st.integers(0, 2**32 - 1))
def test_q8_1(lead, nblocks, log_scale, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, 32 * nblocks)) * 10.0 ** log_scale + rng.uniform(-1, 1)).astype(np.float32)
    qs, d, s = F.q8_1_quantize(x)
    assert qs.dtype == np.int8 and qs.shape == x.shape and d.shape == s.shape == (*lead, nblocks)
    xb, qb = x.reshape(-1, 32).astype(np.float64), qs.reshape(-1, 32).astype(np.float64)
    d32 = np.abs(xb).max(axis=1, keepdims=True).astype(np.float32) / np.float32(127)
    assert (np.abs(xb / d32 - qb) <= 0.5 + 1e-5).all()  # q rounds x / d at the unrounded d
    assert (np.abs(xb - d.reshape(-1, 1) * qb) <= d32 * (0.5 + 127 * 2.0**-11)).all()
    ds = d32[:, 0] * qb.sum(axis=1)  # s = d·Σq rounded once to f16
    assert (np.abs(s.reshape(-1) - ds) <= np.abs(ds) * 2.0**-11 + 2.0**-25).all()
    # Q8_1's d and codes are Q8_0's, and its blocks decode to d·q
    b = F.quantize(x, Q.Q8_1).reshape(-1, 36)
    b0 = quants.quantize(x.reshape(-1, 32), Q.Q8_0)
    assert np.array_equal(b[:, :2], b0[:, :2]) and np.array_equal(b[:, 4:], b0[:, 2:])
    dq = qs.astype(np.float32) * d[..., None].repeat(32, -1).reshape(x.shape)
    assert np.array_equal(F.dequantize(b, Q.Q8_1, x.shape), dq)


@settings(max_examples=examples(100))
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
def test_float_quantizers(bits):
    x = np.array(bits, np.uint32).view(np.float32)  # every float32 pattern: NaNs, infinities, ties
    bf = F.quantize(x, Q.BF16)
    assert np.array_equal(bf, quants.quantize(x, Q.BF16).view(np.uint8).reshape(bf.shape))
    with np.errstate(over="ignore"):
        assert np.array_equal(F.quantize(x, Q.F16), x.astype(np.float16).view(np.uint8))
    assert np.array_equal(F.quantize(x, Q.F32), x.view(np.uint8))
    y = F.dequantize(bf, Q.BF16, x.shape)
    fin = np.isfinite(x) & (np.abs(x) < 3e38)
    assert (np.abs(y[fin] - x[fin]) <= np.abs(x[fin]) * 2.0**-8 + 2.0**-134).all()
    assert np.array_equal(np.isnan(y), np.isnan(x))


def test_q4_k_quantize_speed():
    x = np.random.default_rng(7).standard_normal((1024, 8192)).astype(np.float32)
    t0 = time.perf_counter()
    F.quantize(x, Q.Q4_K)
    assert time.perf_counter() - t0 < 4.0  # measured 0.3 s on one core (2048 x 8192: 0.6 s)


# ---- ggml's C reference (opt-in: pytest -m llamacpp) ---------------------------------------------

@pytest.fixture(scope="module")
def ggml():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: run scripts/install-llamacpp.sh")
    lib = ctypes.CDLL(str(Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib" / "libggml-base.so"))

    def quantize(x: np.ndarray, name: str, nbytes: int) -> np.ndarray:
        f = getattr(lib, f"quantize_row_{name}_ref")
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        x = np.ascontiguousarray(x, np.float32)
        out = np.zeros((*x.shape[:-1], x.shape[-1] // (32 if name.startswith("q8") else 256) * nbytes), np.uint8)
        f(x.ctypes.data, out.ctypes.data, x.size)
        return out

    return quantize


@pytest.mark.llamacpp
def test_q8_1_bytes_equal_ggml(ggml):
    x = (np.random.default_rng(8).standard_normal((64, 1024)) * 3 + 0.5).astype(np.float32)
    assert np.array_equal(F.quantize(x, Q.Q8_1), ggml(x, "q8_1", 36))


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quant_error_at_most_ggmls(ggml, qtype):
    rng = np.random.default_rng(9)
    for x in (rng.standard_normal((128, 4096)), rng.standard_t(4, (128, 4096))):
        x = x.astype(np.float32)
        theirs = gguf_dequant(ggml(x, qtype.name.lower().replace("_k", "_K"), F.block_shape(qtype)[1]), qtype, x.shape)
        ours = F.dequantize(F.quantize(x, qtype), qtype, x.shape)
        assert np.sqrt(np.mean((ours - x) ** 2)) <= np.sqrt(np.mean((theirs - x) ** 2))
