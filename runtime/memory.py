"""Device memory: blocks of VkDeviceMemory, each with one VkBuffer over all of it, sub-allocated.

Why blocks: drivers cap the number of allocations (often 4096) and each costs a kernel call,
while a model has thousands of tensors. A Buffer is (block, offset, nbytes), so binding one is a
descriptor with an offset, and barrier tracking compares byte ranges of the same block.
What a model holds is known before it loads, so `Arena.alloc_many` packs such a set into blocks
sized to what they hold: no block tail is left empty (a 32 GB card must hold a 19.7 GiB model
and its context). Buffers made one at a time go first-fit into blocks that grow with what the
arena holds. Bytes move through host-visible staging slots used in turn, so the CPU fills one
while the GPU copies another, or straight through the mapping when the device memory is
host-visible (lavapipe, unified-memory APUs); file ranges are read by several threads at once
(`os.preadv` releases the GIL).
"""

from __future__ import annotations

import bisect
import os

import numpy as np

from zdsl.errors import OutOfMemoryError, ZdslError
from zdsl.runtime import vk
from zdsl.runtime.vk import DEPENDENCY, TO_HOST, Keep, ffi, lib

MiB = 1 << 20
GiB = 1 << 30
BLOCK_SIZE = 256 * MiB    # the largest block made for buffers allocated one at a time
FIRST_BLOCK = 4 * MiB     # ... and the smallest: each new one as large as what the arena holds
PACKED_BLOCK = GiB        # the largest block `alloc_many` makes (fewer allocations, any driver)
STAGING_SIZE = 16 * MiB   # one staging slot
UPLOAD_SLOTS = 4          # slots in flight while a file is uploaded, of UPLOAD_SLOT bytes
UPLOAD_SLOT = 64 * MiB
READ_PIECE = 4 * MiB      # a file range is read in pieces of this size, by READ_THREADS at once
READ_THREADS = min(8, os.cpu_count() or 1)
HOST_BLOCK_SIZE = 64 * MiB
USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
         | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT | vk.VK_BUFFER_USAGE_INDIRECT_BUFFER_BIT)
HOST_VISIBLE = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def pack(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices of `sizes` grouped into bins of at most `cap` bytes (a larger size gets a bin of
    its own): first fit, largest first, so few bins are needed and each can be allocated at
    exactly the sum of its sizes."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for b, left in enumerate(room):
            if sizes[i] <= left:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(max(cap - sizes[i], 0))
    return bins


class Block:
    """One VkDeviceMemory bound to one VkBuffer; `free` is a sorted list of [offset, size].
    A `dedicated` block (one request, or a packed set) is released once all it holds is freed."""

    __slots__ = ("memory", "buffer", "size", "mapped", "free", "dedicated")

    def __init__(self, memory, buffer, size: int, mapped, dedicated: bool):
        self.memory, self.buffer, self.size, self.mapped = memory, buffer, size, mapped
        self.free = [[0, size]]
        self.dedicated = dedicated

    def take(self, size: int) -> int | None:
        for i, (off, avail) in enumerate(self.free):
            if avail >= size:
                if avail == size:
                    del self.free[i]
                else:
                    self.free[i] = [off + size, avail - size]
                return off
        return None

    def give(self, offset: int, size: int) -> None:
        i = bisect.bisect(self.free, [offset, size])
        self.free.insert(i, [offset, size])
        if i + 1 < len(self.free) and offset + size == self.free[i + 1][0]:
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1][1] += self.free.pop(i)[1]

    @property
    def empty(self) -> bool:
        return self.free == [[0, self.size]]


class Arena:
    """Blocks of one memory type."""

    def __init__(self, device, type_index: int, block_size: int, label: str):
        self.device, self.type_index, self.label = device, type_index, label
        flags, self.heap = device._phys.memory_types[type_index]
        self.host_visible = flags & HOST_VISIBLE == HOST_VISIBLE
        self.heap_size = device._phys.heap_sizes[self.heap]
        self.largest = min(device._phys.max_buffer_size, device._phys.max_allocation_size)
        self.block_size = min(block_size, self.largest, max(self.heap_size // 4, MiB))
        self.align = max(16, device._phys.min_storage_offset_alignment)
        self.blocks: list[Block] = []
        self.used = 0

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self.blocks)

    def _aligned(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def alloc(self, nbytes: int, name: str) -> tuple[Block, int, int]:
        size = self._aligned(nbytes)
        for block in self.blocks:
            offset = block.take(size)
            if offset is not None:
                self.used += size
                return block, offset, size
        grown = min(self.block_size, max(FIRST_BLOCK, self.reserved))
        block = self._new_block(max(size, grown), size > grown, nbytes, name)
        self.blocks.append(block)
        self.used += size
        return block, block.take(size), size

    def alloc_many(self, requests: list[tuple[int, str]]) -> list[tuple[Block, int, int]]:
        """(block, offset, size) for each (nbytes, name), packed into new blocks of exactly the
        bytes they hold (each at most PACKED_BLOCK, or one request alone)."""
        sizes = [self._aligned(n) for n, _ in requests]
        out: list = [None] * len(requests)
        made = []
        try:
            for members in pack(sizes, min(PACKED_BLOCK, self.largest)):
                total = sum(sizes[i] for i in members)
                largest = max(members, key=lambda i: sizes[i])
                block = self._new_block(total, True, total, requests[largest][1] if len(members) == 1
                                        else f"{len(members)} buffers ({requests[largest][1]}, ...)")
                made.append(block)
                for i in members:
                    out[i] = (block, block.take(sizes[i]), sizes[i])
        except BaseException:
            for block in made:
                self._destroy_block(block)
            raise
        self.blocks += made
        self.used += sum(sizes)
        return out

    def release(self, block: Block, offset: int, size: int) -> None:
        block.give(offset, size)
        self.used -= size
        if block.dedicated and block.empty:
            self.blocks.remove(block)
            self._destroy_block(block)

    def _oom(self, nbytes: int, name: str, why: str = "") -> str:
        who = f"'{name}'" if name else "an unnamed buffer"
        return (f"allocating {fmt_bytes(nbytes)} for {who} on {self.device.info.name} "
                f"(heap {self.heap}: {fmt_bytes(self.heap_size)}, {fmt_bytes(self.reserved)} already reserved"
                f" by zdsl{why})")

    def check_heap(self, nbytes: int, name: str) -> None:
        """Refuse what the heap cannot hold at all (before a pieced request takes what it can)."""
        if nbytes > self.heap_size:
            raise OutOfMemoryError(f"out of {self.label} memory {self._oom(nbytes, name)}")

    def _new_block(self, size: int, dedicated: bool, nbytes: int, name: str) -> Block:
        if size > self.heap_size or size > self.largest:
            limit = f"; the largest buffer it allows is {fmt_bytes(self.largest)}" if size <= self.heap_size else ""
            raise OutOfMemoryError(f"out of {self.label} memory {self._oom(nbytes, name, limit)}")
        dev, keep = self.device._dev, Keep()
        info = keep.struct("VkBufferCreateInfo", sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size,
                           usage=USAGE, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE)
        out = keep.new("VkBuffer *")
        vk.check(lib.vkCreateBuffer(dev, info, ffi.NULL, out), "vkCreateBuffer", self._oom(nbytes, name))
        buffer = out[0]
        try:
            req = keep.new("VkMemoryRequirements *")
            lib.vkGetBufferMemoryRequirements(dev, buffer, req)
            if not req.memoryTypeBits & (1 << self.type_index):
                raise ZdslError(f"{self.device.info.name}: storage buffers cannot live in memory type "
                                f"{self.type_index} (a driver zdsl does not handle yet)")
            alloc = keep.struct("VkMemoryAllocateInfo", sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                allocationSize=req.size, memoryTypeIndex=self.type_index)
            mem = keep.new("VkDeviceMemory *")
            vk.check(lib.vkAllocateMemory(dev, alloc, ffi.NULL, mem), "vkAllocateMemory", self._oom(nbytes, name))
        except BaseException:
            lib.vkDestroyBuffer(dev, buffer, ffi.NULL)
            raise
        block = Block(mem[0], buffer, size, None, dedicated)
        try:
            vk.check(lib.vkBindBufferMemory(dev, buffer, block.memory, 0), "vkBindBufferMemory")
            if self.host_visible:
                ptr = keep.new("void **")
                vk.check(lib.vkMapMemory(dev, block.memory, 0, vk.WHOLE_SIZE, 0, ptr), "vkMapMemory",
                         self._oom(nbytes, name))
                block.mapped = ffi.cast("char *", ptr[0])
        except BaseException:
            self._destroy_block(block)
            raise
        return block

    def _destroy_block(self, block: Block) -> None:
        dev = self.device._dev
        if block.mapped is not None:
            lib.vkUnmapMemory(dev, block.memory)
        lib.vkDestroyBuffer(dev, block.buffer, ffi.NULL)
        lib.vkFreeMemory(dev, block.memory, ffi.NULL)

    def report(self) -> dict:
        return {"reserved": self.reserved, "used": self.used, "blocks": len(self.blocks),
                "block_size": self.block_size, "memory_type": self.type_index, "heap": self.heap}

    def destroy(self) -> None:
        for block in self.blocks:
            self._destroy_block(block)
        self.blocks.clear()
        self.used = 0


def _bytes_of(array) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B")


class _Memory:
    """What a Buffer and a PiecedBuffer share: bytes to and from the host, moved span by span
    (a Buffer is one span; a PiecedBuffer one a piece it touches)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name or 'unnamed'} {fmt_bytes(self.nbytes)}>"

    def _check(self, offset: int, nbytes: int, what: str) -> None:
        if self._freed:
            raise ZdslError(f"{what} of freed buffer {self.name or '(unnamed)'}")
        if self.device._closed:
            raise ZdslError(f"{what} of buffer {self.name or '(unnamed)'} after its device was closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ZdslError(f"{what} of {nbytes} bytes at offset {offset} is outside buffer "
                            f"{self.name or '(unnamed)'} of {self.nbytes} bytes")

    def write(self, array, offset: int = 0) -> None:
        data = _bytes_of(array)
        self._check(offset, len(data), "write")
        at = 0
        for buf, start, n in self.spans(offset, len(data)):
            self.device._write(buf.block, buf.offset + start, data[at:at + n])
            at += n

    def read(self, dtype=np.float32, shape=None, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        dtype = np.dtype(dtype)
        if nbytes is None:
            nbytes = (int(np.prod(shape)) * dtype.itemsize if shape is not None
                      else (self.nbytes - offset) // dtype.itemsize * dtype.itemsize)
        self._check(offset, nbytes, "read")
        out = np.empty(nbytes, np.uint8)
        at = 0
        for buf, start, n in self.spans(offset, nbytes):
            self.device._read(buf.block, buf.offset + start, memoryview(out)[at:at + n])
            at += n
        out = out.view(dtype)
        return out if shape is None else out.reshape(shape)

    def _aligned(self, at: int, offset: int) -> None:
        """A slice `at` bytes past the start of its block (or piece) can be bound there."""
        align = self.device._phys.min_storage_offset_alignment
        if at % align:
            raise ZdslError(f"slice of {self.name or 'buffer'} at offset {offset} is not aligned to "
                            f"{align} bytes, so it cannot be bound")


class Buffer(_Memory):
    """A sub-allocation (block, offset, nbytes) of device memory, or a slice of one."""

    __slots__ = ("nbytes", "name", "device", "block", "offset", "_arena", "_size")

    def __init__(self, device, block: Block, offset: int, nbytes: int, name: str, arena=None, size: int = 0):
        self.device, self.block, self.offset, self.nbytes, self.name = device, block, offset, nbytes, name
        self._arena, self._size = arena, size

    @property
    def _freed(self) -> bool:
        return self.block is None

    def spans(self, offset: int, nbytes: int) -> list[tuple["Buffer", int, int]]:
        """(buffer, offset in it, bytes) covering bytes [offset, offset + nbytes): here, one."""
        return [(self, offset, nbytes)]

    def slice(self, offset: int, nbytes: int) -> "Buffer":
        self._check(offset, nbytes, "slice")
        self._aligned(self.offset + offset, offset)
        view = type(self).__new__(type(self))
        Buffer.__init__(view, self.device, self.block, self.offset + offset, nbytes, f"{self.name}[{offset}:+{nbytes}]")
        return view

    def free(self) -> None:
        """Give the memory back to the arena (slices of it must not be used afterwards)."""
        if self._arena is None:
            raise ZdslError(f"{self.name or 'buffer'} is a slice or already freed; free the buffer it came from")
        if not self.device._closed:
            self._arena.release(self.block, self.offset, self._size)
        self._arena, self.block = None, None


class PiecedBuffer(_Memory):
    """A buffer larger than the device binds in one descriptor (or allocates at once): ordinary
    Buffers ("pieces") of `piece` bytes each, the last maybe shorter. `piece` is a power of two,
    so a kernel finds an element's piece with a shift and its place there with a mask (kernels
    bind it as an array of descriptors: zdsl/lang/glsl.py). Outside a dispatch it is one buffer:
    reads, writes, slices, copies and fills span the pieces. A slice across a seam keeps the
    whole pieces it touches and `start`, the byte where it begins in the first."""

    __slots__ = ("device", "pieces", "piece", "start", "nbytes", "name", "_owner")

    def __init__(self, pieces: list[Buffer], piece: int, nbytes: int, name: str, start: int = 0, owner: bool = True):
        self.device, self.pieces, self.piece, self.start = pieces[0].device, pieces, piece, start
        self.nbytes, self.name, self._owner = nbytes, name, owner

    def __repr__(self) -> str:
        return f"<PiecedBuffer {self.name or 'unnamed'} {fmt_bytes(self.nbytes)} in {len(self.pieces)} pieces>"

    @property
    def _freed(self) -> bool:
        return any(p.block is None for p in self.pieces)

    @classmethod
    def joined(cls, buffers: list[Buffer], piece: int, name: str) -> "PiecedBuffer":
        """Buffers of their own as the pieces of one, each at a piece of `piece` bytes (a power of
        two that holds the largest), so a kernel reaches byte e of buffer j at j · piece + e: the
        caches, states and step values of a step's rows bound at once (schedule.RowBlocks). It owns
        none of them."""
        if piece & (piece - 1) or any(isinstance(b, PiecedBuffer) or b.nbytes > piece for b in buffers):
            raise ZdslError(f"{name}: buffers join as pieces of a power of two that holds each, and are not in "
                            f"pieces themselves")
        return cls(list(buffers), piece, piece * (len(buffers) - 1) + buffers[-1].nbytes, name, owner=False)

    def spans(self, offset: int, nbytes: int) -> list[tuple[Buffer, int, int]]:
        """(piece, offset in it, bytes) covering bytes [offset, offset + nbytes), one a piece."""
        out, at, end = [], self.start + offset, self.start + offset + nbytes
        while at < end:
            i, start = divmod(at, self.piece)
            n = min(self.piece - start, end - at)
            out.append((self.pieces[i], start, n))
            at += n
        return out

    def slice(self, offset: int, nbytes: int) -> "Buffer | PiecedBuffer":
        """Bytes within one piece: a slice of that piece; across a seam: a view of the pieces."""
        self._check(offset, nbytes, "slice")
        at = self.start + offset
        first = min(at // self.piece, len(self.pieces) - 1)
        last = max(first, (at + nbytes - 1) // self.piece)
        if first == last:
            return self.pieces[first].slice(at - first * self.piece, nbytes)
        self._aligned(at, offset)
        return PiecedBuffer(self.pieces[first:last + 1], self.piece, nbytes, f"{self.name}[{offset}:+{nbytes}]",
                            at - first * self.piece, owner=False)

    def bindings(self) -> list[Buffer]:
        """The pieces as a kernel binds them: each from its start, where its indices count from,
        the last up to this buffer's end (what it touches, for the barriers)."""
        end = self.start + self.nbytes - (len(self.pieces) - 1) * self.piece
        return self.pieces[:-1] + [self.pieces[-1].slice(0, end)]

    def free(self) -> None:
        """Give every piece back to the arena (slices of it must not be used afterwards)."""
        if not self._owner:
            raise ZdslError(f"{self.name or 'buffer'} is a slice or already freed; free the buffer it came from")
        for p in self.pieces:
            p.free()
        self._owner = False


def cut(nbytes: int, piece: int) -> list[int]:
    """The sizes of the pieces of a buffer of `nbytes`: `piece` each, the last the rest."""
    return [min(piece, nbytes - at) for at in range(0, nbytes, piece)]


def piece_size(binding: int, largest: int) -> int:
    """The pieces' size on a device that binds `binding` bytes in one descriptor and allocates at
    most `largest` at once: the largest power of two within both (a shift and a mask find an
    element's place, and no naturally aligned element straddles a seam)."""
    return 1 << (min(binding, largest).bit_length() - 1)


class HostBuffer(Buffer):
    """Host-visible, coherent memory, bindable like any Buffer: for values that change every step.

    Writes through `view()` are visible to the next submit; do not write while a run that reads
    the buffer is in flight.
    """

    __slots__ = ()

    def view(self, dtype=np.uint32) -> np.ndarray:
        self._check(0, self.nbytes, "view")
        dtype = np.dtype(dtype)
        n = self.nbytes // dtype.itemsize
        return np.frombuffer(ffi.buffer(self.block.mapped + self.offset, n * dtype.itemsize), dtype)


class Staging:
    """Host-visible slots that carry bytes to and from device-local memory, used in turn: the
    CPU fills one slot while the GPU copies the ones before it. A slot is waited for only when it
    comes round again (or by `finish`), so writes return before their copies are done; the
    queue runs them before anything submitted later, which reads them after a barrier."""

    def __init__(self, device, arena: Arena, slots: int = 2, slot_size: int = STAGING_SIZE):
        self.device, self.arena, self.size = device, arena, min(slot_size, arena.largest // slots)
        self.block, self.offset, self._nbytes = arena.alloc(slots * self.size, "staging")
        self._cbs = [device._command_buffer(device._pool) for _ in range(slots)]
        self._fences = [device._fence() for _ in range(slots)]
        self._pending = [False] * slots
        self._next = 0
        self._keep = Keep()
        self._regions = self._keep.new("VkBufferCopy[]", 256)

    def _slot(self) -> int:
        """The next slot, once the GPU is done with it."""
        i = self._next
        self._next = (i + 1) % len(self._cbs)
        if self._pending[i]:
            self.device._wait_fence(self._fences[i])
            self._pending[i] = False
        return i

    def view(self, slot: int, start: int, n: int) -> memoryview:
        """Writable bytes [start, start + n) of a slot."""
        return memoryview(ffi.buffer(self.block.mapped + self._at(slot) + start, n))

    def _submit(self, slot: int, copies: list[tuple]) -> None:
        """Record and submit the slot's copies: (src VkBuffer, dst VkBuffer, [(src offset, dst
        offset, bytes), ...]) each."""
        cb, keep = self._cbs[slot], Keep()
        begin = keep.struct("VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                            flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
        vk.check(lib.vkBeginCommandBuffer(cb, begin), "vkBeginCommandBuffer")
        DEPENDENCY.record(cb)
        for src, dst, regions in copies:
            if len(regions) > len(self._regions):
                self._regions = self._keep.new("VkBufferCopy[]", len(regions))
            for r, (so, do, n) in zip(self._regions, regions):
                r.srcOffset, r.dstOffset, r.size = so, do, n
            lib.vkCmdCopyBuffer(cb, src, dst, len(regions), self._regions)  # reads the regions now
        TO_HOST.record(cb)
        vk.check(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        self.device._submit(cb, self._fences[slot])
        self._pending[slot] = True

    def _at(self, slot: int) -> int:
        return self.offset + slot * self.size

    def write(self, block: Block, offset: int, data: memoryview) -> None:
        for start in range(0, len(data), self.size):
            chunk = data[start:start + self.size]
            slot = self._slot()
            ffi.memmove(self.block.mapped + self._at(slot), chunk, len(chunk))
            self._submit(slot, [(self.block.buffer, block.buffer, [(self._at(slot), offset + start, len(chunk))])])

    def write_file(self, fd: int, jobs, pool, progress=None) -> None:
        """jobs: (block, offset, file offset, bytes), read into the slots by `pool`'s threads."""
        for slot_jobs in _chunks(jobs, self.size):
            slot = self._slot()
            reads, regions, at = [], {}, 0
            for block, offset, file_offset, n in slot_jobs:
                reads += _reads(fd, self.view(slot, at, n), file_offset)
                regions.setdefault(block, []).append((self._at(slot) + at, offset, n))
                at += n
            for _ in pool.map(_read_exactly, reads):
                pass
            self._submit(slot, [(self.block.buffer, block.buffer, r) for block, r in regions.items()])
            if progress:
                progress(at)

    def read(self, block: Block, offset: int, out: memoryview) -> None:
        for start in range(0, len(out), self.size):
            n = min(self.size, len(out) - start)
            slot = self._slot()
            self._submit(slot, [(block.buffer, self.block.buffer, [(offset + start, self._at(slot), n)])])
            self.device._wait_fence(self._fences[slot])
            self._pending[slot] = False
            ffi.memmove(out[start:start + n], self.block.mapped + self._at(slot), n)

    def finish(self) -> None:
        """Wait until every copy made so far is done."""
        for i, pending in enumerate(self._pending):
            if pending:
                self.device._wait_fence(self._fences[i])
                self._pending[i] = False

    def free(self) -> None:
        self.finish()
        for fence in self._fences:
            lib.vkDestroyFence(self.device._dev, fence, ffi.NULL)
        lib.vkFreeCommandBuffers(self.device._dev, self.device._pool, len(self._cbs),
                                 self._keep.new("VkCommandBuffer[]", self._cbs))
        self.arena.release(self.block, self.offset, self._nbytes)


def _chunks(jobs, size: int):
    """jobs cut and grouped so that each group holds at most `size` bytes."""
    group, room = [], size
    for block, offset, file_offset, n in jobs:
        while n:
            take = min(n, room)
            group.append((block, offset, file_offset, take))
            offset, file_offset, n, room = offset + take, file_offset + take, n - take, room - take
            if not room:
                yield group
                group, room = [], size
    if group:
        yield group


def _reads(fd: int, dst: memoryview, file_offset: int) -> list[tuple]:
    """`dst` filled from the file at `file_offset`, as pieces the pool reads side by side."""
    return [(fd, dst[i:i + READ_PIECE], file_offset + i) for i in range(0, len(dst), READ_PIECE)]


def _read_exactly(job) -> None:
    fd, dst, offset = job
    while len(dst):
        n = os.preadv(fd, [dst], offset)
        if n <= 0:
            raise ZdslError(f"the file ended at byte {offset:,} while zdsl was reading it; was it changed or "
                            "truncated while loading? Check it and run again")
        dst, offset = dst[n:], offset + n


def read_file_into(fd: int, jobs, pool, progress=None) -> None:
    """jobs (block, offset, file offset, bytes) read straight into host-visible blocks."""
    for block, offset, file_offset, n in jobs:
        dst = memoryview(ffi.buffer(block.mapped + offset, n))
        for _ in pool.map(_read_exactly, _reads(fd, dst, file_offset)):
            pass
        if progress:
            progress(n)
