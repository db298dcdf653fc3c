"""Buffers larger than one binding: pieces in the runtime, pieced bindings in the language.

On `pieced_device` (lavapipe told it binds 64 KiB at once, tests/conftest.py) a larger buffer is
pieces of 64 KiB: reads, writes, slices, copies, fills and file uploads span them as one buffer,
against a numpy copy of the same bytes; kernels given pieced buffers (the variant's pieced twin)
compute what they compute on the same inputs in one binding each, atomics and vector views
included, with barriers between dependent dispatches as before.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import dsl_kernels as k
import zdsl
from zdsl import Buffer, Const, f32, u8, u32
from zdsl.errors import MissingFeatureError, ZdslError
from zdsl.runtime import open_device
from zdsl.runtime.memory import Buffer as RuntimeBuffer
from zdsl.runtime.memory import PiecedBuffer
from zdsl.runtime.physical import lowered_limits

PIECE = 64 << 10
ALIGN = 16  # slices start where a binding may (lavapipe's minStorageBufferOffsetAlignment)
TEST_DEVICE = os.environ.get("ZDSL_TEST_DEVICE", "lavapipe")  # as tests/conftest.py's device


def _bytes(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, np.uint8)


# -- the limits override -------------------------------------------------------------------------

def test_the_pieced_device_binds_64_kib_and_pieces_what_is_larger(pieced_device):
    assert pieced_device.info.max_storage_buffer_range == PIECE
    assert pieced_device._phys.max_allocation_size == 256 << 10
    small, big = pieced_device.alloc(PIECE, "small"), pieced_device.alloc(3 * PIECE + 5, "big")
    assert isinstance(small, RuntimeBuffer) and isinstance(big, PiecedBuffer)
    assert [p.nbytes for p in big.pieces] == [PIECE, PIECE, PIECE, 5] and big.nbytes == 3 * PIECE + 5
    small.free()
    big.free()
    with pytest.raises(ZdslError, match="already freed"):
        big.free()
    with pytest.raises(ZdslError, match="freed buffer big"):
        big.read()


@pytest.mark.parametrize("text, limits", [("binding=4MiB,allocation=4MiB", {"binding": 4 << 20, "allocation": 4 << 20}),
                                          (" binding = 256KiB ", {"binding": 256 << 10}),
                                          ("allocation=1GiB", {"allocation": 1 << 30}), ("", {})])
def test_device_limits_are_read(text, limits):
    assert lowered_limits(text) == limits


@pytest.mark.parametrize("text", ["binding", "binding=4MB", "bindings=4MiB", "binding=1KiB", "binding=-1",
                                  "binding=4MiB;allocation=1GiB", "binding=4MiB,"])
def test_a_bad_device_limits_value_is_one_line(text, monkeypatch):
    monkeypatch.setenv("ZDSL_DEVICE_LIMITS", text)
    with pytest.raises(ZdslError) as e:
        open_device(TEST_DEVICE)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"ZDSL_DEVICE_LIMITS={text!r}: write LIMIT=SIZE") and "binding=4MiB" in str(e.value)


def test_a_limit_above_the_devices_own_changes_nothing(device, monkeypatch):
    monkeypatch.setenv("ZDSL_DEVICE_LIMITS", "binding=1024GiB")
    with open_device(TEST_DEVICE) as dev:
        assert dev.info.max_storage_buffer_range == device.info.max_storage_buffer_range


# -- bytes across seams ---------------------------------------------------------------------------

@given(size=st.integers(PIECE + 1, 5 * PIECE), data=st.data())
def test_writes_reads_and_slices_span_the_pieces(pieced_device, size, data):
    """Writes and reads at any offset and length land where a flat buffer has them; a slice within
    one piece is a plain Buffer of that piece, one across a seam a view that reads and writes the
    same bytes as its parent; nested slices too."""
    rng = np.random.default_rng(size)
    buf = pieced_device.alloc(size, "flat")
    want = _bytes(rng, size)
    buf.write(want)
    for _ in range(3):
        at = data.draw(st.integers(0, size))
        n = data.draw(st.integers(0, size - at))
        part = _bytes(rng, n)
        buf.write(part, at)
        want[at:at + n] = part
        np.testing.assert_array_equal(buf.read(np.uint8, offset=at, nbytes=n), want[at:at + n])
    np.testing.assert_array_equal(buf.read(np.uint8), want)

    at = ALIGN * data.draw(st.integers(0, (size - 1) // ALIGN))
    n = data.draw(st.integers(1, size - at))
    view = buf.slice(at, n)
    crosses = at // PIECE != (at + n - 1) // PIECE
    assert isinstance(view, PiecedBuffer) == crosses and view.nbytes == n
    np.testing.assert_array_equal(view.read(np.uint8), want[at:at + n])
    inner_at = ALIGN * data.draw(st.integers(0, (n - 1) // ALIGN))
    inner_n = data.draw(st.integers(0, n - inner_at))
    inner = view.slice(inner_at, inner_n)
    part = _bytes(rng, inner_n)
    inner.write(part)
    want[at + inner_at:at + inner_at + inner_n] = part
    np.testing.assert_array_equal(buf.read(np.uint8), want)
    if crosses:
        with pytest.raises(ZdslError, match="a slice or already freed"):
            view.free()
    with pytest.raises(ZdslError, match="outside buffer"):
        buf.write(np.zeros(2, np.uint8), size - 1)
    buf.free()


@given(src_size=st.integers(1, 4 * PIECE), dst_size=st.integers(1, 4 * PIECE), data=st.data())
def test_copies_and_fills_span_the_pieces(pieced_device, src_size, dst_size, data):
    """Copies between buffers pieced or not, from and to slices at any place (a copy region a
    pair of pieces), and fills of slices, give the bytes numpy's copies give."""
    rng = np.random.default_rng(src_size ^ dst_size)
    src, dst = pieced_device.alloc(src_size, "src"), pieced_device.alloc(dst_size, "dst")
    src_bytes, want = _bytes(rng, src_size), _bytes(rng, dst_size)
    src.write(src_bytes)
    dst.write(want)
    src_at = ALIGN * data.draw(st.integers(0, (src_size - 1) // ALIGN))
    n = data.draw(st.integers(1, min(src_size - src_at, dst_size)))
    dst_at = data.draw(st.integers(0, dst_size - n))
    fill_at = ALIGN * data.draw(st.integers(0, (dst_size - 1) // ALIGN))
    fill_n = 4 * data.draw(st.integers(0, (dst_size - fill_at) // 4))
    seq = pieced_device.sequence()
    seq.copy(src.slice(src_at, n), dst, n, dst_at)
    want[dst_at:dst_at + n] = src_bytes[src_at:src_at + n]
    if fill_n:
        seq.fill(dst.slice(fill_at, fill_n), 0x01020304)
        want[fill_at:fill_at + fill_n] = np.full(fill_n // 4, 0x01020304, np.uint32).view(np.uint8)
        assert seq.barriers == (1 if fill_at < dst_at + n and dst_at < fill_at + fill_n else 0)
    seq.run()
    np.testing.assert_array_equal(dst.read(np.uint8), want)
    seq.free()
    src.free()
    dst.free()


def test_alloc_many_packs_pieces_with_the_rest(pieced_device):
    """A plan's pieced requests come back pieced, their pieces packed into blocks with the rest
    (no byte reserved beyond alignment), and each round-trips its bytes."""
    sizes = [3 * PIECE + 100, 1000, PIECE, PIECE + 1, 0, 7 * PIECE]
    before = pieced_device.memory_report().get("device", {}).get("reserved", 0)
    bufs = pieced_device.alloc_many([(f"b{i}", n) for i, n in enumerate(sizes)])
    assert [type(b) for b in bufs] == [PiecedBuffer, RuntimeBuffer, RuntimeBuffer, PiecedBuffer, RuntimeBuffer,
                                      PiecedBuffer]
    align = max(16, pieced_device._phys.min_storage_offset_alignment)
    pieces = [p for b in bufs for p in (b.pieces if isinstance(b, PiecedBuffer) else [b])]
    reserved = pieced_device.memory_report()["device"]["reserved"] - before
    assert reserved == sum(max(align, -(-p.nbytes // align) * align) for p in pieces)
    assert all(block.size <= 256 << 10 for block in {p.block for p in pieces})   # the allocation limit
    rng = np.random.default_rng(0)
    data = [_bytes(rng, n) for n in sizes]
    for b, d in zip(bufs, data):
        b.write(d)
    for b, d in zip(bufs, data):
        np.testing.assert_array_equal(b.read(np.uint8), d)
    for b in bufs:
        b.free()
    assert pieced_device.memory_report()["device"]["reserved"] == before


@given(data=st.data())
def test_file_uploads_are_split_at_seams(pieced_device, tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "pieces-blob.bin"
    if not path.exists():
        np.random.default_rng(1).integers(0, 256, 3 * PIECE + 7, np.uint8).tofile(path)
    blob = np.fromfile(path, np.uint8)
    buf = pieced_device.alloc(4 * PIECE + 3, "weights")
    want = np.zeros(buf.nbytes, np.uint8)
    buf.write(want)
    jobs, at = [], 0
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(0, min(len(blob), buf.nbytes - at)))
        start = data.draw(st.integers(0, len(blob) - n))
        jobs.append((buf, at, start, n))
        want[at:at + n] = blob[start:start + n]
        at += n + data.draw(st.integers(0, 4))
        if at >= buf.nbytes:
            break
    pieced_device.upload_file(path, jobs)
    np.testing.assert_array_equal(buf.read(np.uint8), want)
    buf.free()


# -- kernels on pieced buffers --------------------------------------------------------------------

@zdsl.kernel(workgroup=64, register=False)
def _histogram(keys: Buffer[u32], counts: Buffer[u32], flags: Buffer[u8], n: u32):
    """counts[keys[i]] += 1 atomically, and flags[keys[i]] = 1 (byte stores), for i < n."""
    i = zdsl.global_id()
    with zdsl.if_(i < n):
        key = keys[i]
        zdsl.atomic_add(counts, key, 1)
        flags[key] = 1


def _both(device, pieced_device, variant, groups, **args):
    """What `variant` writes on the device with every buffer in one binding and on the pieced one."""
    return variant.run(device, groups, **args), variant.run(pieced_device, groups, **args)


@given(n=st.integers(PIECE // 4 + 1, 3 * PIECE // 4), a=st.floats(-4, 4, width=32), seed=st.integers(0, 99))
def test_kernels_read_and_write_across_seams(device, pieced_device, n, a, seed):
    """Elementwise kernels (f32 and vec4 views) and a histogram (atomics into u32 counts, u8 byte
    stores) over buffers of 1 to 3 pieces each: the same outputs as in one binding, and numpy's."""
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for variant, groups, args in (
            (k.axpy.specialize(WG=256), -(-n // 256), dict(x=x, y=y, out=np.zeros(n, np.float32), n=n, a=a)),
            (k.axpy4.specialize(), -(-(n // 4) // 64), dict(x=x, y=y, out=np.zeros(n, np.float32), n4=n // 4, a=a))):
        plain, pieced = _both(device, pieced_device, variant, groups, **args)
        np.testing.assert_array_equal(pieced["out"], plain["out"])
        m = n if "n" in args else n // 4 * 4
        np.testing.assert_allclose(pieced["out"][:m], k.axpy_ref(x, y, a)[:m], rtol=1e-6, atol=1e-6)
    keys = rng.integers(0, n, 2 * n).astype(np.uint32)
    plain, pieced = _both(device, pieced_device, _histogram.specialize(), -(-len(keys) // 64), keys=keys,
                          counts=np.zeros(n, np.uint32), flags=np.zeros(n, np.uint8), n=len(keys))
    np.testing.assert_array_equal(pieced["counts"], np.bincount(keys, minlength=n))
    np.testing.assert_array_equal(pieced["flags"], np.bincount(keys, minlength=n) > 0)
    np.testing.assert_array_equal(pieced["counts"], plain["counts"])


@given(rows=st.integers(2, 6), seed=st.integers(0, 99), data=st.data())
def test_slices_that_start_inside_a_piece(pieced_device, rows, seed, data):
    """A slice across a seam starts inside its first piece: the kernel finds its elements from
    that start (a push constant), through every view (f32, vec4, u32 from an offset: at())."""
    n4 = PIECE // 16 + 8 * data.draw(st.integers(0, 100))
    width = 4 * n4
    at = ALIGN * data.draw(st.integers(1, PIECE // ALIGN - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(rows * width).astype(np.float32)
    big_x = pieced_device.alloc(at + x.nbytes, "x")
    big_out = pieced_device.alloc(at + x.nbytes, "out")
    big_x.write(x, at)
    big_out.write(np.zeros(rows * width, np.float32), at)
    xs, outs = big_x.slice(at, x.nbytes), big_out.slice(at, x.nbytes)
    assert isinstance(xs, PiecedBuffer) and xs.start == at
    row = data.draw(st.integers(0, rows - 1))
    seq = pieced_device.sequence()
    k.scale_row.specialize().dispatch(seq, -(-n4 // 64), x=xs, out=outs, n4=n4, a=3.0, row=row)
    seq.run()
    got = outs.read(np.float32).reshape(rows, width)
    want = np.zeros((rows, width), np.float32)
    want[row] = 3 * x.reshape(rows, width)[row]
    want[row, 0] = np.float32(x.reshape(rows, width)[row, :1].view(np.uint32)[0])
    np.testing.assert_array_equal(got, want)
    seq.free()
    big_x.free()
    big_out.free()


def test_dependent_dispatches_on_pieces_are_ordered(pieced_device):
    """A kernel that reads what the one before wrote across pieces waits for it (one barrier a
    dependency, as with whole buffers); one that touches none of it does not."""
    n = PIECE // 2  # two pieces of f32
    rng = np.random.default_rng(3)
    x0, y0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x, y = pieced_device.upload(x0, "x"), pieced_device.upload(y0, "y")
    a, b, other = (pieced_device.alloc(4 * n, name) for name in ("a", "b", "other"))
    axpy, push = k.axpy.specialize(WG=256), dict(n=n)
    seq = pieced_device.sequence()
    axpy.dispatch(seq, n // 256, x=x, y=y, out=a, a=2.0, **push)        # a = 2x + y
    axpy.dispatch(seq, n // 256, x=x, y=y, out=other, a=1.0, **push)    # independent
    assert seq.barriers == 0
    axpy.dispatch(seq, n // 256, x=a, y=y, out=b, a=3.0, **push)        # reads a
    axpy.dispatch(seq, n // 256, x=b, y=x, out=a, a=-1.0, **push)       # reads b, rewrites a
    assert seq.barriers == 2
    seq.run(times=2)
    a_want = -(3 * (2 * x0 + y0) + y0) + x0
    np.testing.assert_allclose(a.read(np.float32), a_want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.read(np.float32), 3 * (2 * x0 + y0) + y0, rtol=1e-5, atol=1e-5)
    seq.free()
    for buf in (x, y, a, b, other):
        buf.free()


def test_more_pieces_than_the_driver_pushes_go_through_descriptor_sets(pieced_device):
    """Descriptors past maxPushDescriptors (32 on lavapipe) are bound as an allocated set."""
    n = 12 * PIECE // 4  # 12 pieces a buffer: 36 descriptors
    limit = pieced_device._phys.max_push_descriptors
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    variant = k.axpy.specialize(WG=64)
    out = variant.run(pieced_device, n // 64, x=x, y=y, out=np.zeros(n, np.float32), n=n, a=0.5)["out"]
    np.testing.assert_allclose(out, k.axpy_ref(x, y, 0.5), rtol=1e-6, atol=1e-6)
    pipe = variant.pieced((12,) * 3).pipeline(pieced_device)
    assert len(pipe.bindings) == 36 and pipe.arrays == (12, 12, 12)
    assert pipe.pushed == (0 < 36 <= limit)


def test_pieced_twins_leave_the_variants_glsl_alone():
    """A pieced twin is the same code with the pieced buffer's accesses rewritten: the variant's
    own GLSL (and so its SPIR-V and speed) is what it was."""
    variant = k.axpy4.specialize()
    before = variant.glsl
    twin = variant.pieced((None, 3, None))
    assert variant.glsl == before and "nonuniformEXT" not in before
    assert "y_f32x4_pieces[3]" in twin.glsl and "x_f32x4_pieces" not in twin.glsl
    assert twin.glsl.replace("y_f32x4_pieces", "").count("_pieces") == 0
    assert twin.bindings == ("r", "r", "r", "r", "w") and twin.arrays == (1, 3, 1)
    assert twin.push_size == variant.push_size + 8  # where the buffer starts, and its pieces' size
    assert variant.pieced((None, 3, None)) is twin


def test_pieces_of_any_size_share_one_pipeline(pieced_device):
    """Buffers joined as pieces of 16, 32 and 64 KiB (PiecedBuffer.joined: a batch's sequences'
    own buffers), three or four of them, run on one twin, one pipeline: the size is a push
    constant, and the count rounds up to a power of two (descriptors past the pieces repeat the
    last); each product as numpy's, from a start inside the first piece."""
    variant = k.axpy.specialize(WG=64)
    before = set(variant._twins)
    for piece, count in ((PIECE // 4, 3), (PIECE // 2, 4), (PIECE, 3)):
        n = (count - 1) * piece // 4 + 12  # the last piece short
        rng = np.random.default_rng(piece)
        x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        parts = {name: [pieced_device.upload(np.ascontiguousarray(v[i:i + piece // 4]), f"{name}{i}")
                        for i in range(0, n, piece // 4)]
                 for name, v in (("x", x), ("y", y), ("out", np.zeros(n, np.float32)))}
        bufs = {name: PiecedBuffer.joined(p, piece, name) for name, p in parts.items()}
        m = n - 16  # the kernel's view starts 16 floats in
        seq = pieced_device.sequence()
        variant.dispatch(seq, -(-m // 64), **{name: b.slice(64, 4 * m) for name, b in bufs.items()}, n=m, a=1.5)
        seq.run()
        np.testing.assert_allclose(bufs["out"].read(np.float32)[16:], k.axpy_ref(x, y, 1.5)[16:], rtol=1e-6,
                                   atol=1e-6)
        seq.free()
        for b in (b for p in parts.values() for b in p):
            b.free()
    assert set(variant._twins) - before <= {(4, 4, 4)} and (4, 4, 4) in variant._twins


def test_descriptor_arrays_round_up_unless_past_the_limit():
    """Counts of pieces round up to powers of two, unless the rounded arrays pass the shader's
    limit of descriptors where the exact ones fit."""
    from zdsl.lang.kernel import _array_sizes

    class Pieces:
        def __init__(self, n):
            self.pieces = [object()] * n

        def bindings(self):
            return self.pieces

    plain = object()
    assert _array_sizes([Pieces(5), plain, Pieces(1), Pieces(16)], 64) == (8, None, 1, 16)
    assert _array_sizes([Pieces(33), plain], 65) == (64, None) and _array_sizes([Pieces(33), plain], 64) == (33, None)


def test_a_device_without_nonuniform_indexing_says_so(monkeypatch):
    monkeypatch.setenv("ZDSL_DEVICE_LIMITS", "binding=64KiB")
    with open_device(TEST_DEVICE) as dev:
        monkeypatch.setattr(dev, "info", dataclasses.replace(dev.info, features=dev.info.features - {"pieced_buffers"}))
        n = PIECE // 2
        with pytest.raises(MissingFeatureError) as e:
            k.axpy.specialize().run(dev, n // 64, x=np.zeros(n, np.float32), y=np.zeros(n, np.float32),
                                    out=np.zeros(n, np.float32), n=n, a=1.0)
        assert "\n" not in str(e.value) and "shaderStorageBufferArrayNonUniformIndexing" in str(e.value)


def test_misuse_of_pieces_is_one_line(pieced_device):
    big = pieced_device.alloc(2 * PIECE, "big")
    pipe = pieced_device.pipeline(k.axpy.specialize().spirv, bindings=["r", "r", "w"], push_size=12)
    with pytest.raises(ZdslError, match="buffer big is in pieces: dispatch a kernel variant"):
        pieced_device.sequence().dispatch(pipe, 1, [big, big, big], bytes(12))
    odd = PiecedBuffer(big.pieces, PIECE, PIECE, "odd", start=8, owner=False)  # as a device aligning to 8 allows
    with pytest.raises(ZdslError, match=r"axpy4: x \(odd\) starts 8 bytes into a piece, not a whole number of its "
                                        r"f32x4 elements; slice it at a multiple of 16 bytes"):
        k.axpy4.specialize().dispatch(pieced_device.sequence(), 1, x=odd, y=odd, out=odd, n4=1, a=1.0)
    big.free()


@zdsl.kernel(workgroup=32, subgroup="SG", register=False)
def _tile_copy(a: Buffer[f32], out: Buffer[f32], SG: Const = 32):
    zdsl.mat_store(zdsl.mat_load(a, 0, 16, use="acc"), out, 0, 16)


def test_a_matrix_tile_of_a_pieced_buffer_is_refused():
    """Devices with matrix units bind far more than the tensors of a model at once: a tile
    straight from a pieced buffer is refused in one line rather than emitted."""
    with pytest.raises(ZdslError, match="_tile_copy.*: a cooperative-matrix tile of buffer a, which is bound in "):
        _tile_copy.specialize().pieced(((2, PIECE), None)).glsl
