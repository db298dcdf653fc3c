"""What the barrier between dependent dispatches costs with other access masks (docs/PERF.md).

Usage: python3 barrier_masks.py [DEVICE (default 0)]

The "barrier" chain of counter_chain.py, its compute → compute barriers recorded with: the masks
zdsl records (shader write → shader read and write), shader write → shader read only, no access
masks (an execution dependency alone: not a correct barrier, the floor), and the generic memory
read/write masks."""
import sys

import vulkan as V

from counter_chain import measure
from zdsl.runtime import open_device
from zdsl.runtime import sequence, vk

recorded = sequence.barrier


def only_compute(src_access, dst_access):
    return lambda s, d: vk.Barrier(s, src_access, d, dst_access) if s == d == vk.COMPUTE else recorded(s, d)


MASKS = {
    "recorded": recorded,
    "write -> read": only_compute(V.VK_ACCESS_SHADER_WRITE_BIT, V.VK_ACCESS_SHADER_READ_BIT),
    "no access": only_compute(0, 0),
    "memory": only_compute(V.VK_ACCESS_MEMORY_READ_BIT | V.VK_ACCESS_MEMORY_WRITE_BIT,
                           V.VK_ACCESS_MEMORY_READ_BIT | V.VK_ACCESS_MEMORY_WRITE_BIT),
}

dev = open_device(sys.argv[1] if len(sys.argv) > 1 else "0")
for rows, WG, ROWS in ((64, 64, 1), (2048, 256, 1), (8192, 256, 1)):
    for _ in range(2):
        line = []
        for name, make in MASKS.items():
            sequence.barrier = make
            us, _result = measure(dev, "barrier", rows, WG, ROWS, 40)
            line.append(f"{name} {us:6.2f}")
        sequence.barrier = recorded
        print(f"rows={rows:5d} WG={WG} ROWS={ROWS}: " + ", ".join(line) + " us/link", flush=True)
