"""The Vulkan runtime on lavapipe: memory round trips, kernels, specialization, replays,
barrier placement, timestamps, indirect dispatch, errors; compile-only RDNA statistics through
RADV's null device; `zdsl devices`."""

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import zdsl
from zdsl import Buffer, u32
from zdsl.errors import MissingFeatureError, NoDeviceError, OutOfMemoryError, ZdslError
from zdsl.runtime import HostBuffer, open_device
from zdsl.toolchain import compile_glsl

# Every test kernel, in one place: they get replaced by DSL-generated kernels once those exist.
_HEAD = "#version 450\n#extension GL_KHR_shader_subgroup_basic : require\n"
SHADERS = {
    # x[i] += a for i < n
    "add": _HEAD + """layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
layout(push_constant) uniform P { uint n; float a; };
void main() { uint i = gl_GlobalInvocationID.x; if (i < n) x[i] += a; }""",
    # y[i] = x[i] * 2 for i < n
    "double": _HEAD + """layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; };
void main() { uint i = gl_GlobalInvocationID.x; if (i < n) y[i] = 2.0 * x[i]; }""",
    # y[i] = (NEGATE ? -1 : 1) * x[i] * SCALE + OFFSET, specialized
    "affine": _HEAD + """layout(local_size_x = 64) in;
layout(constant_id = 0) const float SCALE = 1.0;
layout(constant_id = 1) const int OFFSET = 0;
layout(constant_id = 2) const bool NEGATE = false;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; };
void main() { uint i = gl_GlobalInvocationID.x;
  if (i < n) y[i] = (NEGATE ? -1.0 : 1.0) * x[i] * SCALE + float(OFFSET); }""",
    # the workgroup size comes from a specialization constant; every invocation reports it
    "wgsize": _HEAD + """layout(local_size_x_id = 0) in;
layout(std430, binding = 0) writeonly buffer Y { uint y[]; };
void main() { y[gl_GlobalInvocationID.x] = gl_WorkGroupSize.x; }""",
    # each invocation reports its subgroup size
    "subgroup": _HEAD + """layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Y { uint y[]; };
void main() { y[gl_GlobalInvocationID.x] = gl_SubgroupSize; }""",
    # x[i] += h[0]: a per-step value read from a host buffer
    "add_host": _HEAD + """layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer H { float h[]; };
layout(push_constant) uniform P { uint n; };
void main() { uint i = gl_GlobalInvocationID.x; if (i < n) x[i] += h[0]; }""",
    # indirect dispatch arguments for n elements at 64 per workgroup
    "make_args": _HEAD + """layout(local_size_x = 1) in;
layout(std430, binding = 0) writeonly buffer A { uint args[3]; };
layout(push_constant) uniform P { uint n; };
void main() { args[0] = (n + 63) / 64; args[1] = 1; args[2] = 1; }""",
    # a workgroup sum over 4096 floats (subgroups + shared memory): register use depends on wave size
    "reduce": "#version 450\n#extension GL_KHR_shader_subgroup_arithmetic : require\n" + """
layout(local_size_x = 256) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer Y { float y[]; };
shared float part[32];
void main() {
  float v = 0.0;
  for (uint i = gl_LocalInvocationID.x; i < 4096; i += 256) v += x[gl_WorkGroupID.x * 4096 + i];
  v = subgroupAdd(v);
  if (subgroupElect()) part[gl_SubgroupID] = v;
  barrier();
  if (gl_LocalInvocationID.x == 0) {
    float s = 0.0;
    for (uint i = 0; i < gl_NumSubgroups; i++) s += part[i];
    y[gl_WorkGroupID.x] = s;
  }
}""",
}


def spirv(name: str) -> bytes:
    return compile_glsl(SHADERS[name], name=name)


def groups(n: int, wg: int = 64) -> int:
    return -(-n // wg)


@pytest.fixture(scope="module")
def add(device):
    return device.pipeline(spirv("add"), bindings=["rw"], push_size=8, name="add")


@pytest.fixture(scope="module")
def double(device):
    return device.pipeline(spirv("double"), bindings=["r", "w"], push_size=4, name="double")


def push_add(n: int, a: float) -> bytes:
    return struct.pack("<If", n, a)


# -- memory ------------------------------------------------------------------------------

DTYPES = [np.float32, np.float16, np.int8, np.uint8, np.int32, np.uint32, np.uint16]   # uint16 = bf16 bits


@given(dtype=st.sampled_from(DTYPES), count=st.integers(1, 5000), offset=st.integers(0, 64), seed=st.integers(0, 9))
def test_round_trip_small(device, dtype, count, offset, seed):
    data = np.random.default_rng(seed).integers(0, 256, count * np.dtype(dtype).itemsize, np.uint8).view(dtype)
    buf = device.alloc(offset + data.nbytes, "rt")
    try:
        buf.write(data, offset=offset)
        np.testing.assert_array_equal(buf.read(dtype, offset=offset), data)
        np.testing.assert_array_equal(buf.read(dtype, shape=(count,), offset=offset), data)
    finally:
        buf.free()


@pytest.mark.parametrize("nbytes", [1, 3, 4, 17, (1 << 20) + 3, 6 * (1 << 20) + 5])
def test_round_trip_sizes(device, nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, np.uint8)
    buf = device.upload(data, "bytes")
    assert buf.nbytes == nbytes
    np.testing.assert_array_equal(buf.read(np.uint8), data)
    np.testing.assert_array_equal(buf.read(np.uint8, offset=nbytes // 2), data[nbytes // 2:])
    buf.free()


def test_bf16_bits_round_trip(device):
    x = np.random.default_rng(0).standard_normal(1001).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    buf = device.upload(bits, "bf16")
    back = (buf.read(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(back, x, rtol=1 / 128)
    buf.free()


def test_small_allocations_share_a_block(device):
    first = device.alloc(16, "first")
    free_before = [list(r) for r in first.block.free]
    blocks = device.memory_report()["device"]["blocks"]
    bufs = [device.alloc(100 + i % 7, f"t{i}") for i in range(500)]
    assert device.memory_report()["device"]["blocks"] == blocks
    assert {b.block for b in bufs} == {first.block}
    spans = sorted((b.offset, b.offset + b.nbytes) for b in bufs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "allocations overlap"
    align = max(16, device._phys.min_storage_offset_alignment)
    assert all(b.offset % align == 0 for b in bufs)
    for i, b in enumerate(bufs):
        b.write(np.full(b.nbytes, i % 251, np.uint8))
    for i, b in enumerate(bufs):
        assert (b.read(np.uint8) == i % 251).all()
    used = device.memory_report()["device"]["used"]
    for b in bufs:
        b.free()
    freed = sum(-(-(100 + i % 7) // align) * align for i in range(500))
    assert device.memory_report()["device"]["used"] == used - freed
    assert first.block.free == free_before        # freed neighbours coalesced back into one range
    first.free()


def test_buffer_errors(device):
    buf = device.alloc(16, "small")
    with pytest.raises(ZdslError, match="outside buffer small"):
        buf.write(np.zeros(5, np.float32))
    buf.free()
    with pytest.raises(ZdslError, match="freed"):
        buf.read()
    with pytest.raises(ZdslError, match="already freed"):
        buf.free()


def test_out_of_memory_is_one_line(device):
    with pytest.raises(OutOfMemoryError) as e:
        device.alloc(1 << 50, "blk.0.huge")
    msg = str(e.value)
    assert "\n" not in msg and "blk.0.huge" in msg and device.info.name in msg and "heap 0" in msg
    assert "1048576.0 GiB" in msg


def test_host_buffer_per_step_value(device):
    pipe = device.pipeline(spirv("add_host"), bindings=["rw", "r"], push_size=4, name="add_host")
    n = 300
    x = device.upload(np.zeros(n, np.float32), "x")
    h = device.host_buffer(4, "step")
    assert isinstance(h, HostBuffer)
    seq = device.sequence()
    seq.dispatch(pipe, groups(n), [x, h], struct.pack("<I", n))
    for step in range(1, 5):
        h.view(np.float32)[0] = step          # a new value every replay, no re-recording
        seq.run()
    np.testing.assert_array_equal(x.read(np.float32), np.full(n, 1 + 2 + 3 + 4, np.float32))
    seq.free()
    x.free()
    h.free()


# -- kernels -------------------------------------------------------------------------------

def test_trivial_kernel(device, add):
    n = 1000
    x0 = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    x = device.upload(x0, "x")
    seq = device.sequence()
    seq.dispatch(add, np.int64(groups(n)), [x], push_add(n, 0.5))
    seq.dispatch(add, (groups(n),), [x], push_add(n, 0.25))
    seq.run()
    np.testing.assert_array_equal(x.read(np.float32), x0 + np.float32(0.5) + np.float32(0.25))
    assert add.bindings == ("rw",) and add.push_size == 8 and add.subgroup_size is None
    seq.free()
    x.free()


@pytest.mark.parametrize("spec", [{}, {0: 3.0}, {0: 0.5, 1: -7}, {0: 2.0, 1: 5, 2: True},
                                  {0: np.float32(0.25), 1: np.int64(-3), 2: np.bool_(True)}])
def test_specialization_changes_behaviour(device, spec):
    pipe = device.pipeline(spirv("affine"), bindings=["r", "w"], push_size=4, spec=spec, name="affine")
    n = 257
    x0 = np.arange(n, dtype=np.float32) - 100
    x, y = device.upload(x0, "x"), device.alloc(4 * n, "y")
    seq = device.sequence()
    seq.dispatch(pipe, groups(n), [x, y], struct.pack("<I", n))
    seq.run()
    sign = -1.0 if spec.get(2, False) else 1.0
    expect = sign * x0 * np.float32(spec.get(0, 1.0)) + np.float32(spec.get(1, 0))
    np.testing.assert_array_equal(y.read(np.float32), expect.astype(np.float32))
    for b in (x, y):
        b.free()
    pipe.free()



def test_warm_has_each_pipeline_compiled_once_before_it_runs(device, tmp_path, monkeypatch):
    """lavapipe compiles a pipeline at its first dispatch: `warm` makes helper devices (one a
    core) dispatch no workgroups of each pipeline, notes each one done, and a later call finds
    nothing to do; the pipelines then run as ever. A driver that compiles at creation is left alone."""
    from types import SimpleNamespace

    from zdsl.runtime.warm import warm

    monkeypatch.setenv("ZDSL_CACHE_DIR", str(tmp_path))
    add = device.pipeline(spirv("add"), bindings=["rw"], push_size=8, name="add")
    double = device.pipeline(spirv("double"), bindings=["r", "w"], push_size=4, name="double")
    heard = []
    assert warm(device, [add, double, add], heard.append) == 2 and heard == [1, 1]
    assert warm(device, [double, add]) == 0
    x = device.upload(np.arange(100, dtype=np.float32))
    seq = device.sequence()
    seq.dispatch(add, groups(100), [x], push_add(100, 1.5))
    seq.run()
    assert np.array_equal(x.read(np.float32, (100,)), np.arange(100, dtype=np.float32) + 1.5)
    x.free()
    assert warm(SimpleNamespace(info=SimpleNamespace(device_type="discrete-gpu")), [add]) == 0


def test_warm_leaves_a_pipeline_to_the_process_that_compiles_it(device, tmp_path, monkeypatch):
    """Processes sharing the caches (a test run's workers): a pipeline whose lock another one
    holds is being compiled there; `warm` compiles the others first, waits, then finds it noted
    and does not compile it again. The lock file goes with the lock."""
    import fcntl
    import threading
    import time

    from zdsl.runtime import warm

    monkeypatch.setenv("ZDSL_CACHE_DIR", str(tmp_path))
    add = device.pipeline(spirv("add"), bindings=["rw"], push_size=8, name="add")
    double = device.pipeline(spirv("double"), bindings=["r", "w"], push_size=4, name="double")
    mark = warm._mark(device, add)
    lock = mark.with_name(mark.name + ".lock")
    other = open(lock, "ab")  # the other process, compiling add
    fcntl.flock(other, fcntl.LOCK_EX)
    heard, done = [], {}
    runs = threading.Thread(target=lambda: done.update(n=warm.warm(device, [add, double], heard.append)))
    runs.start()
    for _ in range(200):
        if heard:
            break
        time.sleep(0.05)
    assert heard == [1] and runs.is_alive() and double.compiled and not add.compiled
    mark.write_bytes(b"")  # the other process is done: it noted add and lets go
    other.close()
    runs.join(20)
    assert done == {"n": 1} and heard == [1, 1] and add.compiled
    assert not lock.exists()


@pytest.mark.parametrize("wg", [1, 32, 96, 1024])
def test_workgroup_size_from_spec(device, wg):
    pipe = device.pipeline(spirv("wgsize"), bindings=["w"], spec={0: wg}, name="wgsize")
    assert pipe.workgroup == (wg, 1, 1)
    y = device.alloc(4 * wg * 2, "y")
    seq = device.sequence()
    seq.dispatch(pipe, 2, [y])
    seq.run()
    assert (y.read(np.uint32) == wg).all()
    seq.free()
    y.free()
    pipe.free()


def test_workgroup_over_limit(device):
    with pytest.raises(ZdslError, match="exceeds"):
        device.pipeline(spirv("wgsize"), bindings=["w"], spec={0: 4096}, name="wgsize")


@zdsl.kernel(workgroup=(2, 1, 1), register=False)
def _where_am_i(out: Buffer[u32]):
    """Each workgroup writes its ids, the grid it sees (x, y) and the global id of its lane 1, at
    its flat index."""
    i = (zdsl.workgroup_id(2) * zdsl.num_workgroups(1) + zdsl.workgroup_id(1)) * zdsl.num_workgroups(0) \
        + zdsl.workgroup_id(0)
    with zdsl.if_(zdsl.local_id() == 1):
        for axis in range(3):
            out[6 * i + axis] = zdsl.workgroup_id(axis)
        for axis in range(2):
            out[6 * i + 3 + axis] = zdsl.num_workgroups(axis)
        out[6 * i + 5] = zdsl.global_id(0)


def _where_expected(grid):
    g = np.indices(grid[::-1]).reshape(3, -1)[::-1].T  # x fastest
    return np.column_stack([g, np.tile([grid[0], grid[1]], (len(g), 1)), 2 * g[:, 0] + 1]).astype(np.uint32)


@given(grid=st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(1, 4)),
       limit=st.tuples(st.integers(1, 9), st.integers(1, 9), st.just(65535)))
def test_grids_past_the_device_limit_are_folded(device, monkeypatch, grid, limit):
    """A grid larger than the device's per-axis limits runs folded into the other axes, and every
    workgroup still sees its own place in the grid it was dispatched with (the limits are
    lowered here so that small grids exercise it; real vocabularies need it on lavapipe)."""
    monkeypatch.setattr(device._phys, "max_group_count", limit)
    n = grid[0] * grid[1] * grid[2]
    out = _where_am_i.specialize().run(device, grid, out=np.zeros(6 * n, np.uint32))["out"].reshape(n, 6)
    np.testing.assert_array_equal(out, _where_expected(grid))


def test_a_grid_past_lavapipes_real_limit(device):
    """70,000 workgroups along x: lavapipe launches at most 65,535 per axis."""
    grid = (70_000, 1, 1)
    out = _where_am_i.specialize().run(device, grid, out=np.zeros(6 * grid[0], np.uint32))["out"].reshape(-1, 6)
    np.testing.assert_array_equal(out, _where_expected(grid))


def test_unfoldable_pipeline_past_the_limit_is_one_line(device, add):
    """A pipeline whose shader does not come from zdsl cannot be folded: one line, no crash."""
    limit = device._phys.max_group_count[0]
    x = device.alloc(4 * 64, "x")
    seq = device.sequence()
    with pytest.raises(ZdslError, match="cannot run a folded grid"):
        seq.dispatch(add, limit + 1, [x], struct.pack("<If", 0, 1.0))
    seq.free()
    x.free()


def test_required_subgroup_size(device):
    size = device.info.subgroup_size
    pipe = device.pipeline(spirv("subgroup"), bindings=["w"], subgroup_size=size, name="subgroup")
    y = device.alloc(4 * 128, "y")
    seq = device.sequence()
    seq.dispatch(pipe, 2, [y])
    seq.run()
    assert (y.read(np.uint32) == size).all()
    with pytest.raises(MissingFeatureError, match="subgroup size"):
        device.pipeline(spirv("subgroup"), bindings=["w"], subgroup_size=device.info.max_subgroup_size * 2)
    seq.free()
    y.free()


def test_pipeline_argument_errors(device, add):
    with pytest.raises(ZdslError, match="'x'"):
        device.pipeline(spirv("add"), bindings=["x"])
    with pytest.raises(ZdslError, match="multiple of 4"):
        device.pipeline(spirv("add"), bindings=["rw"], push_size=6)
    with pytest.raises(ZdslError, match="32-bit"):
        device.pipeline(spirv("affine"), bindings=["r", "w"], push_size=4, spec={1: 1 << 40})
    x = device.alloc(64, "x")
    seq = device.sequence()
    with pytest.raises(ZdslError, match="2 buffers for 1 bindings"):
        seq.dispatch(add, 1, [x, x], push_add(16, 1))
    with pytest.raises(ZdslError, match="push constants"):
        seq.dispatch(add, 1, [x], b"1234")
    seq.run()
    with pytest.raises(ZdslError, match="already run"):
        seq.dispatch(add, 1, [x], push_add(16, 1))
    seq.free()
    x.free()


# -- sequences -----------------------------------------------------------------------------

@pytest.mark.parametrize("times", [1, 3, 17])
def test_replay_has_n_times_the_effect(device, add, times):
    n = 777
    x = device.upload(np.zeros(n, np.float32), "x")
    seq = device.sequence()
    seq.dispatch(add, groups(n), [x], push_add(n, 1.0))
    seq.dispatch(add, groups(n), [x], push_add(n, 1.0))     # dependent on the first: one barrier
    seq.run(times=times)
    np.testing.assert_array_equal(x.read(np.float32), np.full(n, 2 * times, np.float32))
    for _ in range(times):
        seq.run(wait=False)
    seq.wait()
    np.testing.assert_array_equal(x.read(np.float32), np.full(n, 4 * times, np.float32))
    assert seq.barriers == 1
    seq.free()
    x.free()


def test_together_leaves_out_the_barriers_between_its_commands(device, double):
    """Commands in a together() block (the caller knows they touch disjoint memory: rows of one
    buffer) get no barrier between them, only the one that what came before calls for; what they
    touch counts for the commands after."""
    n = 256
    x0 = np.arange(2 * n, dtype=np.float32)
    x, y = device.upload(x0, "x"), device.alloc(8 * n, "y")
    push = struct.pack("<I", n)
    seq = device.sequence()
    seq.dispatch(double, groups(n), [x, y], push)  # writes y
    with seq.together():
        seq.dispatch(double, groups(n), [y, x], push)   # reads y: the one barrier
        seq.dispatch(double, groups(n), [y, x], push)   # writes x again, but together: none
    assert seq.barriers == 1
    seq.dispatch(double, groups(n), [x, y], push)  # reads what the block wrote
    assert seq.barriers == 2
    with pytest.raises(ZdslError, match="do not nest"), seq.together(), seq.together():
        pass
    seq.run()
    np.testing.assert_array_equal(y.read(np.float32, (n,)), 8 * x0[:n])
    seq.free()
    x.free()
    y.free()


def test_barriers_only_between_dependent_commands(device, double, monkeypatch):
    """Barriers go only where a command depends on an earlier one, and name only the stages
    involved; a stage the last barrier left out gets its own."""
    from zdsl.runtime import sequence as sequence_module
    from zdsl.runtime.vk import COMPUTE, TRANSFER, barrier

    recorded = []
    monkeypatch.setattr(sequence_module, "barrier", lambda src, dst: recorded.append((src, dst)) or barrier(src, dst))
    n = 500
    x0 = np.arange(n, dtype=np.float32)
    x = device.upload(x0, "x")
    y, z, w = (device.alloc(4 * n, name) for name in "yzw")
    push = struct.pack("<I", n)
    seq = device.sequence()
    seq.dispatch(double, groups(n), [x, y], push)      # reads x, writes y
    seq.dispatch(double, groups(n), [x, z], push)      # reads x, writes z: independent
    assert seq.barriers == 0
    seq.dispatch(double, groups(n), [y, w], push)      # reads y: read after write
    seq.dispatch(double, groups(n), [z, y], push)      # writes y, which the previous one read
    seq.dispatch(double, groups(n), [x, y], push)      # writes y again: write after write
    assert seq.barriers == 3 and recorded == [(COMPUTE, COMPUTE)] * 3
    seq.fill(w, 0)             # no conflict since the last barrier, but that one did not cover transfers
    assert recorded[3] == (COMPUTE, COMPUTE | TRANSFER)
    seq.fill(z, 0)             # covered now, and z untouched since
    assert seq.barriers == 4
    seq.copy(w, x)                                     # reads what the fill wrote (transfer → transfer)
    assert recorded[4] == (TRANSFER, TRANSFER)
    seq.dispatch(double, groups(n), [y, w], push)      # writes w, which the copy read; compute uncovered
    assert recorded[5] == (COMPUTE | TRANSFER, COMPUTE) and seq.barriers == 6
    seq.run()
    np.testing.assert_array_equal(x.read(np.float32), np.zeros(n, np.float32))
    np.testing.assert_array_equal(z.read(np.float32), np.zeros(n, np.float32))
    np.testing.assert_array_equal(w.read(np.float32), 4 * x0)
    seq.free()
    for b in (x, y, z, w):
        b.free()


def test_disjoint_slices_need_no_barrier(device, add):
    n = 64
    x = device.upload(np.zeros(4 * n, np.float32), "kv")
    seq = device.sequence()
    for layer in range(4):      # one layer's part of a shared buffer each: no dependency
        seq.dispatch(add, 1, [x.slice(4 * n * layer, 4 * n)], push_add(n, float(layer + 1)))
    assert seq.barriers == 0
    seq.run()
    np.testing.assert_array_equal(x.read(np.float32), np.repeat(np.arange(1, 5, dtype=np.float32), n))
    with pytest.raises(ZdslError, match="aligned"):
        x.slice(1, 16)
    seq.free()
    x.free()


def test_copy_and_fill(device):
    src = device.upload(np.arange(100, dtype=np.uint32), "src")
    dst = device.alloc(400, "dst")
    seq = device.sequence()
    seq.fill(dst, 0xDEADBEEF)
    seq.copy(src, dst, 40)
    assert seq.barriers == 1
    seq.run()
    out = dst.read(np.uint32)
    np.testing.assert_array_equal(out[:10], np.arange(10))
    assert (out[10:] == 0xDEADBEEF).all()
    with pytest.raises(ZdslError, match="u32"):
        device.sequence().fill(device.alloc(6, "odd"))
    seq.free()


def test_indirect_dispatch(device, add):
    make_args = device.pipeline(spirv("make_args"), bindings=["w"], push_size=4, name="make_args")
    n = 1000
    args = device.alloc(12, "args")
    x = device.upload(np.zeros(n + 64, np.float32), "x")
    seq = device.sequence()
    seq.dispatch(make_args, 1, [args], struct.pack("<I", n))    # group counts computed on the GPU
    seq.dispatch_indirect(add, args, [x], push_add(n + 64, 1.0))  # reads them: one barrier
    assert seq.barriers == 1
    seq.run()
    np.testing.assert_array_equal(args.read(np.uint32), [groups(n), 1, 1])
    out = x.read(np.float32)
    assert (out[:groups(n) * 64] == 1).all() and (out[groups(n) * 64:] == 0).all()
    seq.free()
    x.free()
    args.free()


def test_a_recorder_records_on_its_thread_while_this_one_runs(device, add):
    import threading
    import time

    n = 3000
    xs = [device.upload(np.zeros(n, np.float32), f"x{i}") for i in range(2)]
    recorder = device.recorder()
    threads = []

    def record(sequence, x, times):
        threads.append(threading.get_ident())
        seq = sequence()
        for _ in range(times):
            seq.dispatch(add, groups(n), [x], push_add(n, 1.0))
        return seq

    try:
        pending = recorder.record(record, xs[1], 200)
        for _ in range(20):  # meanwhile this thread records and runs sequences from the device's pool
            seq = device.sequence()
            seq.dispatch(add, groups(n), [xs[0]], push_add(n, 1.0))
            seq.run()
            seq.free()
        seq = pending.result()
        seq.run(times=2)
        assert len(threads) == 1 and threads[0] != threading.get_ident()
        np.testing.assert_array_equal(xs[0].read(np.float32), np.full(n, 20, np.float32))
        np.testing.assert_array_equal(xs[1].read(np.float32), np.full(n, 400, np.float32))
        recorder.free(pending)
        recorder.wait()
        assert seq.cb is None
        failed = recorder.record(lambda sequence: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result()
        started = threading.Event()

        def slow(sequence):
            started.set()
            time.sleep(0.2)
            return record(sequence, xs[1], 1)
        under_way, waiting = recorder.record(slow), recorder.record(record, xs[1], 1)
        started.wait()
        recorder.close()  # finishes the recording under way, drops the one waiting
        assert under_way.result().commands == 1 and waiting.cancelled()
        under_way.result().free()  # its thread has stopped: the pool is this thread's now
    finally:
        recorder.close()
        for x in xs:
            x.free()


def test_timestamps(device, add, double):
    n = 4096
    x, y = device.upload(np.ones(n, np.float32), "x"), device.alloc(4 * n, "y")
    seq = device.sequence(timestamps=True)
    seq.dispatch(add, groups(n), [x], push_add(n, 1.0), label="first")
    seq.dispatch(double, groups(n), [x, y], struct.pack("<I", n), label="second")
    seq.copy(y, x)
    seq.run(times=2)
    t = seq.timings()
    assert [label for label, _ in t] == ["first", "second", "copy y -> x"]
    assert all(ms > 0 for _, ms in t)
    assert sum(ms for _, ms in t) < 10_000
    with pytest.raises(ZdslError, match="timestamps=True"):
        device.sequence().timings()
    seq.free()


def test_descriptor_sets_without_push_descriptors():
    """Drivers without VK_KHR_push_descriptor get descriptor sets allocated at record time."""
    with open_device("lavapipe") as dev:
        dev._push_descriptors = False
        pipe = dev.pipeline(spirv("double"), bindings=["r", "w"], push_size=4)
        n = 100
        x, y = dev.upload(np.arange(n, dtype=np.float32), "x"), dev.alloc(4 * n, "y")
        seq = dev.sequence()
        for _ in range(300):        # more sets than one pool holds
            seq.dispatch(pipe, groups(n), [x, y], struct.pack("<I", n))
        seq.run()
        np.testing.assert_array_equal(y.read(np.float32), 2 * np.arange(n, dtype=np.float32))
        assert len(seq._pools) == 2


def test_close_frees_everything_and_saves_the_pipeline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZDSL_CACHE_DIR", str(tmp_path))
    dev = open_device("lavapipe")
    dev.pipeline(spirv("add"), bindings=["rw"], push_size=8)
    x = dev.alloc(64, "x")
    dev.sequence().dispatch(dev.pipeline(spirv("add"), bindings=["rw"], push_size=8), 1, [x], push_add(16, 1))
    dev.close()
    dev.close()     # idempotent
    assert any(p.stat().st_size > 0 for p in (tmp_path / "pipelines").iterdir())
    with pytest.raises(ZdslError, match="closed"):
        x.read()
    with pytest.raises(ZdslError, match="closed"):
        dev.alloc(16)


# -- device selection and errors -------------------------------------------------------------

def test_selectors(device):
    assert device.info.device_type == "cpu" and "llvmpipe" in device.info.name
    assert re.fullmatch(r"[0-9a-f]{4,}:[0-9a-f]{4}:llvmpipe:\d+", device.info.identity)
    with open_device(device.info.index) as dev:
        assert dev.info.name == device.info.name
    with open_device("LLVMPIPE") as dev:
        assert dev.info == device.info


def test_bad_selector_lists_devices():
    with pytest.raises(NoDeviceError) as e:
        open_device("no-such-gpu-9000")
    assert "\n" not in str(e.value) and "no-such-gpu-9000" in str(e.value) and "llvmpipe" in str(e.value)
    with pytest.raises(NoDeviceError, match="llvmpipe"):
        open_device(99)


def test_family_selector_points_to_nulldevice(monkeypatch):
    monkeypatch.delenv("RADV_FORCE_FAMILY", raising=False)
    with pytest.raises(ZdslError, match="compile_statistics"):
        open_device("gfx1201")


def test_no_loader_is_one_line_error():
    code = ("import builtins, sys\n"
            "real = builtins.__import__\n"
            "def fake(name, *a, **k):\n"
            "    if name == 'vulkan': raise OSError('libvulkan.so.1: cannot open shared object file')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = fake\n"
            "from zdsl.cli import main\n"
            "sys.exit(main(['devices']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: no Vulkan loader (libvulkan.so.1): run scripts/setup.sh or "
                                   "apt-get install libvulkan1 mesa-vulkan-drivers")


# -- compile-only targets ------------------------------------------------------------------

def _null_device_or_skip():
    from zdsl.runtime import nulldevice
    try:
        return nulldevice.target_info("gfx1201")
    except ZdslError as e:
        pytest.skip(f"no RADV null device here: {e}")


@pytest.mark.nulldevice
def test_gfx1201_statistics_wave32_vs_wave64():
    from zdsl.runtime.nulldevice import ShaderSpec, compile_statistics

    info = _null_device_or_skip()
    assert info.compile_only and info.min_subgroup_size == 32 and info.max_subgroup_size == 64
    code = spirv("reduce")
    w32, w64 = compile_statistics("gfx1201", [ShaderSpec("reduce", code, ("r", "w"), subgroup_size=32),
                                              ShaderSpec("reduce", code, ("r", "w"), subgroup_size=64)], isa=True)
    for stats in (w32, w64):
        assert stats["VGPRs"] > 0 and stats["SGPRs"] > 0
        assert stats["Spilled VGPRs"] == 0 and stats["Spilled SGPRs"] == 0
        assert stats["LDS size"] >= 32 * 4
        assert isinstance(stats["isa"], str) and stats["isa"]
    assert (w32["VGPRs"], w32["Subgroups per SIMD"]) != (w64["VGPRs"], w64["Subgroups per SIMD"])


@pytest.mark.nulldevice
def test_unknown_family_is_refused():
    from zdsl.runtime.nulldevice import target_info

    _null_device_or_skip()
    with pytest.raises(ZdslError, match="does not know the family 'gfx1100'"):
        target_info("gfx1100")


def test_cli_devices(monkeypatch, capsys):
    from zdsl.cli import main

    assert main(["devices", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    runnable = [d for d in listing["devices"] if not d["compile_only"]]
    assert any("llvmpipe" in d["name"] for d in runnable)
    targets = [d for d in listing["devices"] if d["compile_only"]]
    assert any("GFX1201" in d["name"] for d in targets) or listing["unavailable_targets"]
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["devices", "--targets", "gfx1201"]) == 0
    table = capsys.readouterr().out
    assert "llvmpipe" in table and ("GFX1201" in table or "unavailable target gfx1201" in table)
    assert "compile-only" in table or "unavailable" in table


def _devices_cli(**env) -> str:
    proc = subprocess.run([sys.executable, "-m", "zdsl.cli", "devices"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "40", **env})
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)


def test_devices_piped_keeps_every_cell_whole(device):
    out = _devices_cli()    # stdout is a pipe: COLUMNS=40 must not narrow it
    assert "…" not in out
    row = next(line for line in out.splitlines() if line.startswith("│ 0 "))
    assert [c.strip() for c in row.split("│")[1:3]] == ["0", device.info.name]


def test_devices_in_a_narrow_terminal_folds_cells_and_cuts_none(device):
    out = _devices_cli(TTY_COMPATIBLE="1")    # a terminal 40 columns wide
    assert "…" not in out
    body = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    first = next(i for i, cells in enumerate(body) if cells[1].strip() == "0")
    end = next((i for i in range(first + 1, len(body)) if body[i][1].strip()), len(body))
    folded = [cells[2].strip() for cells in body[first:end]]
    assert len(folded) > 1 and all(len(part) < len(device.info.name) for part in folded)
    assert "".join(folded) == device.info.name.replace(" ", "")


def test_vulkan_failures_become_one_line_errors():
    from zdsl.runtime import vk

    with pytest.raises(OutOfMemoryError, match=r"^out of device memory allocating 2.0 GiB for 'w' \(vkAllocate"):
        vk.check(vk.VK_ERROR_OUT_OF_DEVICE_MEMORY, "vkAllocateMemory", "allocating 2.0 GiB for 'w'")
    with pytest.raises(OutOfMemoryError, match="host memory"):
        vk.check(vk.VK_ERROR_OUT_OF_HOST_MEMORY, "vkCreateBuffer")
    with pytest.raises(MissingFeatureError, match="VK_ERROR_FEATURE_NOT_PRESENT"):
        vk.check(vk.VK_ERROR_FEATURE_NOT_PRESENT, "vkCreateDevice")
    with pytest.raises(ZdslError, match="device lost"):
        vk.check(vk.VK_ERROR_DEVICE_LOST, "vkQueueSubmit")
    with pytest.raises(ZdslError, match="VK_ERROR_OUT_OF_POOL_MEMORY"):
        vk.check(-1000069000, "vkAllocateDescriptorSets")
    assert vk.check(vk.VK_INCOMPLETE, "vkEnumeratePhysicalDevices") == vk.VK_INCOMPLETE


@zdsl.kernel(workgroup=32, name="two_loops_test", register=False, grid=lambda v, s: 1, traffic=lambda v, s: 0)
def two_loops(y: Buffer[u32], n: u32):
    acc = zdsl.var(zdsl.local_index())
    for i in zdsl.range(0, n):  # left to the compiler
        acc.set(acc * 3 + i)
    for i in zdsl.range(0, n, unroll=True):  # asked to unroll
        acc.set(acc ^ i)
    y[zdsl.local_index()] = acc


def test_a_cpu_device_keeps_the_loops_it_would_unroll(tmp_path):
    """What a CPU device (lavapipe) is given: every loop the source leaves to the compiler marked
    DontUnroll, the one asked to unroll ([[unroll]]) left so, as spirv-dis reads the module; and the
    module still valid (spirv-val)."""
    from zdsl.runtime.pipeline import loops_kept
    from zdsl.toolchain import tool

    path = tmp_path / "m.spv"

    def merges(spirv: bytes) -> list[str]:
        path.write_bytes(spirv)
        text = tool("spirv-dis").run(str(path)).stdout.decode()
        return sorted(line.split("OpLoopMerge")[1].split()[2] for line in text.splitlines() if "OpLoopMerge" in line)

    spirv = two_loops.specialize().spirv
    assert merges(spirv) == ["None", "Unroll"]
    kept = loops_kept(spirv)
    assert merges(kept) == ["DontUnroll", "Unroll"]
    assert tool("spirv-val").run(str(path)).returncode == 0
    assert loops_kept(kept) == kept and len(kept) == len(spirv)
