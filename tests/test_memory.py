"""Device memory that fits: packing a model's buffers into blocks of exactly what they hold, the
decode graph's buffer plan and its refusal in one line, and uploads from a file through the
mapping or through staging slots in flight."""

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zdsl.errors import OutOfMemoryError, ZdslError
from zdsl.kernels.kvcache import KVTypes
from zdsl.models.qwen35.file import synth
from zdsl.models.qwen35.file.info import plan_tensors
from zdsl.models.qwen35.model.buffers import Footprint, check_fits, decode_buffers, largest_context
from zdsl.models.qwen35.model.weights import GraphWeights
from zdsl.runtime import memory

GIB, MIB = 1 << 30, 1 << 20


def _fake_arena(monkeypatch, align: int, largest: int = 1 << 40) -> memory.Arena:
    """An Arena whose blocks are bookkeeping only (no Vulkan), as on a device with these limits."""
    phys = SimpleNamespace(memory_types=[(0, 0)], heap_sizes=[80 * GIB], max_buffer_size=largest,
                           max_allocation_size=largest, min_storage_offset_alignment=align)
    monkeypatch.setattr(memory.Arena, "_new_block",
                        lambda self, size, dedicated, nbytes, name: memory.Block(None, None, size, None, dedicated))
    return memory.Arena(SimpleNamespace(_phys=phys), 0, memory.BLOCK_SIZE, "device")


def _35b_buffers(n_ctx: int):
    hp = synth.preset("35b-a3b")
    tensors = GraphWeights(hp, {name: (shape, qtype) for name, shape, qtype in synth.plan(hp)})
    return hp, tensors, decode_buffers(hp, tensors, n_ctx, candidates=8 * 64 * 1000)


@pytest.mark.parametrize("align", [16, 64, 256])
def test_the_35b_plan_packs_within_two_percent(monkeypatch, align):
    """The 35B-A3B at --ctx 4096: 19.7 GiB of weights (expert stacks of 144-211 MiB), KV cache,
    states and scratch, reserved with at most 2% beyond what is asked (first-fit into 256 MiB
    blocks reserved 10.9 GiB more), in blocks of at most 1 GiB or one buffer alone."""
    hp, tensors, specs = _35b_buffers(4096)
    file_weights = plan_tensors(hp, [(n, q, shape) for n, shape, q in synth.plan(hp)]).weight_bytes
    assert Footprint(specs).by_kind["weights"] == file_weights   # stacked and joined, not one byte more
    arena = _fake_arena(monkeypatch, align)
    placed = arena.alloc_many([(s.nbytes, s.name) for s in specs])
    asked = sum(s.nbytes for s in specs)
    assert asked > 19.5 * GIB
    assert arena.reserved <= 1.02 * asked
    assert arena.reserved == arena.used          # blocks hold exactly their buffers
    for block in arena.blocks:
        inside = sorted((off, off + size) for b, off, size in placed if b is block)
        assert all(a[1] <= b[0] for a, b in zip(inside, inside[1:])) and inside[-1][1] <= block.size
        assert block.size <= memory.PACKED_BLOCK or len(inside) == 1
    assert all(off % align == 0 for _, off, _ in placed)


@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=60), cap=st.integers(1, 5000))
def test_pack_fills_bins_up_to_the_cap(sizes, cap):
    bins = memory.pack(sizes, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    for b in bins:
        assert sum(sizes[i] for i in b) <= cap or len(b) == 1
    # first fit, largest first: no two bins could be merged
    totals = sorted(sum(sizes[i] for i in b) for b in bins)
    assert len(bins) == 1 or totals[0] + totals[1] > cap


def test_a_model_that_does_not_fit_is_refused_naming_a_context_that_does():
    hp, tensors, _ = _35b_buffers(4096)

    def specs_at(n):
        return decode_buffers(hp, tensors, n, candidates=1024)

    card = SimpleNamespace(name="card", max_storage_buffer_range=4 * GIB)
    available = Footprint(specs_at(100_000)).total
    assert check_fits(specs_at, 100_000, available, card).total == available
    with pytest.raises(OutOfMemoryError) as e:
        check_fits(specs_at, 262_144, available, card)
    msg = str(e.value)
    assert "\n" not in msg and "--ctx 262144 needs" in msg and "--ctx 100000 would fit" in msg
    assert "a quantized --kv-type holds more" in msg
    with pytest.raises(OutOfMemoryError, match="this model cannot run on it"):
        check_fits(specs_at, 4096, 18 * GIB, card)
    # a tensor larger than one binding is not refused for its size (it is bound in pieces)
    lavapipe = SimpleNamespace(name="lavapipe", max_storage_buffer_range=128 * MIB)
    assert max(s.nbytes for s in specs_at(4096)) > 128 * MIB
    assert check_fits(specs_at, 4096, 1 << 50, lavapipe).total == Footprint(specs_at(4096)).total


def test_the_caches_take_their_formats_bytes_and_the_longest_context_follows():
    """The 35B-A3B's KV caches: 2 KV heads of 256 in 10 layers are 20 KiB a token at f16, 10.6
    KiB at q8_0, 8.1 KiB at q4_0 K with q8_0 V, 4.4 KiB at q3_rot; the caches hold whole blocks of 64 positions and
    nothing else grows with the format. Beside the weights and every other buffer, the full
    262,144-token context fits a 32 GiB card in any format, a 23 GiB one only quantized (f16:
    160,960 tokens), and at 22 GiB q4_0,q8_0 still holds it where q8_0 does not."""
    hp, tensors, _ = _35b_buffers(4096)
    plans = {kv: decode_buffers(hp, tensors, 1000, 0, kv=kv) for kv in (KVTypes("f16", "f16"), KVTypes("q8_0", "q8_0"),
                                                                        KVTypes("q4_0", "q8_0"), KVTypes("q3_rot", "q3_rot"))}
    kv_bytes = {kv: Footprint(specs).by_kind["KV cache"] for kv, specs in plans.items()}
    assert kv_bytes == {("f16", "f16"): 1024 * 20 * 1024, ("q8_0", "q8_0"): 1024 * 10 * 2 * 2 * 272,
                        ("q4_0", "q8_0"): 1024 * 10 * 2 * (144 + 272), ("q3_rot", "q3_rot"): 1024 * 10 * 2 * 2 * 112}
    others = {kv: Footprint(specs).total - kv_bytes[kv] for kv, specs in plans.items()}
    assert len(set(others.values())) == 1
    contexts = {gib: [largest_context(hp, tensors, gib * GIB, kv) for kv in plans] for gib in (22, 23, 32)}
    assert contexts == {22: [108_544, 204_224, 262_144, 262_144], 23: [160_960] + [262_144] * 3, 32: [262_144] * 4}
    n = contexts[23][0]  # the largest: one more block of 64 positions does not fit
    fits = [Footprint(decode_buffers(hp, tensors, c, 0, chunk=512, halves=True)).total <= 23 * GIB for c in (n, n + 64)]
    assert fits == [True, False]
    with pytest.raises(ZdslError, match="blocks of 32 values, but this model's heads have 48: use --kv-type f16"):
        decode_buffers(dataclasses.replace(hp, head_dim=48), tensors, 64, 0, kv=KVTypes("f16", "q8_0"))


def test_alloc_many_on_a_device(device):
    sizes = [1000, 5 * MIB, 3, 0, 64 * 1024 + 7]
    before = device.memory_report().get("device", {}).get("reserved", 0)
    bufs = device.alloc_many([(f"b{i}", n) for i, n in enumerate(sizes)])
    report = device.memory_report()["device"]
    align = max(16, device._phys.min_storage_offset_alignment)
    assert report["reserved"] - before == sum(max(align, -(-n // align) * align) for n in sizes)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, n, np.uint8) for n in sizes]
    for b, d in zip(bufs, data):
        if len(d):
            b.write(d)
    for b, d in zip(bufs, data):
        np.testing.assert_array_equal(b.read(np.uint8), d)
    for b in bufs:
        b.free()
    assert device.memory_report()["device"]["reserved"] == before   # the packed block went back


@pytest.fixture(scope="module")
def file_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("upload") / "blob.bin"
    data = np.random.default_rng(1).integers(0, 256, 3 * MIB + 123, np.uint8)
    data.tofile(path)
    return path, data


def _jobs(blob, draw, room=(1_300_000, 800_000)):
    """Random (destination index, destination offset, file offset, bytes) ranges, laid one after
    another with gaps in each of two destinations of `room` bytes (copies never overlap)."""
    at, out = [0, 0], []
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, 1))
        gap = 4 * draw(st.integers(0, 10_000))
        size = draw(st.integers(0, min(600_000, max(room[i] - at[i] - gap, 0))))
        start = draw(st.integers(0, len(blob) - size))
        out.append((i, at[i] + gap, start, size))
        at[i] += gap + size
    return out


@given(data=st.data())
def test_upload_file_puts_each_range_where_asked(device, file_bytes, data):
    path, blob = file_bytes
    jobs = _jobs(blob, data.draw)
    bufs = device.alloc_many([("a", 1_300_000), ("b", 800_000)])
    device.upload_file(path, [(bufs[i], off, start, n) for i, off, start, n in jobs])
    for i, off, start, n in jobs:
        np.testing.assert_array_equal(bufs[i].read(np.uint8, offset=off, nbytes=n), blob[start:start + n])
    for b in bufs:
        b.free()


@given(data=st.data(), slots=st.integers(1, 3), slot=st.sampled_from([4096, 65536, 1 << 20]))
def test_staging_slots_carry_file_ranges_in_flight(device, file_bytes, data, slots, slot):
    """The path of devices whose memory is not host-visible: ranges cut across slots, several
    destination blocks in one slot, slots reused once the GPU is done with them."""
    path, blob = file_bytes
    one, other = device.alloc(1_300_000, "one"), device.alloc_many([("other", 800_000)])[0]
    bufs = [one, other]
    jobs = _jobs(blob, data.draw)
    done = []
    staging = memory.Staging(device, device._arena("host"), slots, slot)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(2) as pool:
            staging.write_file(fd, [(bufs[i].block, bufs[i].offset + off, start, n) for i, off, start, n in jobs],
                               pool, done.append)
    finally:
        os.close(fd)
        staging.free()
    assert sum(done) == sum(n for *_, n in jobs)
    for i, off, start, n in jobs:
        np.testing.assert_array_equal(bufs[i].read(np.uint8, offset=off, nbytes=n), blob[start:start + n])
    data_in = np.random.default_rng(2).integers(0, 256, 200_003, np.uint8)
    staging = memory.Staging(device, device._arena("host"), slots, slot)
    staging.write(one.block, one.offset + 16, memoryview(data_in))
    out = np.zeros_like(data_in)
    staging.read(one.block, one.offset + 16, memoryview(out))
    np.testing.assert_array_equal(out, data_in)
    staging.free()
    one.free()
    other.free()
