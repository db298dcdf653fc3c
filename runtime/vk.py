"""The only module that touches the `vulkan` cffi binding.

Why one wrapper: cffi frees a struct as soon as Python drops the last reference, so a nested
create-info built inline can be gone before the driver reads it (seen on lavapipe as
VK_ERROR_UNKNOWN from a freed entry-point name). Every struct, array and string made for a call
is built through one `Keep`, which the caller holds until the call returns. Calls go straight to
the loader's C entry points (`lib.vk...`): the binding's Python wrappers cost microseconds each,
and a decode step records hundreds of commands. Failures become one-line zdsl errors.
"""

from __future__ import annotations

import functools

from zdsl.errors import MissingFeatureError, NoDeviceError, OutOfMemoryError, ZdslError

try:
    import vulkan as _vulkan
except OSError:
    raise NoDeviceError("no Vulkan loader (libvulkan.so.1): run scripts/setup.sh or "
                        "apt-get install libvulkan1 mesa-vulkan-drivers") from None

ffi = _vulkan.ffi
lib = _vulkan.lib
NULL = ffi.NULL


def __getattr__(name: str):
    """VK_* constants, read from the binding (`from zdsl.runtime.vk import VK_...` works)."""
    if name.startswith("VK_"):
        return getattr(_vulkan, name)
    raise AttributeError(name)


# Values the binding gets wrong or lacks.
WHOLE_SIZE = (1 << 64) - 1
SHADER_STAGE_REQUIRE_FULL_SUBGROUPS = 0x2
STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR = 1000141000


def make_version(major: int, minor: int, patch: int = 0) -> int:
    return (major << 22) | (minor << 12) | patch


def version_str(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


class Keep:
    """Builds the cdata for Vulkan calls and keeps all of it alive while the Keep lives.

    `keep.struct("VkXInfo", field=value, ...)` returns a pointer to a new struct. Values are
    converted by the field's C type: str → NUL-terminated char array, bytes → an aligned copy,
    dict → a nested struct (pointed to or embedded), list → an array of the pointee type (dicts
    for struct elements), another Keep-made pointer → cast to the field's pointer type (pNext).
    """

    __slots__ = ("refs",)

    def __init__(self):
        self.refs: list = []

    def new(self, ctype: str, init=None):
        obj = ffi.new(ctype, init)
        self.refs.append(obj)
        return obj

    def struct(self, ctype: str, **fields):
        ptr = self.new(ctype + " *")
        self._fill(ptr[0], ffi.typeof(ctype), fields)
        return ptr

    def array(self, ctype: str, items) -> object:
        """An array of `ctype`: scalars/handles as they are, dicts as struct elements."""
        return self._array(ffi.typeof(ctype), list(items))

    def blob(self, data) -> object:
        """An 8-byte aligned copy of a bytes-like object, as `void *`."""
        data = memoryview(data).cast("B")
        buf = self.new("uint64_t[]", max(1, (len(data) + 7) // 8))
        ffi.memmove(buf, data, len(data))
        return ffi.cast("void *", buf)

    def _fill(self, target, ctype, fields: dict) -> None:
        types = dict(ctype.fields)
        for name, value in fields.items():
            ftype = types[name].type
            if ftype.kind == "struct" and isinstance(value, dict):
                self._fill(getattr(target, name), ftype, value)
            else:
                setattr(target, name, self._value(ftype, value))

    def _value(self, ftype, value):
        if ftype.kind != "pointer":
            return value
        if value is None:
            return NULL
        if isinstance(value, ffi.CData):
            return value if ffi.typeof(value) is ftype else ffi.cast(ftype, value)
        item = ftype.item
        if isinstance(value, str):
            return self.new("char[]", value.encode())
        if isinstance(value, (bytes, bytearray, memoryview)):
            return ffi.cast(ftype, self.blob(value))
        if isinstance(value, dict):
            ptr = self.new(ftype)
            self._fill(ptr[0], item, value)
            return ptr
        return ffi.cast(ftype, self._array(item, list(value)))

    def _array(self, item, values: list):
        arr = self.new(ffi.getctype(item, "[]"), len(values))
        for i, v in enumerate(values):
            if item.kind == "struct":
                if isinstance(v, dict):
                    self._fill(arr[i], item, v)
                else:
                    arr[i] = v[0] if ffi.typeof(v).kind == "pointer" else v
            else:
                arr[i] = self._value(item, v)
        return arr


class Barrier:
    """A prebuilt global memory barrier, recorded with one C call (no per-use struct building)."""

    __slots__ = ("_struct", "src", "dst")

    def __init__(self, src_stage: int, src_access: int, dst_stage: int, dst_access: int):
        self._struct = ffi.new("VkMemoryBarrier *", {"sType": _vulkan.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                                      "srcAccessMask": src_access, "dstAccessMask": dst_access})
        self.src, self.dst = src_stage, dst_stage

    def record(self, cb) -> None:
        lib.vkCmdPipelineBarrier(cb, self.src, self.dst, 0, 1, self._struct, 0, NULL, 0, NULL)


COMPUTE = _vulkan.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
INDIRECT = _vulkan.VK_PIPELINE_STAGE_DRAW_INDIRECT_BIT   # an indirect dispatch reading its arguments
TRANSFER = _vulkan.VK_PIPELINE_STAGE_TRANSFER_BIT
_WORK = COMPUTE | TRANSFER
_WRITES = _vulkan.VK_ACCESS_SHADER_WRITE_BIT | _vulkan.VK_ACCESS_TRANSFER_WRITE_BIT


@functools.cache
def barrier(src: int, dst: int) -> Barrier:
    """The barrier ordering earlier commands of stages `src` before later ones of stages `dst`:
    their writes become visible to the later reads and writes. Only the stages at hand go in,
    because a wider mask costs: on NVIDIA a compute→compute dependency is about 2.5 µs cheaper
    than one that also names the transfer and indirect-argument stages."""
    src_access = ((_vulkan.VK_ACCESS_SHADER_WRITE_BIT if src & COMPUTE else 0)
                  | (_vulkan.VK_ACCESS_TRANSFER_WRITE_BIT if src & TRANSFER else 0))
    dst_access = ((_vulkan.VK_ACCESS_SHADER_READ_BIT | _vulkan.VK_ACCESS_SHADER_WRITE_BIT if dst & COMPUTE else 0)
                  | (_vulkan.VK_ACCESS_TRANSFER_READ_BIT | _vulkan.VK_ACCESS_TRANSFER_WRITE_BIT if dst & TRANSFER else 0)
                  | (_vulkan.VK_ACCESS_INDIRECT_COMMAND_READ_BIT if dst & INDIRECT else 0))
    return Barrier(src, src_access, dst, dst_access)


# Everything zdsl records is a compute dispatch, an indirect dispatch, a copy or a fill, so this
# barrier orders any of them after any other (what a sequence starts with).
DEPENDENCY = barrier(_WORK, _WORK | INDIRECT)
# Device writes become visible to the host only through a barrier (a fence alone does not).
TO_HOST = Barrier(_WORK, _WRITES, _vulkan.VK_PIPELINE_STAGE_HOST_BIT, _vulkan.VK_ACCESS_HOST_READ_BIT)


def enumerate_(fn, *args, ctype: str) -> list:
    """The two-call idiom: ask for the count, then fill an array of that many `ctype`."""
    n = ffi.new("uint32_t *")
    result = fn(*args, n, NULL)
    if result is not None:
        check(result, "enumerate")
    arr = ffi.new(f"{ctype}[]", n[0])
    result = fn(*args, n, arr)
    if result is not None:
        check(result, "enumerate")
    return [arr[i] for i in range(n[0])] if n[0] else []


def string(chars) -> str:
    return ffi.string(chars).decode("utf-8", "replace")


def device_proc(device, name: str):
    """An extension entry point of a VkDevice, typed as its PFN (raises if the driver lacks it)."""
    ptr = lib.vkGetDeviceProcAddr(device, name.encode())
    if ptr == NULL:
        raise MissingFeatureError(f"the Vulkan driver does not provide {name}")
    return ffi.cast(f"PFN_{name}", ptr)


_RESULT_NAMES: dict[int, str] = {}


def result_name(code: int) -> str:
    if not _RESULT_NAMES:
        for name in dir(_vulkan):
            if name.startswith(("VK_ERROR_", "VK_SUCCESS", "VK_NOT_READY", "VK_TIMEOUT", "VK_INCOMPLETE")):
                value = getattr(_vulkan, name)
                if isinstance(value, int) and not name.endswith(("_KHR", "_EXT")):
                    _RESULT_NAMES.setdefault(-abs(value) if name.startswith("VK_ERROR_") else value, name)
    return _RESULT_NAMES.get(code, f"VkResult {code}")


def check(result: int, what: str, context: str = "") -> int:
    """Raise the zdsl error for a failed VkResult; `context` says what was being done, for whom."""
    if result >= 0:
        return result
    where = f" {context}" if context else ""
    if result == _vulkan.VK_ERROR_OUT_OF_DEVICE_MEMORY:
        raise OutOfMemoryError(f"out of device memory{where} ({what})")
    if result == _vulkan.VK_ERROR_OUT_OF_HOST_MEMORY:
        raise OutOfMemoryError(f"out of host memory{where} ({what})")
    if result in (_vulkan.VK_ERROR_FEATURE_NOT_PRESENT, _vulkan.VK_ERROR_EXTENSION_NOT_PRESENT):
        raise MissingFeatureError(f"{what} failed{where}: {result_name(result)}")
    if result in (_vulkan.VK_ERROR_INCOMPATIBLE_DRIVER, _vulkan.VK_ERROR_INITIALIZATION_FAILED):
        raise NoDeviceError(f"{what} failed{where}: {result_name(result)} "
                            "(no usable Vulkan driver: run scripts/setup.sh)")
    if result == _vulkan.VK_ERROR_DEVICE_LOST:
        raise ZdslError(f"device lost{where} ({what}): a kernel faulted or ran too long")
    raise ZdslError(f"{what} failed{where}: {result_name(result)}")

