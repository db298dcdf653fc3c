"""Opening a Vulkan device, and the Device that owns everything made on it.

The Device is the single owner of every Vulkan object zdsl creates (memory blocks, pipelines,
layouts, sequences), so `close()` can free them in the right order, once, also at interpreter
exit. Pipelines go through an on-disk VkPipelineCache per device identity, so a second run of
the same kernels skips the driver's compiler.
"""

from __future__ import annotations

import atexit
import os
import re
import threading

import numpy as np

from zdsl.cache import cache_dir, content_key, discard, read_entry, write_entry
from zdsl.errors import MissingFeatureError, NoDeviceError, ZdslError
from zdsl.runtime import memory, nulldevice, physical, pipeline, vk
from zdsl.runtime.physical import DeviceInfo, Physical
from zdsl.runtime.pipeline import Pipeline
from zdsl.runtime.sequence import Sequence
from zdsl.runtime.vk import Keep, ffi, lib

# RADV's names for the families its null device can impersonate (compile-only targets).
FAMILY = re.compile(r"(gfx\d+\w*|navi\d+|vega\d+|polaris\d+)", re.I)
NO_TIMEOUT = (1 << 64) - 1
_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "other": 3, "cpu": 4}


def _listing(devices: list[Physical]) -> str:
    return "; ".join(f"{p.info.index}: {p.info.name} [{p.info.device_type}]" for p in devices) or "none"


def select(devices: list[Physical], selector: str | int | None) -> Physical:
    if not devices:
        raise NoDeviceError("no Vulkan device found: run scripts/setup.sh (mesa-vulkan-drivers brings lavapipe)")
    if selector is None:
        return min(devices, key=lambda p: _RANK.get(p.info.device_type, 3))
    text = str(selector).strip()
    key = text.lower()
    if isinstance(selector, int) or key.isdigit():
        index = int(key)
        if not 0 <= index < len(devices):
            raise NoDeviceError(f"no Vulkan device {index}; found: {_listing(devices)}")
        return devices[index]
    if FAMILY.fullmatch(key) and os.environ.get("RADV_FORCE_FAMILY", "").lower() != key:
        raise ZdslError(f"'{text}' is a compile-only RADV target: use zdsl.runtime.nulldevice.compile_statistics "
                        "(RADV_FORCE_FAMILY only takes effect in a fresh process)")
    if key in ("lavapipe", "llvmpipe", "cpu"):
        matches = [p for p in devices if p.info.device_type == "cpu" or "llvmpipe" in p.info.name.lower()]
    else:
        matches = [p for p in devices if key in p.info.name.lower()]
    if not matches:
        raise NoDeviceError(f"no Vulkan device matches '{text}'; found: {_listing(devices)}")
    return matches[0]


def list_devices(targets=("gfx1201",)) -> list[DeviceInfo]:
    """Devices this process can run on, then the compile-only `targets` that are available
    (each is queried in a child process; a target that is not available is left out)."""
    try:
        instance = physical.create_instance()
    except NoDeviceError:
        runnable = []
    else:
        try:
            runnable = [p.info for p in physical.probe_all(instance)]
        finally:
            lib.vkDestroyInstance(instance, ffi.NULL)
    compile_only = []
    for family in targets:
        try:
            compile_only.append(nulldevice.target_info(family))
        except ZdslError:
            pass
    return runnable + compile_only


def open_device(selector: str | int | None = None) -> "Device":
    """None → $ZDSL_DEVICE, else the first discrete/integrated GPU, else lavapipe; an int or digit
    string → that index; "lavapipe"/"llvmpipe"/"cpu"; else a case-insensitive name substring."""
    if selector is None:
        selector = os.environ.get("ZDSL_DEVICE") or None
    instance = physical.create_instance()
    try:
        chosen = select(physical.probe_all(instance), selector)
    except BaseException:
        lib.vkDestroyInstance(instance, ffi.NULL)
        raise
    return Device(instance, chosen)


def _block_jobs(buf, offset: int, file_offset: int, n: int) -> list[tuple]:
    """An upload job (buffer, offset in it, file offset, bytes) as (block, offset in it, file
    offset, bytes), one a piece it touches."""
    out = []
    for piece, start, m in buf.spans(offset, n):
        out.append((piece.block, piece.offset + start, file_offset, m))
        file_offset += m
    return out


def _pick_type(phys: Physical, want: int, rank) -> int:
    """The memory type with all `want` flags that ranks highest by rank(flags, heap size)."""
    types = phys.memory_types
    found = [i for i, (flags, _) in enumerate(types) if flags & want == want]
    if not found:
        raise ZdslError(f"{phys.info.name} has no memory type with flags 0x{want:x}")
    return max(found, key=lambda i: (rank(types[i][0], phys.heap_sizes[types[i][1]]), -i))


class Device:
    """An open Vulkan device: allocate buffers, build pipelines, record sequences.

    Use it from one thread, apart from a Recorder's (recorder.py), which records sequences on its
    own with a command pool of its own. A recorded Sequence refers to its Buffers and Pipelines
    by handle: keep them (do not free them) while the Sequence can still run.
    """

    def __init__(self, instance, phys: Physical):
        self.info: DeviceInfo = phys.info
        self._instance, self._phys = instance, phys
        self._closed = False
        self._dev = self._queue = self._pool = self._pipeline_cache = None
        self._procs: dict[str, object] = {}
        self._pipelines: dict[Pipeline, None] = {}
        self._sequences: dict[Sequence, None] = {}
        self._set_layouts: dict[tuple, object] = {}
        self._layouts: dict[tuple, object] = {}
        self._arenas: dict[str, memory.Arena] = {}
        self._staging = None
        self._placeholder = None
        self._cache_path = cache_dir("pipelines") / f"{content_key(self.info.identity)}.vkcache"
        self._cache_dirty = False
        self._push_descriptors = "push_descriptors" in self.info.features
        self._command_pools: list = []  # a Recorder's each (Vulkan wants one a recording thread)
        # Pipelines and layouts are made under it: a Recorder's thread records (and makes them) too.
        self.lock = threading.RLock()
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        phys, info = self._phys, self.info
        if phys.api < vk.make_version(1, 3):
            raise MissingFeatureError(f"{info.name} supports Vulkan {info.api_version}; zdsl needs 1.3")
        if phys.queue_family < 0:
            raise MissingFeatureError(f"{info.name} has no compute queue")
        keep = Keep()
        extensions = physical.device_extensions(phys)
        create = keep.struct(
            "VkDeviceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
            pNext=physical.feature_chain(keep, phys), queueCreateInfoCount=1,
            pQueueCreateInfos=[{"sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                "queueFamilyIndex": phys.queue_family, "queueCount": 1, "pQueuePriorities": [1.0]}],
            enabledExtensionCount=len(extensions), ppEnabledExtensionNames=extensions)
        out = keep.new("VkDevice *")
        vk.check(lib.vkCreateDevice(phys.handle, create, ffi.NULL, out), "vkCreateDevice", f"on {info.name}")
        self._dev = out[0]
        queue = keep.new("VkQueue *")
        lib.vkGetDeviceQueue(self._dev, phys.queue_family, 0, queue)
        self._queue = queue[0]
        self._pool = self._new_command_pool()
        self._pipeline_cache = self._open_pipeline_cache()

    def _new_command_pool(self):
        keep = Keep()
        info = keep.struct("VkCommandPoolCreateInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                           flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                           queueFamilyIndex=self._phys.queue_family)
        pool = keep.new("VkCommandPool *")
        vk.check(lib.vkCreateCommandPool(self._dev, info, ffi.NULL, pool), "vkCreateCommandPool")
        return pool[0]

    def _open_pipeline_cache(self):
        """The pipeline cache, filled from disk when the saved data is whole and this device's;
        data the driver refuses anyway is discarded, and the cache starts empty."""
        initial = read_entry(self._cache_path, lambda data: physical.pipeline_cache_problem(self._phys, data)) or b""
        result, cache = self._new_pipeline_cache(initial)
        if result < 0 and initial:
            discard(self._cache_path, f"was refused by the driver ({vk.result_name(result)})")
            result, cache = self._new_pipeline_cache(b"")
        vk.check(result, "vkCreatePipelineCache")
        return cache

    def _new_pipeline_cache(self, initial: bytes):
        keep = Keep()
        info = keep.struct("VkPipelineCacheCreateInfo", sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
                           initialDataSize=len(initial), pInitialData=initial or None)
        cache = keep.new("VkPipelineCache *")
        return lib.vkCreatePipelineCache(self._dev, info, ffi.NULL, cache), cache[0]

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Device {self.info.index}: {self.info.name}{' (closed)' if self._closed else ''}>"

    # -- memory ---------------------------------------------------------------------------

    def _arena(self, kind: str) -> memory.Arena:
        self._check_runnable()
        arena = self._arenas.get(kind)
        if arena is None:
            if kind == "device":     # the big VRAM heap; not the host-visible window onto it (slow to read)
                index = _pick_type(self._phys, vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                                   lambda flags, heap: (heap, not flags & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT))
                arena = memory.Arena(self, index, memory.BLOCK_SIZE, "device")
            else:                    # cached system memory: fast for the CPU to read back
                index = _pick_type(self._phys, memory.HOST_VISIBLE,
                                   lambda flags, heap: (bool(flags & vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT),
                                                        not flags & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, heap))
                arena = memory.Arena(self, index, memory.HOST_BLOCK_SIZE, "host-visible")
            self._arenas[kind] = arena
        return arena

    def alloc(self, nbytes: int, name: str = "") -> memory.Buffer | memory.PiecedBuffer:
        """Device-local memory, sub-allocated from large blocks (contents undefined); more than one
        descriptor binds comes in pieces."""
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ZdslError(f"alloc({nbytes!r}) for {name or 'a buffer'}: size must be a non-negative integer")
        arena, nbytes = self._arena("device"), int(nbytes)
        parts = self._parts(name, nbytes, self._piece(arena))
        if len(parts) == 1:
            return self._buffer(arena, nbytes, name)
        arena.check_heap(nbytes, name)
        pieces: list[memory.Buffer] = []
        try:
            for part, n in parts:
                pieces.append(self._buffer(arena, n, part))
        except BaseException:
            for p in pieces:
                p.free()
            raise
        return memory.PiecedBuffer(pieces, self._piece(arena), nbytes, name)

    def _buffer(self, arena: memory.Arena, nbytes: int, name: str) -> memory.Buffer:
        block, offset, size = arena.alloc(nbytes, name)
        return memory.Buffer(self, block, offset, nbytes, name, arena, size)

    def _piece(self, arena: memory.Arena) -> int:
        """The size of the pieces of a buffer larger than one descriptor binds."""
        return memory.piece_size(self.info.max_storage_buffer_range, arena.largest)

    @staticmethod
    def _parts(name: str, nbytes: int, piece: int) -> list[tuple[str, int]]:
        """(name, bytes) of what a request takes: itself, or its pieces."""
        if nbytes <= piece:
            return [(name, nbytes)]
        return [(f"{name}#{i}", n) for i, n in enumerate(memory.cut(nbytes, piece))]

    def alloc_many(self, requests: list[tuple[str, int]]) -> list[memory.Buffer | memory.PiecedBuffer]:
        """Device-local buffers for (name, nbytes) requests known together (a model's weights,
        caches and activations), packed into blocks of exactly the bytes they hold; the pieces of
        one larger than a descriptor binds are packed like the rest."""
        for name, nbytes in requests:
            if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
                raise ZdslError(f"alloc_many: {name or 'a buffer'} of {nbytes!r} bytes; sizes are non-negative integers")
        arena = self._arena("device")
        piece = self._piece(arena)
        parts = [self._parts(name, int(n), piece) for name, n in requests]
        placed = iter(arena.alloc_many([(n, part) for request in parts for part, n in request]))
        out = []
        for (name, nbytes), request in zip(requests, parts):
            bufs = []
            for part, n in request:
                block, offset, size = next(placed)
                bufs.append(memory.Buffer(self, block, offset, n, part, arena, size))
            out.append(bufs[0] if len(bufs) == 1 else memory.PiecedBuffer(bufs, piece, int(nbytes), name))
        return out

    def upload_file(self, path, jobs, progress=None) -> None:
        """Copy file ranges into buffers: jobs are (Buffer, offset in it, offset in the file,
        bytes). Several threads read while the GPU copies what they read before (a model loads at
        the speed of the page cache, not of one thread's reads). `progress(bytes)` after each part."""
        from concurrent.futures import ThreadPoolExecutor

        for buf, offset, _, n in jobs:
            buf._check(offset, n, "upload")
        jobs = [job for buf, offset, at, n in jobs if n for job in _block_jobs(buf, offset, at, n)]
        fd = os.open(path, os.O_RDONLY)
        try:
            with ThreadPoolExecutor(memory.READ_THREADS, thread_name_prefix="zdsl-read") as pool:
                mapped = [j for j in jobs if j[0].mapped is not None]
                if mapped:
                    vk.check(lib.vkQueueWaitIdle(self._queue), "vkQueueWaitIdle")
                    memory.read_file_into(fd, mapped, pool, progress)
                staged = [j for j in jobs if j[0].mapped is None]
                if staged:
                    staging = memory.Staging(self, self._arena("host"), memory.UPLOAD_SLOTS, memory.UPLOAD_SLOT)
                    try:
                        staging.write_file(fd, staged, pool, progress)
                    finally:
                        staging.free()
        finally:
            os.close(fd)

    def memory_available(self) -> int:
        """Bytes of device-local memory zdsl may still take: the driver's budget for this process
        where it reports one (VK_EXT_memory_budget), else the largest device-local heap, less
        what zdsl holds."""
        budget = physical.memory_budget(self._phys)
        if budget is not None:
            return max(budget[0] - budget[1], 0)
        held = self._arenas["device"].reserved if "device" in self._arenas else 0
        heap = max((size for size, local in self.info.heaps if local), default=0)
        return max(heap - held, 0)

    def upload(self, array: np.ndarray, name: str = "") -> memory.Buffer:
        array = np.ascontiguousarray(array)
        buf = self.alloc(array.nbytes, name)
        buf.write(array)
        return buf

    def joined(self, buffers: list, piece: int, name: str) -> memory.PiecedBuffer:
        """Buffers of their own bound as the pieces of one (memory.PiecedBuffer.joined)."""
        return memory.PiecedBuffer.joined(buffers, piece, name)

    @property
    def offset_alignment(self) -> int:
        """The bytes a buffer bound at an offset must start at a multiple of (at least 16)."""
        return max(16, self._phys.min_storage_offset_alignment)

    @property
    def storage_buffers(self) -> int:
        """The storage-buffer descriptors one shader may bind (pieced buffers take one a piece)."""
        return self._phys.max_storage_buffers

    @property
    def placeholder(self) -> memory.Buffer:
        """A small buffer bound where a kernel variant declares a buffer it never touches."""
        if self._placeholder is None:
            self._placeholder = self.alloc(16, name="placeholder")
        return self._placeholder

    def host_buffer(self, nbytes: int, name: str = "") -> memory.HostBuffer:
        """Host-visible coherent memory that kernels can bind: per-step values (position, token)."""
        if not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ZdslError(f"host_buffer({nbytes!r}) for {name or 'a buffer'}: size must be a non-negative integer")
        arena = self._arena("host")
        block, offset, size = arena.alloc(int(nbytes), name)
        return memory.HostBuffer(self, block, offset, int(nbytes), name, arena, size)

    def _write(self, block: memory.Block, offset: int, data: memoryview) -> None:
        if block.mapped is not None:
            vk.check(lib.vkQueueWaitIdle(self._queue), "vkQueueWaitIdle")
            ffi.memmove(block.mapped + offset, data, len(data))
        else:
            self._staging_buffer().write(block, offset, data)

    def _read(self, block: memory.Block, offset: int, out: memoryview) -> None:
        if block.mapped is not None:
            vk.check(lib.vkQueueWaitIdle(self._queue), "vkQueueWaitIdle")
            ffi.memmove(out, block.mapped + offset, len(out))
        else:
            self._staging_buffer().read(block, offset, out)

    def _staging_buffer(self) -> memory.Staging:
        if self._staging is None:
            self._staging = memory.Staging(self, self._arena("host"))
        return self._staging

    def _fence(self):
        keep = Keep()
        info = keep.struct("VkFenceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO)
        fence = ffi.new("VkFence *")
        vk.check(lib.vkCreateFence(self._dev, info, ffi.NULL, fence), "vkCreateFence")
        return fence[0]

    def _submit(self, cb, fence) -> None:
        keep = Keep()
        submit = keep.struct("VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                             pCommandBuffers=[cb])
        vk.check(lib.vkQueueSubmit(self._queue, 1, submit, fence), "vkQueueSubmit")

    def _wait_fence(self, fence) -> None:
        fences = ffi.new("VkFence[1]", [fence])
        while True:     # in 1 s slices so that Ctrl-C gets through
            result = lib.vkWaitForFences(self._dev, 1, fences, 1, 1_000_000_000)
            if result != vk.VK_TIMEOUT:
                break
        vk.check(result, "vkWaitForFences")
        vk.check(lib.vkResetFences(self._dev, 1, fences), "vkResetFences")

    def memory_report(self) -> dict:
        """Bytes reserved (blocks) and used (live buffers) per arena."""
        return {kind: arena.report() for kind, arena in self._arenas.items()}

    # -- pipelines ------------------------------------------------------------------------

    def pipeline(self, spirv: bytes, *, bindings, push_size: int = 0, spec=None, subgroup_size: int | None = None,
                 name: str = "kernel", statistics: bool = False, isa: bool = False,
                 grid_ids: tuple[int, int, int] | None = None, arrays: tuple[int, ...] | None = None) -> Pipeline:
        """`bindings`: the access of each descriptor; `arrays`: how many of them each binding
        holds (an array of a pieced buffer's pieces), one each by default."""
        self._check_open()
        with self.lock:
            pipe = pipeline.create(self, spirv, bindings=bindings, push_size=push_size, spec=spec,
                                   subgroup_size=subgroup_size, name=name, statistics=statistics, isa=isa,
                                   grid_ids=grid_ids, arrays=arrays)
            self._pipelines[pipe] = None
            self._cache_dirty = True
        return pipe

    def _set_layout(self, arrays: tuple[int, ...], pushed: bool):
        """The set layout of bindings holding `arrays` descriptors each, pushed or allocated."""
        with self.lock:  # a Recorder's thread asks too
            layout = self._set_layouts.get((arrays, pushed))
            if layout is None:
                keep = Keep()
                info = keep.struct(
                    "VkDescriptorSetLayoutCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                    flags=vk.VK_DESCRIPTOR_SET_LAYOUT_CREATE_PUSH_DESCRIPTOR_BIT_KHR if pushed else 0,
                    bindingCount=len(arrays),
                    pBindings=[{"binding": i, "descriptorType": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                "descriptorCount": n, "stageFlags": vk.VK_SHADER_STAGE_COMPUTE_BIT}
                               for i, n in enumerate(arrays)])
                out = keep.new("VkDescriptorSetLayout *")
                vk.check(lib.vkCreateDescriptorSetLayout(self._dev, info, ffi.NULL, out), "vkCreateDescriptorSetLayout")
                layout = self._set_layouts[(arrays, pushed)] = out[0]
            return layout

    def _pipeline_layout(self, arrays: tuple[int, ...], pushed: bool, push_size: int):
        with self.lock:
            layout = self._layouts.get((arrays, pushed, push_size))
            if layout is None:
                keep = Keep()
                ranges = ([{"stageFlags": vk.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0, "size": push_size}]
                          if push_size else [])
                info = keep.struct("VkPipelineLayoutCreateInfo",
                                   sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                                   setLayoutCount=1, pSetLayouts=[self._set_layout(arrays, pushed)],
                                   pushConstantRangeCount=len(ranges), pPushConstantRanges=ranges or None)
                out = keep.new("VkPipelineLayout *")
                vk.check(lib.vkCreatePipelineLayout(self._dev, info, ffi.NULL, out), "vkCreatePipelineLayout")
                layout = self._layouts[(arrays, pushed, push_size)] = out[0]
            return layout

    def _ext(self, name: str):
        fn = self._procs.get(name)
        if fn is None:
            fn = self._procs[name] = vk.device_proc(self._dev, name)
        return fn

    def _forget_pipeline(self, pipe: Pipeline) -> None:
        if pipe in self._pipelines:
            del self._pipelines[pipe]
            lib.vkDestroyPipeline(self._dev, pipe.handle, ffi.NULL)

    # -- command sequences ----------------------------------------------------------------

    def sequence(self, timestamps: bool = False, pool=None) -> Sequence:
        """A new Sequence; `pool`: a Recorder's command pool (runtime/recorder.py), not the device's."""
        self._check_runnable()
        seq = Sequence(self, timestamps, pool or self._pool)
        self._sequences[seq] = None
        return seq

    def recorder(self):
        """A Recorder: sequences recorded on a thread of its own while this thread runs others."""
        from zdsl.runtime.recorder import Recorder

        self._check_runnable()
        pool = self._new_command_pool()
        self._command_pools.append(pool)
        return Recorder(self, pool)

    def _command_buffer(self, pool):
        keep = Keep()
        info = keep.struct("VkCommandBufferAllocateInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                           commandPool=pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1)
        out = keep.new("VkCommandBuffer *")
        vk.check(lib.vkAllocateCommandBuffers(self._dev, info, out), "vkAllocateCommandBuffers")
        return out[0]

    def _forget_sequence(self, seq: Sequence) -> None:
        if seq in self._sequences:
            del self._sequences[seq]
            seq._destroy()

    def wait_idle(self) -> None:
        self._check_open()
        vk.check(lib.vkDeviceWaitIdle(self._dev), "vkDeviceWaitIdle")

    def _check_open(self) -> None:
        if self._closed:
            raise ZdslError(f"device {self.info.name} is closed")

    def _check_runnable(self) -> None:
        self._check_open()
        if self.info.compile_only:
            raise ZdslError(f"{self.info.name} is a compile-only target: it builds pipelines but cannot "
                            "allocate or run; use a runnable device for that")

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Free everything made on this device, in dependency order. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        dev = self._dev
        if dev is not None:
            if not self.info.compile_only:      # the null device has no queue to wait for (it crashes)
                lib.vkDeviceWaitIdle(dev)
            for seq in list(self._sequences):
                seq._destroy()
            self._sequences.clear()
            for pipe in self._pipelines:
                lib.vkDestroyPipeline(dev, pipe.handle, ffi.NULL)
            self._pipelines.clear()
            for layout in self._layouts.values():
                lib.vkDestroyPipelineLayout(dev, layout, ffi.NULL)
            for layout in self._set_layouts.values():
                lib.vkDestroyDescriptorSetLayout(dev, layout, ffi.NULL)
            if self._pipeline_cache is not None:
                self._save_pipeline_cache()
                lib.vkDestroyPipelineCache(dev, self._pipeline_cache, ffi.NULL)
            if self._staging is not None:
                self._staging.free()
            for arena in self._arenas.values():
                arena.destroy()
            for pool in [self._pool, *self._command_pools]:
                if pool is not None:
                    lib.vkDestroyCommandPool(dev, pool, ffi.NULL)
            lib.vkDestroyDevice(dev, ffi.NULL)
        lib.vkDestroyInstance(self._instance, ffi.NULL)

    def _save_pipeline_cache(self) -> None:
        if not self._cache_dirty:
            return
        data = self._pipeline_cache_data(self._pipeline_cache)
        if data:
            try:
                write_entry(self._cache_path, data)
            except OSError:
                pass    # a read-only cache folder only costs compile time next run

    def _pipeline_cache_data(self, cache) -> bytes | None:
        """A pipeline cache's data, or None where the driver gives none."""
        size = ffi.new("size_t *")
        if lib.vkGetPipelineCacheData(self._dev, cache, size, ffi.NULL) != vk.VK_SUCCESS or not size[0]:
            return None
        data = ffi.new("char[]", size[0])
        if lib.vkGetPipelineCacheData(self._dev, cache, size, data) != vk.VK_SUCCESS:
            return None
        return ffi.buffer(data, size[0])[:]

