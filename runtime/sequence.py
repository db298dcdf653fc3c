"""A Sequence is one command buffer: recorded once, then replayed as often as needed.

Why: every call through cffi costs microseconds and a decode step has hundreds of dispatches,
so per token the only Python work left is one vkQueueSubmit. Barriers are placed at record
time from the byte ranges each command reads and writes: only where a command touches what an
earlier one since the last barrier wrote (RAW, WAW), or writes what it read (WAR). Each barrier
names only the pipeline stages involved (dispatches after dispatches: compute → compute), and a
command of a stage the last barrier did not cover gets one of its own.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from zdsl.errors import MissingFeatureError, ZdslError
from zdsl.runtime import vk
from zdsl.runtime.memory import PiecedBuffer
from zdsl.runtime.vk import COMPUTE, DEPENDENCY, INDIRECT, TO_HOST, TRANSFER, Keep, barrier, ffi, lib
from zdsl.runtime.warm import warm

MAX_TIMESTAMPS = 16384
_COMPUTE = vk.VK_PIPELINE_BIND_POINT_COMPUTE
_STAGE_COMPUTE = vk.VK_SHADER_STAGE_COMPUTE_BIT
_STORAGE = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
_BOTTOM = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
_TIMEOUT = vk.VK_TIMEOUT


def _overlaps(ranges, lo: int, hi: int) -> bool:
    return ranges is not None and any(a < hi and lo < b for a, b in ranges)


class Hazards:
    """Byte ranges read and written since the last barrier, per memory block."""

    __slots__ = ("reads", "writes")

    def __init__(self):
        self.reads: dict = {}
        self.writes: dict = {}

    def conflict(self, reads, writes) -> bool:
        w, r = self.writes, self.reads
        return (any(_overlaps(w.get(b), lo, hi) for b, lo, hi in reads)
                or any(_overlaps(w.get(b), lo, hi) or _overlaps(r.get(b), lo, hi) for b, lo, hi in writes))

    def add(self, reads, writes) -> None:
        for table, ranges in ((self.reads, reads), (self.writes, writes)):
            for b, lo, hi in ranges:
                table.setdefault(b, []).append((lo, hi))

    def clear(self) -> None:
        self.reads.clear()
        self.writes.clear()

    def ranges(self) -> tuple[list, list]:
        """(reads, writes) as add() takes them."""
        return tuple([(b, lo, hi) for b, spans in table.items() for lo, hi in spans]
                     for table in (self.reads, self.writes))


def fold(grid: tuple[int, int, int], limit: tuple[int, int, int]) -> tuple[int, int, int]:
    """A physical grid of at least as many workgroups as `grid` (and fewer than one row more)
    that the device can launch: real vocabularies need 248,320 rows of an output head, where
    many drivers launch at most 65,535 workgroups per axis. The shader maps each physical
    workgroup back to its place in `grid` (zdsl/lang/glsl.py) and the extra ones return."""
    n = grid[0] * grid[1] * grid[2]
    nz = -(-n // (limit[0] * limit[1]))
    per_z = -(-n // nz)
    ny = -(-per_z // limit[0])
    nx = -(-per_z // ny)
    if nz > limit[2] or n >= 1 << 32:
        raise ZdslError(f"{grid[0]}x{grid[1]}x{grid[2]} workgroups are more than the device can launch "
                        f"({limit[0]}x{limit[1]}x{limit[2]})")
    return nx, ny, nz


def _range(buf, offset: int = 0, nbytes: int | None = None) -> tuple:
    """(block, first byte, end) of `nbytes` (all by default) at `offset` into a Buffer."""
    if buf.block is None:
        raise ZdslError(f"buffer {buf.name or '(unnamed)'} was freed")
    lo = buf.offset + offset
    return buf.block, lo, lo + (buf.nbytes - offset if nbytes is None else nbytes)


class Sequence:
    """Record with dispatch/copy/fill; `run()` ends recording and submits."""

    def __init__(self, device, timestamps: bool = False, pool=None):
        if timestamps and "timestamps" not in device.info.features:
            raise MissingFeatureError(f"{device.info.name} has no timestamp queries on its compute queue")
        self.device = device
        self.barriers = 0
        self._dev = device._dev
        self._keep = Keep()
        self._labels: list[str] = []
        self.launches: list = []  # what KernelDef.launch recorded here (the tuner reads a step's)
        self.pipelines: dict = {}  # the pipelines dispatched, in order (a dict as an ordered set: runtime/warm.py)
        self.warmed = False  # its pipelines went through runtime/warm.py (its first run does it)
        self._hazards = Hazards()
        self._together: Hazards | None = None  # what the commands of a together() block touch
        self._since = 0     # stages of the commands since the last barrier
        self._seen = 0      # stages of every command recorded
        self._covered = DEPENDENCY.dst  # stages the last barrier ordered after everything before it
        self._bound = None
        self._recording, self._pending, self._runs = True, False, 0
        self._submits: dict[int, object] = {}
        self._pools: list = []
        self._room = (0, 0)        # (sets, descriptors) left in the newest pool
        self._infos = self._keep.new("VkDescriptorBufferInfo[]", 16)
        self._write = self._keep.struct("VkWriteDescriptorSet", sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET,
                                        descriptorType=_STORAGE)
        self._region = self._keep.new("VkBufferCopy *")
        self._set = self._keep.new("VkDescriptorSet *")
        self._fence = self._keep.new("VkFence[1]")
        self._query_pool = None
        self._push_set = device._ext("vkCmdPushDescriptorSetKHR") if device._push_descriptors else None
        self._pool = pool or device._pool  # the command pool its buffer comes from
        self.cb = device._command_buffer(self._pool)
        keep = Keep()
        fence_info = keep.struct("VkFenceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO)
        vk.check(lib.vkCreateFence(self._dev, fence_info, ffi.NULL, self._fence), "vkCreateFence")
        begin = keep.struct("VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                            flags=vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT)
        vk.check(lib.vkBeginCommandBuffer(self.cb, begin), "vkBeginCommandBuffer")
        if timestamps:
            pool_info = keep.struct("VkQueryPoolCreateInfo", sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                                    queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=MAX_TIMESTAMPS + 1)
            pool = keep.new("VkQueryPool *")
            vk.check(lib.vkCreateQueryPool(self._dev, pool_info, ffi.NULL, pool), "vkCreateQueryPool")
            self._query_pool = pool[0]
            lib.vkCmdResetQueryPool(self.cb, self._query_pool, 0, MAX_TIMESTAMPS + 1)
        DEPENDENCY.record(self.cb)      # orders this replay after whatever the queue ran before
        if timestamps:
            lib.vkCmdWriteTimestamp(self.cb, _BOTTOM, self._query_pool, 0)

    @property
    def commands(self) -> int:
        """How many commands (dispatches, copies, fills) are recorded."""
        return len(self._labels)

    # -- recording ------------------------------------------------------------------------

    def dispatch(self, pipe, groups, buffers, push: bytes = b"", label: str = "") -> None:
        g = [groups] if isinstance(groups, (int, np.integer)) else list(groups)
        x, y, z = (int(v) for v in g + [1] * (3 - len(g)))
        limit = self.device._phys.max_group_count
        if min(x, y, z) < 0:
            raise ZdslError(f"dispatch of {pipe.name}: {x}x{y}x{z} workgroups")
        if x > limit[0] or y > limit[1] or z > limit[2]:
            try:
                physical = fold((x, y, z), limit)
                pipe = pipe.folded((x, y, z))
            except ZdslError as e:
                raise ZdslError(f"dispatch of {pipe.name}: {e}") from None
            x, y, z = physical
        self._bind(pipe, buffers, push, (), COMPUTE)
        lib.vkCmdDispatch(self.cb, x, y, z)
        self._done(label or pipe.name)

    def dispatch_indirect(self, pipe, args, buffers, push: bytes = b"", label: str = "") -> None:
        if args.nbytes < 12:
            raise ZdslError(f"indirect arguments {args.name or '(unnamed)'} need 12 bytes (3 x u32), "
                            f"it has {args.nbytes}")
        block, lo, _ = _range(args)
        self._bind(pipe, buffers, push, ((block, lo, lo + 12),), COMPUTE | INDIRECT)
        lib.vkCmdDispatchIndirect(self.cb, block.buffer, lo)
        self._done(label or pipe.name)

    def copy(self, src, dst, nbytes: int | None = None, dst_offset: int = 0) -> None:
        """nbytes (all of src by default) from the start of src to dst_offset bytes into dst (a
        copy, unlike a binding, may start anywhere); one region a pair of pieces where either is
        pieced."""
        n = src.nbytes if nbytes is None else nbytes
        if n > src.nbytes or dst_offset + n > dst.nbytes:
            raise ZdslError(f"copy of {n} bytes from {src.name or 'a buffer'} ({src.nbytes} bytes) to "
                            f"{dst.name or 'a buffer'} ({dst.nbytes} bytes) at {dst_offset} does not fit")
        regions, done = [], 0
        for src_piece, at, m in src.spans(0, n):
            for dst_piece, dst_at, k in dst.spans(dst_offset + done, m):
                regions.append((_range(src_piece, at, k), _range(dst_piece, dst_at, k)))
                at += k
            done += m
        self._order([r for r, _ in regions], [w for _, w in regions], TRANSFER)
        for (src_block, lo, hi), (dst_block, dst_lo, _) in regions:
            self._region.srcOffset, self._region.dstOffset, self._region.size = lo, dst_lo, hi - lo
            lib.vkCmdCopyBuffer(self.cb, src_block.buffer, dst_block.buffer, 1, self._region)
        self._done(f"copy {src.name} -> {dst.name}")

    def fill(self, dst, value: int = 0) -> None:
        if dst.nbytes % 4:
            raise ZdslError(f"fill of {dst.name or 'a buffer'}: {dst.nbytes} bytes is not a whole number of u32")
        ranges = [_range(d, at, n) for d, at, n in dst.spans(0, dst.nbytes)]
        self._order((), ranges, TRANSFER)
        for block, lo, hi in ranges:
            lib.vkCmdFillBuffer(self.cb, block.buffer, lo, hi - lo, value & 0xFFFFFFFF)
        self._done(f"fill {dst.name}")

    @contextmanager
    def together(self):
        """Commands recorded inside get no barrier between them, only the one before them that
        what came earlier calls for: the caller knows they touch disjoint memory (one launch per
        sequence of a batch, each on its own row of a buffer they all bind, batch.py), which the
        byte ranges of their bindings cannot show."""
        if self._together is not None:
            raise ZdslError("together() blocks do not nest")
        self._together = Hazards()
        try:
            yield
        finally:
            block, self._together = self._together, None
            self._hazards.add(*block.ranges())

    def _check_recording(self) -> None:
        if not self._recording or self.cb is None:
            raise ZdslError("this sequence has already run, so it can no longer record: make a new one")

    def _order(self, reads, writes, stage: int) -> None:
        """Record the barrier the next command (of pipeline stages `stage`) needs, if any."""
        self._check_recording()
        conflict = self._hazards.conflict(reads, writes)
        uncovered = stage & ~self._covered
        if conflict or uncovered:
            # A conflict is with commands since the last barrier; a stage the last barrier did not
            # cover may depend on anything before it, and must keep what that barrier covered.
            src = self._seen if uncovered else self._since
            dst = stage if conflict else self._covered | stage
            barrier(src, dst).record(self.cb)
            self.barriers += 1
            self._hazards.clear()
            self._since, self._covered = 0, dst
        (self._hazards if self._together is None else self._together).add(reads, writes)
        self._since |= stage
        self._seen |= stage

    def _bind(self, pipe, buffers, push: bytes, extra_reads, stage: int) -> None:
        if pipe.device is not self.device:
            raise ZdslError(f"pipeline {pipe.name} belongs to another device")
        if len(buffers) != len(pipe.bindings):
            raise ZdslError(f"dispatch of {pipe.name}: {len(buffers)} buffers for {len(pipe.bindings)} bindings")
        if len(push) != pipe.push_size:
            raise ZdslError(f"dispatch of {pipe.name}: {len(push)} bytes of push constants, the pipeline takes "
                            f"{pipe.push_size}")
        reads, writes = list(extra_reads), []
        max_range = self.device.info.max_storage_buffer_range
        for buf, (r, w) in zip(buffers, pipe.access):
            if isinstance(buf, PiecedBuffer):
                raise ZdslError(f"dispatch of {pipe.name}: buffer {buf.name or '(unnamed)'} is in pieces: dispatch "
                                "a kernel variant (Variant.dispatch), which binds them")
            if not 0 < buf.nbytes <= max_range:
                raise ZdslError(f"dispatch of {pipe.name}: buffer {buf.name or '(unnamed)'} of {buf.nbytes} bytes "
                                f"cannot be bound (1..{max_range} bytes): bind slices")
            rng = _range(buf)
            if r:
                reads.append(rng)
            if w:
                writes.append(rng)
        self._order(reads, writes, stage)
        self.pipelines[pipe] = None
        cb = self.cb
        if self._bound is not pipe:
            lib.vkCmdBindPipeline(cb, _COMPUTE, pipe.handle)
            self._bound = pipe
        n = len(buffers)
        if n:
            if n > len(self._infos):
                self._infos = self._keep.new("VkDescriptorBufferInfo[]", n)
            infos = self._infos
            for i, buf in enumerate(buffers):
                info = infos[i]
                info.buffer, info.offset, info.range = buf.block.buffer, buf.offset, buf.nbytes
            write = self._write
            write.descriptorCount, write.pBufferInfo = n, infos
            if pipe.pushed:
                self._push_set(cb, _COMPUTE, pipe.layout, 0, 1, write)
            else:
                write.dstSet = self._allocate_set(pipe)
                lib.vkUpdateDescriptorSets(self._dev, 1, write, 0, ffi.NULL)
                lib.vkCmdBindDescriptorSets(cb, _COMPUTE, pipe.layout, 0, 1, self._set, 0, ffi.NULL)
        if push:
            lib.vkCmdPushConstants(cb, pipe.layout, _STAGE_COMPUTE, 0, len(push), ffi.from_buffer(push))

    def _allocate_set(self, pipe):
        """A descriptor set for the pipeline's bindings from this sequence's pools (where its
        descriptors are not pushed)."""
        keep, n = Keep(), len(pipe.bindings)
        sets, descriptors = self._room
        if sets < 1 or descriptors < n:
            sets, descriptors = 256, 256 * max(n, 8)
            pool_info = keep.struct("VkDescriptorPoolCreateInfo", maxSets=sets, poolSizeCount=1,
                                    sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                                    pPoolSizes=[{"type": _STORAGE, "descriptorCount": descriptors}])
            pool = keep.new("VkDescriptorPool *")
            vk.check(lib.vkCreateDescriptorPool(self._dev, pool_info, ffi.NULL, pool), "vkCreateDescriptorPool")
            self._pools.append(pool[0])
        self._room = (sets - 1, descriptors - n)
        info = keep.struct("VkDescriptorSetAllocateInfo", sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                           descriptorPool=self._pools[-1], descriptorSetCount=1,
                           pSetLayouts=[self.device._set_layout(pipe.arrays, False)])
        vk.check(lib.vkAllocateDescriptorSets(self._dev, info, self._set), "vkAllocateDescriptorSets")
        return self._set[0]

    def _done(self, label: str) -> None:
        self._labels.append(label)
        if self._query_pool is not None:
            if len(self._labels) > MAX_TIMESTAMPS:
                raise ZdslError(f"a timed sequence holds at most {MAX_TIMESTAMPS} commands")
            lib.vkCmdWriteTimestamp(self.cb, _BOTTOM, self._query_pool, len(self._labels))

    # -- running --------------------------------------------------------------------------

    def run(self, times: int = 1, wait: bool = True) -> None:
        """Submit the recorded commands `times` times in order (one vkQueueSubmit)."""
        if self.cb is None:
            raise ZdslError("this sequence was freed (or its device closed)")
        self.end()
        if not isinstance(times, int) or times < 1:
            raise ZdslError(f"run(times={times!r}): times must be a positive integer")
        if not self.warmed:
            self.warmed = True
            warm(self.device, self.pipelines)
        self.wait()
        submit = self._submits.get(times)
        if submit is None:
            submit = self._keep.struct("VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                       commandBufferCount=times, pCommandBuffers=[self.cb] * times)
            self._submits[times] = submit
        vk.check(lib.vkQueueSubmit(self.device._queue, 1, submit, self._fence[0]), "vkQueueSubmit")
        self._pending = True
        self._runs += 1
        if wait:
            self.wait()

    def end(self) -> None:
        """End the recording (run() does it first if not done): on the thread that recorded, when
        that is a Recorder's, since ending touches the command pool as recording does."""
        if self._recording:
            self.device._check_runnable()
            TO_HOST.record(self.cb)
            vk.check(lib.vkEndCommandBuffer(self.cb), "vkEndCommandBuffer")
            self._recording = False

    def wait(self) -> None:
        if not self._pending:
            return
        while True:     # wait in 1 s slices so that Ctrl-C gets through
            result = lib.vkWaitForFences(self._dev, 1, self._fence, 1, 1_000_000_000)
            if result != _TIMEOUT:
                break
        vk.check(result, "vkWaitForFences")
        vk.check(lib.vkResetFences(self._dev, 1, self._fence), "vkResetFences")
        self._pending = False

    def timings(self) -> list[tuple[str, float]]:
        """(label, GPU ms) per command of the last replay: the time from the end of the previous
        command to the end of this one, so the figures add up to the whole sequence."""
        if self._query_pool is None:
            raise ZdslError("this sequence records no timestamps: make it with sequence(timestamps=True)")
        if not self._runs or not self._labels:
            return []
        self.wait()
        n = len(self._labels) + 1
        data = np.zeros(n, np.uint64)
        vk.check(lib.vkGetQueryPoolResults(self._dev, self._query_pool, 0, n, data.nbytes, ffi.from_buffer(data), 8,
                                           vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT),
                 "vkGetQueryPoolResults")
        bits = self.device._phys.timestamp_bits
        if bits < 64:
            data &= np.uint64((1 << bits) - 1)
        ms = np.diff(data.astype(np.int64)) * (self.device._phys.timestamp_period / 1e6)
        return list(zip(self._labels, ms.tolist()))

    def free(self) -> None:
        """Release the command buffer and its objects now; the device also does it at close."""
        self.device._forget_sequence(self)

    def _destroy(self) -> None:
        dev = self._dev
        if self._pending:       # no error raised here: this also runs while closing a lost device
            lib.vkWaitForFences(dev, 1, self._fence, 1, 10_000_000_000)
            self._pending = False
        lib.vkFreeCommandBuffers(dev, self._pool, 1, self._keep.new("VkCommandBuffer[1]", [self.cb]))
        lib.vkDestroyFence(dev, self._fence[0], ffi.NULL)
        if self._query_pool is not None:
            lib.vkDestroyQueryPool(dev, self._query_pool, ffi.NULL)
        for pool in self._pools:
            lib.vkDestroyDescriptorPool(dev, pool, ffi.NULL)
        self._pools.clear()
        self.cb = None
