"""Device memory: large blocks, each one VkDeviceMemory with one VkBuffer over all of it,
sub-allocated first-fit.

Why blocks: drivers cap the number of allocations (often 4096) and each costs a kernel call,
while a model has thousands of tensors. A Buffer is (block, offset, nbytes), so binding one is a
descriptor with an offset, and barrier tracking compares byte ranges of the same block.
Bytes move through one reusable host-visible staging buffer, or straight through the mapping
when the device memory is host-visible (lavapipe, unified-memory APUs).
"""

from __future__ import annotations

import bisect

import numpy as np

from zdsl.errors import OutOfMemoryError, ZdslError
from zdsl.runtime import vk
from zdsl.runtime.vk import Keep, ffi, lib

MiB = 1 << 20
BLOCK_SIZE = 256 * MiB
HOST_BLOCK_SIZE = 64 * MiB
STAGING_SIZE = 16 * MiB
USAGE = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
         | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT | vk.VK_BUFFER_USAGE_INDIRECT_BUFFER_BIT)
HOST_VISIBLE = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Block:
    """One VkDeviceMemory bound to one VkBuffer; `free` is a sorted list of [offset, size]."""

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
    """Blocks of one memory type. Requests larger than a block get a dedicated block."""

    def __init__(self, device, type_index: int, block_size: int, label: str):
        self.device, self.type_index, self.label = device, type_index, label
        flags, self.heap = device._phys.memory_types[type_index]
        self.host_visible = flags & HOST_VISIBLE == HOST_VISIBLE
        self.heap_size = device._phys.heap_sizes[self.heap]
        self.block_size = min(block_size, device._phys.max_buffer_size, max(self.heap_size // 4, MiB))
        self.align = max(16, device._phys.min_storage_offset_alignment)
        self.blocks: list[Block] = []
        self.used = 0

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self.blocks)

    def alloc(self, nbytes: int, name: str) -> tuple[Block, int, int]:
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for block in self.blocks:
            offset = block.take(size)
            if offset is not None:
                self.used += size
                return block, offset, size
        block = self._new_block(max(size, self.block_size), size > self.block_size, nbytes, name)
        self.blocks.append(block)
        self.used += size
        return block, block.take(size), size

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

    def _new_block(self, size: int, dedicated: bool, nbytes: int, name: str) -> Block:
        phys = self.device._phys
        if size > self.heap_size or size > phys.max_buffer_size:
            limit = (f"; the largest buffer it allows is {fmt_bytes(phys.max_buffer_size)}"
                     if size <= self.heap_size else "")
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


class Buffer:
    """A sub-allocation (block, offset, nbytes) of device memory, or a slice of one."""

    __slots__ = ("nbytes", "name", "device", "block", "offset", "_arena", "_size")

    def __init__(self, device, block: Block, offset: int, nbytes: int, name: str, arena=None, size: int = 0):
        self.device, self.block, self.offset, self.nbytes, self.name = device, block, offset, nbytes, name
        self._arena, self._size = arena, size

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name or 'unnamed'} {fmt_bytes(self.nbytes)}>"

    def _check(self, offset: int, nbytes: int, what: str) -> None:
        if self.block is None:
            raise ZdslError(f"{what} of freed buffer {self.name or '(unnamed)'}")
        if self.device._closed:
            raise ZdslError(f"{what} of buffer {self.name or '(unnamed)'} after its device was closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ZdslError(f"{what} of {nbytes} bytes at offset {offset} is outside buffer "
                            f"{self.name or '(unnamed)'} of {self.nbytes} bytes")

    def write(self, array, offset: int = 0) -> None:
        data = _bytes_of(array)
        self._check(offset, len(data), "write")
        self.device._write(self.block, self.offset + offset, data)

    def read(self, dtype=np.float32, shape=None, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        dtype = np.dtype(dtype)
        if nbytes is None:
            nbytes = (int(np.prod(shape)) * dtype.itemsize if shape is not None
                      else (self.nbytes - offset) // dtype.itemsize * dtype.itemsize)
        self._check(offset, nbytes, "read")
        out = np.empty(nbytes, np.uint8)
        self.device._read(self.block, self.offset + offset, memoryview(out))
        out = out.view(dtype)
        return out if shape is None else out.reshape(shape)

    def slice(self, offset: int, nbytes: int) -> "Buffer":
        self._check(offset, nbytes, "slice")
        if (self.offset + offset) % self.device._phys.min_storage_offset_alignment:
            raise ZdslError(f"slice of {self.name or 'buffer'} at offset {offset} is not aligned to "
                            f"{self.device._phys.min_storage_offset_alignment} bytes, so it cannot be bound")
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
    """Moves bytes between numpy and device-local memory through one host-visible buffer."""

    def __init__(self, device, arena: Arena):
        self.device = device
        self.block, self.offset, self.size = arena.alloc(STAGING_SIZE, "staging")

    def write(self, block: Block, offset: int, data: memoryview) -> None:
        for start in range(0, len(data), self.size):
            chunk = data[start:start + self.size]
            ffi.memmove(self.block.mapped + self.offset, chunk, len(chunk))
            self._copy(self.block.buffer, self.offset, block.buffer, offset + start, len(chunk))

    def read(self, block: Block, offset: int, out: memoryview) -> None:
        for start in range(0, len(out), self.size):
            n = min(self.size, len(out) - start)
            self._copy(block.buffer, offset + start, self.block.buffer, self.offset, n)
            ffi.memmove(out[start:start + n], self.block.mapped + self.offset, n)

    def _copy(self, src, src_offset: int, dst, dst_offset: int, n: int) -> None:
        keep = Keep()
        region = keep.struct("VkBufferCopy", srcOffset=src_offset, dstOffset=dst_offset, size=n)
        self.device._submit_now(lambda cb: lib.vkCmdCopyBuffer(cb, src, dst, 1, region))
