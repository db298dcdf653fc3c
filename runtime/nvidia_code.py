"""A pipeline's machine code out of NVIDIA's pipeline cache data.

NVIDIA's driver reports no disassembly through VK_KHR_pipeline_executable_properties (it lists
no internal representations), but the data of a pipeline cache holding one pipeline carries its
compiled code: after the cache header and the driver's own entry header, a zstd frame whose
content is an "NVuc" container; a table in that container's header gives the code's size (the
pipeline's "Binary Size" statistic) followed by its offset. The code is the raw SASS that
`toolchain.nvdisasm` disassembles. The layout is the driver's (seen on 580.x), not a published
format: where it does not hold, `machine_code` says so and nothing else depends on it.
"""

from __future__ import annotations

import struct

from zdsl.errors import ZdslError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CONTAINER = b"NVuc"
HEADER_WORDS = 64  # the container's header table lies within its first 64 words


def machine_code(cache_data: bytes, binary_size: int) -> bytes:
    """The machine code of the one pipeline in `cache_data`, `binary_size` bytes long."""
    try:
        import zstandard
    except ImportError:
        raise ZdslError("reading NVIDIA's machine code needs the zstandard package",
                        hint="pip install 'zdsl[nvidia]'") from None
    start = cache_data.find(ZSTD_MAGIC)
    if start < 0:
        raise ZdslError("NVIDIA pipeline cache data holds no zstd frame: not a layout this reader knows")
    try:
        content = zstandard.ZstdDecompressor().decompressobj().decompress(cache_data[start:])
    except zstandard.ZstdError as e:
        raise ZdslError(f"NVIDIA pipeline cache data: its zstd frame does not decompress ({e})") from None
    if content[8:12] != CONTAINER or len(content) < 4 * HEADER_WORDS:
        raise ZdslError("NVIDIA pipeline cache data holds no NVuc container: not a layout this reader knows")
    words = struct.unpack_from(f"<{HEADER_WORDS}I", content)
    for i, word in enumerate(words[:-1]):
        offset = words[i + 1] + 8  # offsets count from after the container's 8-byte tag
        if word == binary_size and offset + binary_size <= len(content):
            return content[offset:offset + binary_size]
    raise ZdslError(f"NVIDIA pipeline cache data: no code of {binary_size} bytes in its container's header")
