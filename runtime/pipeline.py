"""Compute pipelines: SPIR-V + binding access + push size + specialization → VkPipeline, with the
driver's own statistics (registers, spills, occupancy) and disassembly when it offers them, or
(NVIDIA, which offers none) the machine code itself.

Every storage buffer is one binding of set 0, in order, and most bindings hold one descriptor;
a pieced buffer's binding holds an array of them, one a piece (runtime/memory.py). The access
string of each descriptor ("r", "w", "rw", or "-" for one the variant never touches) is what the
Sequence uses to decide where barriers go. Descriptors are pushed where the driver can
(VK_KHR_push_descriptor) and the pipeline has no more than it pushes at once, else allocated.
"""

from __future__ import annotations

import re
import struct
from array import array

import numpy as np

from zdsl.errors import MissingFeatureError, ZdslError
from zdsl.runtime import nvidia_code, vk
from zdsl.runtime.vk import Keep, ffi, lib

ACCESS = {"r": (True, False), "w": (False, True), "rw": (True, True), "-": (False, False)}

_OP_EXECUTION_MODE, _OP_EXECUTION_MODE_ID, _OP_DECORATE = 16, 331, 71
_OP_CONSTANT, _OP_SPEC_CONSTANT, _OP_CONSTANT_COMPOSITE, _OP_SPEC_CONSTANT_COMPOSITE = 43, 50, 44, 51
_MODE_LOCAL_SIZE, _MODE_LOCAL_SIZE_ID = 17, 38
_DECORATION_SPEC_ID, _DECORATION_BUILTIN, _BUILTIN_WORKGROUP_SIZE = 1, 11, 25
_OP_LOOP_MERGE = 246
_LOOP_UNROLL, _LOOP_DONT_UNROLL, _LOOP_PEEL_COUNT, _LOOP_PARTIAL_COUNT = 0x1, 0x2, 0x100, 0x200


def loops_kept(spirv: bytes) -> bytes:
    """The module with every loop its source leaves to the compiler marked DontUnroll. For a CPU
    device (lavapipe): there a pipeline compiles at its first dispatch, and Mesa fully unrolls loops
    of few trips, which the tests' small shapes make, each copy of a body with barriers costing LLVM
    coroutine splits (a delta-net scan of 16-token blocks: 9.5 → 3.5 s to compile), while the loops'
    runs take microseconds. Loops asked to unroll ([[unroll]]) keep that."""
    words = array("I", spirv[: len(spirv) // 4 * 4])
    for i, op, count in _instructions(words):
        if (op == _OP_LOOP_MERGE and count >= 4
                and not words[i + 3] & (_LOOP_UNROLL | _LOOP_PEEL_COUNT | _LOOP_PARTIAL_COUNT)):
            words[i + 3] |= _LOOP_DONT_UNROLL
    return words.tobytes()


def _instructions(words):
    """(index, opcode, word count) of each instruction of a module's words, past the header."""
    i = 5
    while i < len(words):
        count = words[i] >> 16
        yield i, words[i] & 0xFFFF, count
        i += max(count, 1)


def workgroup_size(spirv: bytes, spec: dict[int, int | float | bool] | None = None) -> tuple[int, int, int]:
    """The workgroup size a SPIR-V compute module will run with, specialization applied.

    Needed to decide whether full subgroups can be required and to check the device limit.
    """
    words = array("I", spirv[: len(spirv) // 4 * 4])
    if len(words) < 5 or words[0] != 0x07230203:
        raise ZdslError("not a SPIR-V module (bad magic number)")
    spec = spec or {}
    literal, constants, composites, spec_ids = None, {}, {}, {}
    builtin = mode_ids = None
    for i, op, count in _instructions(words):
        args = words[i + 1:i + count]
        if op == _OP_EXECUTION_MODE and args[1] == _MODE_LOCAL_SIZE:
            literal = tuple(args[2:5])
        elif op == _OP_EXECUTION_MODE_ID and args[1] == _MODE_LOCAL_SIZE_ID:
            mode_ids = tuple(args[2:5])
        elif op == _OP_DECORATE and args[1] == _DECORATION_SPEC_ID:
            spec_ids[args[0]] = args[2]
        elif op == _OP_DECORATE and args[1] == _DECORATION_BUILTIN and args[2] == _BUILTIN_WORKGROUP_SIZE:
            builtin = args[0]
        elif op in (_OP_CONSTANT, _OP_SPEC_CONSTANT) and len(args) >= 3:
            constants[args[1]] = args[2]
        elif op in (_OP_CONSTANT_COMPOSITE, _OP_SPEC_CONSTANT_COMPOSITE):
            composites[args[1]] = tuple(args[2:])

    def value(cid: int) -> int:
        if cid in spec_ids and spec_ids[cid] in spec:
            return int(spec[spec_ids[cid]])
        return constants[cid]

    if builtin is not None and builtin in composites:
        return tuple(value(c) for c in composites[builtin])
    if mode_ids is not None:
        return tuple(value(c) for c in mode_ids)
    if literal is not None:
        return literal
    raise ZdslError("SPIR-V module declares no workgroup size (is it a compute shader?)")


def pack_spec(spec: dict[int, int | float | bool]) -> tuple[list[dict], bytes]:
    """Map entries and data: bool → VkBool32, float → f32, int → 32 bits (negative as int32)."""
    entries, data = [], b""
    for cid, value in sorted(spec.items()):
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool):
            raw = struct.pack("<I", int(value))
        elif isinstance(value, float):
            raw = struct.pack("<f", value)
        elif isinstance(value, int) and -(1 << 31) <= value < (1 << 32):
            raw = struct.pack("<i" if value < 0 else "<I", value)
        else:
            raise ZdslError(f"specialization constant {cid} = {value!r}: use a bool, a float or a 32-bit int")
        entries.append({"constantID": cid, "offset": len(data), "size": 4})
        data += raw
    return entries, data


class Pipeline:
    __slots__ = ("name", "bindings", "push_size", "subgroup_size", "statistics", "isa", "code", "workgroup",
                 "device", "handle", "layout", "access", "grid_ids", "arrays", "pushed", "source", "compiled",
                 "_folded")

    def __repr__(self) -> str:
        wave = f" subgroup {self.subgroup_size}" if self.subgroup_size else ""
        return f"<Pipeline {self.name} bindings={','.join(self.bindings)}{wave}>"

    def folded(self, grid: tuple[int, int, int]) -> "Pipeline":
        """The twin of this pipeline that runs logical grid `grid` from any physical grid of at
        least as many workgroups (the shader reads its ids through the specialization constants
        `grid_ids`; zdsl's GLSL backend declares them). Made once per grid."""
        if self.grid_ids is None:
            raise ZdslError(f"pipeline {self.name} cannot run a folded grid (its shader does not declare one)")
        with self.device.lock:
            twin = self._folded.get(grid)
            if twin is None:
                source = {**self.source, "spec": {**self.source["spec"], **dict(zip(self.grid_ids, grid))}}
                twin = self._folded[grid] = self.device.pipeline(**source)
        return twin

    def on(self, device) -> "Pipeline":
        """The same pipeline made on another device (of the same driver: runtime/warm.py)."""
        return device.pipeline(**self.source)

    def free(self) -> None:
        """Destroy the VkPipeline now (a tuner makes thousands); the device also does it at close."""
        for twin in self._folded.values():
            self.device._forget_pipeline(twin)
        self._folded.clear()
        self.device._forget_pipeline(self)


def create(device, spirv: bytes, *, bindings, push_size: int, spec, subgroup_size: int | None, name: str,
           statistics: bool, isa: bool, grid_ids: tuple[int, int, int] | None = None,
           arrays: tuple[int, ...] | None = None) -> Pipeline:
    """`grid_ids`: the specialization constants through which the shader reads a folded grid
    (None: it cannot run one); `arrays`: the descriptors each binding holds (None: one each)."""
    phys, info = device._phys, device.info
    bindings = tuple(bindings)
    for b in bindings:
        if b not in ACCESS:
            raise ZdslError(f"pipeline {name}: binding access {b!r} must be 'r', 'w', 'rw' or '-'")
    arrays = tuple(arrays) if arrays is not None else (1,) * len(bindings)
    _check_arrays(device, name, bindings, arrays)
    if push_size % 4 or push_size < 0 or push_size > phys.max_push_constants:
        raise ZdslError(f"pipeline {name}: push_size {push_size} must be a multiple of 4 and at most "
                        f"{phys.max_push_constants} on {info.name}")
    spec = dict(spec or {})
    wg = workgroup_size(spirv, spec)
    if wg[0] * wg[1] * wg[2] > info.max_workgroup_invocations:
        raise ZdslError(f"pipeline {name}: workgroup {wg[0]}x{wg[1]}x{wg[2]} exceeds {info.name}'s limit of "
                        f"{info.max_workgroup_invocations} invocations")
    keep = Keep()
    stage = {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
             "stage": vk.VK_SHADER_STAGE_COMPUTE_BIT, "pName": "main"}
    if subgroup_size is not None:
        if "subgroup_size_control" not in info.features:
            raise MissingFeatureError(f"pipeline {name}: {info.name} cannot fix the subgroup size "
                                      "(no subgroup_size_control)")
        if not info.min_subgroup_size <= subgroup_size <= info.max_subgroup_size or subgroup_size & (subgroup_size - 1):
            raise MissingFeatureError(f"pipeline {name}: subgroup size {subgroup_size} is not available on "
                                      f"{info.name} (it has {info.min_subgroup_size}..{info.max_subgroup_size})")
        stage["pNext"] = keep.struct(
            "VkPipelineShaderStageRequiredSubgroupSizeCreateInfo", requiredSubgroupSize=subgroup_size,
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO)
        if wg[0] % subgroup_size == 0:
            stage["flags"] = vk.SHADER_STAGE_REQUIRE_FULL_SUBGROUPS
    if spec:
        entries, data = pack_spec(spec)
        stage["pSpecializationInfo"] = {"mapEntryCount": len(entries), "pMapEntries": entries,
                                        "dataSize": len(data), "pData": data}
    capture = (statistics or isa) and "pipeline_stats" in info.features
    flags = 0
    if capture:
        flags |= vk.VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR
        if isa:
            flags |= vk.VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR

    dev = device._dev
    if info.device_type == "cpu":
        spirv = loops_kept(spirv)
    module_info = keep.struct("VkShaderModuleCreateInfo", sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                              codeSize=len(spirv), pCode=spirv)
    module = keep.new("VkShaderModule *")
    vk.check(lib.vkCreateShaderModule(dev, module_info, ffi.NULL, module), "vkCreateShaderModule",
             f"for pipeline {name}")
    stage["module"] = module[0]
    pushed = device._push_descriptors and len(bindings) <= phys.max_push_descriptors
    layout = device._pipeline_layout(arrays, pushed, push_size)
    create_info = keep.struct("VkComputePipelineCreateInfo", sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
                              flags=flags, stage=stage, layout=layout, basePipelineIndex=-1)
    out = keep.new("VkPipeline *")
    # NVIDIA's code comes only through a pipeline cache's data: one that holds this pipeline alone
    own_cache = _own_cache(device) if capture and isa and info.vendor == "NVIDIA" else None
    try:
        vk.check(lib.vkCreateComputePipelines(dev, own_cache or device._pipeline_cache, 1, create_info, ffi.NULL,
                                              out), "vkCreateComputePipelines", f"for pipeline {name} on {info.name}")
        cache_data = device._pipeline_cache_data(own_cache) if own_cache else None
    finally:
        lib.vkDestroyShaderModule(dev, module[0], ffi.NULL)
        if own_cache:
            lib.vkDestroyPipelineCache(dev, own_cache, ffi.NULL)

    pipe = Pipeline()
    pipe.name, pipe.bindings, pipe.push_size, pipe.subgroup_size = name, bindings, push_size, subgroup_size
    pipe.device, pipe.handle, pipe.layout, pipe.workgroup = device, out[0], layout, wg
    pipe.access = tuple(ACCESS[b] for b in bindings)
    pipe.arrays, pipe.pushed = arrays, pushed
    pipe.grid_ids, pipe._folded = grid_ids, {}
    pipe.source = dict(spirv=spirv, bindings=bindings, push_size=push_size, spec=spec, subgroup_size=subgroup_size,
                       name=name, grid_ids=grid_ids, arrays=arrays)
    pipe.statistics = pipe.isa = pipe.code = None
    pipe.compiled = False  # by a driver that compiles at the first dispatch, known to be (runtime/warm.py)
    if capture:
        executable = _first_executable(device, out[0])
        if executable and (statistics or cache_data):
            pipe.statistics = _statistics(device, executable)
        if executable and isa:
            pipe.isa = _assembly(device, executable)
        if cache_data and pipe.statistics and "Binary Size" in pipe.statistics:
            pipe.code = nvidia_code.machine_code(cache_data, int(pipe.statistics["Binary Size"]))
    return pipe


def _check_arrays(device, name: str, bindings: tuple, arrays: tuple) -> None:
    """Descriptors that add up, and arrays of them (a pieced buffer's) only where the device
    indexes them per element."""
    info = device.info
    if sum(arrays) != len(bindings) or min(arrays, default=1) < 1:
        raise ZdslError(f"pipeline {name}: {len(bindings)} descriptors cannot fill bindings of {list(arrays)}")
    if max(arrays, default=1) > 1 and "pieced_buffers" not in info.features:
        raise MissingFeatureError(f"pipeline {name}: a buffer larger than {info.name} binds at once is bound in "
                                  "pieces, which needs shaderStorageBufferArrayNonUniformIndexing; it lacks it")
    if len(bindings) > device.storage_buffers:
        raise ZdslError(f"pipeline {name}: {len(bindings)} storage buffers, more than {info.name} binds in one "
                        f"shader ({device.storage_buffers}); its pieced buffers may be too large for it")


def _own_cache(device):
    result, cache = device._new_pipeline_cache(b"")
    vk.check(result, "vkCreatePipelineCache")
    return cache


def _first_executable(device, pipeline):
    keep = Keep()
    info = keep.struct("VkPipelineInfoKHR", sType=vk.VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR, pipeline=pipeline)
    count = keep.new("uint32_t *")
    vk.check(device._ext("vkGetPipelineExecutablePropertiesKHR")(device._dev, info, count, ffi.NULL),
             "vkGetPipelineExecutablePropertiesKHR")
    if not count[0]:
        return None
    return {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, "pipeline": pipeline, "executableIndex": 0}


def _statistics(device, executable: dict) -> dict[str, int | float]:
    keep = Keep()
    info = keep.struct("VkPipelineExecutableInfoKHR", **executable)
    fn = device._ext("vkGetPipelineExecutableStatisticsKHR")
    count = keep.new("uint32_t *")
    vk.check(fn(device._dev, info, count, ffi.NULL), "vkGetPipelineExecutableStatisticsKHR")
    stats = keep.array("VkPipelineExecutableStatisticKHR",
                       [{"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR}] * count[0])
    vk.check(fn(device._dev, info, count, stats), "vkGetPipelineExecutableStatisticsKHR")
    out: dict[str, int | float] = {}
    for s in stats[0:count[0]]:
        fmt, v = s.format, s.value
        out[vk.string(s.name)] = (bool(v.b32) if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR
                                  else v.i64 if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR
                                  else v.u64 if fmt == vk.VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR
                                  else v.f64)
    return out


def _assembly(device, executable: dict) -> str | None:
    """The driver's disassembly: the text representation named like assembly/ISA, else the last one."""
    keep = Keep()
    info = keep.struct("VkPipelineExecutableInfoKHR", **executable)
    fn = device._ext("vkGetPipelineExecutableInternalRepresentationsKHR")
    count = keep.new("uint32_t *")
    vk.check(fn(device._dev, info, count, ffi.NULL), "vkGetPipelineExecutableInternalRepresentationsKHR")
    n = count[0]
    reps = keep.array("VkPipelineExecutableInternalRepresentationKHR",
                      [{"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION_KHR}] * n)
    vk.check(fn(device._dev, info, count, reps), "vkGetPipelineExecutableInternalRepresentationsKHR")
    for r in reps[0:n]:
        r.pData = keep.new("char[]", r.dataSize)
    vk.check(fn(device._dev, info, count, reps), "vkGetPipelineExecutableInternalRepresentationsKHR")
    texts = {vk.string(r.name): ffi.string(ffi.cast("char *", r.pData), r.dataSize).decode("utf-8", "replace")
             for r in reps[0:n] if r.isText}
    for key, text in texts.items():
        if re.search(r"assembly|\bisa\b|sass", key, re.I):
            return text
    return list(texts.values())[-1] if texts else None
