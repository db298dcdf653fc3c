"""A device that allocates nothing and runs nothing, for recording what a graph launches.

A graph built on a `DryDevice` records its step as it would on the device `info` describes
(the same kernels, sizes and chosen variants: `Sequence.launches`), without memory, weights or
a GPU. The tuner, the kernel benches and the static RDNA ranking read a model's launches this
way, for any model on any machine, compile-only targets included.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


class DryBuffer:
    """A buffer's name and size, and for host buffers an array standing in for the mapping."""

    __slots__ = ("name", "nbytes", "_host")

    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes, self._host = name, int(nbytes), None

    def write(self, array, offset: int = 0) -> None:
        pass  # holds nothing: a dry graph runs nothing

    def slice(self, offset: int, nbytes: int) -> "DryBuffer":
        return DryBuffer(f"{self.name}[{offset}:+{nbytes}]", nbytes)

    def view(self, dtype=np.uint32) -> np.ndarray:
        if self._host is None:
            self._host = np.zeros(self.nbytes, np.uint8)
        return self._host.view(dtype)

    def free(self) -> None:
        pass


class DrySequence:
    """Keeps the launches recorded into it (KernelDef.launch sees `dry` and dispatches nothing)."""

    dry = True

    def __init__(self, device):
        self.device, self.launches = device, []

    def copy(self, src, dst, nbytes=None, dst_offset=0) -> None:
        pass

    @contextmanager
    def together(self):
        yield

    def fill(self, dst, value: int = 0) -> None:
        pass

    def run(self, times: int = 1, wait: bool = True) -> None:
        pass

    def free(self) -> None:
        pass

    @property
    def commands(self) -> int:
        return len(self.launches)


class DryDevice:
    """Stands in for an open Device of `info` (a runtime DeviceInfo, or a compile-only target's)."""

    dry = True  # what it records need not fit the device: nothing is allocated

    def __init__(self, info):
        self.info = info
        self.placeholder = DryBuffer("placeholder", 16)

    def alloc(self, nbytes: int, name: str = "") -> DryBuffer:
        return DryBuffer(name, nbytes)

    def alloc_many(self, requests) -> list[DryBuffer]:
        return [DryBuffer(name, n) for name, n in requests]

    host_buffer = alloc

    def joined(self, buffers: list, piece: int, name: str) -> DryBuffer:
        return DryBuffer(name, piece * (len(buffers) - 1) + buffers[-1].nbytes)

    def upload_file(self, path, jobs, progress=None) -> None:
        pass

    def memory_available(self) -> int:
        return 1 << 62

    def sequence(self, timestamps: bool = False) -> DrySequence:
        return DrySequence(self)

    def wait_idle(self) -> None:
        pass

    def close(self) -> None:
        pass
