"""What a Vulkan physical device is and can do: one query pass, shared by listing and opening.

`DeviceInfo` is the public, picklable description (it crosses the process boundary of the
compile-only null device); `Physical` adds what opening a device needs (queue family, limits,
memory types, the exact feature bits to enable).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

from zdsl.errors import ZdslError
from zdsl.runtime import vk
from zdsl.runtime.vk import Keep, ffi, lib

FEATURES = ("int8_dot", "fp16", "bf16", "int8_storage", "int16", "int64", "coopmat",
            "subgroup_size_control", "pipeline_stats", "push_descriptors", "timestamps", "pieced_buffers")

# Limits lowered for this process: lets lavapipe (128 MiB a binding) stand in for a device that
# binds or allocates less, so that tests put tensors of the tiny models across piece seams.
LIMITS_VAR = "ZDSL_DEVICE_LIMITS"
LIMITS = ("binding", "allocation")   # maxStorageBufferRange, maxMemoryAllocationSize
SMALLEST_LIMIT = 4 << 10
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

VENDORS = {0x1002: "AMD", 0x10DE: "NVIDIA", 0x8086: "Intel", 0x10005: "Mesa", 0x13B5: "ARM",
           0x5143: "Qualcomm", 0x106B: "Apple", 0x1010: "ImgTec", 0x14E4: "Broadcom"}
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    vendor: str
    device_type: str
    driver_name: str
    driver_info: str
    api_version: str
    identity: str
    subgroup_size: int
    min_subgroup_size: int
    max_subgroup_size: int
    shared_memory: int
    max_workgroup_invocations: int
    max_storage_buffer_range: int
    heaps: tuple[tuple[int, bool], ...]
    features: frozenset[str]
    compile_only: bool


# Feature structs chained into vkGetPhysicalDeviceFeatures2, and the bits zdsl enables when
# supported: (C type or None for one the binding lacks, sType, needs: API (major, minor) or an
# extension, fields). Field names are unique across the structs, so support is one flat dict.
_FEATURE_STRUCTS = (
    ("VkPhysicalDeviceVulkan11Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, (1, 2),
     ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess", "storagePushConstant16")),
    ("VkPhysicalDeviceVulkan12Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, (1, 2),
     ("storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess", "storagePushConstant8",
      "shaderFloat16", "shaderInt8", "shaderSubgroupExtendedTypes", "vulkanMemoryModel",
      "vulkanMemoryModelDeviceScope", "scalarBlockLayout", "shaderStorageBufferArrayNonUniformIndexing")),
    ("VkPhysicalDeviceVulkan13Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES, (1, 3),
     ("subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct", "maintenance4",
      "synchronization2")),
    ("VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
     vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR, "VK_KHR_cooperative_matrix",
     ("cooperativeMatrix",)),
    ("VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR",
     vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
     "VK_KHR_pipeline_executable_properties", ("pipelineExecutableInfo",)),
    ("VkPhysicalDeviceWorkgroupMemoryExplicitLayoutFeaturesKHR",
     vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_WORKGROUP_MEMORY_EXPLICIT_LAYOUT_FEATURES_KHR,
     "VK_KHR_workgroup_memory_explicit_layout",
     ("workgroupMemoryExplicitLayout", "workgroupMemoryExplicitLayout16BitAccess")),
    (None, vk.STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR, "VK_KHR_shader_bfloat16",
     ("shaderBFloat16Type", "shaderBFloat16DotProduct", "shaderBFloat16CooperativeMatrix")),
)
_CORE_FEATURES = ("shaderInt16", "shaderInt64", "shaderStorageBufferArrayDynamicIndexing")
# Extensions enabled when present (the rest zdsl uses is core in Vulkan 1.3).
EXTENSIONS = ("VK_KHR_push_descriptor", "VK_KHR_pipeline_executable_properties",
              "VK_KHR_cooperative_matrix", "VK_KHR_shader_bfloat16", "VK_EXT_memory_budget",
              "VK_KHR_workgroup_memory_explicit_layout")


@dataclass
class Physical:
    handle: object
    info: DeviceInfo
    vendor_id: int
    device_id: int
    pipeline_cache_uuid: bytes                   # the header of this device's pipeline cache data carries it
    api: int
    extensions: frozenset[str]
    supported: dict[str, bool]
    queue_family: int
    timestamp_bits: int
    timestamp_period: float
    min_storage_offset_alignment: int
    max_push_constants: int
    max_push_descriptors: int                    # 0 without VK_KHR_push_descriptor
    max_storage_buffers: int                     # descriptors of storage buffers a shader may bind
    max_group_count: tuple[int, int, int]
    max_buffer_size: int
    max_allocation_size: int
    memory_types: list[tuple[int, int]]          # (property flags, heap index)
    heap_sizes: list[int] = field(default_factory=list)


def _wanted(spec, api: int, extensions) -> bool:
    _, _, need, _ = spec
    return api >= vk.make_version(*need) if isinstance(need, tuple) else need in extensions


def _chain(keep: Keep, specs, values=None):
    """Build the feature-struct chain for `specs`; `values` (field → bool) fills it for enabling."""
    nodes = []
    for ctype, stype, _, fields in specs:
        if ctype is None:                # laid out by hand: sType, pNext, then VkBool32 fields
            node = keep.new("uint64_t[]", 2 + (len(fields) + 1) // 2)
            ffi.cast("uint32_t *", node)[0] = stype
            if values:
                for i, f in enumerate(fields):
                    ffi.cast("uint32_t *", node)[4 + i] = int(values.get(f, False))
        else:
            node = keep.struct(ctype, sType=stype, **({f: int(values.get(f, False)) for f in fields} if values else {}))
        nodes.append(node)
    for a, b in zip(nodes, nodes[1:]):
        ffi.cast("VkBaseOutStructure *", a).pNext = ffi.cast("VkBaseOutStructure *", b)
    return nodes


def _read(node, spec) -> dict[str, bool]:
    ctype, _, _, fields = spec
    if ctype is None:
        words = ffi.cast("uint32_t *", node)
        return {f: bool(words[4 + i]) for i, f in enumerate(fields)}
    return {f: bool(getattr(node, f)) for f in fields}


def feature_chain(keep: Keep, phys: Physical):
    """The VkPhysicalDeviceFeatures2 chain that enables every supported bit zdsl uses."""
    specs = [s for s in _FEATURE_STRUCTS if _wanted(s, phys.api, phys.extensions)]
    nodes = _chain(keep, specs, phys.supported)
    core = {f: int(phys.supported[f]) for f in _CORE_FEATURES}
    return keep.struct("VkPhysicalDeviceFeatures2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                       pNext=nodes[0] if nodes else None, features=core)


def device_extensions(phys: Physical) -> list[str]:
    return [e for e in EXTENSIONS if e in phys.extensions]


def lowered_limits(text: str | None = None) -> dict[str, int]:
    """$ZDSL_DEVICE_LIMITS (e.g. `binding=4MiB,allocation=4MiB`) as {limit: bytes}: what this
    process takes the device to bind in one descriptor and allocate at once, where that is less
    than the device says."""
    text = os.environ.get(LIMITS_VAR, "") if text is None else text
    if not text.strip():
        return {}
    out = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", part)
        size = int(m[2]) * _UNITS[m[3] or ""] if m else 0
        if not m or m[1] not in LIMITS or size < SMALLEST_LIMIT:
            raise ZdslError(f"{LIMITS_VAR}={text!r}: write LIMIT=SIZE[,LIMIT=SIZE] with LIMIT one of "
                            f"{', '.join(LIMITS)} and SIZE at least 4KiB, e.g. binding=4MiB,allocation=4MiB")
        out[m[1]] = size
    return out


def probe(handle, index: int) -> Physical:
    keep = Keep()
    base = keep.struct("VkPhysicalDeviceProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2)
    lib.vkGetPhysicalDeviceProperties2(handle, base)
    api = base.properties.apiVersion
    extensions = frozenset(vk.string(e.extensionName) for e in
                           vk.enumerate_(lib.vkEnumerateDeviceExtensionProperties, handle, ffi.NULL,
                                         ctype="VkExtensionProperties"))
    p11, p12, p13 = (keep.struct(f"VkPhysicalDeviceVulkan1{v}Properties",
                                 sType=getattr(vk, f"VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_{v}_PROPERTIES"))
                     for v in (1, 2, 3))
    pushing = keep.struct("VkPhysicalDevicePushDescriptorPropertiesKHR",
                          sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PUSH_DESCRIPTOR_PROPERTIES_KHR)
    has12, has13 = api >= vk.make_version(1, 2), api >= vk.make_version(1, 3)
    chain = [p11, p12] if has12 else []
    chain += [p13] if has13 else []
    chain += [pushing] if "VK_KHR_push_descriptor" in extensions else []
    if chain:
        for a, b in zip([base] + chain, chain):
            a.pNext = b
        lib.vkGetPhysicalDeviceProperties2(handle, base)
    props, limits = base.properties, base.properties.limits
    lowered = lowered_limits()

    def lower(name: str, value: int) -> int:
        return min(value, lowered.get(name, value))
    specs = [s for s in _FEATURE_STRUCTS if _wanted(s, api, extensions)]
    nodes = _chain(keep, specs)
    features2 = keep.struct("VkPhysicalDeviceFeatures2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                            pNext=nodes[0] if nodes else None)
    lib.vkGetPhysicalDeviceFeatures2(handle, features2)
    supported = {f: bool(getattr(features2.features, f)) for f in _CORE_FEATURES}
    for spec in _FEATURE_STRUCTS:
        supported.update({f: False for f in spec[3]})
    for node, spec in zip(nodes, specs):
        supported.update(_read(node, spec))

    families = vk.enumerate_(lib.vkGetPhysicalDeviceQueueFamilyProperties, handle,
                             ctype="VkQueueFamilyProperties")
    compute = [i for i, q in enumerate(families) if q.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
    queue_family = compute[0] if compute else -1
    timestamp_bits = families[queue_family].timestampValidBits if compute else 0

    memory = keep.new("VkPhysicalDeviceMemoryProperties *")
    lib.vkGetPhysicalDeviceMemoryProperties(handle, memory)
    heaps = tuple((memory.memoryHeaps[i].size, bool(memory.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
                  for i in range(memory.memoryHeapCount))
    memory_types = [(memory.memoryTypes[i].propertyFlags, memory.memoryTypes[i].heapIndex)
                    for i in range(memory.memoryTypeCount)]

    subgroup = p11.subgroupSize if has12 else 0
    sizes_controlled = (has13 and supported["subgroupSizeControl"] and supported["computeFullSubgroups"]
                        and p13.requiredSubgroupSizeStages & vk.VK_SHADER_STAGE_COMPUTE_BIT)
    period = limits.timestampPeriod
    flags = {
        "int8_dot": supported["shaderIntegerDotProduct"],
        "fp16": supported["shaderFloat16"] and supported["storageBuffer16BitAccess"],
        "bf16": supported["shaderBFloat16Type"],
        "int8_storage": supported["shaderInt8"] and supported["storageBuffer8BitAccess"],
        "int16": supported["shaderInt16"],
        "int64": supported["shaderInt64"],
        # matrix units as the products use them: their result tile takes the storage of their
        # operand tiles (zdsl.shared's `over`), so shared memory blocks come with them
        "coopmat": supported["cooperativeMatrix"] and supported["workgroupMemoryExplicitLayout"]
        and supported["workgroupMemoryExplicitLayout16BitAccess"],
        "subgroup_size_control": bool(sizes_controlled),
        "pipeline_stats": supported["pipelineExecutableInfo"],
        "push_descriptors": "VK_KHR_push_descriptor" in extensions,
        "timestamps": timestamp_bits > 0 and 0 < period < float("inf"),
        # a buffer larger than one binding, bound as an array indexed per element
        "pieced_buffers": supported["shaderStorageBufferArrayDynamicIndexing"]
        and supported["shaderStorageBufferArrayNonUniformIndexing"],
    }
    name = vk.string(props.deviceName)
    driver_name = vk.string(p12.driverName) if has12 else ""
    info = DeviceInfo(
        index=index, name=name,
        vendor=VENDORS.get(props.vendorID, f"0x{props.vendorID:04x}"),
        device_type=DEVICE_TYPES.get(props.deviceType, "other"),
        driver_name=driver_name, driver_info=vk.string(p12.driverInfo) if has12 else "",
        api_version=vk.version_str(api),
        identity=f"{props.vendorID:04x}:{props.deviceID:04x}:{driver_name}:{props.driverVersion}",
        subgroup_size=subgroup,
        min_subgroup_size=p13.minSubgroupSize if sizes_controlled else subgroup,
        max_subgroup_size=p13.maxSubgroupSize if sizes_controlled else subgroup,
        shared_memory=limits.maxComputeSharedMemorySize,
        max_workgroup_invocations=limits.maxComputeWorkGroupInvocations,
        max_storage_buffer_range=lower("binding", limits.maxStorageBufferRange),
        heaps=heaps,
        features=frozenset(k for k, v in flags.items() if v),
        compile_only=driver_name == "radv" and "RADV_FORCE_FAMILY" in os.environ,
    )
    return Physical(
        handle=handle, info=info, vendor_id=props.vendorID, device_id=props.deviceID,
        pipeline_cache_uuid=bytes(ffi.buffer(props.pipelineCacheUUID)), api=api, extensions=extensions,
        supported=supported, queue_family=queue_family, timestamp_bits=timestamp_bits, timestamp_period=period,
        min_storage_offset_alignment=limits.minStorageBufferOffsetAlignment,
        max_push_constants=limits.maxPushConstantsSize,
        max_push_descriptors=pushing.maxPushDescriptors if "VK_KHR_push_descriptor" in extensions else 0,
        max_storage_buffers=limits.maxPerStageDescriptorStorageBuffers,
        max_group_count=tuple(limits.maxComputeWorkGroupCount),
        max_buffer_size=p13.maxBufferSize if has13 else limits.maxStorageBufferRange,
        max_allocation_size=lower("allocation", p11.maxMemoryAllocationSize if has12 else limits.maxStorageBufferRange),
        memory_types=memory_types, heap_sizes=[h for h, _ in heaps],
    )


# VkPipelineCacheHeaderVersionOne: headerSize, headerVersion (1), vendorID, deviceID, pipelineCacheUUID
CACHE_HEADER = struct.Struct("<IIII16s")


def pipeline_cache_problem(phys: Physical, data: bytes) -> str | None:
    """Why `data` is not pipeline cache data of this device (None when its header is this
    device's): the driver would ignore it, or misread a damaged one."""
    if len(data) < CACHE_HEADER.size:
        return "is too short for pipeline cache data"
    size, version, *written_for = CACHE_HEADER.unpack_from(data)
    if version != 1 or not CACHE_HEADER.size <= size <= len(data):
        return "has no valid pipeline cache header"
    if written_for != [phys.vendor_id, phys.device_id, phys.pipeline_cache_uuid]:
        return f"was written for another device or driver build than {phys.info.name}"
    return None


def memory_budget(phys: Physical) -> tuple[int, int] | None:
    """(budget, usage) of this process on the largest device-local heap, as the driver sees them
    now (VK_EXT_memory_budget), or None where the driver does not say."""
    if "VK_EXT_memory_budget" not in phys.extensions:
        return None
    keep = Keep()
    budget = keep.struct("VkPhysicalDeviceMemoryBudgetPropertiesEXT",
                         sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT)
    props = keep.struct("VkPhysicalDeviceMemoryProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                        pNext=budget)
    lib.vkGetPhysicalDeviceMemoryProperties2(phys.handle, props)
    local = [i for i, (size, is_local) in enumerate(phys.info.heaps) if is_local]
    if not local:
        return None
    heap = max(local, key=lambda i: phys.heap_sizes[i])
    return int(budget.heapBudget[heap]), int(budget.heapUsage[heap])


def create_instance():
    keep = Keep()
    app = dict(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName="zdsl", pEngineName="zdsl",
               apiVersion=vk.make_version(1, 3))
    info = keep.struct("VkInstanceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
    out = keep.new("VkInstance *")
    vk.check(lib.vkCreateInstance(info, ffi.NULL, out), "vkCreateInstance")
    return out[0]


def probe_all(instance) -> list[Physical]:
    handles = vk.enumerate_(lib.vkEnumeratePhysicalDevices, instance, ctype="VkPhysicalDevice")
    return [probe(h, i) for i, h in enumerate(handles)]
